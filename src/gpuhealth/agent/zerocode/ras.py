"""A client for NCCL's RAS service: which ranks of each communicator launched how many collectives.

Every NCCL job (NCCL ≥ 2.24, unless ``NCCL_RAS_ENABLE=0``) listens on ``localhost:28028``
(``NCCL_RAS_ADDR``) and answers the ``ncclras`` tool's text protocol (NCCL ``src/ras/client.cc``,
``client_support.cc``)::

    > CLIENT PROTOCOL 2          < SERVER PROTOCOL 2
    > TIMEOUT <s>                < OK          (optional: how long RAS waits for other processes)
    > SET FORMAT json            < OK          (NCCL ≥ 2.28.9; older: "ERROR: Unknown command …")
    > VERBOSE STATUS             < the report, then the server closes the connection

The JSON report lists every rank of every communicator (host, pid, CUDA/NVML device, status, launch
count per collective type); NCCL 2.28's misses a comma after a missing rank's ``nvml_dev``, which is
repaired here. The text report (every version) lists only the communicators that disagree, and in
them the ranks whose counts differ ("Rank 1 has launched up to operation 20 -- GPU 1 managed by
process 843 on node 10.0.0.2"). Both parse to one ``RasStatus``. Pids and ranks are as NCCL sees
them: pids in the job's PID namespace, ranks within the communicator.

Each process of a node binds the port with SO_REUSEPORT, so a connection reaches one of them at
random; every process answers for its whole job (all nodes). A job in its own network namespace
(a pod without hostNetwork) is reached by creating the socket inside that namespace (``netns_pid``;
needs CAP_SYS_ADMIN).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PROTOCOL = 2
MAX_REPLY_BYTES = 16 * 1024 * 1024
CLONE_NEWNET = 0x40000000
# ncclFuncStr order in NCCL: the collective types RAS counts.
OPS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
# How long a name RAS is asked at ("localhost") stays resolved: the watcher asks every job every poll, and each
# getaddrinfo walks the resolver (nsswitch, /etc/hosts, in a pod possibly DNS search domains) — the largest
# share of the watcher's CPU with four jobs on the footprint benchmark. A failure is never kept.
RESOLVE_TTL_S = 300.0

_resolved: dict[tuple[str, int], tuple[float, list[Any]]] = {}
_resolved_lock = threading.Lock()


def resolve(host: str, port: int, *, now: float | None = None) -> list[Any]:
    """``getaddrinfo(host, port)`` for a stream socket, kept ``RESOLVE_TTL_S``; raises ``OSError`` as it does."""
    now = time.monotonic() if now is None else now
    with _resolved_lock:
        kept = _resolved.get((host, port))
    if kept is not None and now - kept[0] < RESOLVE_TTL_S:
        return kept[1]
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    with _resolved_lock:
        if len(_resolved) > 256:  # one entry per RAS port in use: a bound, never reached in practice
            _resolved.clear()
        _resolved[(host, port)] = (now, infos)
    return infos


class RasUnavailable(Exception):
    """RAS cannot be asked (nothing listens, refused, no permission): the message says why, in words."""


class RasProtocolError(Exception):
    """Something answered, but not as NCCL's RAS does."""


@dataclass(frozen=True, slots=True)
class RasReply:
    text: str
    format: str  # "json" | "text"
    seconds: float


@dataclass(frozen=True, slots=True)
class RasRank:
    comm_rank: int
    host: str = ""
    pid: int | None = None
    cuda_dev: int | None = None
    nvml_dev: int | None = None
    counts: Mapping[str, int] = field(default_factory=dict)  # collective type -> launched up to
    status: str = ""  # "RUNNING", "INIT", "FINALIZE", "ABORT" when known; text: "" unless NCCL printed it
    error: str = ""  # an init or async error NCCL reported


@dataclass(frozen=True, slots=True)
class CountGroup:
    """Ranks of one communicator that launched the same number of one collective type. ``ranks`` lists
    those NCCL named; a text report leaves the majority unnamed (``n`` counts them all)."""

    op: str
    count: int
    n: int
    ranks: tuple[RasRank, ...] = ()


@dataclass(frozen=True, slots=True)
class RasCommunicator:
    key: str  # the communicator hash, 16 hex digits
    size: int | None = None
    ranks: tuple[RasRank, ...] = ()  # JSON: every rank that answered; text: the ranks NCCL named
    missing: tuple[RasRank, ...] = ()  # ranks NCCL got no data about
    groups: tuple[CountGroup, ...] = ()  # per collective type, most ranks first
    complete: bool = False  # every rank's count is known (JSON)
    labels: tuple[str, ...] = ()  # text: MISMATCH, INCOMPLETE, ERROR as NCCL printed them

    def counts_differ(self) -> bool:
        return any(len(self.ops_groups(op)) > 1 for op in {g.op for g in self.groups})

    def ops_groups(self, op: str) -> list[CountGroup]:
        return [g for g in self.groups if g.op == op]


