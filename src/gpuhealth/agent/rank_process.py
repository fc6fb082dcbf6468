"""``RankProcess``: the rank socket served by an unprivileged child, seen from the agent's root part.

The agent runs as root (NVML, the kernel log, sysfs, diagnostics). What talks to tenants — the rank
socket, with everything ranks send — runs in ``tenant_proc`` under another uid, ``no_new_privs`` and
memory/CPU limits. This object is the root part's side: it binds the socket (its folder and file are
made here: the child needs no write access to host paths), starts the child with the listening socket and
one end of a socketpair (``tenant_channel``), restarts it when it dies (logged, counted on ``/metrics``;
the socket stays bound, so ranks that connect meanwhile wait in its backlog), and offers what the rest of
the agent uses of a ``RankHub`` — ``ranks``, ``iter_dumps``, ``request_dump``, ``request_stacks``,
``add_listener``, ``stats``, ``samples`` — over the channel. Every frame from the child is untrusted: checked
against the channel's schema, identities and step records through the instrument protocol's own
readers, step records only for the identity they come with, and a rank's pid handed on (to py-spy, run
here with ptrace rights) only when it is no root process, or names the job itself (``pid_may_be_traced``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import pwd
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpuhealth.agent.ranks import (
    DumpBudgetExceeded,
    OnDisconnect,
    OnIdentity,
    OnSteps,
    RankHubError,
    RankNotConnectedError,
    RankRequestError,
    bind_rank_socket,
    process_names_job,
    rank_samples,
)
from gpuhealth.agent.tenant_channel import ANSWER_KINDS, TO_ROOT, Channel, ChannelError
from gpuhealth.instrument import protocol
from gpuhealth.model import MetricKind, RankIdentity, Sample

log = logging.getLogger("gpuhealth.agent")

DEFAULT_USER = "nobody"
NOBODY_UID = 65534  # where the name is unknown (a minimal container image)
READY_TIMEOUT_S = 30.0
EXIT_CPU_BUDGET = 75  # as tenant_proc.EXIT_CPU_BUDGET (not imported: the root part does not load the child's code)
CALL_TIMEOUT_S = 5.0
ANSWER_GRACE_S = 10.0  # past a request's own timeout, how long the root part waits for the child's end
_DEAD: tuple[str, dict[str, Any], bytes] = ("dead", {}, b"")
_ERRORS: dict[str, Callable[[str], Exception]] = {
    "DumpBudgetExceeded": DumpBudgetExceeded, "RankRequestError": RankRequestError,
    "RankNotConnectedError": RankNotConnectedError, "TimeoutError": TimeoutError, "LookupError": LookupError,
}


def resolve_user(user: str) -> tuple[int, int]:
    """(uid, gid) of ``user``: a name from the passwd database or a number (its own gid then)."""
    if user.isdigit():
        uid = int(user)
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except KeyError:
            return uid, uid
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        if user == DEFAULT_USER:
            return NOBODY_UID, NOBODY_UID
        raise RankHubError(f"agent.rank_process_user: no user {user!r} on this node") from None
    if entry.pw_uid == 0:
        raise RankHubError(f"agent.rank_process_user: {user!r} is root; the rank process must not be")
    return entry.pw_uid, entry.pw_gid


def pid_may_be_traced(pid: int, job_id: str, proc: Path = Path("/proc")) -> bool:
    """May the root part point py-spy at ``pid``, a pid the rank process reports? Only at a process of a
    non-root user, or one whose own environment or Slurm cgroup names the job: a rank process that was
    taken over cannot make the agent read a root daemon's memory."""
    try:
        owner = (proc / str(pid)).stat().st_uid
    except OSError:
        return False
    return owner != 0 or process_names_job(pid, job_id, proc)


