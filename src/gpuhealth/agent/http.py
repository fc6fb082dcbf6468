"""The agent's HTTP endpoints (thin: parse, call, render), on a server whose cost is bounded whatever
connects.

- ``GET /metrics``: Prometheus text format 0.0.4, or OpenMetrics 1.0 when the scraper's
  ``Accept`` asks for it; gzip when its ``Accept-Encoding`` allows (Prometheus always asks: the
  text shrinks ~10×); rendered from the cache, never from NVML. NVLink counters are summed per GPU
  unless ``agent.nvlink_per_link`` (or this scrape's ``?nvlink=link``) asks for every link.
- ``GET /health``: JSON, the ``gpuhealth status --json`` shape (node verdict, GPUs, findings).
- ``GET /ready``: 200 once every collector completed its first run, 503 before.
- ``GET /healthz``: 200 while the process serves (a liveness probe that never depends on GPUs).
- ``GET /``: a short index.
- routes an extension adds (``AgentHttpServer.route``): ``GET``/``POST /screen`` (screening,
  ``agent/extensions.py``). A POST carries its parameters in the query string, never a body.

The server (``_HttpLoop``): one thread waits on every connection with a selector and hands a request
to a fixed pool of worker threads only once its headers are complete. A connection costs a socket
and at most ``MAX_HEADER_BYTES`` until then, never a thread; it must send its headers within
``header_timeout_s`` of its first byte (slowloris: 1,019 threads before, a fixed few now), an idle
keep-alive connection goes after ``idle_timeout_s``, and at most ``max_connections`` are open (a
new one pushes out the oldest that has not finished a request). GET and HEAD are served, and POST
on a route that takes it; the connection closes after a POST.

With a web config (``agent.web_config_file``, ``--web.config.file``: exporter-toolkit's format,
``runtime/webconfig.py``) connections are TLS and requests may need basic auth. The TLS handshake runs in the
loop, non-blocking, under the same ``header_timeout_s`` as the headers: a client that opens a connection and
never finishes its handshake holds no worker and is closed when that time is up. Basic auth guards every
endpoint but ``/healthz`` and ``/ready`` (a kubelet's probes carry no password; they say only that the process
serves and has swept once).
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import io
import json
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from gpuhealth.exporters.prometheus import MetricsEndpoint

if TYPE_CHECKING:
    from gpuhealth.agent.view import AgentView
    from gpuhealth.runtime.webconfig import WebGuard

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024  # a GET's request line and headers; more is not a scrape
# an extension's route: (method, query parameters, client address) → (status, JSON document)
Route = Callable[[str, Mapping[str, str], str], tuple[int, Any]]


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


class _Handler(BaseHTTPRequestHandler):
    """One request, already read whole by the loop (``rfile`` holds it); built per request by
    ``_HttpLoop._serve``, never through ``BaseHTTPRequestHandler.__init__``."""

    server: _HttpLoop  # type: ignore[assignment]
    protocol_version = "HTTP/1.1"

    def _allowed(self, path: str) -> bool:
        """Basic auth (when the web config has users): False after answering 401."""
        guard = self.server.guard
        if guard is None or path in _NO_AUTH or guard.authorized(self.headers.get("Authorization")):
            return True
        self.server.stats["unauthorized"] += 1
        body = b'{"error": "unauthorized"}'
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="gpuhealth"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return False

    def do_GET(self) -> None:
        owner = self.server.owner
        path, _, query = self.path.partition("?")
        try:
            if not self._allowed(path):
                return
            if path == "/metrics":
                view = dict(parse_qsl(query)).get("nvlink", "")  # ?nvlink=link | gpu: this scrape's NVLink view
                per_link = {"link": True, "gpu": False}.get(view)
                body, ctype = owner.metrics.render(self.headers.get("Accept"), nvlink_per_link=per_link)
                encoding = "gzip" if accepts_gzip(self.headers.get("Accept-Encoding")) else None
                if encoding:
                    body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
                self._send(200, body, ctype, encoding=encoding, vary=True)
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
            elif path in owner.routes:
                self._route(owner.routes[path], "GET")
            else:
                self._json(404, {"error": f"no such endpoint: {path}"})
        except BrokenPipeError:
            pass
        except Exception:  # a rendering bug answers 500; it never kills the server thread
            log.exception("error serving %s", path)
            self._json(500, {"error": "internal error; see the agent log"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            route = self.server.owner.routes.get(path)
            if not self._allowed(path):
                return
            if route is None:  # as for any method no endpoint takes
                self._json(501, {"error": f"Unsupported method ('POST') for {path}"})
            elif (self.headers.get("Content-Length") or "0").strip() != "0" or self.headers.get("Transfer-Encoding"):
                self._json(400, {"error": "no request body expected: pass parameters in the query string"})
            else:
                self._route(route, "POST")
        except BrokenPipeError:
            pass
        except Exception:
            log.exception("error serving POST %s", path)
            self._json(500, {"error": "internal error; see the agent log"})

    def _route(self, route: Route, method: str) -> None:
        query = dict(parse_qsl(self.path.partition("?")[2][:2048], max_num_fields=16))
        code, payload = route(method, query, str(self.client_address[0]) if self.client_address else "")
        self._json(code, payload)

    def _json(self, code: int, payload: Any) -> None:
        self._send(code, json.dumps(payload, indent=1, default=str).encode(), "application/json")

    def _send(self, code: int, body: bytes, ctype: str, *, encoding: str | None = None, vary: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if encoding:
            self.send_header("Content-Encoding", encoding)
        if vary:
            self.send_header("Vary", "Accept-Encoding")
        if self.server.owner.agent.simulated:
            self.send_header("X-Gpuhealth-Simulated", "true")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s - " + format, self.address_string(), *args)


GZIP_LEVEL = 1  # the ratio of level 6 within a few percent on /metrics text, at a third of the CPU


def accepts_gzip(header: str | None) -> bool:
    """Does an ``Accept-Encoding`` value allow gzip (``gzip`` or ``*`` with a q-value above 0)?"""
    allowed: dict[str, float] = {}
    for item in (header or "").split(","):
        name, _, params = item.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if name:
            allowed[name.strip().lower()] = q
    q = allowed.get("gzip", allowed.get("x-gzip", allowed.get("*", 0.0)))
    return q > 0.0


class _Writer:
    """``wfile`` for a handler: every write goes out whole (``sendall`` under the socket's timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def write(self, data: bytes) -> int:
        self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    addr: Any
    buf: bytearray = field(default_factory=bytearray)
    deadline: float = 0.0  # when the loop closes it, unless a request's headers are complete by then
    answered: int = 0  # requests served on it (a keep-alive connection that finished one is a scraper)
    busy: bool = False  # a worker has it
    done: bool = False  # the worker says: close it
    handshaking: bool = False  # TLS: the handshake is not done yet (the loop drives it, no worker waits on it)


class _HttpLoop:
    """The listening socket, a selector over idle connections, and ``workers`` threads that answer."""

    def __init__(self, addr: tuple[str, int], owner: AgentHttpServer, *, workers: int = 4,
                 max_connections: int = 256, header_timeout_s: float = 10.0, idle_timeout_s: float = 30.0,
                 write_timeout_s: float = 10.0, guard: WebGuard | None = None) -> None:
        self.owner = owner
        self.guard = guard
        self.workers = workers
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.write_timeout_s = write_timeout_s
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self._listen = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listen.bind(addr)
            self._listen.listen(128)
        except OSError:
            self._listen.close()
            raise
        self._listen.setblocking(False)
        self.server_address = self._listen.getsockname()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listen, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[socket.socket, _Conn] = {}
        self._returned: collections.deque[_Conn] = collections.deque()  # workers → loop
        self._jobs: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.stats = {"connections": 0, "requests": 0, "header_timeouts": 0, "idle_closed": 0, "evicted": 0,
                      "refused": 0, "too_large": 0, "tls_failed": 0, "tls_timeouts": 0, "unauthorized": 0}

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._threads = [threading.Thread(target=self._work, name=f"gpuhealth-http-{i}", daemon=True)
                         for i in range(self.workers)]
        self._threads.append(threading.Thread(target=self._loop, name="gpuhealth-http", daemon=True))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake()
        for _ in range(self.workers):
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=self.write_timeout_s + 1)
        for conn in list(self._conns.values()):
            self._close(conn)
        self._sel.close()
        for sock in (self._listen, self._wake_r, self._wake_w):
            sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                events = self._sel.select(self._next_deadline())
                for key, _ in events:
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._read(key.data)
                self._take_back()
                self._expire()
            except Exception:  # one bad connection never stops the server
                log.exception("HTTP loop: unexpected error")
                time.sleep(0.05)

    def _next_deadline(self) -> float | None:
        """Until the first idle connection's deadline; with none, until a socket is ready: a worker handing a
        connection back and ``stop`` write to the wake socket, so an unscraped agent's loop never wakes."""
        idle = [c.deadline for c in self._conns.values() if not c.busy]
        return max(0.0, min(idle) - time.monotonic()) if idle else None

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: try again on the next event
                log.warning("HTTP: cannot accept: %s", exc)
                return
            if len(self._conns) >= self.max_connections and not self._evict():
                self.stats["refused"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            tls = self.guard.context() if self.guard is not None else None
            if tls is not None:
                try:
                    sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (ssl.SSLError, OSError) as exc:
                    log.debug("HTTP: TLS wrap of %s failed: %s", addr, exc)
                    sock.close()
                    continue
            # the handshake and then the headers must arrive within header_timeout_s
            conn = _Conn(sock, addr, deadline=time.monotonic() + self.header_timeout_s, handshaking=tls is not None)
            self._conns[sock] = conn
            self.stats["connections"] += 1
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _evict(self) -> bool:
        """Make room: close the oldest connection that has not finished a request (a scraper that has
        is kept); False when every connection is busy or a proven scraper."""
        waiting = [c for c in self._conns.values() if not c.busy and not c.answered]
        if not waiting:
            return False
        self.stats["evicted"] += 1
        self._close(min(waiting, key=lambda c: c.deadline))
        return True

    def _handshake(self, conn: _Conn) -> bool:
        """One step of a connection's TLS handshake; True once it is done (and the client may be served)."""
        assert isinstance(conn.sock, ssl.SSLSocket)
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
            return False
        except ssl.SSLWantWriteError:
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return False
        except (ssl.SSLError, OSError, ValueError) as exc:  # not TLS, a certificate we refuse, a reset
            self.stats["tls_failed"] += 1
            log.debug("HTTP: TLS handshake with %s failed: %s", conn.addr, exc)
            self._close(conn)
            return False
        conn.handshaking = False
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        assert self.guard is not None
        if not self.guard.peer_allowed(conn.sock.getpeercert()):
            self.stats["tls_failed"] += 1
            log.debug("HTTP: client certificate of %s names none of client_allowed_sans", conn.addr)
            self._close(conn)
            return False
        return True

    def _read(self, conn: _Conn) -> None:
        if conn.handshaking and not self._handshake(conn):
            return
        try:
            data = conn.sock.recv(16384)
            while isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():  # decrypted, not yet taken
                data += conn.sock.recv(16384)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if not conn.buf and conn.answered:  # the first byte of the next request on a keep-alive connection
            conn.deadline = time.monotonic() + self.header_timeout_s
        conn.buf += data
        self._dispatch(conn)

    def _dispatch(self, conn: _Conn) -> None:
        """Hand ``conn`` to a worker once its buffer holds a whole request head."""
        end = _head_end(conn.buf)
        if end < 0:
            if len(conn.buf) > MAX_HEADER_BYTES:
                self.stats["too_large"] += 1
                with contextlib.suppress(OSError):
                    conn.sock.send(b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
                                   b"Connection: close\r\n\r\n")
                self._close(conn)
            return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.busy = True
        self._jobs.put(conn)

    def _take_back(self) -> None:
        """Connections a worker is done with: wait for their next request (or one already buffered)."""
        while self._returned:
            conn = self._returned.popleft()
            conn.busy = False
            if conn.done or conn.sock.fileno() < 0:
                self._close(conn)
                continue
            conn.deadline = time.monotonic() + (self.header_timeout_s if conn.buf else self.idle_timeout_s)
            try:
                conn.sock.setblocking(False)
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError, KeyError):
                self._close(conn)
                continue
            if conn.buf:
                self._dispatch(conn)
            elif isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():  # read from the wire, still in TLS
                self._read(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if not c.busy and c.deadline <= now]:
            if conn.handshaking:
                self.stats["tls_timeouts"] += 1
            self.stats["header_timeouts" if conn.buf or not conn.answered else "idle_closed"] += 1
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    # -- the workers ------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            conn = self._jobs.get()
            if conn is None:
                return
            keep = False
            try:
                keep = self._serve(conn)
            except (ConnectionError, TimeoutError, OSError) as exc:  # a scraper that hung up or stalled
                log.debug("HTTP client %s went away: %s", conn.addr, exc)
            except Exception:
                log.exception("HTTP request from %s failed", conn.addr)
            conn.done = not keep or self._stopping.is_set()
            self._returned.append(conn)  # the loop owns the connection table: it closes or waits
            self._wake()

    def _serve(self, conn: _Conn) -> bool:
        """Answer the request at the head of ``conn.buf``; True to keep the connection open."""
        rfile = io.BytesIO(bytes(conn.buf))
        conn.sock.settimeout(self.write_timeout_s)  # a client that does not read gives the worker back
        handler = _Handler.__new__(_Handler)
        handler.server = self
        handler.request = conn.sock
        handler.client_address = conn.addr
        handler.rfile = rfile
        handler.wfile = _Writer(conn.sock)  # type: ignore[assignment]
        handler.close_connection = True
        handler.handle_one_request()
        del conn.buf[: rfile.tell()]  # what a client pipelined after this request stays for the next
        conn.answered += 1
        self.stats["requests"] += 1
        if getattr(handler, "command", None) not in ("GET", "HEAD"):
            return False  # a body we did not read, or no request at all: start afresh on a new connection
        return not handler.close_connection


