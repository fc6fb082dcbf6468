"""The coordinator's ``/metrics``: a custom collector over a snapshot the event loop refreshes, in
a private registry, served on its own port by :class:`MetricsServer` — bounded like the agent's HTTP
server whatever connects (anyone on the network path can: docs/security.md).

The server: one thread waits on every connection with a selector and hands a request to a fixed pool
of ``workers`` threads only once its headers are complete. A connection costs a socket and at most
``MAX_HEADER_BYTES`` until then, never a thread (prometheus-client's server took one per connection:
2,000 half-open requests held 2,010 threads for minutes). Headers must come within
``header_timeout_s`` of the first byte, an idle connection goes after ``idle_timeout_s``, an answer
that cannot be written within ``write_timeout_s`` is dropped, and at most ``max_connections`` are
open (a new one pushes out the oldest that has not finished a request). GET and HEAD of ``/metrics``
(gzip when the scraper allows it) and ``/``; anything else is answered with its status and closed.

With a web config (``coordinator.metrics_web_config_file``, ``--web.config.file``: exporter-toolkit's format,
``runtime/webconfig.py``) connections are TLS, handshaken in the selector thread under the header deadline (a
handshake that never completes holds no worker), and requests need basic auth when it names users.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gpuhealth.runtime.webconfig import WebGuard

log = logging.getLogger(__name__)

SnapshotFn = Callable[[], dict[str, Any]]


class CoordinatorCollector(Collector):
    """Reads the latest snapshot only; a scrape never touches live coordinator state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {"jobs": []}

    def update(self, snapshot: dict[str, Any]) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            s = self._snapshot
        p = "gpuhealth_coordinator_"
        yield _gauge(p + "connected_agents", "Agents with an open stream.", s.get("connected", 0))
        yield _gauge(p + "nodes", "Nodes known (registered at least once).", s.get("nodes", 0))
        yield _counter(p + "records", "Records committed (acknowledged to agents).", s.get("records", 0))
        yield _counter(p + "step_records", "Rank-step records ingested.", s.get("step_records", 0))
        yield _counter(p + "duplicate_records", "Resent records ignored (seq already committed).",
                       s.get("duplicates", 0))
        yield _counter(p + "rejected_records", "Records rejected as malformed.", s.get("rejected", 0))
        verdicts = CounterMetricFamily(p + "verdicts", "Verdicts stored, by kind.", labels=["kind"])
        for kind, n in sorted(s.get("verdicts", {}).items()):
            verdicts.add_metric([kind], n)
        yield verdicts
        triage = CounterMetricFamily(p + "triage_reports", "Flight-recorder triages run (hang investigations and "
                                     "live triage), by verdict and the headline root cause's kind.",
                                     labels=["verdict", "root"])
        for (verdict, root), n in sorted(s.get("triage", {}).items()):
            triage.add_metric([verdict, root], n)
        yield triage
        # Per-job series carry ``job_id``, not ``job``: Prometheus reserves ``job`` for the scrape job and
        # would rename ours to ``exported_job``.
        records = CounterMetricFamily(p + "job_step_records", "Rank-step records ingested per job.", labels=["job_id"])
        quant = Metric(p + "job_step_seconds", "Wall step time per job: quantiles over a bounded recent sample; "
                       "_count and _sum over every step record (counters).", "summary")
        scores = GaugeMetricFamily(p + "straggler_score",
                                   "Rank slowness score (compute time / job median; top ranks only).",
                                   labels=["job_id", "rank"])
        stragglers = GaugeMetricFamily(p + "job_stragglers", "Ranks currently flagged as stragglers.",
                                       labels=["job_id"])
        slowdown = GaugeMetricFamily(p + "job_slowdown_ratio", "The whole job's step compute against its own best "
                                     "pace while a job.slowdown is open (every rank slower together: never a "
                                     "straggler); 1 otherwise.", labels=["job_id"])
        comm = GaugeMetricFamily(p + "job_comm_slow_ratio", "The job's communication time per step (collective wait) "
                                 "against its own baseline while a job.comm_slow is open (compute held); 1 "
                                 "otherwise.", labels=["job_id"])
        cut = GaugeMetricFamily(p + "job_nodes_cut_off", "Nodes of the job judged cut off (node.cut_off: agent and "
                                "ranks silent together while the other ranks wait).", labels=["job_id"])
        hangs = CounterMetricFamily(p + "job_hangs", "Hangs detected per job.", labels=["job_id"])
        stalled = GaugeMetricFamily(p + "job_seconds_since_progress", "Seconds since any rank finished a step.",
                                    labels=["job_id"])
        for job in s.get("jobs", []):
            jid = job["job_id"]
            records.add_metric([jid], job["records"])
            for q, v in sorted(job["quantiles"].items()):
                quant.add_sample(p + "job_step_seconds", {"job_id": jid, "quantile": str(q)}, v)
            quant.add_sample(p + "job_step_seconds_count", {"job_id": jid}, job.get("step_count", 0))
            quant.add_sample(p + "job_step_seconds_sum", {"job_id": jid}, job.get("step_sum", 0.0))
            for rank, score in job["scores"]:
                scores.add_metric([jid, str(rank)], score)
            stragglers.add_metric([jid], job["stragglers"])
            slowdown.add_metric([jid], job.get("slowdown_ratio", 1.0))
            comm.add_metric([jid], job.get("comm_slow_ratio", 1.0))
            cut.add_metric([jid], job.get("nodes_cut_off", 0))
            hangs.add_metric([jid], job["hangs"])
            stalled.add_metric([jid], job["stalled_s"])
        yield from (records, quant, scores, stragglers, slowdown, comm, cut, hangs, stalled)
        hangs_total = CounterMetricFamily(p + "hangs", "Hangs detected, all jobs.")
        hangs_total.add_metric([], s.get("hangs", 0))
        yield hangs_total
        yield from _screening(s)
        fleet = GaugeMetricFamily("gpuhealth_fleet_findings", "Findings only the coordinator can make, across "
                                  "nodes: sdc.mismatch (a GPU's result digest outvoted by the GPUs with the same "
                                  "key), version.drift; 1 per finding, refreshed every few seconds.",
                                  labels=["code", "severity", "action", "node", "gpu", "uuid", "entity"])
        for f in s.get("fleet_findings", []):
            fleet.add_metric([f["code"], f["severity"], f["action"], f["node"], f["gpu"], f["uuid"], f["entity"]], 1.0)
        yield fleet
        fabric = GaugeMetricFamily(
            "gpuhealth_fleet_" + "netprobe_findings", "The fabric probe's findings each node's "
                                   "agent reports about itself (netprobe.node_slow, nic_send_slow, nic_recv_slow, "
                                   "link_slow, latency_high, unjudged): how many, by node and code.",
                                   labels=["node", "code"])
        for (node, code), n in sorted(s.get("fabric_findings", {}).items()):
            fabric.add_metric([node, code], float(n))
        yield fabric