def sandbox_breach(pid: int, proc: Path = Path("/proc")) -> str:
    """What ``/proc/<pid>/status`` says is missing of the rank process's sandbox ("" when nothing): no_new_privs
    and empty capability sets (its uid is logged; a root agent without CAP_SETUID cannot change it)."""
    try:
        status = dict(line.split(":", 1) for line in (proc / str(pid) / "status").read_text().splitlines()
                      if ":" in line)
    except OSError as exc:
        return f"cannot read its status: {exc}"
    missing = [key for key, want in (("NoNewPrivs", "1"), ("CapEff", "0" * 16), ("CapPrm", "0" * 16),
                                     ("CapAmb", "0" * 16)) if status.get(key, "").strip() not in (want, "")]
    return ", ".join(f"{key} is {status[key].strip()}" for key in missing)


class RankProcess:
    """The rank socket at ``socket_path``, served by an unprivileged child (``tenant_proc``)."""

    name = "ranks"

    def __init__(self, socket_path: str | os.PathLike[str], *, user: str = DEFAULT_USER, mode: int = 0o666,
                 memory_bytes: int = 384 * 1024 * 1024, cpu_seconds: int = 3600,
                 restart_backoff_s: tuple[float, float] = (1.0, 30.0),
                 child_module: str = "gpuhealth.agent.tenant_proc") -> None:
        self.socket_path = Path(socket_path)
        self.child_module = child_module  # what runs as the child (tests put a misbehaving one here)
        self.user = user
        self.mode = mode
        self.memory_bytes = memory_bytes
        self.cpu_seconds = cpu_seconds
        self.restart_backoff_s = restart_backoff_s
        self.restarts = 0
        self.child_pid: int | None = None
        self.child_uid: int | None = None
        self._listen: socket.socket | None = None
        self._inode: int | None = None
        self._uid: int | None = None
        self._gid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._up = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, queue.SimpleQueue[tuple[str, dict[str, Any], bytes]]] = {}
        self._listeners: list[tuple[OnIdentity | None, OnSteps | None, OnDisconnect | None]] = []
        # Counted here, not by the child: a restarted child starts from zero, these do not.
        self._stats = {"records": 0, "rejected_frames": 0, "bad_records": 0}
        self.last_exit = ""  # why the last child stopped (for the log, and tests)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, agent: object | None = None) -> None:
        """Bind the socket, start the child and wait until it serves (RankHubError when it cannot)."""
        if self._thread is not None:
            return
        if os.geteuid() == 0:
            self._uid, self._gid = resolve_user(self.user)
        else:  # already unprivileged: the child keeps this uid (it cannot take another)
            log.info("agent runs as uid %d: the rank process keeps that uid", os.geteuid())
        self._listen, self._inode = bind_rank_socket(self.socket_path, self.mode)
        self._stopping.clear()
        try:
            self._spawn()
        except (OSError, ChannelError) as exc:
            self._close_listen()
            raise RankHubError(f"cannot start the rank process: {exc}") from exc
        self._thread = threading.Thread(target=self._supervise, name="gpuhealth-rankproc", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._kill()
        if self._thread is not None:
            self._thread.join(10.0)
            self._thread = None
        self._close_listen()

    def _close_listen(self) -> None:
        if self._listen is not None:
            self._listen.close()
            self._listen = None
        with contextlib.suppress(OSError):  # remove the file only if it is still the one we made
            if self._inode is not None and self.socket_path.lstat().st_ino == self._inode:
                self.socket_path.unlink()

    def _spawn(self) -> None:
        assert self._listen is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", self.child_module, "--listen-fd", str(self._listen.fileno()),
               "--channel-fd", str(theirs.fileno()), "--socket-path", str(self.socket_path),
               "--memory-bytes", str(self.memory_bytes), "--cpu-seconds", str(self.cpu_seconds)]
        if self._uid is not None:
            cmd += ["--uid", str(self._uid), "--gid", str(self._gid)]
        # Two arenas: RLIMIT_AS counts address space, and glibc reserves 64 MiB per thread's arena.
        env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
        try:
            proc = subprocess.Popen(cmd, pass_fds=(self._listen.fileno(), theirs.fileno()), stdin=subprocess.DEVNULL,
                                    cwd="/", env=env)
        finally:
            theirs.close()
        channel = Channel(ours, TO_ROOT)
        ours.settimeout(READY_TIMEOUT_S)
        try:
            op, msg, _ = channel.receive()
            if op != "ready":
                raise ChannelError(f"the rank process began with {op!r}, not ready")
        except ChannelError:
            channel.close()
            proc.kill()
            proc.wait()
            raise
        ours.settimeout(None)
        why = sandbox_breach(proc.pid)
        if why:  # the kernel's word, not the child's: a child that is not sandboxed never serves
            channel.close()
            proc.kill()
            proc.wait()
            raise ChannelError(f"the rank process is not sandboxed ({why})")
        self._proc, self._channel = proc, channel
        self.child_pid, self.child_uid = msg["pid"], msg["uid"]
        self._up.set()
        log.info("rank process pid %d serves %s as uid %d", proc.pid, self.socket_path, msg["uid"])
        if msg["uid"] == 0:
            log.warning("the rank process runs as uid 0 (this agent may not change uids: no CAP_SETUID/CAP_SETGID); "
                        "it still has no capabilities, no_new_privs and its limits (docs/security.md)")

    def _supervise(self) -> None:
        """Read the child's frames; when it dies, say so, fail what was pending and start another."""
        failures = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            why = self._read_loop()
            self._up.clear()
            code = self._kill()
            self._fail_pending()
            if self._stopping.is_set():
                return
            self.restarts += 1
            if code == EXIT_CPU_BUDGET:
                why = f"it spent its CPU-time budget of {self.cpu_seconds} s"
            self.last_exit = f"{why}; exit status {code}"
            failures = 0 if time.monotonic() - started > 60 else failures + 1
            delay = min(self.restart_backoff_s[1], self.restart_backoff_s[0] * (2 ** max(0, failures - 1)))
            log.error("rank process stopped (%s, exit status %s): restarting it in %.0f s (restart %d); "
                      "ranks reconnect to %s", why, code, delay, self.restarts, self.socket_path)
            while not self._stopping.wait(delay):
                try:
                    self._spawn()
                    break
                except (OSError, ChannelError) as exc:
                    log.error("cannot restart the rank process: %s", exc)
                    delay = min(self.restart_backoff_s[1], delay * 2)

    def _read_loop(self) -> str:
        channel = self._channel
        assert channel is not None
        while True:
            try:
                op, msg, payload = channel.receive()
            except ChannelError as exc:
                if "closed" not in str(exc):
                    with self._lock:
                        self._stats["rejected_frames"] += 1
                return str(exc)
            try:
                self._dispatch(op, msg, payload)
            except protocol.ProtocolError as exc:  # a frame that fits the schema but not the protocol's readers
                with self._lock:
                    self._stats["rejected_frames"] += 1
                return f"the rank process sent a bad {op}: {exc}"

    def _kill(self) -> int | None:
        proc, channel = self._proc, self._channel
        if channel is not None:
            channel.close()
        if proc is None:
            return None
        with contextlib.suppress(OSError):
            proc.kill()
        try:
            return proc.wait(10.0)
        except subprocess.TimeoutExpired:
            return None

    def _fail_pending(self) -> None:
        with self._lock:
            pending = list(self._pending.values())
        for q in pending:
            q.put(_DEAD)

    # -- frames from the child -------------------------------------------------------------------
    def _dispatch(self, op: str, msg: dict[str, Any], payload: bytes) -> None:
        if op in ("identity", "disconnect", "steps"):
            ident = _child_identity(msg["identity"])
            with self._lock:
                listeners = list(self._listeners)
            if op == "steps":
                records, bad = protocol.read_steps(msg)
                own = [r for r in records if (r.job_id, r.rank) == (ident.job_id, ident.rank)]
                with self._lock:
                    self._stats["bad_records"] += bad + len(records) - len(own)
                    self._stats["records"] += len(own)
                if own:
                    self._notify(lambda li: li[1] and li[1](ident, own), listeners)
            elif op == "identity":
                self._notify(lambda li: li[0] and li[0](ident), listeners)
            else:
                self._notify(lambda li: li[2] and li[2](ident), listeners)
            return
        if op == "verify":  # a bool back; the pid and job are the child's word, the environment is the kernel's
            names = msg["pid"] > 0 and process_names_job(msg["pid"], msg["job_id"])
            self._send({"op": "verified", "rid": msg["rid"], "names_job": bool(names)})
            return
        if op == "answer" and (msg["kind"] not in ANSWER_KINDS or (payload and msg["kind"] != "dump")):
            raise protocol.ProtocolError(f"an answer of kind {msg['kind']!r}")
        with self._lock:
            q = self._pending.get(msg["rid"]) if op in ("value", "answer", "end") else None
        if q is not None:
            q.put((op, msg, payload))

    @staticmethod
    def _notify(call: Callable[[Any], Any], listeners: list[Any]) -> None:
        for li in listeners:
            try:
                call(li)
            except Exception:
                log.exception("rank process: a listener raised")

    # -- requests --------------------------------------------------------------------------------
    def _open(self) -> tuple[int, queue.SimpleQueue[tuple[str, dict[str, Any], bytes]]]:
        rid = next(self._ids)
        q: queue.SimpleQueue[tuple[str, dict[str, Any], bytes]] = queue.SimpleQueue()
        with self._lock:
            self._pending[rid] = q
        return rid, q

    def _close(self, rid: int) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    def _send(self, message: dict[str, Any]) -> bool:
        channel = self._channel
        if channel is None or not self._up.is_set():
            return False
        try:
            channel.send(message)
        except ChannelError:
            return False
        return True

    def _call(self, message: dict[str, Any]) -> dict[str, Any] | None:
        rid, q = self._open()
        try:
            if not self._send({**message, "rid": rid}):
                return None
            try:
                op, msg, _ = q.get(timeout=CALL_TIMEOUT_S)
            except queue.Empty:
                return None
            return msg if op == "value" else None
        finally:
            self._close(rid)

    def add_listener(self, on_identity: OnIdentity | None = None, on_steps: OnSteps | None = None,
                     on_disconnect: OnDisconnect | None = None) -> None:
        with self._lock:
            self._listeners.append((on_identity, on_steps, on_disconnect))

    def ranks(self, job_id: str | None = None) -> list[RankIdentity]:
        """Connected ranks (none while the child is down); a pid py-spy may not trace is handed on as 0."""
        value = self._call({"op": "ranks", "job_id": job_id})
        out: list[RankIdentity] = []
        for item in (value or {}).get("ranks") or []:
            try:
                ident = _child_identity(item)
            except protocol.ProtocolError:
                with self._lock:
                    self._stats["rejected_frames"] += 1
                continue
            if job_id is not None and ident.job_id != job_id:
                continue
            out.append(ident)
        return sorted(out, key=lambda i: (i.job_id, i.rank))

    def traceable_pid(self, ident: RankIdentity) -> int | None:
        return ident.pid if ident.pid > 0 and pid_may_be_traced(ident.pid, ident.job_id) else None

    def stats(self) -> dict[str, int]:
        value = self._call({"op": "stats"}) or {}
        raw = value.get("stats") or {}
        out = {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}
        with self._lock:
            out.update({f"rank_process_{k}": v for k, v in self._stats.items()})
            out["records"] = self._stats["records"]  # every record that reached the agent, across restarts
        out["rank_process_restarts"] = self.restarts
        return out

    def samples(self) -> list[Sample]:
        st = self.stats()
        up = self._up.is_set()
        out = rank_samples(st, self.ranks()) if up else []
        out += [
            Sample("agent_rank_process_up", 1.0 if up else 0.0,
                   "Is the agent's unprivileged rank process (the rank socket's side) serving? (docs/security.md)"),
            Sample("agent_rank_process_restarts", float(self.restarts),
                   "Times the agent restarted its rank process (it died, broke the channel's protocol or spent "
                   "its CPU-time budget)", MetricKind.COUNTER),
        ]
        return out

    def request_dump(self, job_id: str, rank: int | None, out_dir: str | None = None, timeout_s: float = 30.0
                     ) -> dict[int, bytes | str | Exception]:
        return dict(self.iter_dumps(job_id, rank, out_dir, timeout_s))

    def iter_dumps(self, job_id: str, rank: int | None, out_dir: str | None = None, timeout_s: float = 30.0
                   ) -> Iterator[tuple[int, bytes | str | Exception]]:
        """As ``RankHub.iter_dumps``: one dump at a time comes over the channel, the next only once this one
        is taken (the root part holds one dump, whatever the job's size)."""
        rid, q = self._open()
        answered: set[int] = set()
        deadline = time.monotonic() + timeout_s + ANSWER_GRACE_S
        try:
            if self._send({"op": "dump", "rid": rid, "job_id": job_id, "rank": rank,
                           "out_dir": os.path.abspath(out_dir) if out_dir else None, "timeout_s": float(timeout_s)}):
                while True:
                    try:
                        op, msg, payload = q.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    if op != "answer":
                        break  # end, or the child died
                    r = msg["rank"]
                    if (rank is not None and r != rank) or r in answered or (r < 0 and msg["kind"] != "error"):
                        continue  # not what was asked
                    answered.add(r)
                    value = self._answer(msg, payload, out_dir)
                    del payload
                    if isinstance(value, dict):  # stacks where a dump was asked for
                        value = RankRequestError(f"rank {r} replied without a dump")
                    yield r, value
                    del value
                    self._send({"op": "next", "rid": rid})
        finally:
            self._send({"op": "stop", "rid": rid})
            self._close(rid)
        if rank is not None and rank not in answered:
            yield rank, RankNotConnectedError(f"rank {rank}: no answer from the agent's rank process")

    def request_stacks(self, job_id: str, rank: int | None, timeout_s: float = 10.0
                       ) -> dict[int, dict[str, Any] | Exception]:
        rid, q = self._open()
        out: dict[int, dict[str, Any] | Exception] = {}
        deadline = time.monotonic() + timeout_s + ANSWER_GRACE_S
        try:
            if self._send({"op": "stacks", "rid": rid, "job_id": job_id, "rank": rank, "timeout_s": float(timeout_s)}):
                while True:
                    try:
                        op, msg, payload = q.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    if op != "answer":
                        break
                    r = msg["rank"]
                    if r < 0 or (rank is not None and r != rank):
                        continue
                    value = self._answer(msg, payload, None)
                    out[r] = value if isinstance(value, (dict, Exception)) else RankRequestError(
                        f"rank {r} replied without stacks")
        finally:
            self._close(rid)
        if rank is not None and rank not in out:
            out[rank] = RankNotConnectedError(f"rank {rank}: no answer from the agent's rank process")
        return out

    @staticmethod
    def _answer(msg: dict[str, Any], payload: bytes, out_dir: str | None) -> bytes | str | dict[str, Any] | Exception:
        kind = msg["kind"]
        if kind == "dump":
            return payload
        if kind == "stacks" and msg["stacks"] is not None:
            return dict(msg["stacks"])
        if kind == "path" and out_dir and msg["path"]:
            return str(msg["path"])  # read by the caller through its drop box only (coordinator_requests)
        if kind == "error":
            make = _ERRORS.get(msg["error_type"] or "", RankRequestError)
            return make(str(msg["error"] or "the rank process gave no reason"))
        return RankRequestError(f"rank {msg['rank']}: the rank process answered {kind!r} without its content")


__all__ = ["RankProcess", "pid_may_be_traced", "resolve_user", "sandbox_breach"]


def _child_identity(item: Any) -> RankIdentity:
    """An identity the rank process sends, checked as a hello is. ``verified`` is the child's judgement of the
    kernel evidence (its hub read the peer's cgroup and uid): a hello's own word never sets it, the child's
    frame does. (A child taken over by a tenant could claim it; see docs/security.md.)"""
    ident = protocol.read_identity({"identity": item})
    return dataclasses.replace(ident, verified=isinstance(item, dict) and item.get("verified") is True)
