"""Runs one collector with isolation: the agent never dies from a collector (docs/architecture.md, rule 2).

``CollectorRunner.run(collector, ctx, history) -> CollectorRun`` is the one call the agent's
scheduler (and ``gpuhealth status``) makes, per collector, at that collector's interval:

- ``supported`` → ``collect`` → pure ``evaluate`` → pure ``samples`` run on the collector's own
  worker thread; the caller waits at most ``timeout_s``.
- Any exception becomes ``success=False`` plus a ``collector.failed`` finding on the node.
- A run past ``timeout_s`` is reported failed; its thread is left to finish (Python threads cannot be
  killed) and that collector is not started again until it has returned. Each later call meanwhile
  answers at once with a failed run saying since when it has been stuck.
- Readings that really failed on one GPU (``obs.errors``; "Not Supported" is not an error) become a
  ``collector.failed`` finding on that GPU while every other reading is still reported. GPU_IS_LOST
  and RESET_REQUIRED are left to the presence collector (``gpu.lost``), not repeated per collector.
- After a successful run the observations are appended to ``history`` (the caller owns one
  ``History`` per collector and passes the same one every time).

``enumerate_gpus(backend)`` lists the GPUs once per sweep for ``CollectContext.gpus``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.errors import GPU_GONE_CODES, NvmlError
from gpuhealth.backends.plausible import BAD_VALUE
from gpuhealth.collectors.base import (
    CollectContext,
    CollectError,
    Collector,
    GpuIdentity,
    History,
    Lane,
    Observations,
)
from gpuhealth.model import Action, Entity, Finding, Sample, Severity

FAILED_CODE = "collector.failed"
BAD_VALUE_CODE = "nvml.bad_value"  # a reading no GPU can give: never judged as healthy


@dataclass(slots=True)
class CollectorRun:
    """The outcome of one run of one collector: the one result type of a collector run, whoever ran
    it (the runner, or the agent for sources it publishes itself and runs it abandoned)."""

    name: str
    started: float  # wall clock, seconds since the epoch
    duration_s: float
    success: bool
    error: str | None = None
    observations: Observations | None = None
    findings: list[Finding] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    lane: Lane = Lane.FAST
    skipped: bool = False  # ``supported`` said no: a normal outcome, counted as success
    timed_out: bool = False
    error_type: str | None = None  # class name of the exception, e.g. "RecordingError"

    @property
    def finished_at(self) -> float:
        return self.started + self.duration_s

    @property
    def nvml_codes(self) -> frozenset[int]:
        """NVML error codes the run's readings failed with."""
        obs = self.observations
        return frozenset(e.code for e in obs.errors if e.code is not None) if obs is not None else frozenset()

    @property
    def gone_gpus(self) -> frozenset[int]:
        """GPU indexes that answered GPU_IS_LOST / RESET_REQUIRED."""
        obs = self.observations
        if obs is None:
            return frozenset()
        return frozenset(e.gpu for e in obs.errors if e.code in GPU_GONE_CODES and e.gpu is not None)

    @property
    def answered_gpus(self) -> frozenset[int]:
        """GPU indexes that gave at least one reading (presence marks lost ones ``present=False``)."""
        obs = self.observations
        if obs is None:
            return frozenset()
        answered = {i for i, rec in obs.per_gpu.items() if rec and rec.get("present", True) is not False}
        return frozenset(answered - self.gone_gpus)

    def summary(self) -> dict[str, Any]:
        """Plain-data view for ``status --json`` and logs (the same entry ``/health`` shows)."""
        return CollectorStatus(self.name, self.lane.value, 0.0).after(self).to_dict(totals=False)


@dataclass(frozen=True, slots=True)
class CollectorStatus:
    """How one collector has been doing: its last run and totals over every run. What
    ``gpuhealth_collector_*`` exports and what the node report's ``collectors`` list shows."""

    name: str
    lane: str
    interval_s: float
    success: bool | None = None  # None: has not completed a run yet
    duration_s: float | None = None  # of the last completed (or timed out) run
    last_success_time: float | None = None  # wall clock, seconds since the epoch
    runs_total: int = 0
    errors_total: int = 0  # failed runs, timeouts included
    timeouts_total: int = 0
    last_error: str = ""
    findings: int = 0  # findings of the last run
    skipped: bool = False  # the last run: "not supported here"
    timed_out: bool = False  # the last run

    def after(self, run: CollectorRun) -> CollectorStatus:
        """This status, one run later."""
        return replace(
            self,
            success=run.success,
            duration_s=run.duration_s,
            last_success_time=run.finished_at if run.success else self.last_success_time,
            runs_total=self.runs_total + 1,
            errors_total=self.errors_total + (0 if run.success else 1),
            timeouts_total=self.timeouts_total + (1 if run.timed_out else 0),
            last_error="" if run.success else (run.error or ""),
            findings=len(run.findings),
            skipped=run.skipped,
            timed_out=run.timed_out,
        )

    def to_dict(self, *, totals: bool) -> dict[str, Any]:
        """The node report's entry; ``totals`` (an agent's report) adds the counts over every run."""
        out: dict[str, Any] = {
            "name": self.name,
            "lane": self.lane,
            "success": self.success,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 6),
            "findings": self.findings,
        }
        if self.skipped:
            out["skipped"] = True
        if self.timed_out:
            out["timed_out"] = True
        if self.last_error:
            out["error"] = self.last_error
        if totals:
            out.update(last_success_time=self.last_success_time, runs_total=self.runs_total,
                       errors_total=self.errors_total, timeouts_total=self.timeouts_total)
        return out


