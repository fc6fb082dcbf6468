"""The agent's HTTP endpoints (stdlib ``ThreadingHTTPServer``; thin: parse, call, render).

- ``GET /metrics``: Prometheus text format 0.0.4, or OpenMetrics 1.0 when the scraper's
  ``Accept`` asks for it; rendered from the cache, never from NVML.
- ``GET /health``: JSON, the ``gpuhealth status --json`` shape (node verdict, GPUs, findings).
- ``GET /ready``: 200 once every collector completed its first run, 503 before.
- ``GET /healthz``: 200 while the process serves (a liveness probe that never depends on GPUs).
- ``GET /``: a short index.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from gpuhealth.exporters.prometheus import MetricsEndpoint

if TYPE_CHECKING:
    from gpuhealth.agent.view import AgentView

log = logging.getLogger(__name__)


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port``, ``:port``, ``[v6]:port`` → (host, port). Raises ValueError with the reason."""
    text = listen.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"listen address {listen!r}: expected [IPv6]:PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"listen address {listen!r}: expected HOST:PORT")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {listen!r}: port must be 0..65535")
    return host or "0.0.0.0", int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler], owner: AgentHttpServer) -> None:
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, handler)
        self.owner = owner

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that hung up or timed out is routine: one debug line, never a raw traceback on stderr.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("HTTP client %s went away: %s", client_address, exc)
        else:
            log.exception("HTTP request from %s failed", client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = 30  # an idle or half-open keep-alive connection gives its thread back after 30 s

    def do_GET(self) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                body, ctype = owner.metrics.render(self.headers.get("Accept"))
                self._send(200, body, ctype)
            elif path == "/health":
                self._json(200, owner.agent.node_report())
            elif path == "/ready":
                snap = owner.agent.snapshot()
                code = 200 if snap.ready else 503
                self._json(code, {"ready": snap.ready, "nvml_up": snap.nvml_up, "simulated": snap.simulated})
            elif path == "/healthz":
                self._json(200, {"status": "ok"})
            elif path == "/":
                self._send(200, _INDEX.encode(), "text/html; charset=utf-8")
            else:
                self._json(404, {"error": f"no such endpoint: {path}"})
        except BrokenPipeError:
            pass
        except Exception:  # a rendering bug answers 500; it never kills the server thread
            log.exception("error serving %s", path)
            self._json(500, {"error": "internal error; see the agent log"})

    def _json(self, code: int, payload: Any) -> None:
        self._send(code, json.dumps(payload, indent=1, default=str).encode(), "application/json")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if self.server.owner.agent.simulated:
            self.send_header("X-Gpuhealth-Simulated", "true")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s - " + format, self.address_string(), *args)


_INDEX = """<html><head><title>gpuhealth agent</title></head><body><h1>gpuhealth agent</h1>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/health">/health</a></li>
<li><a href="/ready">/ready</a></li><li><a href="/healthz">/healthz</a></li></ul></body></html>
"""


class AgentHttpServer:
    """Serves one agent. ``start`` binds (raises OSError when the address is taken) and returns."""

    def __init__(self, agent: AgentView, listen: str, *, dcgm_compat: bool = False) -> None:
        self.agent = agent
        self.metrics = MetricsEndpoint(agent.snapshot, dcgm_compat=dcgm_compat)
        self._server = _Server(parse_listen(listen), _Handler, self)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def set_dcgm_compat(self, enabled: bool) -> None:
        self.metrics.dcgm_compat = enabled

    def start(self) -> None:
        # poll_interval only bounds how long stop() waits; each wakeup costs CPU on an idle node
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 2.0},
                                        name="gpuhealth-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        # shutdown() waits for serve_forever to notice, which takes up to poll_interval; a
        # connection to ourselves wakes its select() at once.
        stopper = threading.Thread(target=self._server.shutdown, daemon=True)
        stopper.start()
        host, port = self.address
        wake_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        while stopper.is_alive():
            try:
                socket.create_connection((wake_host, port), timeout=0.2).close()
            except OSError:
                pass
            stopper.join(0.05)
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=2.0)


__all__ = ["AgentHttpServer", "parse_listen"]
