"""Whole-job slowdown: the job's typical step compute against its own best pace.

Per-step normalisation cancels anything that slows every rank (a checkpoint, a longer batch, a
throttled fabric), so such slowdowns are never a straggler. They are still worth knowing about when
they last: this tracker compares the trimmed mean of the last ``job_window`` steps' cross-rank
median compute with the fastest such window seen so far, and reports ``job.slowdown`` (a warning,
about the job, not a rank) when it is ``job_slowdown_ratio`` slower with significance. Isolated slow
steps (checkpoints every N steps) are trimmed away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpuhealth.model import Action, Entity, EntityKind, Finding, Severity
from gpuhealth.stragglers.config import StragglerConfig
from gpuhealth.stragglers.stats import change_point, trimmed_window

CODE = "job.slowdown"
SOURCE = "stragglers"


@dataclass(slots=True)
class _Best:
    level: float
    se: float
    step: int


class JobTrend:
    def __init__(self, config: StragglerConfig, capacity: int, job_id: str = "") -> None:
        self.config = config
        self.job_id = job_id
        self._cap = max(capacity, config.job_window * 2)
        self._levels = np.full(self._cap, np.nan)
        self._steps = np.zeros(self._cap, np.int64)
        self._count = 0
        self._best: _Best | None = None
        self._active = False
        self._onset: int | None = None
        self._recovered: int | None = None
        self._ratio = 1.0
        self._recent_s = 0.0
        self.finding: Finding | None = None

    def add(self, step: int, level: float) -> None:
        """``level``: log of the step's cross-rank median compute (seconds)."""
        slot = self._count % self._cap
        self._levels[slot] = level
        self._steps[slot] = step
        self._count += 1

    def _series(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        n = min(n, self._count, self._cap)
        pos = np.arange(self._count - n, self._count) % self._cap
        return self._levels[pos], self._steps[pos]

    def evaluate(self, z_crit: float) -> Finding | None:
        """A new or ended whole-job slowdown, else None."""
        cfg = self.config
        w = cfg.job_window
        if self._count < w:
            return None
        levels, steps = self._series(w)
        loc_a, se_a, _, _ = trimmed_window(levels[None, :], cfg.trim)
        loc, se = float(loc_a[0]), float(se_a[0])
        if not math.isfinite(loc):
            return None
        if self._best is None or loc < self._best.level:
            self._best = _Best(loc, se if math.isfinite(se) else 0.0, int(steps[-1]))
        best = self._best
        excess = loc - best.level
        spread = math.hypot(se if math.isfinite(se) else 0.0, best.se) or 1e-12
        floor = math.log(cfg.job_slowdown_ratio)
        if not self._active and excess >= floor and excess / spread >= z_crit:
            self._active = True
            self._recovered = None
            long_levels, long_steps = self._series(self._cap)
            ok = np.isfinite(long_levels)
            idx, strength = change_point(long_levels[ok])
            self._onset = int(long_steps[ok][idx]) if strength >= 3.0 else int(long_steps[ok][0])
            self._ratio, self._recent_s = math.exp(excess), math.exp(loc)
            self.finding = self._finding()
            return self.finding
        if self._active:
            if excess + cfg.exit_z * spread < floor / 2:
                self._active = False
                self._recovered = int(steps[0])
                self.finding = self._finding()
                return self.finding
            if excess > math.log(self._ratio):
                self._ratio, self._recent_s = math.exp(excess), math.exp(loc)
                self.finding = self._finding()
        return None

    def _finding(self) -> Finding:
        assert self._best is not None
        base_s = math.exp(self._best.level)
        evidence: dict[str, object] = {
            "active": self._active, "ratio_to_history": round(self._ratio, 3), "since_step": self._onset,
            "onset_step": self._onset, "recovered_step": self._recovered, "baseline_step_compute_s": round(base_s, 6),
            "recent_step_compute_s": round(self._recent_s, 6), "baseline_at_step": self._best.step,
            "window": self.config.job_window, "measure": "cross-rank median compute per step",
        }
        if self.job_id:
            evidence["job_id"] = self.job_id
        entity = Entity(EntityKind.JOB, self.job_id or "job")
        if not self._active:
            msg = (f"the whole job is back to its earlier pace (slowdown from step {self._onset} ended at step "
                   f"{self._recovered})")
            return Finding(CODE, Severity.INFO, entity, msg, Action.NONE, evidence, SOURCE)
        msg = (f"the whole job is {self._ratio:.2f}× slower than its own best pace ({self._recent_s * 1000:.1f} ms of "
               f"compute per step vs {base_s * 1000:.1f} ms) since step {self._onset}: every rank slowed down "
               "together, so no rank is a straggler")
        return Finding(CODE, Severity.WARNING, entity, msg, Action.MONITOR, evidence, SOURCE)
