"""``RankHub``: the agent's side of the instrument socket (training ranks on this node connect here).

An agent extension (``name``, ``start(agent)``, ``stop()``). It listens on a unix stream socket,
speaks ``gpuhealth.instrument.protocol`` (newline-delimited JSON; it never imports torch), keeps
the identity of each connected rank, passes step records to listeners and sends requests to
ranks on behalf of the coordinator link:

    hub = RankHub("/run/gpuhealth/agent.sock")
    hub.add_listener(on_identity=..., on_steps=..., on_disconnect=...)
    hub.start(agent)
    hub.ranks()                                         # -> list[RankIdentity]
    hub.request_dump("job42", None, timeout_s=30)
        # -> {rank: b"<the rank's flight-recorder JSON>" | Exception}  (sent inline over the socket)
    hub.request_stacks("job42", 3, timeout_s=10)        # -> {3: {"pid", "threads", "text"} | Exception}
    hub.stop()

Listener callbacks run on the hub's thread: keep them short (hand off to a queue). A listener that
raises is counted in ``stats()["listener_errors"]`` and never stops the hub. Malformed lines are
counted and skipped. One thread runs a selector over all connections.

Any local process that may open the socket can talk to it, so what it can cost and claim is bounded
(docs/security.md):

- Memory: partial lines of all connections share one budget (``max_buffered_bytes``); a connection
  that would go over it is not read until others' lines complete (the kernel holds the rest and the
  sender waits). A line not finished within ``line_timeout_s``, or no hello within
  ``hello_timeout_s``, closes the connection; at most ``max_connections`` are open at once, at most
  ``max_connections_per_uid`` of one user and ``max_connections_per_pid`` of one process (the kernel's
  ``SO_PEERCRED``). Freed buffers are handed back to the OS (``malloc_trim``), so the agent shrinks when
  they go.
- Judged before parsed: until its hello a connection's lines may be no longer than a hello
  (``protocol.MAX_HELLO_BYTES``; a longer one closes it, unread); a steps line is read record by record
  (``protocol.iter_steps_line``), never decoded as one document; a line longer than a hello is decoded
  only when it answers a request pending on that connection (a dump chunk, a reply).
- Identity: the kernel says who connected (``SO_PEERCRED``: pid, uid). A hello for a job whose ranks
  here run as another user is refused unless the caller's environment (or Slurm cgroup) names that
  job; a rank held by a live connection is not taken over (a restarted rank's old connection is
  gone, or is the same process's) except by a verified claim (``claim_verified``: kernel evidence —
  the Slurm cgroup, or the uid of the job's verified ranks) from an unverified one. Each identity says
  whether it is verified; the coordinator lets no unverified claim move a verified rank or count as
  progress. Step records count only for the connection's own job and rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import hashlib
import itertools
import logging
import os
import queue
import re
import select
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.instrument import protocol
from gpuhealth.model import MetricKind, RankIdentity, Sample, StepRecord

log = logging.getLogger(__name__)

OnIdentity = Callable[[RankIdentity], None]
OnSteps = Callable[["RankIdentity | None", list[StepRecord]], None]
OnDisconnect = Callable[[RankIdentity], None]

_UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL on Linux


class RankHubError(RuntimeError):
    """The socket cannot be set up (bad path, in use by a live agent, not a socket)."""


class RankRequestError(RuntimeError):
    """A rank answered a request with an error (its message is the rank's)."""


class DumpBudgetExceeded(RankRequestError):
    """Other ranks' dumps in flight fill the agent's memory budget: ask this rank again later."""


class RankNotConnectedError(LookupError):
    """The rank asked for is not connected, or went away before answering."""


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """Who is at the other end of a connection, from the kernel (Linux ``SO_PEERCRED``), in the
    agent's PID namespace. None where the platform does not say."""

    pid: int | None = None
    uid: int | None = None
    gid: int | None = None


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return PeerCredentials()
    try:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i")))
    except OSError:
        return PeerCredentials()
    return PeerCredentials(pid or None, uid, gid)  # pid 0: the peer lives in a namespace we cannot see


# Where a rank's job id comes from (gpuhealth.instrument.identity.JOB_ID_VARS; a test keeps them equal).
JOB_ENV_VARS = ("GPUHEALTH_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
_MAX_ENVIRON_BYTES = 1 << 20


def process_names_job(pid: int, job_id: str, proc: Path = Path("/proc")) -> bool:
    """Does process ``pid`` belong to ``job_id`` by its own environment (a job-id variable set to it) or
    its Slurm cgroup (``…/job_<id>/…``)? False when unreadable (another user's process, and the agent
    not root) — then the caller's uid decides."""
    try:
        with (proc / str(pid) / "environ").open("rb") as fh:
            environ = fh.read(_MAX_ENVIRON_BYTES).split(b"\0")
    except OSError:
        environ = []
    wanted = {f"{var}={job_id}".encode() for var in JOB_ENV_VARS}
    if wanted & set(environ):
        return True
    try:
        cgroups = (proc / str(pid) / "cgroup").read_text(errors="replace")[:65536]
    except OSError:
        return False
    return re.search(rf"/job_{re.escape(job_id)}(/|$)", cgroups, re.MULTILINE) is not None


def _dump_of(rank: int, res: Any, folder: str | None) -> bytes | bytearray | str | Exception:
    """A rank's answer to a dump request: its bytes (taken out of the reply), a file's path, or an Exception."""
    if isinstance(res, Exception):
        return res
    if isinstance(res.get("data"), bytes | bytearray):
        data: bytes | bytearray = res.pop("data")
        return data
    if folder and isinstance(res.get("path"), str):
        return str(res["path"])
    return RankRequestError(f"rank {rank} replied without a dump")


def cgroup_names_job(pid: int | None, job_id: str, proc: Path = Path("/proc")) -> bool:
    """Kernel evidence that process ``pid`` is job ``job_id``'s: its cgroup, which slurmd made and only root
    can move a process into (``…/job_<id>/…``). Its environment is no evidence: any process sets its own."""
    if not pid:
        return False  # no pid we can see (no hostPID): no cgroup to read
    try:
        cgroups = (proc / str(pid) / "cgroup").read_text(errors="replace")[:65536]
    except OSError:
        return False
    return re.search(rf"/job_{re.escape(job_id)}(/|$)", cgroups, re.MULTILINE) is not None


def claim_verified(peer: PeerCredentials, job_id: str, verified_uids: set[int],
                   proc: Path = Path("/proc")) -> bool:
    """Is a claim to ``job_id`` from ``peer`` backed by the kernel? Its Slurm cgroup names the job, or it runs
    as the (non-root) uid of the job's verified ranks here (``verified_uids``): that user's own process.
    Root is no evidence (every container's root may be uid 0)."""
    if peer.uid is not None and peer.uid != 0 and peer.uid in verified_uids:
        return True
    return cgroup_names_job(peer.pid, job_id, proc)


def bind_rank_socket(path: Path, mode: int = 0o666) -> tuple[socket.socket, int]:
    """Listen on ``path`` (its own folder made if missing; a stale socket of a dead agent replaced): the
    listening socket and the file's inode (to remove the file on stop only while it is still that one)."""
    if len(os.fsencode(str(path))) > _UNIX_PATH_MAX:
        raise RankHubError(f"socket path {path} is longer than {_UNIX_PATH_MAX} bytes (unix socket limit)")
    # Only the socket's own folder is made (as systemd's RuntimeDirectory would): a path whose folder above
    # that does not exist is a typo, not a tree to create as root.
    try:
        path.parent.mkdir(exist_ok=True)
    except FileNotFoundError as exc:
        raise RankHubError(f"agent.socket_path: {path.parent.parent} does not exist (only the socket's own "
                           f"folder {path.parent.name}/ is created)") from exc
    except OSError as exc:
        raise RankHubError(f"agent.socket_path: cannot create {path.parent}: {exc.strerror or exc}") from exc
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise RankHubError(f"{path} exists and is not a socket; not removing it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
            live = True
        except OSError:
            live = False  # stale socket from a dead agent
        finally:
            probe.close()
        if live:
            raise RankHubError(f"another process is already listening on {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise RankHubError(f"cannot listen on {path}: {exc.strerror or exc}") from exc
    return sock, path.lstat().st_ino


def rank_samples(st: Mapping[str, int], ranks: list[RankIdentity]) -> list[Sample]:
    """For the agent's /metrics: who is connected, what arrived, what was refused (``RankHub.stats()`` and
    ``RankHub.ranks()``, in the agent's process or from the rank process over the channel)."""
    per_job: dict[str, int] = {}
    for ident in ranks:
        per_job[ident.job_id] = per_job.get(ident.job_id, 0) + 1
    out = [
        Sample("agent_ranks_connected", float(st.get("ranks", 0)),
               "Training ranks connected to this agent's socket (gpuhealth.instrument)"),
        Sample("agent_rank_step_records", float(st.get("records", 0)), "Step records received from ranks",
               MetricKind.COUNTER),
        Sample("agent_rank_malformed_messages", float(st.get("malformed", 0) + st.get("bad_records", 0)),
               "Lines or step records from ranks that were not valid (skipped)", MetricKind.COUNTER),
        Sample("agent_dump_budget_refusals", float(st.get("dump_budget_refusals", 0)),
               "Flight-recorder dumps refused for the agent's memory budget (asked again one at a time)",
               MetricKind.COUNTER),
        Sample("agent_rank_socket_refusals",
               float(sum(st.get(k, 0) for k in ("refused_connections", "refused_hellos", "hello_timeouts",
                                                "line_timeouts", "refused_over_share", "refused_before_hello",
                                                "displaced_over_share"))),
               "Rank-socket connections the agent closed: over the connection cap or one user's or process's "
               "share, a hello claiming a live rank or another user's job, anything but a hello first, no hello "
               "in time, a line left unfinished (docs/security.md)",
               MetricKind.COUNTER),
    ]
    out += [Sample("agent_job_ranks_connected", float(n), "Connected ranks of one job on this node",
                   labels=(("job_id", job),)) for job, n in sorted(per_job.items())]
    return out


class _Trimmer:
    """Hands freed heap memory back to the OS (glibc ``malloc_trim``): without it, the megabytes a burst
    of partial lines took stay in the agent's RSS after they are freed. A no-op elsewhere."""

    def __init__(self, every_bytes: int = 8 << 20, min_interval_s: float = 1.0) -> None:
        self._every = every_bytes
        self._interval = min_interval_s
        self._freed = 0
        self._last = 0.0
        self._trim: Any = None
        with contextlib.suppress(OSError, AttributeError, TypeError):
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim

    def freed(self, nbytes: int) -> None:
        self._freed += nbytes
        if self._freed >= self._every:
            self.tick()

    @property
    def pending(self) -> bool:
        """A trim waits for its interval to pass (the hub's loop must come round to do it)."""
        return self._trim is not None and self._freed >= 1 << 20

    def tick(self) -> None:
        """Trim now if a MiB or more was freed since the last trim and the interval has passed. Called by the
        hub's loop at least once a second too: the last connections of a burst close within the interval
        of the previous trim, and nothing would free memory after them to trim it (seen: 40+ MiB kept)."""
        now = time.monotonic()
        if self._trim is not None and self._freed >= 1 << 20 and now - self._last >= self._interval:
            self._freed, self._last = 0, now
            with contextlib.suppress(Exception):
                self._trim(0)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: PeerCredentials = field(default_factory=PeerCredentials)
    identity: RankIdentity | None = None
    job_verified: bool = False  # the peer's own environment/cgroup names the job of its hello
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    connected_at: float = field(default_factory=time.time)
    opened: float = field(default_factory=time.monotonic)
    # The line being received (bytes read since the last newline), charged to the hub's budget.
    partial: list[bytes] = field(default_factory=list)
    partial_bytes: int = 0
    partial_since: float | None = None  # monotonic time its first byte came
    discarding: bool = False  # inside an over-long line: drop bytes up to its newline
    paused: bool = False  # not read until the budget has room
    share: tuple[int | None, int | None] = (None, None)  # (uid, pid) slots it holds (see RankHub._accept)

    @property
    def peer_pid(self) -> int | None:
        return self.peer.pid


def _gone(conn: _Conn) -> bool:
    """Has the peer of ``conn`` closed its end (its process died or let go)? Peeks; reads nothing."""
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)  # (a recv on a socket with a timeout would wait)
        return bool(readable) and conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False
    except (OSError, ValueError):
        return True


@dataclass(eq=False)
class _Waiter:
    conn: _Conn
    rank: int
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    # An inline dump, as it arrives: one buffer grown in place (a large realloc moves pages, it does not copy
    # them), handed on as it is — a list of chunks joined at the end held the dump twice.
    chunks: bytearray = field(default_factory=bytearray)
    received: int = 0  # chunks appended
    size: int = 0
    answered: queue.SimpleQueue[str] | None = None  # where _finish says "done" (the request's queue)
    rid: str = ""


@dataclass(frozen=True)
class _Listener:
    on_identity: OnIdentity | None
    on_steps: OnSteps | None
    on_disconnect: OnDisconnect | None


class RankHub:
    """Listens for instrumented training ranks on ``socket_path`` (file mode ``mode``).

    0666 by default: training ranks run as their users, and the agent as its own (systemd's DynamicUser, a pod's
    root), so a 0660 socket refused every rank but root's. Who a connection is comes from the kernel
    (``SO_PEERCRED``), never from the file's mode: a user joins only its own jobs, within its share of the slots.
    A site narrows who may connect with the folder's mode (``RuntimeDirectoryMode``)."""

    name = "ranks"

    def __init__(self, socket_path: str | os.PathLike[str], *, mode: int = 0o666, send_timeout_s: float = 2.0,
                 max_dump_bytes: int = 32 * 1024 * 1024, max_inflight_dump_bytes: int = 64 * 1024 * 1024,
                 max_connections: int = 1024, max_buffered_bytes: int = 64 * 1024 * 1024,
                 hello_timeout_s: float = 10.0, line_timeout_s: float = 30.0,
                 max_connections_per_uid: int | None = None, max_connections_per_pid: int = 64,
                 max_connections_per_job: int = 64, max_unidentified_per_uid: int = 32,
                 listen_socket: socket.socket | None = None,
                 names_job: Callable[[int, str], bool] = process_names_job) -> None:
        self.socket_path = Path(socket_path)
        # Does a process name a job (its environment, its Slurm cgroup)? The unprivileged rank process asks the
        # agent's root part: only root reads another user's /proc/<pid>/environ.
        self._names_job = names_job
        # A socket bound by someone else (the agent's root part, for the unprivileged rank process:
        # tenant_proc.py): this hub only accepts on it, and neither binds nor removes the file.
        self._given_listen = listen_socket
        # Whatever connects: open connections, bytes of unfinished lines over all of them, and how long a
        # connection may stay silent about who it is, or keep a line unfinished (a rank's line is
        # written in one go: milliseconds).
        self.max_connections = max_connections
        # One user's share (a quarter by default), and one process's (a rank holds one connection): a
        # flood from one user leaves slots for everyone else's ranks.
        self.max_connections_per_uid = max_connections_per_uid or max(1, max_connections // 4)
        self.max_connections_per_pid = max_connections_per_pid
        # Where the kernel gives no pid (an agent without hostPID: SO_PEERCRED says 0), processes of one uid
        # cannot be told apart, so one uid's connections are shared by the job they claim instead: at most
        # this many per job, this many before their hello, and a full share gives way (see _make_room).
        self.max_connections_per_job = max_connections_per_job
        self.max_unidentified_per_uid = max_unidentified_per_uid
        self._held: dict[tuple[str, int], int] = {}  # ("uid"|"pid", id) -> connections open
        self.max_buffered_bytes = max_buffered_bytes
        self.hello_timeout_s = hello_timeout_s
        self.line_timeout_s = line_timeout_s
        self._buffered = 0
        self._paused: list[_Conn] = []
        self._trimmer = _Trimmer()
        self._next_sweep = 0.0
        self._last_warning = 0.0
        self._warnings_held = 0
        # One rank's dump, and all dumps being received at once: the agent's memory stays bounded however
        # many ranks answer (a 2000-entry NCCL dump is ~1 MB).
        self.max_dump_bytes = max_dump_bytes
        self.max_inflight_dump_bytes = max_inflight_dump_bytes
        self._inflight = 0
        self.mode = mode
        self._send_timeout = send_timeout_s
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._by_rank: dict[tuple[str, int], _Conn] = {}
        self._waiters: dict[str, _Waiter] = {}
        self._listeners: list[_Listener] = []
        self._ids = itertools.count(1)
        self._listen: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._inode: int | None = None
        self._stats = {"connections": 0, "disconnects": 0, "malformed": 0, "bad_records": 0, "records": 0,
                       "listener_errors": 0, "unknown_messages": 0, "late_replies": 0, "foreign_replies": 0,
                       "dump_budget_refusals": 0, "refused_connections": 0, "refused_hellos": 0,
                       "foreign_records": 0, "hello_timeouts": 0, "line_timeouts": 0, "budget_pauses": 0,
                       "refused_over_share": 0, "refused_before_hello": 0, "unexpected_lines": 0,
                       "displaced_over_share": 0}

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self, agent: object | None = None) -> None:
        """Bind the socket and start the hub thread (does not block). ``agent`` is unused."""
        if self._thread is not None:
            return
        self._listen = self._given_listen if self._given_listen is not None else self._bind()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w, self._listen):
            s.setblocking(False)
        self._sel.register(self._listen, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="gpuhealth-rankhub", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close every connection, fail pending requests, remove the socket file."""
        if self._thread is None:
            return
        self._stopping.set()
        self._wake()
        self._thread.join(5.0)
        self._thread = None
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            self._drop(conn)
        for s in (self._listen, self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self._sel is not None:
            self._sel.close()
        self._listen = self._wake_r = self._wake_w = None
        self._sel = None
        with contextlib.suppress(OSError):  # remove the file only if it is still the one we made
            if self._inode is not None and self.socket_path.lstat().st_ino == self._inode:
                self.socket_path.unlink()

    def _bind(self) -> socket.socket:
        sock, self._inode = bind_rank_socket(self.socket_path, self.mode)
        return sock

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")

    # -- public API (thread-safe) -------------------------------------------------------------------

    def add_listener(
        self,
        on_identity: OnIdentity | None = None,
        on_steps: OnSteps | None = None,
        on_disconnect: OnDisconnect | None = None,
    ) -> None:
        """``on_identity(identity)`` when a rank says hello; ``on_steps(identity or None, records)``
        for each batch; ``on_disconnect(identity)`` when a rank that said hello goes away."""
        with self._lock:
            self._listeners.append(_Listener(on_identity, on_steps, on_disconnect))

    def ranks(self, job_id: str | None = None) -> list[RankIdentity]:
        """Identities of connected ranks (of one job when ``job_id`` is given), by job then rank."""
        with self._lock:
            idents = [c.identity for c in self._by_rank.values() if c.identity is not None]
        if job_id is not None:
            idents = [i for i in idents if i.job_id == job_id]
        return sorted(idents, key=lambda i: (i.job_id, i.rank))

    def samples(self) -> list[Sample]:
        """For the agent's /metrics: who is connected, what arrived, what was refused."""
        return rank_samples(self.stats(), self.ranks())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "connected": len(self._conns), "ranks": len(self._by_rank),
                    "dump_bytes_in_flight": self._inflight, "buffered_bytes": self._buffered,
                    "paused": len(self._paused)}

    def request_dump(
        self, job_id: str, rank: int | None, out_dir: str | None = None, timeout_s: float = 30.0
    ) -> dict[int, bytes | bytearray | str | Exception]:
        """Ask ranks (all of the job's ranks on this node when ``rank`` is None) for their flight
        recorder. Each answers with the dump's bytes, sent inline over the socket (at most
        ``max_dump_bytes``, checked against the length and SHA-256 the rank states); a hook older than
        inline dumps writes ``<out_dir>/rank<N>.json`` instead and answers with its path (a str), when
        ``out_dir`` is given. An Exception stands in for a rank that failed (RankRequestError,
        RankNotConnectedError, TimeoutError). Waits at most ``timeout_s``."""
        return dict(self.iter_dumps(job_id, rank, out_dir, timeout_s))

    def iter_dumps(
        self, job_id: str, rank: int | None, out_dir: str | None = None, timeout_s: float = 30.0
    ) -> Iterator[tuple[int, bytes | bytearray | str | Exception]]:
        """``request_dump``, one rank at a time as each answers: a caller that ships and drops each
        dump holds one in memory, not the whole job's."""
        # Absolute: the rank resolves the folder from its own working directory, not the agent's.
        folder = os.path.abspath(out_dir) if out_dir else None
        for r, res in self._request_iter(job_id, rank, timeout_s, lambda rid: protocol.dump_fr_request(rid, folder)):
            # Yielded without a local name: a suspended generator's locals stay alive, and the caller must
            # hold the only reference to the dump while it ships it.
            yield r, _dump_of(r, res, folder)
            del res

    def request_stacks(
        self, job_id: str, rank: int | None, timeout_s: float = 10.0
    ) -> dict[int, dict[str, Any] | Exception]:
        """All-thread Python stacks of the ranks: ``{"pid", "threads": [{"thread_id", "name", "main",
        "frames": [{"file", "line", "function", "code"}, …innermost last]}], "text"}`` or an Exception."""
        results = self._request(job_id, rank, timeout_s, protocol.stacks_request)
        out: dict[int, dict[str, Any] | Exception] = {}
        for r, res in results.items():
            if isinstance(res, Exception):
                out[r] = res
            elif isinstance(res.get("stacks"), dict):
                out[r] = res["stacks"]
            else:
                out[r] = RankRequestError(f"rank {r} replied without stacks")
        return out

    def _request(
        self, job_id: str, rank: int | None, timeout_s: float, build: Callable[[str], dict[str, Any]]
    ) -> dict[int, Any]:
        return dict(self._request_iter(job_id, rank, timeout_s, build))

    def _request_iter(
        self, job_id: str, rank: int | None, timeout_s: float, build: Callable[[str], dict[str, Any]]
    ) -> Iterator[tuple[int, Any]]:
        """Send the request to the ranks and yield (rank, answer or Exception) as each one answers,
        then the ranks that did not answer in time. Stopping early forgets the rest."""
        answered: queue.SimpleQueue[str] = queue.SimpleQueue()
        with self._lock:
            if rank is None:
                targets = [(r, c) for (j, r), c in self._by_rank.items() if j == job_id]
            else:
                conn = self._by_rank.get((job_id, rank))
                targets = [(rank, conn)] if conn is not None else []
            waiters: dict[str, _Waiter] = {}
            for r, conn in targets:
                rid = f"{os.getpid()}-{next(self._ids)}"
                waiters[rid] = self._waiters[rid] = _Waiter(conn, r, answered=answered, rid=rid)
        if rank is not None and not targets:
            yield rank, RankNotConnectedError(f"rank {rank} of job {job_id} is not connected here")
        try:
            for rid, w in waiters.items():
                try:
                    line = protocol.encode(build(rid))
                    with w.conn.send_lock:
                        w.conn.sock.sendall(line)
                except (OSError, protocol.ProtocolError) as exc:
                    self._finish(rid, RankNotConnectedError(f"rank {w.rank}: cannot send the request: {exc}"))
            deadline = time.monotonic() + timeout_s
            pending = dict(waiters)
            while pending:
                try:
                    rid = answered.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                done = pending.pop(rid, None)
                if done is not None:
                    result, done.result = done.result, None  # the caller holds the only reference from here
                    yield done.rank, result
                    del result
                    with self._lock:
                        self._drop_chunks(done)  # the caller is done with that dump: its bytes leave the budget
            for w in pending.values():
                yield w.rank, TimeoutError(f"rank {w.rank} did not answer within {timeout_s:g} s")
        finally:
            with self._lock:
                for rid, w in waiters.items():
                    self._waiters.pop(rid, None)
                    self._drop_chunks(w)  # timed out, abandoned, or answered but never taken
                    w.result = None

    def _finish(self, rid: str, result: Any, *, from_conn: _Conn | None = None) -> None:
        with self._lock:
            w = self._waiters.get(rid)
            if w is not None and from_conn is not None and w.conn is not from_conn:
                # a reply to a request sent to another connection: not this one's to answer
                self._stats["foreign_replies"] += 1
                return
            if self._waiters.pop(rid, None) is not None and not (isinstance(result, dict) and "data" in result):
                self._drop_chunks(w)  # type: ignore[arg-type]
        if w is None:
            with self._lock:
                self._stats["late_replies"] += 1
            return
        w.result = result
        w.done.set()
        if w.answered is not None:
            w.answered.put(w.rid)

    # -- hub thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._sel is not None
        while not self._stopping.is_set():
            try:
                self._sweep()
                self._resume()
                self._trimmer.tick()
                events = self._sel.select(self._select_timeout())
            except (OSError, ValueError):
                if self._stopping.is_set():
                    break
                log.exception("rank hub: select failed")  # keep serving; never let the thread die
                time.sleep(0.1)
                continue
            for key, _ in events:
                obj = key.fileobj
                try:
                    if obj is self._listen:
                        self._accept()
                    elif obj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._read(key.data)
                except Exception:  # one bad connection never stops the hub
                    log.exception("rank hub: error on a connection")
                    if isinstance(key.data, _Conn):
                        self._drop(key.data)

    def _select_timeout(self) -> float | None:
        """A second while a sweep (a connection without its hello or inside a line), a paused reader or a trim
        waits on the clock; otherwise none: an idle hub, or one whose ranks are between records, sleeps until
        a socket or the wake pipe is ready (each timed wake-up is CPU on every node, all day)."""
        if self._paused or self._trimmer.pending:
            return 1.0
        with self._lock:
            conns = list(self._conns)
        return 1.0 if any(c.identity is None or c.partial_since is not None for c in conns) else None

    def _accept(self) -> None:
        assert self._listen is not None and self._sel is not None
        while True:
            try:
                sock, _ = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: the next select tries again
                self._warn(f"rank socket: cannot accept: {exc}")
                return
            peer = peer_credentials(sock)
            displaced = self._make_room(peer)
            if displaced is not None:
                self._warn(f"rank socket: uid {peer.uid} is at its share; closing its connection for rank "
                           f"{displaced.identity.rank if displaced.identity else '?'} of the job holding most "
                           "of its connections, to let a new one in")
                self._drop(displaced)
            with self._lock:
                why = self._over_share(peer)
                if why:
                    self._stats["refused_connections" if why.startswith("the agent") else "refused_over_share"] += 1
                else:
                    conn = _Conn(sock, peer=peer, share=(peer.uid, peer.pid))
                    self._take_share(conn, 1)
                    self._conns.add(conn)
                    self._stats["connections"] += 1
            if why:
                self._warn(f"rank socket: refused a connection from pid {peer.pid} uid {peer.uid}: {why}")
                with contextlib.suppress(OSError, protocol.ProtocolError):  # say why; the peer may not listen
                    sock.send(protocol.encode({"type": "refused", "error": why}), socket.MSG_DONTWAIT)
                sock.close()
                continue
            sock.settimeout(self._send_timeout)  # sends from request threads must not hang forever
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _over_share(self, peer: PeerCredentials) -> str:
        """Why a connection from ``peer`` may not have a slot, or "" (call with the lock held)."""
        if len(self._conns) >= self.max_connections:
            return f"the agent has {self.max_connections} connections open"
        if peer.uid is not None and self._held.get(("uid", peer.uid), 0) >= self.max_connections_per_uid:
            return f"uid {peer.uid} holds {self.max_connections_per_uid} connections, its share"
        if peer.pid is not None and self._held.get(("pid", peer.pid), 0) >= self.max_connections_per_pid:
            return f"pid {peer.pid} holds {self.max_connections_per_pid} connections, its share"
        if peer.pid is None and peer.uid is not None and sum(
                1 for c in self._conns if c.identity is None and c.peer.uid == peer.uid
        ) >= self.max_unidentified_per_uid:
            return f"uid {peer.uid} has {self.max_unidentified_per_uid} connections that have not said hello"
        return ""

    def _make_room(self, peer: PeerCredentials) -> _Conn | None:
        """A connection of ``peer``'s uid to close so that ``peer`` gets a slot, or None. Only where the kernel
        gives no pid and the uid's share is full: the newest connection of the job that holds most of the uid's
        connections (at least two) gives way — a flood into a few job ids cannot keep out another rank of
        the same uid (without pids, one uid is every process of every pod that runs as it)."""
        if peer.pid is not None or peer.uid is None:
            return None
        with self._lock:
            if self._held.get(("uid", peer.uid), 0) < self.max_connections_per_uid:
                return None
            groups: dict[str, list[_Conn]] = {}
            for c in self._conns:
                if c.peer.uid == peer.uid and c.identity is not None:
                    groups.setdefault(c.identity.job_id, []).append(c)
            biggest = max(groups.values(), key=len, default=[])
            if len(biggest) < 2:
                return None
            self._stats["displaced_over_share"] += 1
            return max(biggest, key=lambda c: c.opened)

    def _over_job_share(self, conn: _Conn, job_id: str) -> str:
        """Why ``conn`` (no pid known) may not claim a rank of ``job_id``, or "" (lock held): one uid's
        connections to one job are bounded, as one process's are where pids are known."""
        if conn.peer.pid is not None:
            return ""
        held = sum(1 for (job, _), c in self._by_rank.items()
                   if job == job_id and c is not conn and c.peer.uid == conn.peer.uid)
        if held >= self.max_connections_per_job:
            return (f"uid {conn.peer.uid} holds {self.max_connections_per_job} connections to job {job_id}, its "
                    "share where the kernel gives no pid")
        return ""

    def _take_share(self, conn: _Conn, n: int) -> None:
        """Count ``conn`` in (n=1) or out of (n=-1) its user's and process's shares (lock held)."""
        uid, pid = conn.share
        for key in ((("uid", uid),) if uid is not None else ()) + ((("pid", pid),) if pid is not None else ()):
            left = self._held.get(key, 0) + n
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    # One read at most this large, and never more than the budget has room for.
    _READ_BYTES = 256 * 1024

    def _read(self, conn: _Conn) -> None:
        room = self.max_buffered_bytes - self._buffered
        if room <= 0:
            self._pause(conn)
            return
        try:
            data = conn.sock.recv(min(self._READ_BYTES, room))
        except (BlockingIOError, InterruptedError, TimeoutError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        for line in self._lines(conn, data):
            self._on_line(conn, line)
            del line
            if conn not in self._conns:
                break  # refused: nothing more from it
        self._trimmer.freed(len(data))

    def _on_line(self, conn: _Conn, line: bytes) -> None:
        """One complete line, judged before it is decoded (its size, who sent it, what it answers)."""
        if conn.identity is not None and line.startswith(protocol.STEPS_HEAD):
            self._on_steps_line(conn, line)
            return
        else:  # before a hello, _lines lets through nothing longer than one (and records then count for nobody)
            if len(line) > protocol.MAX_HELLO_BYTES:
                head = protocol.request_head(line)
                with self._lock:
                    w = self._waiters.get(head[1]) if head is not None else None
                    if w is None or w.conn is not conn:
                        self._stats["unexpected_lines"] += 1  # a large line that answers nothing asked of it
                        return
            try:
                message = protocol.decode(line)
            except protocol.ProtocolError:
                with self._lock:
                    self._stats["malformed"] += 1
                return
        self._on_message(conn, message)

    def _on_steps_line(self, conn: _Conn, line: bytes) -> None:
        """A steps line, record by record: only the sender's own records are kept (a rank speaks for itself)."""
        ident = conn.identity
        assert ident is not None
        own: list[StepRecord] = []
        bad = foreign = 0
        try:
            for rec in protocol.iter_steps_line(line):
                if rec is None:
                    bad += 1
                elif (rec.job_id, rec.rank) == (ident.job_id, ident.rank):
                    own.append(dataclasses.replace(rec, job_id=ident.job_id))  # one job-id string, not one each
                else:
                    foreign += 1
        except protocol.ProtocolError:
            bad += 1
        with self._lock:
            self._stats["records"] += len(own)
            self._stats["bad_records"] += bad
            self._stats["foreign_records"] += foreign
        if own:
            self._notify(lambda li: li.on_steps and li.on_steps(ident, own))

    def _lines(self, conn: _Conn, data: bytes) -> Iterator[bytes]:
        """Complete lines of ``conn`` as ``data`` finishes them; the rest stays as its partial line,
        charged to the budget. A line over ``protocol.MAX_LINE_BYTES`` is dropped whole."""
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            if conn.discarding:
                conn.discarding = False
            else:
                parts = [*conn.partial, data[start:nl]]
                size = conn.partial_bytes + nl - start
                self._release(conn)
                if conn.identity is None and size > protocol.MAX_HELLO_BYTES:
                    self._refuse_unidentified(conn, f"a first line over {protocol.MAX_HELLO_BYTES} bytes")
                    return
                if size > protocol.MAX_LINE_BYTES:
                    with self._lock:
                        self._stats["malformed"] += 1
                elif size and (line := b"".join(parts)).strip():
                    del parts
                    yield line
                    if conn not in self._conns:
                        return
            self._release(conn)
            start = nl + 1
        rest = len(data) - start
        if rest and conn.identity is None and conn.partial_bytes + rest > protocol.MAX_HELLO_BYTES:
            self._refuse_unidentified(conn, f"a first line over {protocol.MAX_HELLO_BYTES} bytes")
            return
        if rest and not conn.discarding:
            if conn.partial_bytes + rest > protocol.MAX_LINE_BYTES:
                self._release(conn)
                conn.discarding = True
                with self._lock:
                    self._stats["malformed"] += 1
            else:
                conn.partial.append(data[start:] if start else data)
                conn.partial_bytes += rest
                conn.partial_since = conn.partial_since or time.monotonic()
                with self._lock:
                    self._buffered += rest

    def _release(self, conn: _Conn) -> None:
        """Forget ``conn``'s partial line (its bytes leave the budget)."""
        if conn.partial_bytes:
            with self._lock:
                self._buffered -= conn.partial_bytes
        conn.partial.clear()
        conn.partial_bytes = 0
        conn.partial_since = None

    def _pause(self, conn: _Conn) -> None:
        """Stop reading ``conn`` until the budget has room (its peer's writes wait in the kernel)."""
        if conn.paused or self._sel is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.paused = True
        self._paused.append(conn)
        with self._lock:
            self._stats["budget_pauses"] += 1

    def _resume(self) -> None:
        if not self._paused or self._buffered >= self.max_buffered_bytes or self._sel is None:
            return
        paused, self._paused = self._paused, []
        for conn in paused:
            conn.paused = False
            if conn in self._conns:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.register(conn.sock, selectors.EVENT_READ, conn)

    def _sweep(self) -> None:
        """Close connections that never said hello, or sit on an unfinished line (once a second)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, self.hello_timeout_s / 2, self.line_timeout_s / 2)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            if conn.identity is None and now - conn.opened > self.hello_timeout_s:
                reason, stat_key = f"no hello within {self.hello_timeout_s:g} s", "hello_timeouts"
            elif conn.partial_since is not None and now - conn.partial_since > self.line_timeout_s:
                reason, stat_key = f"a line left unfinished for {self.line_timeout_s:g} s", "line_timeouts"
            else:
                continue
            with self._lock:
                self._stats[stat_key] += 1
            self._warn(f"rank socket: closing a connection from pid {conn.peer.pid} uid {conn.peer.uid}: {reason}")
            self._drop(conn)

    def _warn(self, message: str) -> None:
        """A warning at most once a second (a flood of bad connections must not flood the log)."""
        now = time.monotonic()
        if now - self._last_warning < 1.0:
            self._warnings_held += 1
            return
        held, self._warnings_held = self._warnings_held, 0
        self._last_warning = now
        log.warning("%s%s", message, f" ({held} similar held back)" if held else "")

    def _on_message(self, conn: _Conn, msg: Mapping[str, Any]) -> None:
        kind = msg["type"]
        try:
            if kind == protocol.HELLO:
                self._on_hello(conn, protocol.read_identity(msg))
            elif kind == protocol.STEPS:  # a short steps line not in the hook's own layout
                records, bad = protocol.read_steps(msg)
                # A rank speaks for itself: records of another job or rank (or before any hello) do not count.
                ident = conn.identity
                own = [r for r in records if ident is not None and (r.job_id, r.rank) == (ident.job_id, ident.rank)]
                with self._lock:
                    self._stats["records"] += len(own)
                    self._stats["bad_records"] += bad
                    self._stats["foreign_records"] += len(records) - len(own)
                if own:
                    self._notify(lambda li: li.on_steps and li.on_steps(ident, own))
            elif kind == protocol.DUMP_CHUNK:
                self._on_chunk(conn, *protocol.read_dump_chunk(msg))
            elif kind == protocol.REPLY:
                rid = protocol.request_id_of(msg)
                if msg.get("ok") is True:
                    result = self._assemble(conn, rid, msg) if msg.get("inline") is True else dict(msg)
                    self._finish(rid, result, from_conn=conn)
                else:
                    who = conn.identity.rank if conn.identity else "?"
                    self._finish(rid, RankRequestError(f"rank {who}: {msg.get('error', 'request failed')}"),
                                 from_conn=conn)
            else:
                with self._lock:
                    self._stats["unknown_messages"] += 1
        except protocol.ProtocolError:
            with self._lock:
                self._stats["malformed"] += 1

    def _on_chunk(self, conn: _Conn, rid: str, index: int, data: bytes) -> None:
        with self._lock:
            w = self._waiters.get(rid)
            if w is None or w.conn is not conn:
                self._stats["late_replies" if w is None else "foreign_replies"] += 1
                return
            if index != w.received:
                error: Exception | None = RankRequestError(f"rank {w.rank}: dump chunk {index} arrived out of order")
            elif w.size + len(data) > self.max_dump_bytes:
                error = RankRequestError(f"rank {w.rank}: the dump is over the {self.max_dump_bytes}-byte limit")
            elif self._inflight + len(data) > self.max_inflight_dump_bytes:
                error = DumpBudgetExceeded(f"rank {w.rank}: other ranks' dumps fill the agent's "
                                           f"{self.max_inflight_dump_bytes}-byte budget; ask again for this rank")
                self._stats["dump_budget_refusals"] += 1
            else:
                w.chunks += data
                w.received += 1
                w.size += len(data)
                self._inflight += len(data)
                error = None
            if error is not None:
                self._drop_chunks(w)
        if error is not None:
            self._finish(rid, error, from_conn=conn)  # later chunks and the reply count as late

    def _assemble(self, conn: _Conn, rid: str, msg: Mapping[str, Any]) -> dict[str, Any] | Exception:
        """The inline dump a reply closes, checked against the length and digest the rank states."""
        with self._lock:
            w = self._waiters.get(rid)
            if w is None or w.conn is not conn:
                return dict(msg)  # _finish counts it as late or foreign
            data, w.chunks = w.chunks, bytearray()  # still charged to the budget (w.size) until the caller is done
        if msg.get("bytes") != len(data) or msg.get("sha256") != hashlib.sha256(data).hexdigest():
            with self._lock:
                self._drop_chunks(w)
            return RankRequestError(f"rank {w.rank}: the dump arrived incomplete ({len(data)} of "
                                    f"{msg.get('bytes')} bytes, or a digest mismatch)")
        return {**msg, "data": data}

    def _drop_chunks(self, w: _Waiter) -> None:
        """Forget a waiter's buffered chunks (call with the lock held)."""
        self._inflight -= w.size
        w.chunks = bytearray()
        w.received = 0
        w.size = 0

    def _on_hello(self, conn: _Conn, ident: RankIdentity) -> None:
        if conn.peer.pid and ident.pid != conn.peer.pid:
            # The kernel's word, not the hello's: the pid py-spy is pointed at must be the caller's own
            # (and SO_PEERCRED gives it in the agent's PID namespace, which is the one py-spy needs).
            ident = dataclasses.replace(ident, pid=conn.peer.pid)
        key = (ident.job_id, ident.rank)
        with self._lock:
            holder = self._by_rank.get(key)
            others = [c for (job, _), c in self._by_rank.items() if job == ident.job_id and c is not conn]
            over = self._over_job_share(conn, ident.job_id)
        if over:
            self._refuse(conn, ident, over)
            return
        owners = {c.peer.uid for c in others if c.peer.uid is not None}
        # Kernel evidence makes a claim verified (the coordinator lets only those place a rank over another's
        # and count as progress); the environment only lets another user's process join, unverified.
        verified = claim_verified(conn.peer, ident.job_id,
                                  {c.peer.uid for c in others if c.job_verified and c.peer.uid is not None})
        named = verified or (bool(conn.peer.pid) and self._names_job(conn.peer.pid or 0, ident.job_id))
        ident = dataclasses.replace(ident, verified=verified)
        evict = None
        if holder is not None and holder is not conn:
            if _gone(holder) or (holder.peer.pid is not None and holder.peer.pid == conn.peer.pid):
                evict = holder  # a restarted rank's old connection, or the same process reconnecting
            elif verified and not holder.job_verified:
                evict = holder  # the job's own process takes its rank back from an unverified claimer
            else:
                self._refuse(conn, ident, f"rank {ident.rank} of job {ident.job_id} is connected already (pid "
                                          f"{holder.peer.pid}); a live rank is not taken over")
                return
        if owners and conn.peer.uid not in owners and conn.peer.uid != 0 and not named and (
                evict is None or evict.peer.uid in owners):
            self._refuse(conn, ident, f"job {ident.job_id}'s ranks here run as uid {sorted(owners)}, and this "
                                      f"process (uid {conn.peer.uid}) does not name the job in its environment")
            return
        if evict is not None:
            log.warning("rank socket: rank %d of job %s moves from pid %s (uid %s) to pid %s (uid %s)", ident.rank,
                        ident.job_id, evict.peer.pid, evict.peer.uid, conn.peer.pid, conn.peer.uid)
            self._drop(evict)
        with self._lock:
            if conn.identity is not None and self._by_rank.get((conn.identity.job_id, conn.identity.rank)) is conn:
                del self._by_rank[(conn.identity.job_id, conn.identity.rank)]
            conn.identity = ident
            conn.job_verified = verified
            self._by_rank[key] = conn
        self._notify(lambda li: li.on_identity and li.on_identity(ident))

    def _refuse_unidentified(self, conn: _Conn, why: str) -> None:
        """Close a connection that, before its hello, sent a line longer than a hello (not decoded)."""
        with self._lock:
            self._stats["refused_before_hello"] += 1
        self._warn(f"rank socket: closed a connection from pid {conn.peer.pid} uid {conn.peer.uid}: {why}")
        with contextlib.suppress(OSError, protocol.ProtocolError):
            conn.sock.send(protocol.encode({"type": "refused", "error": why}), socket.MSG_DONTWAIT)
        self._drop(conn)

    def _refuse(self, conn: _Conn, ident: RankIdentity, why: str) -> None:
        with self._lock:
            self._stats["refused_hellos"] += 1
        self._warn(f"rank socket: refused a hello from pid {conn.peer.pid} uid {conn.peer.uid}: {why}")
        with contextlib.suppress(OSError, protocol.ProtocolError):  # tell the caller why, if it listens
            conn.sock.send(protocol.encode({"type": "refused", "error": why}), socket.MSG_DONTWAIT)
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        freed = conn.partial_bytes
        self._release(conn)
        self._trimmer.freed(freed)
        with self._lock:
            if conn not in self._conns:
                return
            self._conns.discard(conn)
            self._take_share(conn, -1)
            self._stats["disconnects"] += 1
            ident = conn.identity
            if ident is not None and self._by_rank.get((ident.job_id, ident.rank)) is conn:
                del self._by_rank[(ident.job_id, ident.rank)]
            orphans = [rid for rid, w in self._waiters.items() if w.conn is conn]
        if self._sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
        conn.sock.close()
        for rid in orphans:
            who = ident.rank if ident else "?"
            self._finish(rid, RankNotConnectedError(f"rank {who} disconnected before answering"))
        if ident is not None:
            self._notify(lambda li: li.on_disconnect and li.on_disconnect(ident))

    def _notify(self, call: Callable[[_Listener], Any]) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for li in listeners:
            try:
                call(li)
            except Exception:
                log.exception("rank hub: a listener raised")
                with self._lock:
                    self._stats["listener_errors"] += 1
