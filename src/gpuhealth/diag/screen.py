"""Screens that never hold a GPU a job wants: the block directory, the abort watch, the results.

A *screen* is a diagnostic run the agent starts on its own (its schedule, a Slurm epilog, an operator
asking its HTTP API): ``periodic`` (SDC + memory bandwidth, one GPU at a time is enough) or ``quick``
(``qualify --level quick`` in one warm process per GPU). While the child runs, ``ScreenWatch`` is
polled every ``POLL_S`` by the runner, in the agent process (torch-free). It answers a reason to
abort when

- a holder is in the **block directory** (``diag.screen_block_dir``, default
  ``/run/gpuhealth/screen-block``): one file per holder — the Slurm prolog writes ``job-<id>`` and the
  epilog removes it. A file is JSON ``{"holder", "at", "expires", "pid"?}``; it stops counting once
  ``expires`` has passed or its ``pid`` (when given) is dead, and a file that cannot be read counts
  for ``STALE_UNREADABLE_S`` from its mtime — so a crashed prolog or a lost epilog never blocks
  screening for ever (``/run`` is also emptied at boot);
- a **compute process** appears on a screened GPU (NVML, the backend the agent uses) that is not one
  of the screen's own: a PID visible here whose process group is not the child's. A PID from another
  PID namespace (a container agent without the host's) cannot be told apart: each GPU may then hold
  one such process (the screen's own rank), a second is foreign.

The runner then kills the child's process group (SIGTERM, SIGKILL after a short grace) and the
outcome is ``aborted`` with the reason. ``screen_results`` turns outcomes into one ``ScreenResult``
per screened GPU (what the coordinator counts as coverage), SDC digests with their golden keys.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.diag.runner import gpu_pids
from gpuhealth.model import EntityKind, Finding, Severity

POLL_S = 0.1  # how often a running screen looks at the block directory and the GPUs' processes
STALE_UNREADABLE_S = 24 * 3600.0  # a block file that cannot be parsed counts this long after it was written
LEVELS = ("periodic", "quick", "standard", "full")
TRIGGERS = ("schedule", "epilog", "operator")
RESULTS = ("pass", "fail", "aborted", "error")
MAX_BLOCK_FILES = 256  # more holders than that on one node is not a scheduler: stop reading


# ------------------------------------------------------------------------------- the block directory

@dataclass(frozen=True, slots=True)
class BlockHolder:
    name: str  # the file's name (``job-88``)
    holder: str  # who says so, in words
    at: float
    expires: float | None
    pid: int | None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


class ScreenBlock:
    """The holders in ``directory`` that still count. Reading only; the scheduler hooks write."""

    def __init__(self, directory: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.directory = Path(directory)
        self.clock = clock

    def holders(self) -> list[BlockHolder]:
        now = self.clock()
        out: list[BlockHolder] = []
        try:
            entries = sorted(os.scandir(self.directory), key=lambda e: e.name)[:MAX_BLOCK_FILES]
        except OSError:  # no directory: nobody holds it
            return out
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                continue  # ".job-88.tmp": a hook still writing it
            holder = self._read(entry.path, entry.name)
            if holder is None:
                continue
            if holder.expires is not None and holder.expires < now:
                continue
            if holder.pid is not None and not _pid_alive(holder.pid):
                continue
            out.append(holder)
        return out

    def _read(self, path: str, name: str) -> BlockHolder | None:
        try:
            st = os.stat(path)
            with open(path, "rb") as fh:
                raw = fh.read(4096)
        except OSError:
            return None  # removed while we looked
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            at = _number(doc.get("at"), st.st_mtime)
            expires = doc.get("expires")
            pid = doc.get("pid")
            return BlockHolder(name, str(doc.get("holder") or name)[:200], at,
                               _number(expires, None) if expires is not None else None,
                               pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None)
        except ValueError:  # unreadable: it blocks, but not for ever
            return BlockHolder(name, name, st.st_mtime, st.st_mtime + STALE_UNREADABLE_S, None)

    def reason(self) -> str | None:
        """``prolog lock (job 88)``-style words for the first holder, None when screening is free."""
        holders = self.holders()
        if not holders:
            return None
        more = f" and {len(holders) - 1} more" if len(holders) > 1 else ""
        return f"screen lock held by {holders[0].holder}{more}"


def _number(value: Any, default: float | None) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if default is None:
            raise ValueError("not a number")
        return default
    return float(value)


# ------------------------------------------------------------------------------------ the watch

def _process_group(pid: int) -> int | None:
    """The PID's process group here, None when it is not visible in this PID namespace."""
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError, OSError):
        return None


