"""Run a diagnostic as a child process under a per-GPU GPU-time budget and a per-GPU lock.

The agent and the CLI never import torch: they call ``DiagRunner.run``, which

1. drops GPUs that run user processes (NVML ``ComputeRunningProcesses``) unless forced,
2. drops GPUs whose GPU-time budget (``diag.gpu_seconds_per_hour``, a sliding hour) cannot pay
   for the run's estimate,
3. takes a non-blocking file lock per GPU (two diagnostics never share a GPU, across processes),
4. starts ``python -m gpuhealth.diag …`` in its own process group, with a timeout (the whole group is
   killed past it) and, for a screen, a ``watch`` polled every ``POLL_S`` (``diag/screen.py``): a reason
   from it stops the child at once (SIGTERM to the group, SIGKILL after ``TERM_GRACE_S``) and the
   outcome is ``aborted`` with that reason, charged its wall time,
5. reads the one JSON document it prints and charges each GPU the GPU-seconds it reports
   (the wall time, when the child died before saying).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.errors import NvmlError
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import DiagConfig
from gpuhealth.model import Finding

WINDOW_S = 3600.0
CLOCK_SLACK_S = 60.0  # a charge dated further ahead than this: the wall clock was stepped back
# GPU-seconds a run is expected to cost per GPU before one has been measured on this node. quick: what
# its child reports (the SDC phase on each GPU; copies and collectives are charged nothing), ~3 s per GPU.
DEFAULT_ESTIMATE_S = {"sdc": 1.0, "busbw": 20.0, "bandwidth": 2.0, "probe": 0.0, "quick": 5.0}
POLL_S = 0.1  # how often a watched child's watch is asked
TERM_GRACE_S = 0.3  # SIGTERM → SIGKILL: a rank in a CUDA call may not die on SIGTERM; the GPU must be free in 1 s
# ``watch(child_pid, gpus)`` → a reason to stop the child now, or None (``diag/screen.py``: ``ScreenWatch``);
# child_pid None: asked once before the child starts
Watch = Callable[[int | None, Sequence[GpuIdentity]], str | None]


@dataclass(slots=True)
class DiagOutcome:
    diag: str
    status: str  # ok | failed | skipped | timeout | aborted
    reason: str = ""
    findings: list[Finding] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    gpu_seconds: dict[str, float] = field(default_factory=dict)
    skipped_gpus: dict[str, str] = field(default_factory=dict)  # uuid → why it was left out
    gpus: list[str] = field(default_factory=list)  # uuids it ran on
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"diag": self.diag, "status": self.status, "reason": self.reason,
                "findings": [f.to_dict() for f in self.findings], "result": self.result,
                "gpu_seconds": self.gpu_seconds, "skipped_gpus": self.skipped_gpus, "gpus": self.gpus,
                "wall_s": round(self.wall_s, 3)}


class GpuBudget:
    """GPU-seconds spent per GPU in the last hour, persisted in one JSON file (survives restarts)."""

    def __init__(self, path: str | Path, per_hour: float, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.per_hour = per_hour
        self.clock = clock

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Read-modify-write under a lock shared by every process using this file (the agent's screens,
        an operator's ``gpuhealth diag``): two charging at once must both be counted."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {"spent": {}, "last": {}}
        if not isinstance(data, dict):
            return {"spent": {}, "last": {}}
        data.setdefault("spent", {})
        data.setdefault("last", {})
        return data

    def _load(self) -> dict[str, Any]:
        """The file, with charges dated after now (the clock was stepped back) moved to now, persisted:
        they count for one more hour from the step, not for as long as the step was (a day back would
        otherwise starve every screen for a day)."""
        data = self._read()
        now = self.clock()
        if not any(e[0] > now + CLOCK_SLACK_S for es in data["spent"].values() for e in es):
            return data
        with self._exclusive():
            data = self._read()
            for uuid, entries in data["spent"].items():
                data["spent"][uuid] = [[min(t, now), s] for t, s in entries]
            with contextlib.suppress(OSError):
                self._save(data)
        return data

    def _save(self, data: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)

    def spent(self, uuid: str) -> float:
        now = self.clock()
        return sum(s for t, s in self._load()["spent"].get(uuid, []) if now - t < WINDOW_S)

    def remaining(self, uuid: str) -> float:
        return max(0.0, self.per_hour - self.spent(uuid))

    def estimate(self, diag: str, uuid: str) -> float:
        last = self._load()["last"].get(diag, {}).get(uuid)
        return float(last) if last is not None else DEFAULT_ESTIMATE_S.get(diag, 1.0)

    def charge(self, diag: str, uuid: str, seconds: float, *, complete: bool = True) -> None:
        """Charge ``seconds``. A ``complete`` run's cost becomes the next estimate; a run cut short
        (aborted, timed out, died) only raises it: 0.2 s of an aborted screen says nothing of what a
        whole one costs, and taken as the estimate it would let a budget too low for one start it."""
        self._load()  # a clock stepped back: dated charges moved to now first
        with self._exclusive():
            now = self.clock()
            data = self._read()
            entries = [e for e in data["spent"].get(uuid, []) if now - e[0] < WINDOW_S]
            entries.append([now, float(seconds)])
            data["spent"][uuid] = entries
            last = data["last"].setdefault(diag, {})
            if complete:
                last[uuid] = float(seconds)
            else:
                before = last.get(uuid)
                last[uuid] = max(float(seconds), float(before) if before is not None
                                 else DEFAULT_ESTIMATE_S.get(diag, 1.0))
            self._save(data)


class GpuLocks:
    """One lock file per GPU; ``flock`` so a crashed holder never leaves a stale lock."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @contextlib.contextmanager
    def hold(self, uuids: Sequence[str]) -> Iterator[tuple[list[str], list[str]]]:
        """Yields (locked by us, held by someone else). Releases on exit."""
        self.directory.mkdir(parents=True, exist_ok=True)
        mine: list[tuple[str, IO[str]]] = []
        busy: list[str] = []
        try:
            for uuid in uuids:
                fh: IO[str] = open(self.directory / f"gpu-{uuid}.lock", "a+")  # noqa: SIM115 (held until exit)
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fh.close()
                    busy.append(uuid)
                    continue
                fh.seek(0)
                fh.truncate()
                fh.write(f"{os.getpid()}\n")
                fh.flush()
                mine.append((uuid, fh))
            yield [u for u, _ in mine], busy
        finally:
            for _, fh in mine:
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()