@dataclass(slots=True)
class _Outcome:
    skipped: bool = False
    observations: Observations | None = None
    findings: list[Finding] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


class _Job:
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], _Outcome]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: _Outcome | None = None
        self.error: BaseException | None = None


class _Worker:
    """One long-lived daemon thread per collector, so a run costs a queue hand-off, not a thread start."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.busy_since: float | None = None
        self._thread = threading.Thread(target=self._loop, name=f"gpuhealth-collector-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: _Job, now: float) -> None:
        self.busy_since = now
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.result = job.fn()
            except BaseException as exc:  # a collector calling sys.exit must not end the agent either
                job.error = exc
            finally:
                self.busy_since = None
                job.done.set()


class CollectorRunner:
    """Isolates, times and records collector runs. One runner serves all collectors of an agent.

    ``timeout_s=None`` runs the collector inline on the caller's thread (still catching exceptions,
    but without the timeout); used where a thread is not wanted.
    """

    def __init__(self, timeout_s: float | None = 10.0, *, clock: Callable[[], float] = time.time) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()
        self.last_success: dict[str, float] = {}  # collector name → wall time of its last success

    def run(self, collector: Collector, ctx: CollectContext, history: History) -> CollectorRun:
        name = str(getattr(collector, "name", type(collector).__name__))
        lane = getattr(collector, "lane", Lane.FAST)
        started = self._clock()
        t0 = time.perf_counter()

        def work() -> _Outcome:
            return _run_steps(collector, ctx, history)

        outcome: _Outcome | None = None
        error: BaseException | None = None
        if self.timeout_s is None:
            try:
                outcome = work()
            except Exception as exc:
                error = exc
        else:
            worker = self._worker(name)
            stuck_since = worker.busy_since
            if stuck_since is not None:
                msg = (f"still running since a run that timed out at {stuck_since:.0f} "
                       f"({started - stuck_since:.1f} s ago); not started again until it returns")
                return self._failed(name, lane, ctx, started, time.perf_counter() - t0, msg, timed_out=True)
            job = _Job(work)
            worker.submit(job, started)
            if not job.done.wait(self.timeout_s):
                msg = f"timed out after {self.timeout_s:g} s"
                return self._failed(name, lane, ctx, started, time.perf_counter() - t0, msg, timed_out=True)
            outcome, error = job.result, job.error
        duration = time.perf_counter() - t0
        if error is not None or outcome is None:
            text = _describe(error) if error is not None else "no result"
            run = self._failed(name, lane, ctx, started, duration, text)
            run.error_type = type(error).__name__ if error is not None else None
            return run
        run = CollectorRun(name=name, started=started, duration_s=duration, success=True, lane=lane,
                           skipped=outcome.skipped)
        if outcome.observations is not None:
            obs = outcome.observations
            run.observations = obs
            run.findings = list(outcome.findings) + error_findings(name, obs.errors, ctx)
            run.samples = list(outcome.samples)
            history.append(obs)
        self.last_success[name] = started
        return run

    def close(self) -> None:
        """Stop the idle worker threads (a stuck one ends when its call returns)."""
        with self._lock:
            for w in self._workers.values():
                w.stop()
            self._workers.clear()

    def _worker(self, name: str) -> _Worker:
        with self._lock:
            w = self._workers.get(name)
            if w is None:
                w = self._workers[name] = _Worker(name)
            return w

    @staticmethod
    def _failed(name: str, lane: Lane, ctx: CollectContext, started: float, duration: float, error: str,
                *, timed_out: bool = False) -> CollectorRun:
        finding = Finding(
            code=FAILED_CODE,
            severity=Severity.WARNING,
            entity=Entity.node(ctx.node_name),
            message=f"collector '{name}' failed: {error}",
            action=Action.MONITOR,
            evidence={"collector": name, "error": error},
            source="runner",
        )
        return CollectorRun(name=name, started=started, duration_s=duration, success=False, error=error,
                            findings=[finding], lane=lane, timed_out=timed_out)


def _run_steps(collector: Collector, ctx: CollectContext, history: History) -> _Outcome:
    if not collector.supported(ctx):
        return _Outcome(skipped=True)
    obs = collector.collect(ctx)
    findings = list(collector.evaluate(obs, history, ctx))
    samples = list(collector.samples(obs, ctx))
    return _Outcome(observations=obs, findings=findings, samples=samples)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def error_findings(collector: str, errors: Iterable[CollectError], ctx: CollectContext) -> list[Finding]:
    """One ``collector.failed`` finding per GPU (or the node) with readings that really failed, and
    one ``nvml.bad_value`` per GPU whose readings cannot be real (``backends.plausible``).
    GPU-gone codes are skipped: the presence collector reports them once, as ``gpu.lost``."""
    by_gpu: dict[int | None, list[CollectError]] = {}
    bad: dict[int | None, list[CollectError]] = {}
    for err in errors:
        if err.code in GPU_GONE_CODES:
            continue
        (bad if err.code == BAD_VALUE else by_gpu).setdefault(err.gpu, []).append(err)
    out: list[Finding] = [_bad_value_finding(collector, gpu, errs, ctx) for gpu, errs in bad.items()]
    for gpu, errs in by_gpu.items():
        ident = ctx.gpu_by_index(gpu) if gpu is not None else None
        if gpu is None:
            entity = Entity.node(ctx.node_name)
            where = "the node"
        else:
            entity = Entity.gpu(ident.uuid if ident else f"unknown-gpu-{gpu}", gpu)
            where = f"GPU {gpu}"
        keys = ", ".join(f"{e.key} ({e.message})" for e in errs[:5])
        more = f" and {len(errs) - 5} more" if len(errs) > 5 else ""
        out.append(Finding(
            code=FAILED_CODE,
            severity=Severity.WARNING,
            entity=entity,
            message=f"collector '{collector}': {len(errs)} reading(s) failed on {where}: {keys}{more}",
            action=Action.MONITOR,
            evidence={
                "collector": collector,
                "error": errs[0].message,
                "errors": [{"key": e.key, "code": e.code, "message": e.message} for e in errs],
            },
            source=collector,
        ))
    return out


def _bad_value_finding(collector: str, gpu: int | None, errs: Sequence[CollectError], ctx: CollectContext) -> Finding:
    ident = ctx.gpu_by_index(gpu) if gpu is not None else None
    entity = Entity.node(ctx.node_name) if gpu is None else Entity.gpu(ident.uuid if ident else f"unknown-gpu-{gpu}",
                                                                      gpu)
    where = "the node" if gpu is None else f"GPU {gpu}"
    keys = ", ".join(f"{e.key} ({e.message})" for e in errs[:5])
    more = f" and {len(errs) - 5} more" if len(errs) > 5 else ""
    return Finding(
        code=BAD_VALUE_CODE,
        severity=Severity.WARNING,
        entity=entity,
        message=f"NVML gave {where} {len(errs)} reading(s) no GPU can give: {keys}{more}; what they measure "
                "is not judged",
        action=Action.MONITOR,
        evidence={"collector": collector, "readings": [{"key": e.key, "message": e.message} for e in errs]},
        source=collector,
    )


def _query(backend: NvmlBackend, index: int, key: str) -> Any:
    try:
        return backend.query(index, key)
    except NvmlError:
        return None


def enumerate_gpus(backend: NvmlBackend, previous: Sequence[GpuIdentity] = ()) -> list[GpuIdentity]:
    """Every GPU NVML counts, with UUID, name, PCI bus id and minor number.

    A GPU that cannot answer (fell off the bus) still appears, with what ``previous`` (the last
    sweep's list) knew about that index, else placeholders, so ``gpu.lost`` can name it.
    Raises ``NvmlError`` only when the device count itself cannot be read."""
    known = {g.index: g for g in previous}
    out: list[GpuIdentity] = []
    for i in range(backend.device_count()):
        before = known.get(i)
        uuid = _query(backend, i, "UUID")
        name = _query(backend, i, "Name")
        pci = _query(backend, i, "PciInfo")
        minor = _query(backend, i, "MinorNumber")
        bus_id = pci.get("busId") if isinstance(pci, dict) else None
        out.append(GpuIdentity(
            index=i,
            uuid=str(uuid) if uuid else (before.uuid if before else f"unknown-gpu-{i}"),
            name=str(name) if name else (before.name if before else "unknown"),
            pci_bus_id=str(bus_id) if bus_id else (before.pci_bus_id if before else ""),
            minor=int(minor) if isinstance(minor, int) else (before.minor if before else None),
        ))
    return out


__all__ = ["FAILED_CODE", "CollectorRun", "CollectorRunner", "CollectorStatus", "enumerate_gpus", "error_findings"]
