"""Straggler detection (pure): which rank makes a synchronous job slow, by how much, since when.

Wall step time cannot show a straggler — every rank waits at the collective, so wall times are
equal (MEASUREMENTS.md: 14.91 vs 14.92 ms). The signal is in *compute* time (or, equivalently,
collective wait: the straggler waits least). From flight-recorder ``duration_ms``
(TORCH_NCCL_ENABLE_TIMING=1) the straggler is the rank whose collectives take the LEAST time: it
arrives last and finds everyone else ready.

Per step (or per collective), each rank's value is compared with the cross-rank median: a rank is
"slow" in that step when it exceeds the median by ``min_ratio`` (relative), ``min_excess_s``
(absolute) and, with enough ranks, ``mad_z`` robust standard deviations (median absolute
deviation). A finding needs persistence: slow in at least ``persist`` of the last ``window``
steps. Its onset is the first step of that slow run. Healthy jitter (one slow step, a 5% wobble)
gives nothing.

:class:`StragglerDetector` is the online form (bounded memory: a few pending steps and a window
per rank); :func:`detect_stragglers` runs it over a finished list of records.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuhealth.model import Action, Entity, Finding, Severity, StepRecord

SOURCE = "stragglers"
CODE = "rank.straggler"


@dataclass(frozen=True, slots=True)
class StragglerConfig:
    min_ratio: float = 1.25  # slower than the median by ≥ 25 %…
    min_excess_s: float = 0.002  # …and by ≥ 2 ms (timer noise on small steps)
    mad_z: float = 5.0  # …and ≥ 5 robust sigmas when there are ≥ min_ranks_for_mad ranks
    min_ranks_for_mad: int = 5
    window: int = 8  # steps looked back over
    persist: int = 5  # slow steps within the window to call it persistent
    min_ranks: int = 2  # a step needs this many ranks to compare
    max_pending_steps: int = 64  # online: steps waiting for late ranks before being judged anyway
    critical_ratio: float = 1.75  # ≥ 1.75× the median → critical, else warning


@dataclass(slots=True)
class _RankState:
    flags: deque[tuple[int, bool, float, float]]  # (step, slow, ratio, excess_s)
    active: bool = False
    onset: int | None = None
    last_reported_ratio: float = 0.0
    worst_ratio: float = 0.0
    episodes: int = 0


@dataclass(slots=True)
class StragglerDetector:
    """Online detector. ``add(record)`` returns findings that are new or changed: a rank becoming a
    straggler, its slowdown changing by more than 20 %, or it recovering (severity INFO,
    ``evidence.active`` False). Memory stays bounded by ``max_pending_steps`` × ranks plus a
    ``window`` per rank."""

    config: StragglerConfig = field(default_factory=StragglerConfig)
    job_id: str = ""
    world_size: int | None = None  # when known, a step is judged as soon as every rank reported
    source_label: str = "step records"
    unit: str = "step"
    _pending: OrderedDict[int, dict[int, float]] = field(default_factory=OrderedDict)
    _ranks: dict[int, _RankState] = field(default_factory=dict)
    _last_judged: int = -1
    _seen_ranks: set[int] = field(default_factory=set)
    skipped_no_split: int = 0  # records with neither compute nor wait (wall alone says nothing)
    labels: dict[int, str] = field(default_factory=dict)  # step index -> display name (collectives)

    def add(self, record: StepRecord) -> list[Finding]:
        value = _compute_of(record)
        if value is None:
            self.skipped_no_split += 1
            return []
        if not self.job_id:
            self.job_id = record.job_id
        return self.add_value(record.rank, record.step, value)

    def add_value(self, rank: int, step: int, value: float) -> list[Finding]:
        """Feed one (rank, step) measurement where larger means slower."""
        if step <= self._last_judged:
            return []  # too late: that step was already judged
        self._seen_ranks.add(rank)
        self._pending.setdefault(step, {})[rank] = value
        out: list[Finding] = []
        expected = self.world_size or len(self._seen_ranks)
        # Judge complete steps in order; steps left behind by a much newer one are judged as they are.
        while self._pending:
            first_step, vals = next(iter(self._pending.items()))
            newest = next(reversed(self._pending))
            complete = len(vals) >= expected
            overflow = len(self._pending) > self.config.max_pending_steps
            stale = newest - first_step >= 2 and len(vals) >= max(self.config.min_ranks, expected - 1)
            if not (complete or overflow or stale):
                break
            self._pending.popitem(last=False)
            out += self._judge(first_step, vals)
        return out

    def judge_step(self, step: int, values: Mapping[int, float]) -> list[Finding]:
        """Judge one complete step (or collective) at once: {rank: value}. For batch callers that
        already grouped the values; steps must come in increasing order."""
        return self._judge(step, values)

    def flush(self) -> list[Finding]:
        """Judge every pending step (end of a batch)."""
        out: list[Finding] = []
        while self._pending:
            step, vals = self._pending.popitem(last=False)
            out += self._judge(step, vals)
        return out

    def scores(self) -> dict[int, float]:
        """Per-rank slowness score over the window: median of value / cross-rank median (1.0 typical)."""
        return {r: round(_lower_median(sorted(x[2] for x in st.flags)), 4) for r, st in self._ranks.items() if st.flags}

    def active_findings(self) -> list[Finding]:
        return [self._finding(r, st) for r, st in sorted(self._ranks.items()) if st.active]

    # ---------------------------------------------------------------------------------- internals

    def _judge(self, step: int, vals: Mapping[int, float]) -> list[Finding]:
        self._last_judged = max(self._last_judged, step)
        cfg = self.config
        if len(vals) < cfg.min_ranks:
            return []
        ordered = sorted(vals.values())
        med = _lower_median(ordered)
        mad = _lower_median(sorted(abs(v - med) for v in ordered)) * 1.4826
        use_mad = len(vals) >= cfg.min_ranks_for_mad
        out: list[Finding] = []
        for rank, v in vals.items():
            excess = v - med
            ratio = v / med if med > 0 else (float("inf") if v > 0 else 1.0)
            slow = ratio >= cfg.min_ratio and excess >= cfg.min_excess_s
            if slow and use_mad:
                slow = excess >= cfg.mad_z * max(mad, 0.01 * med)
            st = self._ranks.get(rank)
            if st is None:
                st = self._ranks[rank] = _RankState(flags=deque(maxlen=cfg.window))
            st.flags.append((step, slow, ratio, excess))
            f = self._update(rank, st)
            if f is not None:
                out.append(f)
        return out

    def _update(self, rank: int, st: _RankState) -> Finding | None:
        cfg = self.config
        slow_count = sum(1 for _, s, _, _ in st.flags if s)
        if not st.active and slow_count >= cfg.persist:
            st.active = True
            st.episodes += 1
            st.onset = _onset(st.flags)
            st.last_reported_ratio = self._ratio(st)
            st.worst_ratio = max(st.worst_ratio, st.last_reported_ratio)
            return self._finding(rank, st)
        if st.active and slow_count == 0 and len(st.flags) >= min(cfg.window, cfg.persist):
            st.active = False
            return self._finding(rank, st, recovered=True)
        if st.active:
            ratio = self._ratio(st)
            st.worst_ratio = max(st.worst_ratio, ratio)
            if st.last_reported_ratio and abs(ratio / st.last_reported_ratio - 1.0) > 0.2:
                st.last_reported_ratio = ratio
                return self._finding(rank, st)
        return None

    @staticmethod
    def _ratio(st: _RankState) -> float:
        slow = sorted(r for _, s, r, _ in st.flags if s)
        return _lower_median(slow) if slow else 1.0

    def _label(self, step: int | None) -> str:
        if step is None:
            return "?"
        return self.labels.get(step, str(step))

    def _finding(self, rank: int, st: _RankState, recovered: bool = False) -> Finding:
        slow = [(step, r, e) for step, s, r, e in st.flags if s]
        ratio = _lower_median(sorted(r for _, r, _ in slow)) if slow else 1.0
        excess = _lower_median(sorted(e for _, _, e in slow)) if slow else 0.0
        last_step = st.flags[-1][0] if st.flags else None
        unit = self.unit
        if recovered:
            msg = f"rank {rank} is no longer a straggler (back within range of the other ranks at {unit} {last_step})"
            sev = Severity.INFO
            action = Action.NONE
        elif unit == "collective":
            msg = (f"rank {rank} is a straggler: it reaches collectives {excess * 1000:.1f} ms after the other ranks "
                   f"(its collectives take the least time: it waits least) since {self._label(st.onset)}")
        else:
            msg = (f"rank {rank} is a straggler: {ratio:.2f}× the median ({excess * 1000:.1f} ms more per {unit}) "
                   f"since {unit} {st.onset}; every other rank waits for it at the collective")
        if not recovered:
            sev = Severity.CRITICAL if ratio >= self.config.critical_ratio else Severity.WARNING
            action = Action.CHECK_JOB
        evidence: dict[str, object] = {
            "rank": rank, "active": not recovered, "ratio_to_median": round(ratio, 3),
            "excess_s": round(excess, 6), f"since_{unit}": st.onset, f"last_{unit}": last_step,
            f"slow_{unit}s_in_window": len(slow), "window": len(st.flags), "measure": self.source_label,
        }
        if self.job_id:
            evidence["job_id"] = self.job_id
        if self.labels:
            evidence[f"since_{unit}"] = self._label(st.onset)
            evidence[f"last_{unit}"] = self._label(last_step)
        return Finding(CODE, sev, Entity.rank(rank), msg, action, evidence, SOURCE)


def _compute_of(r: StepRecord) -> float | None:
    if r.compute_s is not None:
        return r.compute_s
    if r.comm_wait_s is not None:
        # Whatever a step did not spend waiting at collectives, it spent computing.
        return max(0.0, r.wall_s - r.comm_wait_s)
    return None


def _lower_median(sorted_vals: Sequence[float]) -> float:
    if not sorted_vals:
        return 0.0
    return sorted_vals[(len(sorted_vals) - 1) // 2]


def _onset(flags: Iterable[tuple[int, bool, float, float]]) -> int | None:
    # The first slow step of the current run of slow steps (allowing single healthy blips).
    items = list(flags)
    onset = None
    gap = 0
    for step, slow, _, _ in reversed(items):
        if slow:
            onset, gap = step, 0
        else:
            gap += 1
            if gap > 1 and onset is not None:
                break
    return onset


def detect_stragglers(records: Sequence[StepRecord], config: StragglerConfig | None = None) -> list[Finding]:
    """Stragglers in a finished run: one finding per rank that was persistently slow (the latest
    episode; ``evidence.active`` False if it recovered before the end). Healthy run → []."""
    det = StragglerDetector(config=config or StragglerConfig())
    ranks = {r.rank for r in records}
    det.world_size = len(ranks) or None
    latest: dict[int, Finding] = {}
    for rec in sorted(records, key=lambda r: (r.step, r.rank)):
        for f in det.add(rec):
            latest[int(f.evidence["rank"])] = f
    for f in det.flush():
        latest[int(f.evidence["rank"])] = f
    # Report the state at the end for active ranks (up-to-date ratio), the last episode otherwise.
    for f in det.active_findings():
        latest[int(f.evidence["rank"])] = f
    return [latest[r] for r in sorted(latest)]


def detect_from_durations(
    durations: Mapping[int, Sequence[tuple[str, int, float]]], config: StragglerConfig | None = None
) -> list[Finding]:
    """Stragglers from flight-recorder ``duration_ms`` per rank: {rank: [(group, seq, ms), …]}.

    A collective takes longest on the ranks that arrived first (they wait for the rest) and least on
    the one that arrived last. A rank's lateness at one collective is the median duration minus its
    own; a rank that is persistently late by ≥ ``min_excess_s`` and ``min_ratio`` × its own
    duration is a straggler (it waited least)."""
    cfg = config or StragglerConfig()
    per_coll: dict[tuple[str, int], dict[int, float]] = {}
    for rank, items in durations.items():
        for group, seq, ms in items:
            per_coll.setdefault((group, seq), {})[rank] = ms / 1000.0
    ranks = set(durations)
    det = StragglerDetector(config=cfg, world_size=len(ranks) or None, source_label="flight-recorder duration_ms",
                            unit="collective")
    latest: dict[int, Finding] = {}
    for idx, key in enumerate(sorted(per_coll, key=lambda k: (k[1], k[0]))):
        det.labels[idx] = f"group {key[0]} collective #{key[1]}"
        vals = per_coll[key]
        if len(vals) < cfg.min_ranks:
            continue
        med = _upper_median(sorted(vals.values()))
        # Lateness is "how much less this rank waited than the typical rank", turned into a
        # larger-is-slower value that the step machinery can compare: median + lateness. Each
        # collective is complete here (only its group's members took part), so judge it whole.
        scored = {rank: med + max(0.0, med - d) for rank, d in vals.items()}
        for f in det.judge_step(idx, scored):
            latest[int(f.evidence["rank"])] = f
    for f in det.active_findings():
        latest[int(f.evidence["rank"])] = f
    return [latest[r] for r in sorted(latest)]


def _upper_median(sorted_vals: Sequence[float]) -> float:
    return sorted_vals[len(sorted_vals) // 2] if sorted_vals else 0.0
