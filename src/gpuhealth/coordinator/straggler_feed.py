"""Feeds a job's columnar step batches into the pure online detector
(``gpuhealth.stragglers.StragglerDetector``) under a CPU budget.

Below ``budget_records_s`` rank-steps per second every step is judged. Above it (very large jobs),
only every ``stride``-th step is fed, so detection cost stays bounded while ingest keeps up; the
persistence window then spans ``stride`` × more steps of wall time, which the detection latency
benchmark reports.
"""

from __future__ import annotations

import math
import statistics

from gpuhealth.model import Finding
from gpuhealth.proto.convert import StepColumns
from gpuhealth.stragglers import StragglerConfig, StragglerDetector


class BudgetedStragglerFeed:
    def __init__(self, job_id: str, *, budget_records_s: float = 50_000.0, config: StragglerConfig | None = None,
                 rate_window_s: float = 2.0) -> None:
        self.detector = StragglerDetector(config=config or StragglerConfig(), job_id=job_id)
        self.budget = budget_records_s
        self.stride = 1
        self._active: dict[int, Finding] = {}
        self._last_value: dict[int, float] = {}
        self._window_records = 0
        self._window_start: float | None = None
        self._rate_window_s = rate_window_s
        # Whether a step is judged is decided once, when the step is first seen, so a stride change
        # never leaves a step fed by some ranks only (the detector would wait for the rest).
        self._sampled: dict[int, bool] = {}

    def set_world_size(self, world_size: int) -> None:
        if world_size > 0:
            self.detector.world_size = world_size

    def feed(self, cols: StepColumns, now: float | None = None) -> None:
        self._retune(len(cols), now)
        comp, comm = cols.compute_s, cols.comm_wait_s
        if comp is None and comm is None:
            return  # wall time alone cannot show a straggler
        n = len(cols)
        if n:
            # Without a world size the detector would judge a step as soon as its first rank reported
            # (it expects only the ranks seen so far): the highest rank seen bounds the world from below.
            lower = max(cols.rank) + 1
            if self.detector.world_size is None or self.detector.world_size < lower:
                self.detector.world_size = lower
        values: list[float] = comp if comp is not None else [math.nan] * n
        stride = self.stride
        add = self.detector.add_value
        last = self._last_value
        sampled = self._sampled
        for i in range(n):
            v = values[i]
            if v != v:  # NaN: derive compute from the wait when the hook measured only that
                if comm is None or comm[i] != comm[i]:
                    continue
                v = max(0.0, cols.wall_s[i] - comm[i])
            step = cols.step[i]
            take = sampled.get(step)
            if take is None:
                take = sampled[step] = step % stride == 0
                if len(sampled) > 4096:  # forget the oldest decisions (steps long judged)
                    for old in sorted(sampled)[:2048]:
                        del sampled[old]
            if not take:
                continue
            rank = cols.rank[i]
            last[rank] = v
            for f in add(rank, step, v):
                self._note(f)

    def _retune(self, n: int, now: float | None) -> None:
        if now is None:
            return
        if self._window_start is None:
            self._window_start = now
        self._window_records += n
        elapsed = now - self._window_start
        if elapsed >= self._rate_window_s:
            rate = self._window_records / elapsed
            self.stride = max(1, math.ceil(rate / self.budget)) if self.budget > 0 else 1
            self._window_start, self._window_records = now, 0

    def _note(self, f: Finding) -> None:
        rank = int(f.evidence.get("rank", f.entity.id))
        if f.evidence.get("active", True):
            self._active[rank] = f
        else:
            self._active.pop(rank, None)

    def evaluate(self) -> list[Finding]:
        return list(self._active.values())

    def scores(self) -> dict[int, float]:
        if not self._last_value:
            return {}
        med = statistics.median(self._last_value.values())
        if med <= 0:
            return {}
        return {r: v / med for r, v in self._last_value.items()}
