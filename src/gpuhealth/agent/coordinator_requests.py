"""What the agent does when the coordinator asks (``AgentRequest`` down the stream): dump the flight
recorder of a job's ranks, capture their Python stacks, run a diagnostic.

Each request runs on one of a few worker threads and ends with a final answer, whatever happens;
answers go back through ``emit`` (the stream's send queue). Dumps travel as the ranks wrote them —
JSON objects from the hook, NCCL's pickles from discovered ranks (``fr_pickle``), never a file a rank
merely names. Stacks come from the hook and, where permitted,
``py-spy dump --json``. Diagnostics run through ``DiagRunner`` like periodic ones, in a child process
under the GPU-time budget: the agent never imports torch.
"""

from __future__ import annotations

import codecs
import concurrent.futures
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuhealth.agent.ranks import DumpBudgetExceeded
from gpuhealth.config import Config
from gpuhealth.model import RankIdentity
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import result_message_wire
from gpuhealth.runtime.dropbox import DropBox

log = logging.getLogger("gpuhealth.agent.coordinator")

# Queues a result for the coordinator; may return an event set once it is on the wire.
Emit = Callable[[pb.RequestResult | bytes], object]  # bytes: an AgentMessage on its wire (result_message_wire)

_DEVICE = re.compile(r"cpu|cuda(:\d+(,cuda:\d+)*)?")  # the only parameter a diagnostic request passes on
MAX_DUMP_BYTES = 32 * 1024 * 1024  # as RankHub's cap; under the gRPC message limit with room for the envelope
PICKLE_PROTO = b"\x80"  # pickle's PROTO opcode: how NCCL's dumps (discovered ranks, through the FIFO) begin


class RankSource(Protocol):
    """What the executors need of the rank hub (``ranks.RankHub``)."""

    def ranks(self, job_id: str | None = None) -> list[RankIdentity]: ...

    def iter_dumps(self, job_id: str, rank: int | None, out_dir: str | None = None, timeout_s: float = 30.0
                   ) -> Iterator[tuple[int, bytes | bytearray | str | Exception]]: ...

    def request_stacks(self, job_id: str, rank: int | None, timeout_s: float = 10.0
                       ) -> dict[int, dict[str, Any] | Exception]: ...


@dataclass(frozen=True, slots=True)
class ExecutorSettings:
    work_dir: str | None = None  # where FR dumps of hooks older than inline dumps are written (default: temp)
    pyspy: bool = True
    pyspy_path: str | None = None


