"""gpuhealth: GPU fleet health and distributed-debug daemon.

Nothing happens at import time; see ``gpuhealth.cli`` for the commands and docs/architecture.md for the shape.
"""

__version__ = "0.1.0"