def gpu_pids(backend: NvmlBackend, index: int) -> list[int] | None:
    """Compute-process PIDs NVML lists on the GPU (None when NVML cannot say)."""
    try:
        procs = backend.query(index, "ComputeRunningProcesses")
    except NvmlError:
        return None
    out = []
    for p in procs if isinstance(procs, list) else []:
        pid = p.get("pid") if isinstance(p, Mapping) else getattr(p, "pid", None)
        if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
            out.append(pid)
    return out


def user_processes(backend: NvmlBackend, index: int) -> list[int] | None:
    """PIDs computing on the GPU other than this process (None when NVML cannot say)."""
    pids = gpu_pids(backend, index)
    return None if pids is None else [p for p in pids if p != os.getpid()]


class DiagRunner:
    def __init__(
        self,
        config: DiagConfig,
        *,
        state_dir: str | Path,
        backend: NvmlBackend | None = None,
        python: str | None = None,
        clock: Callable[[], float] = time.time,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.python = python or sys.executable
        self.budget = GpuBudget(Path(state_dir) / "diag-budget.json", config.gpu_seconds_per_hour, clock)
        self.locks = GpuLocks(Path(state_dir) / "locks")
        self.env = dict(os.environ if env is None else env)
        # Triton keeps compiled kernels under ~/.triton by default: unwritable for the systemd agent
        # (DynamicUser, ProtectHome), so every screen would recompile the SDC hash (~1.5 s measured on a fresh
        # 2 x H200 VM). Beside the budget and the locks they persist across runs and reboots.
        self.env.setdefault("TRITON_CACHE_DIR", str(Path(state_dir) / "triton-cache"))

    def select(self, diag: str, gpus: Sequence[GpuIdentity], force: bool, enforce_budget: bool = True
               ) -> tuple[list[GpuIdentity], dict[str, str]]:
        """GPUs this run may use, and why the others are left out."""
        chosen: list[GpuIdentity] = []
        skipped: dict[str, str] = {}
        for g in gpus:
            if not (force or self.config.run_on_busy_gpus) and self.backend is not None:
                pids = user_processes(self.backend, g.index)
                if pids:
                    skipped[g.uuid] = f"user processes on the GPU (pids {pids[:5]}); use --force to test anyway"
                    continue
            need = self.budget.estimate(diag, g.uuid)
            left = self.budget.remaining(g.uuid)
            if enforce_budget and not force and need > left:
                skipped[g.uuid] = (f"GPU-time budget: {left:.1f} s left of {self.config.gpu_seconds_per_hour:g} s/h, "
                                   f"the run needs ~{need:.1f} s")
                continue
            chosen.append(g)
        return chosen, skipped

    def run(
        self,
        diag: str,
        args: Sequence[str] = (),
        *,
        gpus: Sequence[GpuIdentity] | None = None,
        force: bool = False,
        timeout_s: float = 300.0,
        min_gpus: int = 1,
        enforce_budget: bool = True,
        watch: Watch | None = None,
    ) -> DiagOutcome:
        """``gpus`` None: a CPU run (no lock, no budget). Otherwise the child gets ``--device
        cuda:i,…`` (CUDA enumerated in PCI order, as NVML does) or, for busbw, CUDA_VISIBLE_DEVICES.
        ``enforce_budget`` False (a person asked for this run: CLI, qualify): the run is charged
        to the budget but never refused by it. ``watch`` (a screen): asked every ``POLL_S`` while the
        child runs; a reason ends the run as ``aborted``."""
        t0 = time.monotonic()
        if gpus is None:
            return self._spawn(diag, list(args), [], {}, timeout_s, t0, watch)
        chosen, skipped = self.select(diag, gpus, force, enforce_budget)
        with self.locks.hold([g.uuid for g in chosen]) as (locked, busy):
            for uuid in busy:
                skipped[uuid] = "another diagnostic holds this GPU's lock"
            run_on = [g for g in chosen if g.uuid in locked]
            if len(run_on) < max(1, min_gpus):
                why = "; ".join(sorted(set(skipped.values()))) or "no GPU to run on"
                return DiagOutcome(diag, "skipped", f"{len(run_on)} GPU(s) available, needs {max(1, min_gpus)}: {why}",
                                   skipped_gpus=skipped, wall_s=time.monotonic() - t0)
            env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            if diag in ("busbw", "quick"):  # one rank per GPU: each sees its GPUs as cuda:0…
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in run_on)
                extra = ["--world", str(len(run_on))]
            else:
                extra = ["--device", ",".join(f"cuda:{g.index}" for g in run_on)]
            if watch is not None:
                stop = watch(None, run_on)  # a job may have started while the GPUs were picked
                if stop:
                    return DiagOutcome(diag, "skipped", stop, skipped_gpus=skipped, wall_s=time.monotonic() - t0)
            outcome = self._spawn(diag, [*args, *extra], run_on, env, timeout_s, t0, watch)
            outcome.skipped_gpus.update(skipped)
            return outcome

    def _spawn(self, diag: str, args: list[str], gpus: Sequence[GpuIdentity], env_extra: Mapping[str, str],
               timeout_s: float, t0: float, watch: Watch | None = None) -> DiagOutcome:
        cmd = [self.python, "-m", "gpuhealth.diag", diag, *args]
        # the child exits at once if it finds another parent: this process died while it was starting
        env = {**self.env, **env_extra, "GPUHEALTH_DIAG_PARENT_PID": str(os.getpid())}
        uuids = [g.uuid for g in gpus]
        # files, not pipes: the loop below polls the watch instead of draining pipes, and a child that
        # writes a lot must never block on a full pipe meanwhile
        with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
            try:
                proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True, env=env, start_new_session=True)
            except OSError as exc:
                return DiagOutcome(diag, "failed", f"cannot start {self.python}: {exc}", wall_s=time.monotonic() - t0)
            stopped = _wait_watched(proc, timeout_s, t0, watch, gpus)
            out_f.seek(0)
            err_f.seek(0)
            out, err = out_f.read(), err_f.read()
        wall = time.monotonic() - t0
        if stopped is not None:
            for u in uuids:
                self.budget.charge(diag, u, wall, complete=False)
            if stopped == _TIMEOUT:
                return DiagOutcome(diag, "timeout", f"no result within {timeout_s:.0f} s (killed)", gpus=uuids,
                                   gpu_seconds={u: wall for u in uuids}, wall_s=wall)
            return DiagOutcome(diag, "aborted", stopped, gpus=uuids, gpu_seconds={u: wall for u in uuids},
                               wall_s=wall)
        doc = _last_json(out)
        if doc is None:
            for u in uuids:
                self.budget.charge(diag, u, wall, complete=False)
            tail = (err or "").strip().splitlines()[-3:]
            return DiagOutcome(diag, "failed", f"child exited {proc.returncode} without a result: {' | '.join(tail)}",
                               gpus=uuids, wall_s=wall)
        gpu_seconds = {str(k): float(v) for k, v in (doc.get("gpu_seconds") or {}).items()}
        unreported = 0.0 if doc.get("status") == "skipped" else wall  # a child that skipped used no GPU
        for u in uuids:
            self.budget.charge(diag, u, gpu_seconds.get(u, unreported))
        findings = []
        for f in doc.get("findings") or []:
            with contextlib.suppress(KeyError, ValueError):
                findings.append(Finding.from_dict(f))
        return DiagOutcome(diag, str(doc.get("status", "failed")), str(doc.get("reason", "")), findings,
                           dict(doc.get("result") or {}), gpu_seconds, gpus=uuids, wall_s=wall)