def _screening(s: dict[str, Any]) -> Iterator[Metric]:
    """Fleet screening (issue 18): coverage, the oldest screen, turns, screens received."""
    f = "gpuhealth_fleet_"
    yield _gauge(f + "screen_coverage_ratio", "GPUs with a completed (pass or fail) screen within the "
                 "window (coordinator.screen_window_s, 24 h) / GPUs known from registrations; 1 when none is known.",
                 s.get("screen_coverage_ratio", 1.0))
    yield _gauge(f + "screen_oldest_age_seconds", "Seconds since the GPU screened longest ago completed "
                 "a screen (a never-screened GPU counts from when the coordinator first saw it).",
                 s.get("screen_oldest_age_s", 0.0))
    yield _gauge(f + "gpus_unscreened", "GPUs known with no completed screen within the window.",
                 s.get("gpus_unscreened", 0))
    yield _gauge(f + "gpus", "GPUs known from registrations (of nodes heard from within the retention).",
                 s.get("gpus_known", 0))
    yield _gauge(f + "screen_turns", "Nodes holding a screening turn now.", s.get("screen_turns", 0))
    screens = CounterMetricFamily(f + "screens", "Screens received from agents, by level and result.",
                                  labels=["level", "result"])
    for (level, result), n in sorted(s.get("screens", {}).items()):
        screens.add_metric([level, result], n)
    yield screens
    # (named after the prefix, as the catalog test looks for the family: coordinator_…)
    yield _counter("gpuhealth_" + "coordinator_foreign_screens", "Screens an agent reported for GPUs its node has not "
                   "registered: dropped, neither kept nor voted.", s.get("foreign_screens", 0))
    yield _counter("gpuhealth_" + "coordinator_foreign_sdc_digests", "SDC digest records' digests for GPUs the "
                   "reporting node has not registered: dropped, neither stored nor voted.",
                   s.get("foreign_digests", 0))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def make_registry(collector: CoordinatorCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


# ------------------------------------------------------------------------------------------ the server

MAX_HEADER_BYTES = 64 * 1024  # a scrape's request line and headers; more is not a scrape
GZIP_LEVEL = 1  # level 6's ratio within a few percent on metrics text, at a third of the CPU
_INDEX = b"<html><body><a href='/metrics'>/metrics</a></body></html>\n"


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    buf: bytearray = field(default_factory=bytearray)
    deadline: float = 0.0  # closed then, unless a request's headers are complete by then
    answered: int = 0  # requests served on it (one that finished a request is a scraper)
    busy: bool = False  # a worker has it
    opened: float = field(default_factory=time.monotonic)
    handshaking: bool = False  # TLS: the handshake is not done yet (the selector thread drives it)


class MetricsServer:
    """``registry`` on ``http://host:port/metrics`` (port 0: the kernel picks; see ``server_port``)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, *, workers: int = 2,
                 max_connections: int = 256, header_timeout_s: float = 10.0, idle_timeout_s: float = 30.0,
                 write_timeout_s: float = 10.0, guard: WebGuard | None = None) -> None:
        self.registry = registry
        self.guard = guard
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.write_timeout_s = write_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listen = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listen.bind((host, port))
            self._listen.listen(128)
        except OSError:
            self._listen.close()
            raise
        self._listen.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listen, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[socket.socket, _Conn] = {}
        self._returned: collections.deque[tuple[_Conn, bool]] = collections.deque()  # (conn, keep it open)
        self._work: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self.stats = {"connections": 0, "requests": 0, "header_timeouts": 0, "idle_closed": 0, "pushed_out": 0,
                      "too_large": 0, "bad_requests": 0, "tls_failed": 0, "tls_timeouts": 0, "unauthorized": 0}
        self._threads = [threading.Thread(target=self._loop, name="gpuhealth-metrics-http", daemon=True)]
        self._threads += [threading.Thread(target=self._worker, name=f"gpuhealth-metrics-worker-{i}", daemon=True)
                          for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def server_port(self) -> int:
        return int(self._listen.getsockname()[1])

    def shutdown(self) -> None:
        self._stopping.set()
        self._wake()
        for _ in self._threads[1:]:
            self._work.put(None)
        for t in self._threads:
            t.join(5.0)

    def server_close(self) -> None:
        for sock in list(self._conns):
            self._close(sock)
        for s in (self._listen, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # -- the selector thread ---------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                events = self._sel.select(self._next_timeout())
            except (OSError, ValueError):
                if self._stopping.is_set():
                    return
                log.exception("metrics server: select failed")
                time.sleep(0.1)
                continue
            for key, _ in events:
                try:
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._read(key.data)
                except Exception:  # one bad connection never stops the server
                    log.exception("metrics server: error on a connection")
                    if isinstance(key.data, _Conn):
                        self._close(key.data.sock)
            self._take_back()
            self._expire()

    def _next_timeout(self) -> float:
        now = time.monotonic()
        soonest = min((c.deadline for c in self._conns.values() if not c.busy), default=now + 1.0)
        return max(0.0, min(1.0, soonest - now))

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: the next select tries again
                log.warning("metrics server: cannot accept: %s", exc)
                return
            if len(self._conns) >= self.max_connections and not self._push_out_one():
                sock.close()
                continue
            sock.setblocking(False)
            tls = self.guard.context() if self.guard is not None else None
            if tls is not None:
                try:
                    sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (ssl.SSLError, OSError):
                    sock.close()
                    continue
            # a TLS handshake is due as headers are: within header_timeout_s
            deadline = time.monotonic() + (self.header_timeout_s if tls is not None else self.idle_timeout_s)
            conn = _Conn(sock, deadline=deadline, handshaking=tls is not None)
            self._conns[sock] = conn
            self.stats["connections"] += 1
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _push_out_one(self) -> bool:
        """Close the oldest connection that has not finished a request (a scraper keeps its place)."""
        idle = [c for c in self._conns.values() if not c.busy and not c.answered]
        if not idle:
            return False
        self.stats["pushed_out"] += 1
        self._close(min(idle, key=lambda c: c.opened).sock)
        return True

    def _handshake(self, conn: _Conn) -> bool:
        """One step of a connection's TLS handshake; True once it is done."""
        assert isinstance(conn.sock, ssl.SSLSocket) and self.guard is not None
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
            return False
        except ssl.SSLWantWriteError:
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return False
        except (ssl.SSLError, OSError, ValueError):  # not TLS, a refused certificate, a reset
            self.stats["tls_failed"] += 1
            self._close(conn.sock)
            return False
        conn.handshaking = False
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        if not self.guard.peer_allowed(conn.sock.getpeercert()):
            self.stats["tls_failed"] += 1
            self._close(conn.sock)
            return False
        return True

    def _read(self, conn: _Conn) -> None:
        if conn.handshaking and not self._handshake(conn):
            return
        try:
            data = conn.sock.recv(65536)
            while isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():  # decrypted, not yet taken
                data += conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn.sock)
            return
        if not conn.buf:  # its first byte: the headers are due within header_timeout_s
            conn.deadline = min(conn.deadline, time.monotonic() + self.header_timeout_s)
        conn.buf += data
        end = _header_end(conn.buf)
        if (end if end >= 0 else len(conn.buf)) > MAX_HEADER_BYTES:
            self.stats["too_large"] += 1
            self._answer_and_close(conn, 431, b"request headers too large\n")
        elif end >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
            conn.busy = True
            self._work.put(conn)

    def _answer_and_close(self, conn: _Conn, status: int, body: bytes) -> None:
        with contextlib.suppress(OSError):
            conn.sock.send(_response(status, body, "text/plain; charset=utf-8", keep=False, head=False))
        self._close(conn.sock)

    def _take_back(self) -> None:
        while self._returned:
            conn, keep = self._returned.popleft()
            conn.busy = False
            if not keep or self._stopping.is_set():
                self._close(conn.sock)
                continue
            if _header_end(conn.buf) >= 0:  # the next request was pipelined behind the last: answer it
                conn.busy = True
                self._work.put(conn)
                continue
            conn.deadline = time.monotonic() + self.idle_timeout_s
            if conn.buf:  # part of the next request is here: its headers are due as any others
                conn.deadline = min(conn.deadline, time.monotonic() + self.header_timeout_s)
            try:
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            except (KeyError, ValueError, OSError):
                self._close(conn.sock)
                continue
            if isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():  # read from the wire, still in TLS
                self._read(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if not c.busy and c.deadline <= now]:
            if conn.handshaking:
                self.stats["tls_timeouts"] += 1
            self.stats["header_timeouts" if conn.buf or conn.handshaking else "idle_closed"] += 1
            self._close(conn.sock)

    def _close(self, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()

    # -- the workers -----------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            conn = self._work.get()
            if conn is None:
                return
            keep = False
            try:
                keep = self._serve(conn)
            except Exception:  # a rendering bug answers nothing and closes; it never kills the worker
                log.exception("metrics server: error answering a request")
            self._returned.append((conn, keep))
            self._wake()

    def _serve(self, conn: _Conn) -> bool:
        """Answer the request at the head of ``conn.buf``; whether the connection stays open."""
        end = _header_end(conn.buf)
        head, conn.buf = bytes(conn.buf[:end]), conn.buf[end:]
        lines = head.decode("latin-1").splitlines()
        parts = lines[0].split() if lines else []
        headers: dict[str, str] = {}
        head_only = False
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        extra: list[str] = []
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.stats["bad_requests"] += 1
            status, body, ctype, keep, encoding = 400, b"bad request\n", "text/plain; charset=utf-8", False, None
        elif self.guard is not None and not self.guard.authorized(headers.get("authorization")):
            self.stats["unauthorized"] += 1
            status, body, ctype, encoding = 401, b"unauthorized\n", "text/plain; charset=utf-8", None
            keep, head_only = False, parts[0] == "HEAD"
            extra = ['WWW-Authenticate: Basic realm="gpuhealth"']
        else:
            method, target, version = parts
            keep = (version == "HTTP/1.1" and headers.get("connection", "").lower() != "close") or (
                headers.get("connection", "").lower() == "keep-alive")
            path = target.split("?", 1)[0]
            encoding = None
            if method not in ("GET", "HEAD"):
                status, body, ctype, keep = 405, b"only GET and HEAD\n", "text/plain; charset=utf-8", False
            elif headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                status, body, ctype, keep = 400, b"no request body expected\n", "text/plain; charset=utf-8", False
            elif path == "/metrics":
                encoder, ctype = choose_encoder(headers.get("accept", ""))
                body, status = encoder(self.registry), 200
                if _accepts_gzip(headers.get("accept-encoding", "")):
                    body, encoding = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0), "gzip"
            elif path == "/":
                status, body, ctype = 200, _INDEX, "text/html; charset=utf-8"
            else:
                status, body, ctype = 404, b"no such endpoint\n", "text/plain; charset=utf-8"
            self.stats["requests"] += 1
            head_only = method == "HEAD"
        conn.sock.settimeout(self.write_timeout_s)  # a reader that does not read loses its answer
        try:
            conn.sock.sendall(_response(status, body, ctype, keep=keep, head=head_only, encoding=encoding,
                                        extra=extra))
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                conn.sock.setblocking(False)
        conn.answered += 1
        return keep


