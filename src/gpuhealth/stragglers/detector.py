"""The straggler detector: one implementation for offline triage, the flight-recorder path and the
coordinator's online feed.

Per step, each rank's value (larger = slower: compute seconds, or for flight-recorder durations the
time it did not spend waiting) is compared with the median of the *other* ranks in that step — as a
log ratio (``relative``) or, for durations without start times, as a difference in seconds. Whole-
job slowdowns (a checkpoint, a long batch) move every rank and cancel here. The per-step comparisons
of the last ``history`` steps sit in a ring buffer (ranks × steps, float32: a window is one slice).

Every few steps the detector evaluates windows of the last 8, 16, … 256 steps at once for all ranks
(:mod:`gpuhealth.stragglers.stats`): trimmed mean, standard error, persistence. A rank *enters* a
straggler episode when, in some window, it is slower than the others by at least ``min_ratio`` with
a z score that stays significant after dividing the false-alarm budget by ranks × windows; it
*leaves* only on clear recovery. Onset and recovery steps come from a change-point search on the
rank's own series. See docs/stragglers.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gpuhealth.model import Action, Entity, Finding, Severity, StepRecord
from gpuhealth.stragglers.config import StragglerConfig
from gpuhealth.stragglers.stats import (
    change_point,
    leave_one_out_median,
    noise_sigma,
    trimmed_se_from_sigma,
    trimmed_window,
    z_for,
)
from gpuhealth.stragglers.trend import JobTrend

SOURCE = "stragglers"
CODE = "rank.straggler"
_MAX_VALUES = 1 << 24  # ring buffer cap: 64 MiB of float32 for the biggest jobs
_MEDIAN = "median of the other ranks"
_FASTEST = "fastest quarter of the ranks"
_RECENT = 64  # steps an active episode's numbers are taken over
# Below this many ranks the "fastest quarter" is the fastest rank: it is compared through each rank's level in
# the step (log compute − the step's median), not through the leave-one-out ratios, which with 3–7 ranks
# mix the ranks being compared into each other's reference.
_SMALL_JOB = 8
_SMALL_JOB_FASTEST_MIN_WINDOW = 16  # steps: the comparison with the fastest rank needs this many (spikes)


@dataclass(slots=True)
class _Episode:
    rank: int
    onset_step: int
    onset_pos: int  # closed-step position of the onset (windows for recovery stay inside the episode)
    z: float
    window: int
    compared_with: str
    worst: float  # largest window excess seen (log ratio, or seconds)
    offset: float = 0.0  # the reference against the median reference: the fastest quarter's (≤ 0), or 0
    level: bool = False  # measured on the step-level series (small jobs against their fastest rank)
    active: bool = True
    recovered_step: int | None = None
    recovered_pos: int | None = None
    reported_ratio: float = 0.0
    finding: Finding | None = None


@dataclass(slots=True)
class _Pending:
    values: np.ndarray
    walls: np.ndarray
    count: int = 0


@dataclass(slots=True)
class _Candidate:
    z: float
    window: int
    excess: float
    compared_with: str
    offset: float = 0.0
    level: bool = False


@dataclass(slots=True)
class _Window:
    loc: np.ndarray
    se: np.ndarray
    enough: np.ndarray
    fastest: float = 0.0  # the fastest quarter's location (0: not compared)
    candidates: dict[int, _Candidate] = field(default_factory=dict)
    # small jobs: each rank's level in the window, the median of the other ranks' levels, and the fastest
    # rank's level (None: not computed)
    level_loc: np.ndarray | None = None
    level_se: np.ndarray | None = None
    level_ref: np.ndarray | None = None
    level_fastest: float | None = None


class StragglerDetector:
    """Online detector with bounded memory (``history`` steps × ranks, plus up to
    ``max_pending_steps`` steps waiting for late ranks). ``add``/``add_value``/``add_batch``/
    ``add_steps`` return the findings that are new or changed: a rank becoming a straggler, its
    slowdown changing by more than 20 %, or it recovering (severity INFO, ``evidence.active``
    False); ``job.slowdown`` likewise."""

    def __init__(self, config: StragglerConfig | None = None, *, job_id: str = "", world_size: int | None = None,
                 source_label: str = "step records", unit: str = "step", relative: bool = True,
                 small_job_fastest: bool = True) -> None:
        self.config = config or StragglerConfig()
        self.job_id = job_id
        self.world_size = world_size
        self.source_label = source_label
        self.unit = unit
        self.relative = relative  # False: values are seconds compared by difference (no step to divide by)
        # 3–7 ranks: also compare with the fastest rank when the median is pulled up (off for flight-recorder
        # durations: pipeline stages reach the collectives later stage by stage, by design)
        self.small_job_fastest = small_job_fastest
        # (rank, step) -> display name: flight-recorder steps are named by each rank's own collectives
        self.label_of: Callable[[int, int], str] | None = None
        # column -> the rank it is (offline paths give each rank seen one column: sparse rank ids of a
        # huge job would otherwise size every row); None: the column is the rank
        self.rank_ids: Sequence[int] | None = None
        self.skipped_no_split = 0  # records with neither compute nor wait (wall alone says nothing)
        self._width = 0
        self._cap = 0
        self._ring = np.zeros((0, 0), np.float32)
        # small jobs (relative mode): each rank's log compute minus the step's median log compute
        self._level: np.ndarray | None = None
        self._ring_steps = np.zeros(0, np.int64)
        self._centre = np.zeros(0)
        # per step, the median of the other ranks for the slowest rank: a straggler's excess is measured
        # against the others (with two ranks the job's median is halfway to the straggler itself)
        self._others = np.zeros(0)
        self._wall = np.zeros(0)
        self._count = 0
        self._seen = np.zeros(0, bool)
        self._pending: dict[int, _Pending] = {}
        self._last_closed = -1
        self._episodes: dict[int, _Episode] = {}
        self._scores: np.ndarray | None = None
        self._trend: JobTrend | None = None

    # ------------------------------------------------------------------------------------ ingest

    def add(self, record: StepRecord) -> list[Finding]:
        value = compute_of(record)
        if value is None:
            self.skipped_no_split += 1
            return []
        if not self.job_id:
            self.job_id = record.job_id
        return self.add_value(record.rank, record.step, value, record.wall_s)

    def add_value(self, rank: int, step: int, value: float, wall_s: float | None = None) -> list[Finding]:
        """Feed one (rank, step) measurement where larger means slower."""
        if step <= self._last_closed or rank < 0 or not math.isfinite(value) or (self.relative and value <= 0):
            return []
        self._ensure_width(rank + 1)
        self._seen[rank] = True
        p = self._pending_step(step)
        if math.isnan(p.values[rank]):
            p.count += 1
        p.values[rank] = value
        if wall_s is not None:
            p.walls[rank] = wall_s
        return self._close_ready()

    def add_batch(self, ranks: Sequence[int] | np.ndarray, steps: Sequence[int] | np.ndarray,
                  values: Sequence[float] | np.ndarray, walls: Sequence[float] | np.ndarray | None = None,
                  ) -> list[Finding]:
        """Feed many (rank, step, value[, wall]) at once (the coordinator's columnar batches)."""
        r = np.asarray(ranks, np.int64)
        s = np.asarray(steps, np.int64)
        v = np.asarray(values, np.float64)
        w = np.full(len(v), np.nan) if walls is None else np.asarray(walls, np.float64)
        ok = np.isfinite(v) & (r >= 0) & (s > self._last_closed)
        if self.relative:
            ok &= v > 0
        if not ok.all():
            r, s, v, w = r[ok], s[ok], v[ok], w[ok]
        if not len(r):
            return []
        self._ensure_width(int(r.max()) + 1)
        self._seen[r] = True
        order = np.argsort(s, kind="stable")
        uniq, starts = np.unique(s[order], return_index=True)
        bounds = [*starts.tolist(), len(order)]
        for i, step in enumerate(uniq.tolist()):
            idx = order[bounds[i]:bounds[i + 1]]
            p = self._pending_step(step)
            rr = r[idx]
            p.count += int(np.isnan(p.values[rr]).sum())
            p.values[rr] = v[idx]
            p.walls[rr] = w[idx]
        return self._close_ready()

    def add_steps(self, steps: Sequence[int] | np.ndarray, values: np.ndarray,
                  walls: np.ndarray | None = None) -> list[Finding]:
        """Judge whole steps at once: ``values[i, rank]`` (NaN = no value) for ``steps[i]``, in
        increasing step order (offline triage and flight-recorder durations)."""
        if values.ndim != 2 or values.shape[0] != len(steps):
            raise ValueError("values must be steps × ranks")
        self._ensure_width(values.shape[1])
        self._seen[: values.shape[1]] |= np.isfinite(values).any(axis=0)
        out: list[Finding] = []
        for i, step in enumerate(np.asarray(steps, np.int64).tolist()):
            if step <= self._last_closed:
                continue
            out += self._close(step, values[i], None if walls is None else walls[i])
        return out

    def flush(self) -> list[Finding]:
        """Judge every pending step and evaluate every window now (end of a batch)."""
        out: list[Finding] = []
        for step in sorted(self._pending):
            p = self._pending.pop(step)
            out += self._close(step, p.values, p.walls, evaluate=False)
        return out + self._evaluate(force=True)

    def resume(self, findings: Iterable[Finding]) -> None:
        """Continue open episodes known from before a restart (the coordinator's store): those ranks
        stay stragglers, with their onset, until clear recovery is seen in new data."""
        for f in findings:
            if f.code != CODE or not f.evidence.get("active", True):
                continue
            rank = int(f.evidence.get("rank", f.entity.id))
            ep = self._episodes.get(rank)
            onset = f.evidence.get("onset_step")
            onset_step = int(onset) if isinstance(onset, int | float) else self._last_closed
            if ep is not None and ep.active:
                ep.onset_step = min(ep.onset_step, onset_step)
                continue
            ratio = f.evidence.get("ratio_to_median")
            excess = f.evidence.get("excess_s")
            if self.relative:
                worst = math.log(float(ratio)) if isinstance(ratio, int | float) and ratio > 0 else 0.0
            else:
                worst = float(excess) if isinstance(excess, int | float) else 0.0
            self._ensure_width(rank + 1)
            self._episodes[rank] = _Episode(rank, onset_step, self._count, float(f.evidence.get("z") or 0.0),
                                            int(f.evidence.get("window") or 0),
                                            str(f.evidence.get("compared_with") or _MEDIAN), worst,
                                            reported_ratio=float(ratio) if isinstance(ratio, int | float) else 0.0,
                                            finding=f)

    # --------------------------------------------------------------------------------- questions

    def active_findings(self) -> list[Finding]:
        """Current ``rank.straggler`` findings (ranks in an open episode)."""
        return _joint([ep.finding for _, ep in sorted(self._episodes.items()) if ep.active and ep.finding is not None])

    def slowdown(self) -> Finding | None:
        """The whole job's open slowdown (``job.slowdown``, ``evidence.active``), else None."""
        f = self._trend.finding if self._trend is not None else None
        return f if f is not None and f.evidence.get("active") else None

    def findings(self) -> list[Finding]:
        """The latest episode of every rank that had one (``evidence.active`` False if it recovered),
        then the latest ``job.slowdown`` if the whole job slowed down."""
        out = _joint([ep.finding for _, ep in sorted(self._episodes.items()) if ep.finding is not None])
        if self._trend is not None and self._trend.finding is not None:
            out.append(self._trend.finding)
        return out

    def scores(self, limit: int | None = None) -> dict[int, float]:
        """Per-rank slowness over the last evaluated window: ≈ compute / the other ranks' median
        (1.0 typical); in seconds of lateness for durations without start times. ``limit``: only
        the slowest ranks."""
        if self._scores is None:
            return {}
        loc = self._scores
        ranks = np.flatnonzero(np.isfinite(loc))
        if limit is not None and len(ranks) > limit:
            ranks = ranks[np.argsort(-loc[ranks], kind="stable")[:limit]]
        vals = np.exp(loc[ranks]) if self.relative else loc[ranks]
        return {int(r): round(float(v), 4) for r, v in zip(ranks, vals, strict=True)}

    # ---------------------------------------------------------------------------------- storage

    def _ensure_width(self, width: int) -> None:
        if width <= self._width:
            return
        width = max(width, self.world_size or 0)
        cap = max(16, min(self.config.history, _MAX_VALUES // width))
        ring = np.full((width, cap), np.nan, np.float32)
        steps = np.zeros(cap, np.int64)
        centre = np.full(cap, np.nan)
        others = np.full(cap, np.nan)
        wall = np.full(cap, np.nan)
        keep = min(self._count, self._cap, cap)
        if keep:
            old = np.arange(self._count - keep, self._count)
            ring[: self._width, old % cap] = self._ring[:, old % self._cap]
            steps[old % cap] = self._ring_steps[old % self._cap]
            centre[old % cap] = self._centre[old % self._cap]
            others[old % cap] = self._others[old % self._cap]
            wall[old % cap] = self._wall[old % self._cap]
        level = None
        if self.relative and self.small_job_fastest and width < _SMALL_JOB:
            level = np.full((width, cap), np.nan, np.float32)
            if keep and self._level is not None:
                level[: self._width, old % cap] = self._level[:, old % self._cap]
        self._ring, self._ring_steps, self._centre, self._wall = ring, steps, centre, wall
        self._level = level
        self._others = others
        seen = np.zeros(width, bool)
        seen[: self._width] = self._seen
        self._seen = seen
        for p in self._pending.values():
            p.values = np.concatenate((p.values, np.full(width - len(p.values), np.nan)))
            p.walls = np.concatenate((p.walls, np.full(width - len(p.walls), np.nan)))
        if self._trend is None and self.relative:
            self._trend = JobTrend(self.config, cap, self.job_id)
        if self._scores is not None:
            self._scores = np.concatenate((self._scores, np.full(width - len(self._scores), np.nan)))
        self._width, self._cap = width, cap

    def _pending_step(self, step: int) -> _Pending:
        p = self._pending.get(step)
        if p is None:
            p = self._pending[step] = _Pending(np.full(self._width, np.nan), np.full(self._width, np.nan))
        return p

    def _close_ready(self) -> list[Finding]:
        cfg = self.config
        expected = self.world_size or int(self._seen.sum())
        out: list[Finding] = []
        # Judge complete steps in order; steps left behind by a much newer one are judged as they are.
        while self._pending:
            first = min(self._pending)
            p = self._pending[first]
            complete = p.count >= expected
            overflow = len(self._pending) > cfg.max_pending_steps
            stale = max(self._pending) - first >= 2 and p.count >= max(cfg.min_ranks, expected - 1)
            if not (complete or overflow or stale):
                break
            del self._pending[first]
            out += self._close(first, p.values, p.walls)
        return out

    def _close(self, step: int, values: np.ndarray, walls: np.ndarray | None, evaluate: bool = True,
               ) -> list[Finding]:
        self._last_closed = max(self._last_closed, step)
        x = np.asarray(values, np.float64)
        valid = np.isfinite(x) & (x > 0) if self.relative else np.isfinite(x)
        if int(valid.sum()) < self.config.min_ranks:
            return []
        if self.relative:
            lx = np.where(valid, np.log(np.where(valid, x, 1.0)), np.nan)
            loo = leave_one_out_median(lx)
            diff = lx - loo
            centre_log = float(np.median(lx[valid]))
            centre = math.exp(centre_log)
            others = math.exp(float(np.nanmin(loo)))  # the slowest rank's: the lowest leave-one-out median
        else:
            loo = leave_one_out_median(np.where(valid, x, np.nan))
            diff = x - loo
            centre = -float(np.median(x[valid]))  # the other ranks' typical wait
            others = -float(np.nanmin(loo))
        slot = self._count % self._cap
        self._ring[: len(diff), slot] = diff
        self._ring[len(diff):, slot] = np.nan
        if self._level is not None:
            self._level[: len(diff), slot] = lx - centre_log
            self._level[len(diff):, slot] = np.nan
        self._ring_steps[slot] = step
        self._centre[slot] = centre
        self._others[slot] = others
        wall = np.nan
        if walls is not None:
            w = np.asarray(walls, np.float64)
            w = w[np.isfinite(w)]
            if len(w):
                wall = float(np.median(w))
        self._wall[slot] = wall
        self._count += 1
        if self._trend is not None:
            self._trend.add(step, centre_log)
        if evaluate and self._count % self.config.eval_every == 0:
            return self._evaluate()
        return []

    def _block(self, n: int, ring: np.ndarray | None = None) -> np.ndarray:
        """The last ``n`` closed steps, ranks × steps (time order): a view unless the ring wraps."""
        ring = self._ring if ring is None else ring
        n = min(n, self._count, self._cap)
        end = self._count % self._cap or self._cap
        if end >= n:
            return ring[:, end - n:end]
        return np.concatenate((ring[:, self._cap - (n - end):], ring[:, :end]), axis=1)

    # ------------------------------------------------------------------------------- evaluation

    def _evaluate(self, force: bool = False) -> list[Finding]:
        cfg = self.config
        avail = min(self._count, self._cap)
        lengths = [w for w in cfg.windows if w <= avail]
        if not lengths:
            return []  # fewer steps than the shortest window: too few to tell noise from a straggler
        if avail < self._cap and avail > lengths[-1] and avail not in cfg.windows:
            lengths.append(avail)  # a short run: also one window over all of it
        due = [w for w in lengths if force or self._count % max(cfg.eval_every, w // 8) == 0]
        if not due:
            return []
        n_ranks = max(1, int(self._seen.sum()))
        z_crit = z_for(cfg.alpha / (n_ranks * len(cfg.windows)))
        floor = math.log(cfg.min_ratio) if self.relative else cfg.fr_min_lateness_s
        # The job's typical step-to-step noise: a floor under each rank's own standard error, which
        # can be small by chance in a short window.
        per_rank = noise_sigma(self._block(min(avail, 128)))
        sigma = float(np.nanmedian(per_rank)) if np.isfinite(per_rank).any() else 0.0
        found: dict[int, _Candidate] = {}
        recovered: dict[int, int] = {}
        active = {r: ep for r, ep in self._episodes.items() if ep.active}
        score_window = 16 if 16 in due else min(due)  # scores say how slow each rank is now
        for w in due:
            win = self._window(w, sigma, z_crit, floor, n_ranks)
            if w == score_window:
                self._scores = win.loc
            for r, cand in win.candidates.items():
                if r in active or (r in found and cand.z <= found[r].z):
                    continue
                prev = self._episodes.get(r)
                if prev is not None and prev.recovered_pos is not None and self._count - prev.recovered_pos < w:
                    continue  # the window reaches back into the rank's last episode
                found[r] = cand
            for r, ep in active.items():
                if r in recovered or self._count - ep.onset_pos < w or not win.enough[r]:
                    continue  # only windows inside the episode can show recovery
                if ep.level:
                    ref_level = win.level_fastest if ep.compared_with == _FASTEST else (
                        float(win.level_ref[r]) if win.level_ref is not None else None)
                    if win.level_loc is None or win.level_se is None or ref_level is None:
                        continue
                    loc, se = float(win.level_loc[r]) - ref_level, float(win.level_se[r])
                else:
                    ref = win.fastest if ep.compared_with == _FASTEST else 0.0
                    loc, se = float(win.loc[r]) - ref, float(win.se[r])
                if not (math.isfinite(loc) and math.isfinite(se)):
                    continue
                if loc >= floor:
                    ep.worst = max(ep.worst, loc)
                if loc + cfg.exit_z * se < max(floor / 2, ep.worst / 3):  # well below where it entered
                    recovered[r] = w
        out: list[Finding] = []
        for r, cand in sorted(found.items()):
            out.append(self._enter(r, cand))
        for r, ep in sorted(active.items()):
            if r in recovered:
                out.append(self._leave(ep, recovered[r]))
            else:
                f = self._refresh(ep)
                if f is not None:
                    out.append(f)
        if self._trend is not None:
            job = self._trend.evaluate(z_for(cfg.alpha))
            if job is not None:
                out.append(job)
        return out

    def _window(self, w: int, sigma: float, z_crit: float, floor: float, n_ranks: int) -> _Window:
        cfg = self.config
        if self._level is not None and 3 <= n_ranks < _SMALL_JOB:
            return self._small_job_window(w, sigma, z_crit, floor)
        loc, se_own, k, srt = trimmed_window(self._block(w), cfg.trim)
        se = np.fmax(se_own, trimmed_se_from_sigma(np.full(len(k), sigma), k))
        enough = (k >= max(4, int(0.6 * w))) & np.isfinite(loc) & np.isfinite(se)
        win = _Window(loc, se, enough)
        with np.errstate(invalid="ignore", divide="ignore"):
            z = loc / se
            frac = (srt > (loc / 2)[:, None]).sum(axis=1) / np.maximum(k, 1)
            cand = enough & (z >= z_crit) & (loc >= floor) & (frac >= cfg.min_slow_fraction)
        for r in np.flatnonzero(cand).tolist():
            win.candidates[r] = _Candidate(float(z[r]), w, float(loc[r]), _MEDIAN)
        # Against the fastest ranks: only when the median itself is pulled up (most ranks slow: a
        # node or a switch holding up the rest), i.e. the fastest quarter is clearly faster than the
        # median. On a healthy job the gap is ~0.7 standard errors, never 3.
        if n_ranks >= 8 and int(enough.sum()) >= 8:
            good = loc[enough]
            ref = float(np.quantile(good, 0.25))
            typical_se = float(np.median(se[enough]))
            if float(np.median(good)) - ref >= max(floor, 3 * typical_se):
                with np.errstate(invalid="ignore", divide="ignore"):
                    excess = loc - ref
                    zf = excess / se
                    fracf = (srt > (ref + excess / 2)[:, None]).sum(axis=1) / np.maximum(k, 1)
                    candf = enough & ~cand & (zf >= z_crit) & (excess >= floor) & (fracf >= cfg.min_slow_fraction)
                win.fastest = ref
                for r in np.flatnonzero(candf).tolist():
                    win.candidates[r] = _Candidate(float(zf[r]), w, float(excess[r]), _FASTEST, ref)
        return win

    def _small_job_window(self, w: int, sigma: float, z_crit: float, floor: float) -> _Window:
        """3–7 ranks. Each rank's *level* in a step (log compute − the step's median) is averaged over the
        window first, and only then compared with the other ranks' levels: per step, the median of two or
        three other ranks is biased toward the faster of them (with one fast rank among four it is the min of
        the two others), which a window's average turns into a false straggler.

        * against the median of the other ranks' levels, as in larger jobs;
        * against the fastest rank, when the median is clearly pulled up and the slower ranks do not agree on
          one pace (1×, 1.1×, 1.2×, 1.3× among four: the 1.1× rank is below the median of the other three).
          When they agree (1×, 1×, 1× and one 0.9×), the fast rank is the odd one out and nobody is named."""
        assert self._level is not None
        cfg = self.config
        lv, se_own, k, srt = trimmed_window(self._block(w, self._level), cfg.trim)
        se = np.fmax(se_own, trimmed_se_from_sigma(np.full(len(k), sigma), k))
        enough = (k >= max(4, int(0.6 * w))) & np.isfinite(lv) & np.isfinite(se)
        others = np.full(len(lv), np.nan)
        idx = np.flatnonzero(enough)
        for r in idx.tolist():
            # Two other ranks have no median, only a mean, which one fast rank drags down: with three ranks
            # the reference is the middle one's level (the pace two of the three keep).
            rest = lv[idx] if len(idx) == 3 else lv[idx[idx != r]]
            if len(rest):
                others[r] = float(np.median(rest))
        loc = lv - others
        win = _Window(loc, se, enough & np.isfinite(loc), level_loc=lv, level_se=se, level_ref=others)
        if len(idx) < 3:
            return win
        with np.errstate(invalid="ignore", divide="ignore"):
            z = loc / se
            frac = (srt > (others + loc / 2)[:, None]).sum(axis=1) / np.maximum(k, 1)
            cand = win.enough & (z >= z_crit) & (loc >= floor) & (frac >= cfg.min_slow_fraction)
        for r in np.flatnonzero(cand).tolist():
            win.candidates[r] = _Candidate(float(z[r]), w, float(loc[r]), _MEDIAN, float(others[r]), level=True)
        good = np.sort(lv[idx])
        ref = float(good[0])
        win.level_fastest = ref
        if w < _SMALL_JOB_FASTEST_MIN_WINDOW:
            return win  # two spikes in a row on one rank survive an 8-step trimmed mean and fake a spread
        typical_se = float(np.median(se[idx]))
        if float(np.median(good)) - ref < max(floor, 3 * typical_se):
            return win  # the median is where most ranks are: the comparison above is the right one
        # (a difference of two ranks' window levels: its standard error is √2 times one level's)
        if float(good[-1] - good[1]) < max(floor, z_crit * math.sqrt(2.0) * typical_se):
            return win  # the others agree on one pace (no more spread than noise): the fast rank is the odd one
        with np.errstate(invalid="ignore", divide="ignore"):
            excess = lv - ref
            zf = excess / se
            fracf = (srt > (ref + excess / 2)[:, None]).sum(axis=1) / np.maximum(k, 1)
            candf = enough & ~cand & (zf >= z_crit) & (excess >= floor) & (fracf >= cfg.min_slow_fraction)
        for r in np.flatnonzero(candf).tolist():
            win.candidates[r] = _Candidate(float(zf[r]), w, float(excess[r]), _FASTEST, ref, level=True)
        return win

    # ---------------------------------------------------------------------------------- episodes

    def _series(self, rank: int, start_pos: int, end_pos: int, level: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(positions, values) of ``rank`` over [start_pos, end_pos) still in the ring, finite only (``level``:
        the small-job level series; empty once the job grew past it)."""
        ring = self._level if level else self._ring
        if ring is None:
            return np.zeros(0, np.int64), np.zeros(0)
        start = max(start_pos, self._count - self._cap, 0)
        pos = np.arange(start, max(start, end_pos))
        vals = ring[rank, pos % self._cap].astype(np.float64) if len(pos) else np.zeros(0)
        ok = np.isfinite(vals)
        return pos[ok], vals[ok]

    def _enter(self, rank: int, cand: _Candidate) -> Finding:
        prev = self._episodes.get(rank)
        start = prev.recovered_pos if prev is not None and prev.recovered_pos is not None else 0
        pos, vals = self._series(rank, start, self._count, cand.level)
        onset_pos = int(pos[0]) if len(pos) else self._count - 1
        if len(pos) >= 4:
            idx, strength = change_point(vals)
            if strength >= 3.0:
                onset_pos = int(pos[idx])
        ep = _Episode(rank, int(self._ring_steps[onset_pos % self._cap]), onset_pos, cand.z, cand.window,
                      cand.compared_with, cand.excess, cand.offset, cand.level)
        self._episodes[rank] = ep
        ep.finding = self._finding(ep)
        ep.reported_ratio = float(ep.finding.evidence["ratio_to_median"])
        return ep.finding

    def _leave(self, ep: _Episode, window: int) -> Finding:
        pos, vals = self._series(ep.rank, ep.onset_pos, self._count, ep.level)
        rec_pos = self._count - window
        if len(pos) >= 4:
            idx, strength = change_point(vals, rising=False)
            if strength >= 3.0:
                rec_pos = int(pos[idx])
        ep.active = False
        ep.recovered_pos = rec_pos
        ep.recovered_step = int(self._ring_steps[rec_pos % self._cap])
        ep.finding = self._finding(ep)
        return ep.finding

    def _refresh(self, ep: _Episode) -> Finding | None:
        """Update an active episode's numbers; report it again when its slowdown moved by > 20 %."""
        ep.finding = self._finding(ep)
        ratio = float(ep.finding.evidence["ratio_to_median"])
        if ep.reported_ratio and abs(ratio / ep.reported_ratio - 1.0) > 0.2:
            ep.reported_ratio = ratio
            return ep.finding
        return None

    def _rank(self, column: int) -> int:
        return column if self.rank_ids is None else int(self.rank_ids[column])

    def _label(self, step: int | None, column: int) -> str | int | None:
        if step is None or self.label_of is None:
            return step
        return self.label_of(self._rank(column), step)

    def _finding(self, ep: _Episode) -> Finding:
        # An active episode is described by its recent steps (how slow it is now), a finished one whole.
        if ep.active:
            start, end = max(ep.onset_pos, self._count - _RECENT), self._count
        else:
            start, end = ep.onset_pos, ep.recovered_pos if ep.recovered_pos is not None else self._count
        pos, own_vals = self._series(ep.rank, start, end, ep.level)
        vals = own_vals - ep.offset  # against the reference it was named against
        if len(pos) < 2 and ep.finding is not None and ep.active:
            return ep.finding  # a resumed episode without new data yet: keep what the store had
        slots = pos % self._cap if len(pos) else np.zeros(0, np.int64)
        # The reference compute its excess is measured against: the other ranks' median, or (small jobs, level
        # series) the fastest rank's level in each step.
        centre = _trimmed(self._centre[slots] * math.exp(ep.offset)) if ep.level else _trimmed(self._others[slots])
        walls = self._wall[slots]
        walls = walls[np.isfinite(walls)]
        if self.relative:
            excess_ratio = _trimmed(np.expm1(vals)) if len(vals) else math.expm1(ep.worst)
            ratio = 1.0 + excess_ratio
            excess_s = excess_ratio * centre if math.isfinite(centre) else float("nan")
            wall = float(np.median(walls)) if len(walls) else centre * ratio
            cost = excess_s / wall if wall and math.isfinite(excess_s) and wall > 0 else None
        else:
            excess_s = _trimmed(vals) if len(vals) else ep.worst
            ratio = 1.0 + excess_s / centre if math.isfinite(centre) and centre > 0 else float("nan")
            cost = None
        last_step = int(self._ring_steps[(self._count - 1) % self._cap]) if self._count else None
        unit = self.unit
        evidence: dict[str, object] = {
            "rank": self._rank(ep.rank), "active": ep.active,
            "ratio_to_median": round(ratio, 3) if math.isfinite(ratio) else None,
            "excess_s": round(excess_s, 6) if math.isfinite(excess_s) else None,
            "cost_share": round(cost, 3) if cost is not None else None,
            "z": round(min(ep.z, 999.0), 1),  # noiseless data make z unbounded (and JSON has no inf)
            "window": ep.window, "compared_with": ep.compared_with,
            "measure": self.source_label, f"since_{unit}": self._label(ep.onset_step, ep.rank),
            "onset_step": ep.onset_step,
            "recovered_step": ep.recovered_step, f"last_{unit}": self._label(last_step, ep.rank),
        }
        own = self._own_history(ep, pos, own_vals, slots)
        if own is not None:
            evidence["vs_own_history"] = round(own, 3)
        if self.job_id:
            evidence["job_id"] = self.job_id
        severity, message, action = self._words(ep, ratio, excess_s, cost)
        return Finding(CODE, severity, Entity.rank(self._rank(ep.rank)), message, action, evidence, SOURCE)

    def _own_history(self, ep: _Episode, pos: np.ndarray, vals: np.ndarray, slots: np.ndarray) -> float | None:
        """The rank's own compute in the episode against its own before the onset (relative mode)."""
        if not self.relative or len(vals) < 4:
            return None
        prev = self._episodes.get(ep.rank)
        start = prev.recovered_pos if prev is not None and prev is not ep and prev.recovered_pos else 0
        bpos, bvals = self._series(ep.rank, start, ep.onset_pos, ep.level)
        if len(bvals) < 8:
            return None
        before = np.median(bvals + np.log(self._centre[bpos % self._cap]))
        during = np.median(vals + np.log(self._centre[slots]))
        return float(np.exp(during - before))

    def _words(self, ep: _Episode, ratio: float, excess_s: float, cost: float | None,
               ) -> tuple[Severity, str, Action]:
        unit = self.unit
        rank = self._rank(ep.rank)
        since = self._label(ep.onset_step, ep.rank)
        if not ep.active:
            msg = (f"rank {rank} is no longer a straggler: back in line with the other ranks from {unit} "
                   f"{self._label(ep.recovered_step, ep.rank)} (slow since {unit} {since})")
            return Severity.INFO, msg, Action.NONE
        if not self.relative:
            msg = (f"rank {rank} is a straggler: it reaches the collectives {excess_s * 1000:.1f} ms after the "
                   f"other ranks (its collectives take the least time: it waits least) since {since}")
            return Severity.WARNING, msg, Action.CHECK_JOB
        against = "the fastest ranks" if ep.compared_with == _FASTEST else "the median of the other ranks"
        msg = (f"rank {rank} is a straggler: {ratio:.2f}× {against} ({excess_s * 1000:.1f} ms more compute per "
               f"{unit}) since {unit} {since}")
        if cost is not None:
            msg += f"; it costs the job {cost:.0%} of its step time (the other ranks wait for it)"
        critical = cost is not None and cost >= self.config.critical_cost_share
        return (Severity.CRITICAL if critical else Severity.WARNING), msg, Action.CHECK_JOB


def _joint(findings: list[Finding]) -> list[Finding]:
    """Ranks straggling at the same time are one fault: the job waits for the slowest of them, and mending
    one leaves the next slowest holding it up. Each active one carries the severity of the worst, with the
    others named in ``evidence.straggling_with``."""
    active = [f for f in findings if f.evidence.get("active") is not False and f.severity > Severity.INFO]
    if len(active) < 2:
        return findings
    worst = max(f.severity for f in active)
    ranks = sorted(_rank_of(f) for f in active)
    chosen = {id(f) for f in active}
    out = []
    for f in findings:
        if id(f) in chosen:
            me = _rank_of(f)
            f = replace(f, severity=worst, evidence={**f.evidence, "straggling_with": [r for r in ranks if r != me]})
        out.append(f)
    return out


def _rank_of(f: Finding) -> int:
    rank = f.evidence["rank"]
    return rank if isinstance(rank, int) else int(f.entity.id)


def _trimmed(values: np.ndarray, trim: float = 0.2) -> float:
    v = np.sort(values[np.isfinite(values)])
    if not len(v):
        return float("nan")
    g = int(trim * len(v))
    return float(v[g: len(v) - g].mean())


def compute_of(r: StepRecord) -> float | None:
    """The step's compute seconds: ``compute_s``, else what the step did not spend waiting."""
    if r.compute_s is not None:
        return r.compute_s
    if r.comm_wait_s is not None:
        return max(0.0, r.wall_s - r.comm_wait_s)
    return None
