"""Process plumbing both daemons use, and nothing else: systemd's notify protocol (``sdnotify``),
TLS files and gRPC credentials (``tls``), structured logging (``logs``).

Neutral ground between the agent and the coordinator (docs/architecture.md, Layers): it imports
only the vocabulary and the wire options, never either daemon. Importing it imports nothing.
"""
