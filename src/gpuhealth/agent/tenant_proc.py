"""The agent's unprivileged rank process: the rank socket's ``RankHub``, apart from the root part.

Started by ``rank_process.RankProcess`` (never by hand) as ``python -m gpuhealth.agent.tenant_proc``
with two inherited descriptors: the rank socket, already bound and listening (the root part made its
folder and file: this process needs no write access to any host path), and its end of the channel
(``tenant_channel``). Before it reads a byte from a tenant it:

1. sets its limits: address space (``RLIMIT_AS``), CPU time (``RLIMIT_CPU``: a lifetime budget; at the soft
   limit it exits and the root part starts a fresh one), no core files;
2. drops to the configured uid/gid with no supplementary groups (when it runs as root and may; otherwise it
   keeps its uid) and empties its capability sets (a uid change does that too; root without CAP_SETUID
   keeps uid 0 but no capability);
3. sets ``PR_SET_NO_NEW_PRIVS`` (no exec can give privileges back) and ``PR_SET_PDEATHSIG`` (it dies with
   the agent).

Everything it imports is imported before the drop (the interpreter may live where the new uid cannot read).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import itertools
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Generator
from typing import Any

from gpuhealth.agent.ranks import RankHub
from gpuhealth.agent.tenant_channel import STEPS_PER_FRAME, TO_RANK_PROCESS, Channel, ChannelError
from gpuhealth.model import RankIdentity, StepRecord
from gpuhealth.runtime import logs, threadnames

log = logging.getLogger("gpuhealth.agent.rank_process")

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
EXIT_CPU_BUDGET = 75  # the CPU-time budget is spent: the root part restarts it (a fresh budget)
MAX_REQUESTS = 16  # dump/stacks requests served at once (the coordinator link has 4 workers)
VERIFY_TIMEOUT_S = 2.0  # the root part reads /proc/<pid>/environ and cgroup: milliseconds
NEXT_GRACE_S = 5.0  # how long a dump request waits for the root part to take its answer, past its timeout


def sandbox(uid: int | None, gid: int | None, memory_bytes: int, cpu_seconds: int) -> None:
    """Limits, then the uid, then no_new_privs (in this order: lowering a hard limit needs no root, but
    setting it above the current one would)."""
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if cpu_seconds > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 10))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a core file would hold tenants' dumps
    if uid is not None and os.geteuid() == 0:
        group = gid if gid is not None else uid
        try:
            os.setgroups([])
            os.setresgid(group, group, group)
            os.setresuid(uid, uid, uid)
        except OSError as exc:  # root without CAP_SETUID/CAP_SETGID, or a uid its user namespace does not map
            log.warning("cannot change to uid %d (%s): serving as uid %d, without capabilities", uid,
                        exc.strerror or exc, os.geteuid())
        else:
            if os.geteuid() != uid or os.getuid() != uid:  # never go on as root after a drop that seemed to work
                raise SystemExit(f"rank process: could not drop to uid {uid}")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _drop_capabilities(libc)  # (a uid change dropped them already; uid 0 kept: dropped here)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise SystemExit(f"rank process: prctl(PR_SET_NO_NEW_PRIVS) failed: errno {ctypes.get_errno()}")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid: a credential change clears it


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Empty effective, permitted, inheritable and ambient sets (lowering one's own needs no privilege)."""
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise SystemExit(f"rank process: capset failed: errno {ctypes.get_errno()}")