class RequestExecutor:
    """Runs the coordinator's requests. ``ranks`` None: this agent has no rank hub (dumps and stacks
    are answered with that reason). ``config`` gives diagnostics their budget, locks and goldens."""

    def __init__(self, settings: ExecutorSettings, *, ranks: RankSource | None,
                 config: Callable[[], Config | None] = lambda: None, workers: int = 4) -> None:
        self.settings = settings
        self.ranks = ranks
        self._config = config
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpuhealth-req")

    def submit(self, req: pb.AgentRequest, emit: Emit) -> None:
        self._pool.submit(self.execute, req, emit)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def execute(self, req: pb.AgentRequest, emit: Emit) -> None:
        """One request, always ending with a final answer."""
        rid = req.request_id
        try:
            if req.kind == pb.DUMP_FLIGHT_RECORDER:
                self.dump(req, emit)
            elif req.kind == pb.CAPTURE_STACKS:
                self.stacks(req, emit)
            elif req.kind == pb.RUN_DIAGNOSTIC:
                self.diagnostic(req, emit)
            else:
                emit(pb.RequestResult(request_id=rid, rank=-1, ok=False, error=f"unknown request kind {req.kind}"))
        except Exception as exc:  # a request must always end with a final answer
            log.exception("request %d failed", rid)
            emit(pb.RequestResult(request_id=rid, rank=-1, ok=False, error=f"{type(exc).__name__}: {exc}"))
        emit(pb.RequestResult(request_id=rid, rank=-1, ok=True, final=True))

    # ------------------------------------------------------------------ flight recorder
    def dump(self, req: pb.AgentRequest, emit: Emit) -> None:
        if self._no_hub(req, emit):
            return
        assert self.ranks is not None
        # Ranks send their dump inline over the socket. The folder is only for hooks older than that,
        # which write a file there instead; ranks run as the job's user: they may create files here but
        # not list or remove others' (sticky).
        # The folder is where tenants can write (beside the rank socket): made and used only through
        # descriptors, under a name nobody can guess (runtime/dropbox.py); never a link followed as root.
        base = self.settings.work_dir or os.path.join(tempfile.gettempdir(), f"gpuhealth-fr-{os.geteuid()}")
        # Without it (a tenant planted a link there, say) the dumps still travel inline; only a hook that
        # predates inline dumps then has nowhere to write, and says so.
        try:
            box: DropBox | None = DropBox(base, prefix=f"{_safe(req.job_id)[:64]}-{req.request_id}-")
        except OSError as exc:
            log.warning("flight-recorder request %d: no folder for file dumps (inline dumps only): %s",
                        req.request_id, exc)
            box = None
        try:
            self._dump_into(req, emit, box)
        finally:
            if box is not None:
                box.close()

    def _dump_into(self, req: pb.AgentRequest, emit: Emit, box: DropBox | None) -> None:
        assert self.ranks is not None
        out_dir = str(box.path) if box is not None else None
        timeout = req.timeout_s or 20.0
        deadline = time.monotonic() + timeout
        busy: list[int] = []  # ranks refused for the agent's dump memory budget: asked again, one at a time

        def ship(rank: int, res: bytes | bytearray | str | Exception, *, may_retry: bool) -> object:
            """Queue the rank's answer; what emit returned (the dump's written event) or None."""
            if isinstance(res, DumpBudgetExceeded) and may_retry:
                busy.append(rank)
                return None
            if isinstance(res, Exception):
                emit(pb.RequestResult(request_id=req.request_id, rank=rank, ok=False,
                                      error=f"{type(res).__name__}: {res}", format="fr_json"))
                return None
            try:
                fmt = "fr_json"
                if isinstance(res, bytes | bytearray) and res[:1] == PICKLE_PROTO:
                    data, fmt = _looks_like_pickle(res), "fr_pickle"  # NCCL's own dump, through the rank's FIFO
                elif isinstance(res, bytes | bytearray):
                    data = _looks_like_json_object(res)
                elif box is not None:
                    data = _read_json_file(Path(res), box, f"rank{rank}.json")
                else:  # it was not asked to write a file
                    raise ValueError(f"the rank answered with a file ({res}) where an inline dump was asked for")
                # Serialised once, straight from the rank's bytes (building the messages copied it three times).
                wire = result_message_wire(pb.RequestResult(request_id=req.request_id, rank=rank, ok=True,
                                                            format=fmt), data)
                del data
                return emit(wire)
            except (OSError, ValueError) as exc:
                emit(pb.RequestResult(request_id=req.request_id, rank=rank, ok=False, error=str(exc),
                                      format="fr_json"))
                return None

        def settle(written: object) -> None:
            # Wait until it is on the wire before taking the next: dumps do not pile up in the send queue
            # behind a slow link (past the deadline it stays queued and the next one is taken anyway). The
            # caller has dropped its copy of the dump by then: only the queued message holds it.
            if isinstance(written, threading.Event):
                written.wait(max(0.0, deadline - time.monotonic()))

        # Each dump is shipped as soon as it arrives and dropped: the agent holds one, not the job's.
        for rank, res in self.ranks.iter_dumps(req.job_id, None if req.rank < 0 else req.rank, out_dir,
                                               timeout_s=timeout):
            written = ship(rank, res, may_retry=True)
            del res
            settle(written)
        for rank in busy:
            left = deadline - time.monotonic()
            if left <= 0:  # the coordinator stops listening at its deadline: say so instead of answering late
                ship(rank, TimeoutError(f"rank {rank}: refused for the agent's dump memory budget and no time "
                                        "was left to ask again"), may_retry=False)
                continue
            for r, res in self.ranks.iter_dumps(req.job_id, rank, out_dir, timeout_s=left):
                written = ship(r, res, may_retry=False)
                del res
                settle(written)

    # ------------------------------------------------------------------ stacks
    def stacks(self, req: pb.AgentRequest, emit: Emit) -> None:
        if self._no_hub(req, emit):
            return
        assert self.ranks is not None
        rank = None if req.rank < 0 else req.rank
        timeout = req.timeout_s or 10.0
        hook = self.ranks.request_stacks(req.job_id, rank, timeout_s=timeout)
        # A rank source served apart (the unprivileged rank process) vouches for no pid: py-spy, run from here with
        # ptrace rights, is pointed only at a pid it may trace (rank_process.pid_may_be_traced).
        traceable = getattr(self.ranks, "traceable_pid", None)
        pids = {i.rank: (traceable(i) if traceable is not None else i.pid) for i in self.ranks.ranks(req.job_id)}
        for r in sorted(set(hook) | set(pids if rank is None else {})):
            answer: dict[str, Any] = {}
            hook_res = hook.get(r)
            if isinstance(hook_res, dict):
                answer["hook"] = hook_res
            elif hook_res is not None:
                answer["hook_error"] = f"{type(hook_res).__name__}: {hook_res}"
            pid = pids.get(r)
            if pid and self.settings.pyspy:
                answer.update(pyspy_dump(pid, timeout_s=min(timeout, 15.0), exe=self.settings.pyspy_path))
            elif r in pids and self.settings.pyspy:
                answer["py_spy_error"] = ("not traced: the rank's pid is a root process that does not name the job "
                                          "(the rank process's word alone does not point py-spy at a process)")
            answer["source"] = "py-spy" if "py_spy" in answer else ("hook" if "hook" in answer else "none")
            ok = "hook" in answer or "py_spy" in answer
            emit(pb.RequestResult(request_id=req.request_id, rank=r, ok=ok, format="stacks_json",
                                  payload=json.dumps(answer, default=str).encode() if ok else b"",
                                  error="" if ok else "; ".join(str(answer[k]) for k in ("hook_error", "py_spy_error")
                                                                if answer.get(k))))

    # ------------------------------------------------------------------ diagnostics
    def diagnostic(self, req: pb.AgentRequest, emit: Emit) -> None:
        """``gpuhealth diag NAME --json`` as this node's config runs it: through ``DiagRunner``, under
        the GPU-time budget (an automated request never forces). Only ``device`` is taken from the
        request, and only in the form ``cpu`` / ``cuda`` / ``cuda:N[,cuda:M]``."""
        from gpuhealth.diag.ondemand import DiagRequestError, default_args, run_on_demand

        name = req.diagnostic
        if not name.isidentifier():
            emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, error=f"bad diagnostic {name!r}"))
            return
        device = req.params.get("device") or "cuda"
        if not _DEVICE.fullmatch(device):
            emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, error=f"bad device {device!r}"))
            return
        config = self._config() or Config()
        timeout = req.timeout_s or 300.0
        try:
            args = default_args(name, config, cpu=device == "cpu")
            # the runner kills its child (and the child's ranks) before the coordinator stops waiting
            outcome = run_on_demand(name, args, config, device=device, budgeted=True,
                                    timeout_s=max(1.0, timeout - 5.0))
        except DiagRequestError as exc:
            emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, format="diag_json", error=str(exc)))
            return
        emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=True, format="diag_json",
                              payload=json.dumps(outcome.to_dict(), indent=2, default=str).encode()))

    def _no_hub(self, req: pb.AgentRequest, emit: Emit) -> bool:
        if self.ranks is None:
            emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, error="no rank hub on this agent"))
            return True
        return False


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:80] or "_"