@dataclass(frozen=True, slots=True)
class RasStatus:
    format: str
    nccl_version: str = ""
    communicators: tuple[RasCommunicator, ...] = ()
    notes: tuple[str, ...] = ()  # what NCCL itself flagged: missing processes, timeouts, dead peers

    def pids(self) -> frozenset[int]:
        return frozenset(r.pid for c in self.communicators for r in (*c.ranks, *c.missing) if r.pid)


# ------------------------------------------------------------------------------------------ transport


def _socket_in_netns(pid: int, family: int) -> socket.socket:
    """A TCP socket created inside ``pid``'s network namespace (its localhost is the job's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    result: dict[str, Any] = {}

    def run() -> None:  # setns affects only this thread, which ends right after
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        except OSError as exc:
            result["error"] = exc
            return
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                result["error"] = OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
                return
            try:
                result["sock"] = socket.socket(family, socket.SOCK_STREAM)
            finally:
                libc.setns(own, CLONE_NEWNET)
        finally:
            os.close(own)
            os.close(target)

    t = threading.Thread(target=run, name="gpuhealth-netns", daemon=True)
    t.start()
    t.join()
    if "sock" not in result:
        exc = result.get("error") or OSError("setns failed")
        raise RasUnavailable(f"cannot enter the network namespace of process {pid} to reach its RAS port: "
                             f"{getattr(exc, 'strerror', None) or exc} (needs CAP_SYS_ADMIN; or run the job with "
                             "host networking)")
    sock: socket.socket = result["sock"]
    return sock


def _connect(host: str, port: int, timeout_s: float, netns_pid: int | None) -> socket.socket:
    try:
        infos = resolve(host, port)
    except OSError as exc:
        raise RasUnavailable(f"cannot resolve {host}: {exc}") from exc
    last: OSError | None = None
    for family, _type, _proto, _name, addr in infos:
        sock = _socket_in_netns(netns_pid, family) if netns_pid else socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(addr)
            return sock
        except OSError as exc:
            last = exc
            sock.close()
    if isinstance(last, ConnectionRefusedError):
        raise RasUnavailable(f"nothing listens on {host}:{port}: the job's NCCL has no RAS service (NCCL older "
                             "than 2.24, NCCL_RAS_ENABLE=0, another NCCL_RAS_ADDR) or no communicator exists yet")
    raise RasUnavailable(f"cannot connect to RAS at {host}:{port}: {getattr(last, 'strerror', None) or last}")


class _Lines:
    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buf = sock, deadline, b""

    def _recv(self) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("RAS did not answer in time")
        self.sock.settimeout(left)
        return self.sock.recv(65536)

    def line(self) -> str:
        while b"\n" not in self.buf:
            data = self._recv()
            if not data:
                raise RasProtocolError("RAS closed the connection mid-answer")
            self.buf += data
            if len(self.buf) > 4096:
                raise RasProtocolError("RAS answered a command with an over-long line")
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8", "replace").strip()

    def rest(self) -> bytes:
        chunks, size = [self.buf], len(self.buf)
        self.buf = b""
        while True:
            data = self._recv()
            if not data:
                return b"".join(chunks)
            size += len(data)
            if size > MAX_REPLY_BYTES:
                raise RasProtocolError(f"the RAS report is over {MAX_REPLY_BYTES} bytes")
            chunks.append(data)


def query(host: str = "localhost", port: int = 28028, *, fmt: str = "json", timeout_s: float = 10.0,
          collective_timeout_s: int | None = None, netns_pid: int | None = None) -> RasReply:
    """One ``VERBOSE STATUS`` report. ``fmt`` "json" falls back to text on NCCL that has no JSON.
    Raises RasUnavailable (nobody to ask) or RasProtocolError (not RAS); TimeoutError past ``timeout_s``."""
    started = time.monotonic()
    sock = _connect(host, port, timeout_s, netns_pid)
    try:
        lines = _Lines(sock, started + timeout_s)
        try:
            sock.sendall(f"CLIENT PROTOCOL {PROTOCOL}\n".encode())
            hello = lines.line()
            if not hello.upper().startswith("SERVER PROTOCOL "):
                raise RasProtocolError(f"{host}:{port} is not NCCL RAS (it answered {hello[:80]!r})")
            if collective_timeout_s is not None:
                sock.sendall(f"TIMEOUT {int(collective_timeout_s)}\n".encode())
                if lines.line().upper() != "OK":
                    raise RasProtocolError("RAS refused the TIMEOUT command")
            used = "text"
            if fmt == "json":
                sock.sendall(b"SET FORMAT json\n")
                used = "json" if lines.line().upper() == "OK" else "text"  # older NCCL: "ERROR: Unknown command"
            sock.sendall(b"VERBOSE STATUS\n")
            body = lines.rest()
        except ConnectionResetError as exc:
            raise RasProtocolError(f"RAS reset the connection: {exc}") from exc
    finally:
        sock.close()
    return RasReply(body.decode("utf-8", "replace"), used, time.monotonic() - started)


# ------------------------------------------------------------------------------------------ parsing


def _hash_key(text: str) -> str:
    try:
        return f"{int(text, 16):016x}"
    except ValueError:
        return text.strip().lower()


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


_MISSING_COMMA = re.compile(r'("nvml_dev":\s*-?\d+)(\s*\n\s*"status")')


def _groups_of(ranks: Sequence[RasRank], ops: Sequence[str]) -> tuple[CountGroup, ...]:
    out: list[CountGroup] = []
    for op in ops:
        by_count: dict[int, list[RasRank]] = {}
        for r in ranks:
            if op in r.counts:
                by_count.setdefault(r.counts[op], []).append(r)
        for count, members in sorted(by_count.items(), key=lambda kv: (-len(kv[1]), -kv[0])):
            out.append(CountGroup(op, count, len(members), tuple(sorted(members, key=lambda r: r.comm_rank))))
    return tuple(out)


def _json_status(st: Any) -> tuple[str, str]:
    if not isinstance(st, Mapping):
        return "", ""
    if st.get("abort_flag"):
        state = "ABORT"
    elif st.get("finalize_called") or st.get("destroy_flag"):
        state = "FINALIZE"
    elif st.get("init_state") in (0, None):
        state = "RUNNING"
    else:
        state = "INIT"
    errors = [f"{k} {st[k]}" for k in ("init_state", "async_error") if st.get(k) not in (0, 7, None)]  # 7: in progress
    return state, ", ".join(errors)


def _json_rank(r: Mapping[str, Any], counts: Mapping[str, int] | None = None, state: str = "", error: str = ""
               ) -> RasRank:
    return RasRank(int(r["rank"]), str(r.get("host") or ""), _int_or_none(r.get("pid")),
                   _int_or_none(r.get("cuda_dev")), _int_or_none(r.get("nvml_dev")), dict(counts or {}), state, error)


def parse_json(text: str) -> RasStatus:
    try:
        doc = json.loads(text)
    except ValueError:
        try:
            doc = json.loads(_MISSING_COMMA.sub(r"\1,\2", text))
        except ValueError as exc:
            raise RasProtocolError(f"the RAS JSON report does not parse: {exc}") from exc
    if not isinstance(doc, Mapping) or not isinstance(doc.get("communicators"), list):
        raise RasProtocolError("the RAS JSON report has no communicators list")
    comms: list[RasCommunicator] = []
    for c in doc["communicators"]:
        if not isinstance(c, Mapping):
            continue
        ranks: list[RasRank] = []
        ops: list[str] = []
        for r in c.get("ranks") or []:
            if not isinstance(r, Mapping) or _int_or_none(r.get("rank")) is None:
                continue
            counts = {str(k): int(v) for k, v in (r.get("collective_counts") or {}).items()
                      if isinstance(v, int) and not isinstance(v, bool)}
            ops += [k for k in counts if k not in ops]
            state, error = _json_status(r.get("status"))
            ranks.append(_json_rank(r, counts, state, error))
        missing = [_json_rank(m) for m in c.get("missing_ranks") or []
                   if isinstance(m, Mapping) and _int_or_none(m.get("rank")) is not None]
        comms.append(RasCommunicator(
            key=_hash_key(str(c.get("hash", ""))), size=_int_or_none(c.get("size")),
            ranks=tuple(sorted(ranks, key=lambda r: r.comm_rank)), missing=tuple(missing),
            groups=_groups_of(ranks, [op for op in OPS if op in ops] + [op for op in ops if op not in OPS]),
            complete=not missing))
    ras = doc.get("ras") if isinstance(doc.get("ras"), Mapping) else {}
    notes = []
    if isinstance(ras, Mapping) and isinstance(ras.get("timeouts_count"), int) and ras["timeouts_count"] > 0:
        notes.append(f"RAS timed out {ras['timeouts_count']} time(s) gathering data")
    return RasStatus("json", str(doc.get("nccl_version") or ""), tuple(comms), tuple(notes))


_VERSION = re.compile(r"^NCCL version (\S+)")
_COMM = re.compile(r"^#\d+-\d+ \(([0-9a-fA-F]+)\) (\S+)")
_DIFF_COUNTS = re.compile(r"^Communicator ranks have different (\S+) operation counts")
_GROUP = re.compile(r"^(\d+) ranks have (?:launched up to operation (\d+)|not launched any operations)")
_RANK_GPU = r"GPU (\d+)(?: \(NVML (\d+)\))? managed by process (\d+) on node (\S*)"
_RANK_LINE = re.compile(r"^Rank (\d+)(?: has (?:launched up to operation (\d+)|not launched any operations"
                        r"|status (\S+)))? -- (?:" + _RANK_GPU + r"|\[process information not found\])")
_STATUS_GROUP = re.compile(r"^(\d+) ranks have status (\S+)")


def parse_text(text: str) -> RasStatus:
    """The text report: communicators NCCL flagged (``#g-c (hash) LABEL``) and the ranks it names."""
    version = ""
    notes: list[str] = []
    comms: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    label = ""  # the label of the section being read (one communicator may have several sections)
    op: str | None = None
    pending: CountGroup | None = None  # "N ranks have launched up to X": the ranks NCCL names may follow

    def close_pending() -> None:
        nonlocal pending
        if pending is not None and current is not None:
            current["groups"].append(pending)
        pending = None

    for raw in text.splitlines():
        line = raw.strip()
        if m := _VERSION.match(line):
            version = m.group(1)
            continue
        if m := _COMM.match(line):
            close_pending()
            current = comms.setdefault(_hash_key(m.group(1)), {"labels": [], "groups": [], "ranks": {}, "missing": []})
            label = m.group(2)
            current["labels"] += [lab for lab in label.split(",") if lab not in current["labels"]]
            op = None
            continue
        if not line:
            close_pending()
            continue
        if line.startswith(("Missing communicator data", "Encountered")):
            notes.append(line)
            continue
        if current is None:
            continue
        if m := _DIFF_COUNTS.match(line):
            close_pending()
            op = m.group(1)
            continue
        if line.startswith("Communicator ranks have different status") or _STATUS_GROUP.match(line):
            close_pending()
            op = None
            continue
        if (m := _GROUP.match(line)) and op is not None:
            close_pending()
            pending = CountGroup(op, int(m.group(2) or 0), int(m.group(1)))
            continue
        m = _RANK_LINE.match(line)
        if m is None:
            continue
        rank = RasRank(int(m.group(1)), m.group(7) or "", int(m.group(6)) if m.group(6) else None,
                       int(m.group(4)) if m.group(4) else None, int(m.group(5) or m.group(4)) if m.group(4) else None)
        known = current["ranks"].setdefault(rank.comm_rank, rank)
        if label.startswith("INCOMPLETE"):
            current["missing"].append(known)
        elif m.group(3):  # "Rank r has status S"
            current["ranks"][rank.comm_rank] = RasRank(known.comm_rank, known.host, known.pid, known.cuda_dev,
                                                       known.nvml_dev, known.counts, m.group(3))
        elif op is not None:
            if " has " in line.split(" -- ")[0]:  # a rank alone with its count
                close_pending()
                current["groups"].append(CountGroup(op, int(m.group(2) or 0), 1, (known,)))
            elif pending is not None:  # one of the ranks of the group line above
                pending = CountGroup(op, pending.count, pending.n, (*pending.ranks, known))
    close_pending()
    out: list[RasCommunicator] = []
    for key, c in comms.items():
        ranks_by = dict(c["ranks"])
        for g in c["groups"]:  # each named rank carries its counts too
            for r in g.ranks:
                base = ranks_by.get(r.comm_rank, r)
                ranks_by[r.comm_rank] = RasRank(base.comm_rank, base.host, base.pid, base.cuda_dev, base.nvml_dev,
                                                {**base.counts, g.op: g.count}, base.status, base.error)
        groups = tuple(CountGroup(g.op, g.count, g.n, tuple(ranks_by[r.comm_rank] for r in g.ranks))
                       for g in c["groups"])
        missing = {r.comm_rank: r for r in c["missing"]}
        out.append(RasCommunicator(key=key, ranks=tuple(sorted(ranks_by.values(), key=lambda r: r.comm_rank)),
                                   missing=tuple(missing.values()), groups=groups, labels=tuple(c["labels"])))
    return RasStatus("text", version, tuple(out), tuple(notes))


def parse(reply: RasReply) -> RasStatus:
    return parse_json(reply.text) if reply.format == "json" else parse_text(reply.text)


def fetch(host: str = "localhost", port: int = 28028, **kwargs: Any) -> tuple[RasReply, RasStatus]:
    """``query`` then ``parse``: the raw reply (for the record) and what it says."""
    reply = query(host, port, **kwargs)
    return reply, parse(reply)


__all__ = ["OPS", "CountGroup", "RasCommunicator", "RasProtocolError", "RasRank", "RasReply", "RasStatus",
           "RasUnavailable", "fetch", "parse", "parse_json", "parse_text", "query", "resolve"]
