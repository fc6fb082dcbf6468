"""Periodic diagnostics beside the agent (an agent extension; ``agent/extensions.py`` seam).

When ``diag.enabled``, a thread runs the SDC check and the bandwidth probes every
``diag.interval_s`` through ``DiagRunner``: a child process each time, the per-GPU GPU-time budget
enforced, GPUs with user processes skipped (``diag.run_on_busy_gpus`` overrides), per-GPU locks
shared with ``gpuhealth diag`` / ``qualify`` runs. The agent process itself never imports torch.
Never on a simulated backend. Bus bandwidth is not periodic: it needs every GPU of the node at
once and its cost (~10–20 GPU-seconds) exceeds the default hourly budget; run it from qualify.

The latest outcomes and findings are kept here (``latest()``, ``findings()``); ``on_findings`` is
called after every cycle so an owner can publish them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.diag.qualify import default_golden_dir, default_state_dir
from gpuhealth.diag.runner import DiagOutcome, DiagRunner
from gpuhealth.model import Finding

log = logging.getLogger("gpuhealth.diag")

PERIODIC_STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sdc", ()),
    ("bandwidth", ("--d2d-mib", "512", "--host-mib", "128", "--reps", "3")),
)


def _live_backend() -> NvmlBackend | None:
    from gpuhealth.node import open_backend

    try:
        return open_backend(None)
    except Exception as exc:  # no driver: busy-GPU checks are then impossible, so nothing runs
        log.warning("periodic diagnostics: NVML unavailable (%s)", exc)
        return None


class PeriodicDiagnostics:
    name = "diagnostics"

    def __init__(
        self,
        *,
        python: str | None = None,
        backend_factory: Callable[[], NvmlBackend | None] = _live_backend,
        on_findings: Callable[[list[Finding]], None] | None = None,
        steps: Sequence[tuple[str, tuple[str, ...]]] = PERIODIC_STEPS,
    ) -> None:
        self._python = python
        self._backend_factory = backend_factory
        self._on_findings = on_findings
        self._steps = list(steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._latest: dict[str, DiagOutcome] = {}
        # The last run that measured something (not skipped), and when: what /metrics shows. On a node
        # whose GPUs are always busy, "last ran" must not move while nothing runs.
        self._measured: dict[str, DiagOutcome] = {}
        self._finished_at: dict[str, float] = {}
        self.cycles = 0

    def start(self, agent: Any) -> None:
        config = agent.config
        if not config.diag.enabled:
            log.info("periodic diagnostics disabled (diag.enabled = false)")
            return
        if agent.simulated:
            log.info("periodic diagnostics off: the backend is simulated")
            return
        self._thread = threading.Thread(target=self._loop, args=(agent,), name="gpuhealth-diag", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def latest(self) -> dict[str, DiagOutcome]:
        with self._lock:
            return dict(self._latest)

    def finished_at(self) -> dict[str, float]:
        """diag → when its latest run that was not skipped ended (wall clock)."""
        with self._lock:
            return dict(self._finished_at)

    def measured(self) -> dict[str, DiagOutcome]:
        """diag → its latest outcome that was not skipped."""
        with self._lock:
            return dict(self._measured)

    def findings(self) -> list[Finding]:
        with self._lock:
            return [f for o in self._latest.values() for f in o.findings]

    def run_cycle(self, agent: Any, backend: NvmlBackend | None) -> None:
        """One round of every step on the agent's current GPUs (public for tests and tools)."""
        config = agent.config
        runner = DiagRunner(config.diag, state_dir=default_state_dir(config), backend=backend, python=self._python)
        gpus = list(agent.gpus)
        for diag, args in self._steps:
            if self._stop.is_set() or not gpus:
                break
            extra: list[str] = []
            if diag == "sdc":
                extra = ["--golden-dir", str(default_golden_dir(config)), "--node", config.node_name]
            outcome = runner.run(diag, [*args, *extra], gpus=gpus, timeout_s=config.diag.timeout_s)
            if outcome.status not in ("ok", "skipped"):
                log.warning("periodic %s %s: %s", diag, outcome.status, outcome.reason)
            with self._lock:
                self._latest[diag] = outcome
                if outcome.status != "skipped":
                    self._measured[diag] = outcome
                    self._finished_at[diag] = time.time()
        self.cycles += 1
        if self._on_findings is not None:
            try:
                self._on_findings(self.findings())
            except Exception:
                log.exception("diagnostics findings callback failed")

    def _loop(self, agent: Any) -> None:
        backend = self._backend_factory()
        if backend is None:
            return
        try:
            while not self._stop.is_set():
                try:
                    self.run_cycle(agent, backend)
                except Exception:  # a broken cycle must never take the agent down
                    log.exception("periodic diagnostics cycle failed")
                self._stop.wait(agent.config.diag.interval_s)
        finally:
            backend.shutdown()