def _read_json_file(path: Path, box: DropBox, name: str) -> bytes | bytearray:
    """The dump a rank says it wrote — only if it is the file we asked for (``name`` in ``box``): any local
    process can speak on the rank socket, and must not make the agent read (and ship) some other file it
    can reach. Read through the box's descriptor: no link is followed."""
    if path.name != name or os.path.realpath(path.parent) != os.path.realpath(box.path):
        raise ValueError(f"the rank answered with {path}, not the dump file {box.path / name} it was asked for")
    return _looks_like_json_object(box.read(name, MAX_DUMP_BYTES))


def _looks_like_json_object(data: bytes | bytearray) -> bytes | bytearray:
    """A hook's dump travels as JSON only: garbage is refused here already. A cheap check (the coordinator
    parses it with its safe loader): parsing a 30 MB dump here would cost the agent ~10× that in
    memory, and deeply nested input would not even parse (RecursionError)."""
    head = data[:64].lstrip()
    if not head.startswith(b"{") or not data[-64:].rstrip().endswith(b"}"):
        raise ValueError("the rank's dump is not a JSON object")
    decoder = codecs.getincrementaldecoder("utf-8")()  # slice by slice: no full copy of the dump
    view = memoryview(data)
    try:
        for off in range(0, len(data), 1 << 20):
            decoder.decode(view[off:off + (1 << 20)], final=off + (1 << 20) >= len(data))
    except UnicodeDecodeError as exc:
        raise ValueError(f"the rank's dump is not UTF-8 JSON: {exc}") from exc
    return data