def _header_end(buf: bytearray) -> int:
    """Where the first request's headers end (after the blank line), or -1 while they have not."""
    crlf, lf = buf.find(b"\r\n\r\n"), buf.find(b"\n\n")
    ends = [i + n for i, n in ((crlf, 4), (lf, 2)) if i >= 0]
    return min(ends) if ends else -1


def _response(status: int, body: bytes, ctype: str, *, keep: bool, head: bool, encoding: str | None = None,
              extra: list[str] | None = None) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
              431: "Request Header Fields Too Large"}.get(status, "")
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}",
             f"Connection: {'keep-alive' if keep else 'close'}", *(extra or [])]
    if encoding:
        lines += [f"Content-Encoding: {encoding}", "Vary: Accept-Encoding"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)


def _accepts_gzip(header: str) -> bool:
    """Does an ``Accept-Encoding`` value allow gzip (``gzip`` or ``*`` with a q-value above 0)?"""
    allowed: dict[str, float] = {}
    for item in header.split(","):
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
    return allowed.get("gzip", allowed.get("x-gzip", allowed.get("*", 0.0))) > 0.0


def start_metrics_server(port: int, addr: str, registry: CollectorRegistry,
                         guard: WebGuard | None = None) -> tuple[MetricsServer, threading.Thread]:
    """What ``prometheus_client.start_http_server`` returns (server, thread), from the bounded server."""
    server = MetricsServer(registry, addr, port, guard=guard)
    return server, server._threads[0]