_GET_ONLY = frozenset({"/metrics", "/health", "/ready", "/healthz", "/"})
_NO_AUTH = frozenset({"/healthz", "/ready"})  # probes: no password in a pod spec


def _head_end(buf: bytearray) -> int:
    """Where a request's head ends in ``buf`` (after its blank line), or -1."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        at = buf.find(sep)
        if at >= 0:
            return at + len(sep)
    return -1


_INDEX = """<html><head><title>gpuhealth agent</title></head><body><h1>gpuhealth agent</h1>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/health">/health</a></li>
<li><a href="/ready">/ready</a></li><li><a href="/healthz">/healthz</a></li></ul></body></html>
"""


class AgentHttpServer:
    """Serves one agent. ``start`` binds (raises OSError when the address is taken) and returns."""

    def __init__(self, agent: AgentView, listen: str, *, dcgm_compat: bool = False, nvlink_per_link: bool = False,
                 workers: int = 4, max_connections: int = 256, header_timeout_s: float = 10.0,
                 idle_timeout_s: float = 30.0, dcgm_hostname_label: str = "auto",
                 dcgm_schema: str = "4.10", web_config_file: str | None = None) -> None:
        """``web_config_file``: TLS and basic auth (exporter-toolkit's web config); raises ``WebConfigError``
        (one line) when it cannot be served."""
        self.agent = agent
        self.metrics = MetricsEndpoint(agent.snapshot, dcgm_compat=dcgm_compat, nvlink_per_link=nvlink_per_link,
                                       dcgm_hostname_label=dcgm_hostname_label, dcgm_schema=dcgm_schema)
        self.routes: dict[str, Route] = {}
        guard = None
        if web_config_file:
            from gpuhealth.runtime.webconfig import WebGuard

            guard = WebGuard.open(web_config_file)
        self._server = _HttpLoop(parse_listen(listen), self, workers=workers, max_connections=max_connections,
                                 header_timeout_s=header_timeout_s, idle_timeout_s=idle_timeout_s, guard=guard)
        self.scheme = guard.settings.scheme if guard is not None else "http"

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"{self.scheme}://[{host}]:{port}" if ":" in host else f"{self.scheme}://{host}:{port}"

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._server.stats)

    def route(self, path: str, handler: Route) -> None:
        """Serve ``path`` (GET, and POST) from an extension; the built-in endpoints cannot be replaced."""
        if path in _GET_ONLY:
            raise ValueError(f"{path} is a built-in endpoint")
        self.routes[path] = handler

    def set_dcgm_compat(self, enabled: bool, hostname_label: str | None = None, schema: str | None = None) -> None:
        self.metrics.dcgm_compat = enabled
        if hostname_label is not None:
            self.metrics.collector.dcgm_hostname_label = hostname_label
        if schema is not None:
            self.metrics.collector.dcgm_schema = schema

    def set_nvlink_per_link(self, enabled: bool) -> None:
        self.metrics.nvlink_per_link = enabled

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()


__all__ = ["AgentHttpServer", "accepts_gzip", "parse_listen"]