def _looks_like_pickle(data: bytes | bytearray) -> bytes | bytearray:
    """A flight-recorder pickle as NCCL writes it (protocol 2+ framing, ending in STOP). Shipped as bytes:
    the coordinator reads it with the analyser's plain-data unpickler, which refuses every global."""
    if len(data) > MAX_DUMP_BYTES:
        raise ValueError(f"the rank's dump is {len(data)} bytes, over the {MAX_DUMP_BYTES} limit")
    if data[:1] != PICKLE_PROTO or len(data) < 3 or data[1] < 2 or data[-1:] != b".":
        raise ValueError("the rank's dump is neither a JSON object nor a complete pickle")
    return data


def pyspy_dump(pid: int, *, timeout_s: float = 10.0, exe: str | None = None) -> dict[str, Any]:
    """``py-spy dump --json`` of one process: ``{"py_spy": [...threads]}`` or ``{"py_spy_error": ...}``.
    Needs ptrace permission on the process (same user with ptrace_scope 0/1 as parent, or
    CAP_SYS_PTRACE, which the DaemonSet/systemd unit grants)."""
    exe = exe or shutil.which("py-spy") or _venv_pyspy()
    if exe is None:
        return {"py_spy_error": "py-spy is not installed"}
    try:
        proc = subprocess.run([exe, "dump", "--pid", str(pid), "--json"], capture_output=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"py_spy_error": f"py-spy did not finish within {timeout_s:g} s"}
    except OSError as exc:
        return {"py_spy_error": f"cannot run py-spy: {exc}"}
    if proc.returncode != 0:
        return {"py_spy_error": proc.stderr.decode(errors="replace").strip()[-500:] or f"exit {proc.returncode}"}
    try:
        return {"py_spy": json.loads(proc.stdout)}
    except ValueError as exc:
        return {"py_spy_error": f"py-spy output is not JSON: {exc}"}


def _venv_pyspy() -> str | None:
    candidate = Path(sys.executable).parent / "py-spy"
    return str(candidate) if candidate.exists() else None


__all__ = ["MAX_DUMP_BYTES", "Emit", "ExecutorSettings", "RankSource", "RequestExecutor", "pyspy_dump"]