@dataclass(slots=True)
class ScreenWatch:
    """``watch(child_pid, gpus)`` → why the screen must stop now, or None. Given to ``DiagRunner.run``,
    which passes the GPUs the child runs on; ``also`` are watched too (every GPU of the node while
    collectives run: their traffic crosses links and switches a job on another GPU uses)."""

    block: ScreenBlock | None
    backend: NvmlBackend | None
    also: Sequence[GpuIdentity] = ()
    own_pids: frozenset[int] = field(default_factory=lambda: frozenset({os.getpid()}))
    stopping: threading.Event | None = None  # the agent is stopping: no screen outlives it

    def __call__(self, child_pid: int | None, gpus: Sequence[GpuIdentity] = ()) -> str | None:
        if self.stopping is not None and self.stopping.is_set():
            return "the agent is stopping"
        if self.block is not None:
            why = self.block.reason()
            if why:
                return why
        if self.backend is None:
            return None
        watched = {g.uuid: g for g in [*gpus, *self.also]}
        for g in sorted(watched.values(), key=lambda g: g.index):
            pids = gpu_pids(self.backend, g.index)
            if not pids:
                continue
            foreign = self._foreign(pids, child_pid)
            if foreign:
                return f"pid {foreign[0]} started on GPU {g.index}"
        return None

    def _foreign(self, pids: Sequence[int], child_pid: int | None) -> list[int]:
        foreign: list[int] = []
        unseen: list[int] = []
        for pid in pids:
            if pid in self.own_pids or pid == child_pid:
                continue
            group = _process_group(pid)
            if group is None:
                unseen.append(pid)  # another PID namespace: ours or not, nobody here can say
            elif child_pid is None or group != child_pid:
                foreign.append(pid)
        return foreign + unseen[1:]  # one unseen process per GPU may be the screen's own rank


# ------------------------------------------------------------------------------------ results

@dataclass(frozen=True, slots=True)
class ScreenResult:
    """One GPU's screen, as ``ScreenResult`` on the wire (``proto/gpuhealth_v1.proto``)."""

    gpu_uuid: str
    gpu_index: int
    started_at: float
    finished_at: float
    level: str
    result: str  # pass | fail | aborted | error
    reason: str
    trigger: str
    digests: tuple[tuple[str, str], ...] = ()  # (golden key/case, digest)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_uuid": self.gpu_uuid, "gpu_index": self.gpu_index, "started_at": self.started_at,
                "finished_at": self.finished_at, "level": self.level, "result": self.result, "reason": self.reason,
                "trigger": self.trigger, "digests": [{"key": k, "digest": d} for k, d in self.digests]}


def sdc_digests(sdc_result: Any) -> dict[str, list[tuple[str, str]]]:
    """GPU UUID → [(``<key_id>/<case>``, digest)] from an SDC diagnostic's ``result`` (the same votes the
    coordinator takes from ``RunDiagnostic``)."""
    out: dict[str, list[tuple[str, str]]] = {}
    if not isinstance(sdc_result, Mapping):
        return out
    key_id = sdc_result.get("key_id")
    if not isinstance(key_id, str) or not key_id:
        return out
    for dev in sdc_result.get("devices") or []:
        uuid = dev.get("uuid") if isinstance(dev, Mapping) else None
        if not isinstance(uuid, str) or not uuid:
            continue
        for case in dev.get("cases") or []:
            if isinstance(case, Mapping) and isinstance(case.get("digest"), str) and isinstance(case.get("case"), str):
                out.setdefault(uuid, []).append((f"{key_id}/{case['case']}", case["digest"]))
    return out


def _problems(findings: Sequence[Finding], uuid: str) -> list[str]:
    """Codes of the warnings and worse that concern this GPU (its own, or the node's / a link's)."""
    codes = []
    for f in findings:
        if f.severity < Severity.WARNING:
            continue
        if f.entity.kind is EntityKind.GPU and f.entity.id != uuid:
            continue
        if f.code not in codes:
            codes.append(f.code)
    return codes


def screen_results(outcomes: Sequence[Any], gpus: Sequence[GpuIdentity], *, level: str, trigger: str,
                   started_at: float, finished_at: float) -> list[ScreenResult]:
    """One result per GPU that a step of this screen ran on (a GPU left out of every step — busy, out of
    budget, locked — was not screened and gets none). The worst step decides: aborted, then error
    (a step that failed or timed out), then fail (a warning or worse about the GPU), else pass."""
    index = {g.uuid: g.index for g in gpus}
    digests: dict[str, list[tuple[str, str]]] = {}
    verdict: dict[str, tuple[int, str, str]] = {}  # uuid → (rank, result, reason); higher rank wins
    order = {"pass": 0, "fail": 1, "error": 2, "aborted": 3}
    for o in outcomes:
        if o.diag == "sdc" and o.status == "ok":
            for uuid, d in sdc_digests(o.result).items():
                digests.setdefault(uuid, []).extend(d)
        for uuid in o.gpus:
            if o.status == "aborted":
                result, reason = "aborted", o.reason
            elif o.status in ("failed", "timeout"):
                result, reason = "error", f"{o.diag} {o.status}: {o.reason}"
            elif o.status == "skipped":
                continue  # the child ran nothing (no CUDA here, say): not a screen of this GPU
            else:
                codes = _problems(o.findings, uuid)
                result, reason = ("fail", f"{o.diag}: {', '.join(codes)}") if codes else ("pass", "")
            current = verdict.get(uuid)
            if current is None or order[result] > current[0] or (order[result] == current[0] and result == "fail"):
                joined = reason if current is None or current[1] != result else f"{current[2]}; {reason}"
                verdict[uuid] = (order[result], result, joined)
    out = []
    for uuid, (_, result, reason) in verdict.items():
        out.append(ScreenResult(uuid, index.get(uuid, -1), started_at, finished_at, level, result, reason[:500],
                                trigger, tuple(digests.get(uuid, ()))))
    return sorted(out, key=lambda r: (r.gpu_index, r.gpu_uuid))


__all__ = ["LEVELS", "POLL_S", "RESULTS", "TRIGGERS", "BlockHolder", "ScreenBlock", "ScreenResult", "ScreenWatch",
           "gpu_pids", "screen_results", "sdc_digests"]