_TIMEOUT = "\0timeout"


def _wait_watched(proc: subprocess.Popen[str], timeout_s: float, t0: float, watch: Watch | None,
                  gpus: Sequence[GpuIdentity]) -> str | None:
    """Wait for the child; None when it exited by itself, else why it was stopped (``_TIMEOUT`` or
    the watch's reason) — by then its whole process group is gone."""
    deadline = t0 + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            kill_group(proc, grace_s=0.0)
            return _TIMEOUT
        try:
            proc.wait(timeout=min(POLL_S, left) if watch is not None else left)
            return None
        except subprocess.TimeoutExpired:
            pass
        if watch is None:
            continue
        try:
            why = watch(proc.pid, gpus)
        except Exception as exc:  # a watch that cannot look must not leave a GPU held without one
            why = f"the screen's watch failed: {type(exc).__name__}: {exc}"
        if why:
            kill_group(proc)
            return why


def kill_group(proc: subprocess.Popen[Any], grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM the child's process group (it and every rank it started), SIGKILL what is left after
    ``grace_s``, and reap the child. Ranks die with it too (``PR_SET_PDEATHSIG`` in ``child.py``)."""
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while time.monotonic() < end and _group_alive(proc):
            time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + 1.0
    while _group_alive(proc) and time.monotonic() < end:  # ranks of the group that outlived the child
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.005)


def _group_alive(proc: subprocess.Popen[Any]) -> bool:
    """Is a process of the child's group still running? ``poll`` reaps the child itself once dead;
    ranks it left behind may linger as zombies until init reaps them, which hold no GPU."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return proc.returncode is None or _live_members(proc.pid)


def _live_members(pgid: int) -> bool:
    """Any process of group ``pgid`` that is not a zombie (from ``/proc/<pid>/stat``)."""
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return True  # cannot look: assume the worst
    for name in entries:
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(stat) > 2 and int(stat[2]) == pgid and stat[0] != b"Z":
            return True
    return False


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed((text or "").strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                return doc
    return None