class Server:
    """Serves the root part's requests from the hub, and sends it what ranks say."""

    def __init__(self, hub: RankHub, channel: Channel) -> None:
        self.hub = hub
        self.channel = channel
        self._lock = threading.Lock()
        self._pulls: dict[int, tuple[threading.Event, list[bool]]] = {}  # rid -> (the root part answered, [more?])
        self._busy = 0
        self._verify_ids = itertools.count(1)
        self._verdicts: dict[int, tuple[threading.Event, list[bool]]] = {}
        hub.add_listener(on_identity=self._identity, on_steps=self._steps, on_disconnect=self._disconnect)

    # -- what ranks say --------------------------------------------------------------------------
    def _identity(self, ident: RankIdentity) -> None:
        self.channel.send({"op": "identity", "identity": ident.to_dict()})

    def _steps(self, ident: RankIdentity | None, records: list[StepRecord]) -> None:
        if ident is None:
            return
        for off in range(0, len(records), STEPS_PER_FRAME):
            self.channel.send({"op": "steps", "identity": ident.to_dict(),
                               "records": [r.to_dict() for r in records[off:off + STEPS_PER_FRAME]]})

    def _disconnect(self, ident: RankIdentity) -> None:
        self.channel.send({"op": "disconnect", "identity": ident.to_dict()})

    def names_job(self, pid: int, job_id: str) -> bool:
        """Asks the root part (the hub's thread waits; no answer in time: not verified)."""
        rid = next(self._verify_ids)
        done, answer = threading.Event(), [False]
        with self._lock:
            self._verdicts[rid] = (done, answer)
        try:
            self.channel.send({"op": "verify", "rid": rid, "pid": pid, "job_id": job_id})
            done.wait(VERIFY_TIMEOUT_S)
        except ChannelError:
            pass
        finally:
            with self._lock:
                self._verdicts.pop(rid, None)
        return answer[0]

    # -- what the root part asks -----------------------------------------------------------------
    def serve(self) -> None:
        while True:
            op, msg, _ = self.channel.receive()
            rid = msg["rid"]
            if op == "ranks":
                self.channel.send({"op": "value", "rid": rid, "stats": None,
                                   "ranks": [i.to_dict() for i in self.hub.ranks(msg["job_id"])]})
            elif op == "stats":
                self.channel.send({"op": "value", "rid": rid, "ranks": None, "stats": self.hub.stats()})
            elif op == "verified":
                with self._lock:
                    verdict = self._verdicts.get(rid)
                if verdict is not None:
                    verdict[1][0] = msg["names_job"]
                    verdict[0].set()
            elif op in ("next", "stop"):
                with self._lock:
                    pull = self._pulls.get(rid)
                if pull is not None:
                    pull[1][0] = op == "next"
                    pull[0].set()
            else:
                with self._lock:
                    busy = self._busy >= MAX_REQUESTS
                    self._busy += 0 if busy else 1
                if busy:
                    self._error(rid, -1 if msg["rank"] is None else msg["rank"], "RankRequestError",
                                f"the rank process serves {MAX_REQUESTS} requests already; ask again")
                    self.channel.send({"op": "end", "rid": rid})
                    continue
                target = self._dump if op == "dump" else self._stacks
                threading.Thread(target=self._run, args=(target, msg), name=f"rank-req-{rid}", daemon=True).start()

    def _run(self, target: Any, msg: dict[str, Any]) -> None:
        try:
            target(msg)
        except ChannelError:
            pass  # the root part is gone: serve() ends too
        except Exception as exc:  # a request always ends
            log.exception("request %s failed", msg["rid"])
            with contextlib.suppress(ChannelError):
                self._error(msg["rid"], -1, "RankRequestError", f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._busy -= 1
            with contextlib.suppress(ChannelError):
                self.channel.send({"op": "end", "rid": msg["rid"]})

    def _error(self, rid: int, rank: int, kind: str, text: str) -> None:
        self.channel.send({"op": "answer", "rid": rid, "rank": rank, "kind": "error", "path": None, "stacks": None,
                           "error_type": kind, "error": text[:4000]})

    def _dump(self, msg: dict[str, Any]) -> None:
        """One dump at a time: each is sent, then held back until the root part asks for the next."""
        rid, timeout = msg["rid"], float(msg["timeout_s"])
        wake: threading.Event = threading.Event()
        more = [True]
        with self._lock:
            self._pulls[rid] = (wake, more)
        dumps: Generator[tuple[int, bytes | bytearray | str | Exception], None, None] = self.hub.iter_dumps(  # type: ignore[assignment]
            msg["job_id"], msg["rank"], msg["out_dir"], timeout_s=timeout)
        deadline = time.monotonic() + timeout + NEXT_GRACE_S
        try:
            for rank, res in dumps:
                if isinstance(res, Exception):
                    self._error(rid, rank, type(res).__name__, str(res))
                elif isinstance(res, bytes | bytearray):  # the hub gathers an inline dump in a bytearray
                    self.channel.send({"op": "answer", "rid": rid, "rank": rank, "kind": "dump", "path": None,
                                       "stacks": None, "error_type": None, "error": None}, res)
                else:
                    self.channel.send({"op": "answer", "rid": rid, "rank": rank, "kind": "path", "path": res,
                                       "stacks": None, "error_type": None, "error": None})
                del res
                if not wake.wait(max(0.0, deadline - time.monotonic())) or not more[0]:
                    break
                wake.clear()
        finally:
            dumps.close()  # whatever was not taken leaves the hub's budget
            with self._lock:
                self._pulls.pop(rid, None)

    def _stacks(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        for rank, res in sorted(self.hub.request_stacks(msg["job_id"], msg["rank"],
                                                        timeout_s=float(msg["timeout_s"])).items()):
            if isinstance(res, Exception):
                self._error(rid, rank, type(res).__name__, str(res))
            else:
                self.channel.send({"op": "answer", "rid": rid, "rank": rank, "kind": "stacks", "path": None,
                                   "stacks": res, "error_type": None, "error": None})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpuhealth-rank-process", description=__doc__.split("\n")[0])
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--channel-fd", type=int, required=True)
    ap.add_argument("--socket-path", required=True)
    ap.add_argument("--uid", type=int, default=None)
    ap.add_argument("--gid", type=int, default=None)
    ap.add_argument("--memory-bytes", type=int, default=0)
    ap.add_argument("--cpu-seconds", type=int, default=0)
    args = ap.parse_args(argv)
    # The agent's own text format: every tenant-controlled character escaped (job ids, refusal reasons), so no
    # line this process writes into the agent's log can pose as another record.
    logs.setup_logging(level="info")
    threadnames.install()  # "gh-rankhub" in top -H, as in the agent's own process
    listen = socket.socket(fileno=args.listen_fd)
    channel = Channel(socket.socket(fileno=args.channel_fd), TO_RANK_PROCESS)
    sandbox(args.uid, args.gid, args.memory_bytes, args.cpu_seconds)

    def cpu_spent(_sig: int, _frame: object) -> None:
        log.warning("CPU-time budget of %d s spent: exiting for a fresh process", args.cpu_seconds)
        os._exit(EXIT_CPU_BUDGET)

    signal.signal(signal.SIGXCPU, cpu_spent)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server: Server | None = None

    def names_job(pid: int, job_id: str) -> bool:  # asked of the root part (the server exists once ranks connect)
        return server is not None and server.names_job(pid, job_id)

    hub = RankHub(args.socket_path, listen_socket=listen, names_job=names_job)
    server = Server(hub, channel)
    hub.start()
    channel.send({"op": "ready", "pid": os.getpid(), "uid": os.geteuid()})

    def serve() -> None:
        try:
            server.serve()
        except ChannelError as exc:
            log.info("the agent closed the channel (%s): exiting", exc)

    # The channel is served on a thread: Python runs signal handlers on the main thread only, and a main thread
    # blocked in recv would never see SIGXCPU (the hard limit's SIGKILL would come first, unexplained).
    serving = threading.Thread(target=serve, name="rank-channel", daemon=True)
    serving.start()
    while serving.is_alive():
        serving.join(1.0)
    os._exit(0)  # the hub's threads and connections go with the process


if __name__ == "__main__":
    sys.exit(main())
