"""Screening beside the agent (an agent extension; ``agent/extensions.py`` seam): on by default.

A *screen* (``diag/screen.py``) runs in a child process through ``DiagRunner`` — idle GPUs only, the
per-GPU GPU-time budget (``diag.gpu_seconds_per_hour``) enforced, per-GPU locks shared with
``gpuhealth diag`` / ``qualify`` — and is aborted within a poll (``screen.POLL_S``) plus the kill grace
when a compute process appears on one of its GPUs or a holder enters the block directory (the Slurm
prolog). The agent process itself never imports torch. Never on a simulated backend (a recording has
no GPU to test); ``diag.enabled: false`` turns it off.

- ``periodic`` (trigger ``schedule``): SDC then memory bandwidth on every idle GPU, every
  ``diag.interval_s``; sooner again (``RETRY_S``) after a screen that was aborted or found no idle GPU.
  When the coordinator gave this node a turn (``set_turn``: ScreenTurn), a scheduled screen starts only
  inside ``[not_before, not_before + valid_for_s]``; with no turn, or one that lapsed, the agent keeps
  its own schedule.
- ``quick`` (trigger ``epilog`` or ``operator``, asked through ``request_screen``: the HTTP API's
  ``POST /screen``): ``qualify --level quick`` in one warm process per GPU, starting at once (no turn to
  wait for). Its bus-bandwidth part runs only when every GPU of the node is free.

Every GPU a screen ran on gets a ``ScreenResult`` (``screens()`` keeps the latest per GPU; ``on_screens``
hands each screen's results on — to the coordinator link). Findings (``sdc.mismatch``, ``bandwidth.low``
…) are kept per diagnostic and GPU until a later run of that diagnostic on that GPU replaces them (an
aborted or skipped run replaces nothing) and are handed to ``on_findings`` after every screen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.diag.qualify import default_golden_dir, default_state_dir, plan, split_quick
from gpuhealth.diag.runner import DiagOutcome, DiagRunner, user_processes
from gpuhealth.diag.screen import ScreenBlock, ScreenResult, ScreenWatch, screen_results
from gpuhealth.model import EntityKind, Finding

log = logging.getLogger("gpuhealth.diag")

PERIODIC_STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sdc", ()),
    ("bandwidth", ("--d2d-mib", "512", "--host-mib", "128", "--reps", "3")),
)
SCREEN_LEVELS = ("periodic", "quick")  # what the agent runs itself; standard and full are `qualify`'s
RETRY_S = 300.0  # a scheduled screen that was aborted, or found every GPU busy, is tried again this soon
TICK_S = 1.0  # the screening thread looks at requests, the schedule and the turn this often


def _live_backend() -> NvmlBackend | None:
    from gpuhealth.node import open_backend

    try:
        return open_backend(None)
    except Exception as exc:  # no driver: busy-GPU checks are then impossible, so nothing runs
        log.warning("periodic diagnostics: NVML unavailable (%s)", exc)
        return None


@dataclass(frozen=True, slots=True)
class Turn:
    """The coordinator's ScreenTurn for this node."""

    not_before: float
    valid_for_s: float

    def allows(self, now: float) -> bool:
        """May a scheduled screen start now? Before the window: no. Inside: yes. After it (the turn
        lapsed) or a turn without a window: the agent's own schedule, so yes."""
        if self.valid_for_s <= 0 or now > self.not_before + self.valid_for_s:
            return True
        return now >= self.not_before


