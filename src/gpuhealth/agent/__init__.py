"""The per-node agent: scheduler, cache/history, HTTP server, rank hub, coordinator link."""