class PeriodicDiagnostics:
    name = "diagnostics"

    def __init__(
        self,
        *,
        python: str | None = None,
        backend_factory: Callable[[], NvmlBackend | None] = _live_backend,
        on_findings: Callable[[list[Finding]], None] | None = None,
        on_screens: Callable[[list[ScreenResult]], None] | None = None,
        steps: Sequence[tuple[str, tuple[str, ...]]] = PERIODIC_STEPS,
        clock: Callable[[], float] = time.time,
        first_delay_s: float = 0.0,
        tick_s: float = TICK_S,
    ) -> None:
        self._python = python
        self._backend_factory = backend_factory
        self.on_findings = on_findings
        self.on_screens = on_screens
        self._steps = list(steps)
        self._clock = clock
        self._first_delay_s = first_delay_s
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._latest: dict[str, DiagOutcome] = {}
        # The last run that measured something (not skipped or aborted), and when: what /metrics shows.
        # On a node whose GPUs are always busy, "last ran" must not move while nothing runs.
        self._measured: dict[str, DiagOutcome] = {}
        self._finished_at: dict[str, float] = {}
        self._findings: dict[tuple[str, str], list[Finding]] = {}  # (diag, GPU uuid or "" for the node)
        self._screens: dict[str, ScreenResult] = {}
        self._turn: Turn | None = None
        self._pending: tuple[str, str] | None = None  # (level, trigger) asked for, not yet started
        self._running: dict[str, Any] | None = None
        self._agent: Any = None
        self._next_due = 0.0
        self._wait_s = 0.0  # how long the next scheduled screen was meant to wait when it was set
        self.cycles = 0
        self.refusal = "diag.enabled is false"  # why request_screen refuses while the thread is not running

    # -- extension protocol ------------------------------------------------------------------------

    def start(self, agent: Any) -> None:
        config = agent.config
        if not config.diag.enabled:
            log.info("screening disabled (diag.enabled = false)")
            return
        if agent.simulated:
            self.refusal = "the backend is simulated (a recording): no GPU to screen"
            log.info("screening off: the backend is simulated")
            return
        self._agent = agent
        self._next_due = self._clock() + self._first_delay_s
        self._wait_s = self._first_delay_s
        self._thread = threading.Thread(target=self._loop, args=(agent,), name="gpuhealth-diag", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    # -- what it knows -----------------------------------------------------------------------------

    def latest(self) -> dict[str, DiagOutcome]:
        with self._lock:
            return dict(self._latest)

    def finished_at(self) -> dict[str, float]:
        """diag → when its latest run that measured something ended (wall clock)."""
        with self._lock:
            return dict(self._finished_at)

    def measured(self) -> dict[str, DiagOutcome]:
        """diag → its latest outcome that measured something (not skipped, not aborted)."""
        with self._lock:
            return dict(self._measured)

    def findings(self) -> list[Finding]:
        with self._lock:
            return [f for _, fs in sorted(self._findings.items()) for f in fs]

    def screens(self) -> dict[str, ScreenResult]:
        """GPU UUID → its latest screen."""
        with self._lock:
            return dict(self._screens)

    def status(self) -> dict[str, Any]:
        """For ``GET /screen``: what runs now, what is asked, the turn, the latest screen per GPU."""
        with self._lock:
            turn = self._turn
            return {
                "enabled": self._thread is not None,
                "refusal": None if self._thread is not None else self.refusal,
                "running": dict(self._running) if self._running else None,
                "pending": {"level": self._pending[0], "trigger": self._pending[1]} if self._pending else None,
                "next_scheduled_at": self._next_due if self._thread is not None else None,
                "turn": None if turn is None else {"not_before": turn.not_before, "valid_for_s": turn.valid_for_s},
                "screens": [r.to_dict() for r in sorted(self._screens.values(), key=lambda r: r.gpu_index)],
            }

    # -- what it is told ---------------------------------------------------------------------------

    def set_turn(self, not_before: float, valid_for_s: float) -> None:
        """The coordinator's ScreenTurn (``not_before`` 0: now)."""
        with self._lock:
            self._turn = Turn(not_before or self._clock(), valid_for_s)
        self._wake.set()

    def request_screen(self, level: str, trigger: str) -> tuple[bool, str]:
        """Ask for a screen now (an epilog, an operator). (accepted, why): refused while screening is
        off, for an unknown level, or while another screen runs or waits; an accepted one starts
        within a tick, still idle-only, budgeted and abortable."""
        if level not in SCREEN_LEVELS:
            return False, f"unknown level {level!r} (known: {', '.join(SCREEN_LEVELS)})"
        if trigger not in ("epilog", "operator"):
            return False, f"unknown trigger {trigger!r} (epilog or operator)"
        with self._lock:
            if self._thread is None or self._stop.is_set():
                return False, f"screening is off: {self.refusal}"
            if self._pending is not None or self._running is not None:
                what = self._running or {"level": self._pending[0] if self._pending else "?"}
                return False, f"a {what['level']} screen is already running or queued"
            self._pending = (level, trigger)
        self._wake.set()
        return True, f"{level} screen queued"

    # -- running screens ---------------------------------------------------------------------------

    def run_cycle(self, agent: Any, backend: NvmlBackend | None) -> list[ScreenResult]:
        """One scheduled (``periodic``) screen now (public for tests and tools)."""
        return self.run_screen(agent, backend, "periodic", "schedule")

    def run_screen(self, agent: Any, backend: NvmlBackend | None, level: str, trigger: str) -> list[ScreenResult]:
        config = agent.config
        gpus = list(agent.gpus)
        if not gpus:
            return []
        runner = DiagRunner(config.diag, state_dir=default_state_dir(config), backend=backend, python=self._python)
        block = ScreenBlock(config.diag.screen_block_dir) if config.diag.screen_block_dir else None
        started = self._clock()
        with self._lock:
            self._running = {"level": level, "trigger": trigger, "started_at": started}
        try:
            if level == "quick":
                outcomes = self._quick(agent, runner, backend, block, gpus)
            else:
                outcomes = self._periodic(agent, runner, backend, block, gpus)
        finally:
            with self._lock:
                self._running = None
        finished = self._clock()
        results = screen_results(outcomes, gpus, level=level, trigger=trigger, started_at=started,
                                 finished_at=finished)
        self._record(outcomes, results)
        self.cycles += 1
        for o in outcomes:
            if o.status not in ("ok", "skipped"):
                log.warning("%s screen (%s): %s %s: %s", level, trigger, o.diag, o.status, o.reason)
        if self.on_findings is not None:
            try:
                self.on_findings(self.findings())
            except Exception:
                log.exception("diagnostics findings callback failed")
        if results and self.on_screens is not None:
            try:
                self.on_screens(results)
            except Exception:
                log.exception("screen results callback failed")
        return results

    def _periodic(self, agent: Any, runner: DiagRunner, backend: NvmlBackend | None, block: ScreenBlock | None,
                  gpus: list[GpuIdentity]) -> list[DiagOutcome]:
        config = agent.config
        watch = ScreenWatch(block, backend, stopping=self._stop)
        outcomes = []
        for diag, args in self._steps:
            if self._stop.is_set():
                break
            extra: list[str] = []
            if diag == "sdc":
                extra = ["--golden-dir", str(default_golden_dir(config)), "--node", config.node_name]
            outcome = runner.run(diag, [*args, *extra], gpus=gpus, timeout_s=config.diag.timeout_s, watch=watch)
            outcomes.append(outcome)
            if outcome.status == "aborted":
                break  # a job wants the GPUs: the rest of the screen waits for the next idle spell
        return outcomes

    def _quick(self, agent: Any, runner: DiagRunner, backend: NvmlBackend | None, block: ScreenBlock | None,
               gpus: list[GpuIdentity]) -> list[DiagOutcome]:
        config = agent.config
        step = plan("quick", config)[0]
        args = [*step.args, "--golden-dir", str(default_golden_dir(config))]
        # bus bandwidth only when every GPU of the node is free (NVML can say, and says none runs a process)
        every_gpu_free = backend is not None and all(user_processes(backend, g.index) == [] for g in gpus)
        if every_gpu_free:
            watch = ScreenWatch(block, backend, also=gpus, stopping=self._stop)  # collectives cross every GPU's links
        else:
            args += ["--collectives", ""]
            watch = ScreenWatch(block, backend, stopping=self._stop)
        outcome = runner.run("quick", args, gpus=gpus, timeout_s=config.diag.timeout_s, watch=watch)
        if outcome.status == "ok":
            parts, _ = split_quick(outcome)
            return parts
        return [DiagOutcome("quick", outcome.status, outcome.reason, gpus=list(outcome.gpus),
                            skipped_gpus=dict(outcome.skipped_gpus), wall_s=outcome.wall_s)]

    def _record(self, outcomes: Sequence[DiagOutcome], results: Sequence[ScreenResult]) -> None:
        now = self._clock()
        with self._lock:
            for o in outcomes:
                self._latest[o.diag] = o
                if o.status in ("skipped", "aborted"):
                    continue  # measured nothing: what an earlier run found stands
                self._measured[o.diag] = o
                self._finished_at[o.diag] = now
                for uuid in o.gpus:
                    self._findings[(o.diag, uuid)] = [f for f in o.findings
                                                      if f.entity.kind is EntityKind.GPU and f.entity.id == uuid]
                self._findings[(o.diag, "")] = [f for f in o.findings if f.entity.kind is not EntityKind.GPU]
            for r in results:
                self._screens[r.gpu_uuid] = r

    # -- the thread --------------------------------------------------------------------------------

    def _due(self, now: float) -> bool:
        with self._lock:
            turn = self._turn
        if self._next_due > now + self._wait_s:  # the wall clock was stepped back: wait what was meant, no more
            self._next_due = now + self._wait_s
        return now >= self._next_due and (turn is None or turn.allows(now))

    def _loop(self, agent: Any) -> None:
        backend = self._backend_factory()
        if backend is None:
            with self._lock:
                self.refusal = "NVML is unavailable: busy GPUs cannot be told from idle ones"
                self._thread = None
            return
        try:
            while not self._stop.is_set():
                with self._lock:
                    asked, self._pending = self._pending, None
                try:
                    if asked is not None:
                        self._after(self.run_screen(agent, backend, *asked), agent)
                    elif self._due(self._clock()):
                        self._after(self.run_cycle(agent, backend), agent)
                except Exception:  # a broken screen must never take the agent down
                    log.exception("screen failed")
                    self._wait_s = RETRY_S
                    self._next_due = self._clock() + RETRY_S
                self._wake.wait(self._tick_s)
                self._wake.clear()
        finally:
            backend.shutdown()

    def _after(self, results: Sequence[ScreenResult], agent: Any) -> None:
        """When the next scheduled screen is due: an interval after one that screened, sooner after one
        that was aborted or found no idle GPU."""
        screened = any(r.result != "aborted" for r in results)
        wait = agent.config.diag.interval_s if screened else min(RETRY_S, agent.config.diag.interval_s)
        self._wait_s = wait
        self._next_due = self._clock() + wait


__all__ = ["PERIODIC_STEPS", "SCREEN_LEVELS", "PeriodicDiagnostics", "Turn"]
