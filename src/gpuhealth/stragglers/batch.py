"""Stragglers in a finished run: step records (:func:`detect_stragglers`) or flight-recorder
durations alone (:func:`detect_from_durations`). Both build a steps × ranks matrix and run the same
online detector over it (:class:`~gpuhealth.stragglers.detector.StragglerDetector`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpuhealth.model import Finding, StepRecord
from gpuhealth.stragglers.config import StragglerConfig
from gpuhealth.stragglers.detector import CODE, StragglerDetector

MAX_RANK = 1 << 21  # a rank id beyond this is bad input, not a job (it would size the matrices)

# (group, seq, duration_ms) as triage passes them, optionally with the collective's start time in ns
# (``started_ns``, else ``created_ns``): with it, lateness is judged relative to the step.
DurationItem = tuple[str, int, float] | tuple[str, int, float, int | float | None]


def detect_stragglers(records: Sequence[StepRecord], config: StragglerConfig | None = None, *,
                      job_slowdown: bool = False) -> list[Finding]:
    """Stragglers in a finished run: one ``rank.straggler`` finding per rank that was a straggler
    (its latest episode; ``evidence.active`` False if it recovered before the end). Healthy run → [].
    ``job_slowdown``: also the ``job.slowdown`` finding (no ``rank``) when the whole job slowed down
    against its own best pace."""
    ranks: list[int] = []
    steps: list[int] = []
    values: list[float] = []
    walls: list[float] = []
    job_id = ""
    for r in records:
        v = r.compute_s
        if v is None:
            if r.comm_wait_s is None:
                continue
            v = max(0.0, r.wall_s - r.comm_wait_s)  # whatever it did not spend waiting, it computed
        if not 0 <= r.rank < MAX_RANK:
            continue
        ranks.append(r.rank)
        steps.append(r.step)
        values.append(v)
        walls.append(r.wall_s)
        job_id = job_id or r.job_id
    if not ranks:
        return []
    step_ids, inv = np.unique(np.asarray(steps, np.int64), return_inverse=True)
    cols = np.asarray(ranks, np.int64)
    width = int(cols.max()) + 1
    mat = np.full((len(step_ids), width), np.nan)
    mat[inv, cols] = values
    wall = np.full((len(step_ids), width), np.nan)
    wall[inv, cols] = walls
    det = StragglerDetector(config, job_id=job_id, world_size=width)
    det.add_steps(step_ids, mat, wall)
    det.flush()
    return [f for f in det.findings() if job_slowdown or f.code == CODE]


@dataclass(frozen=True, slots=True)
class _FrSteps:
    anchor: str
    steps: np.ndarray  # the anchor group's sequence ids, one per step
    waits: np.ndarray  # steps × ranks: seconds spent in collectives up to and including the anchor
    periods: np.ndarray | None  # seconds between consecutive anchors (from start times), if known


def detect_from_durations(
    durations: Mapping[int, Sequence[DurationItem]], config: StragglerConfig | None = None
) -> list[Finding]:
    """Stragglers from flight-recorder ``duration_ms`` per rank: {rank: [(group, seq, ms[, start_ns]), …]},
    each rank's collectives in the order it ran them.

    A collective lasts from a rank's arrival to the end, so the rank that arrives last waits least.
    The group with the most ranks (the world or data-parallel group) marks the steps; a rank's wait in
    one step is the sum of its durations since the previous such collective (so waits inside a
    tensor-parallel pair are counted where they happen). With start times (the collective's
    ``created_ns``: the watchdog's ``started_ns`` ticks too coarsely and is refused), the step is the
    time between consecutive marks and compute = step − wait, judged like step records; without
    usable start times, ranks are compared by lateness in seconds (``fr_min_lateness_s`` at least)."""
    fr = _fr_steps(durations)
    if fr is None:
        return []
    label = {int(s): f"group {fr.anchor} collective #{int(s)}" for s in fr.steps}
    if fr.periods is not None:
        period = fr.periods[:, None]
        compute = np.where(np.isfinite(fr.waits), np.maximum(period - fr.waits, 0.01 * period), np.nan)
        det = StragglerDetector(config, world_size=fr.waits.shape[1], source_label="flight-recorder duration_ms",
                                unit="collective")
        det.labels = label
        det.add_steps(fr.steps, compute, np.broadcast_to(period, compute.shape))
    else:
        det = StragglerDetector(config, world_size=fr.waits.shape[1], source_label="flight-recorder duration_ms",
                                unit="collective", relative=False)
        det.labels = label
        det.add_steps(fr.steps, -fr.waits)  # larger = slower: the rank that waited least
    det.flush()
    return [f for f in det.findings() if f.code == CODE]


def _number(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def _fr_steps(durations: Mapping[int, Sequence[DurationItem]]) -> _FrSteps | None:
    members: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    clean: dict[int, list[tuple[str, int, float, float | None]]] = {}
    for rank, items in durations.items():
        if not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
            continue
        rows = clean.setdefault(rank, [])
        for item in items:
            if len(item) < 3:
                continue
            seq, ms = _number(item[1]), _number(item[2])
            if seq is None or ms is None or ms < 0:
                continue
            group = str(item[0])
            start = _number(item[3]) if len(item) > 3 else None
            rows.append((group, int(seq), ms / 1000.0, start))
            members.setdefault(group, set()).add(rank)
            counts[group] = counts.get(group, 0) + 1
    if not members:
        return None
    anchor = max(members, key=lambda g: (len(members[g]), counts[g], g))
    waits: dict[tuple[int, int], float] = {}
    starts: dict[tuple[int, int], float] = {}
    for rank, rows in clean.items():
        acc = 0.0
        complete = False  # the first mark's wait may miss collectives older than the dump's window
        for group, seq, sec, start in rows:
            acc += sec
            if group != anchor:
                continue
            if complete and (rank, seq) not in waits:
                waits[(rank, seq)] = acc
            if start is not None:
                starts[(rank, seq)] = start
            complete, acc = True, 0.0
    if not waits:
        return None
    step_ids = np.array(sorted({s for _, s in waits}), np.int64)
    index = {int(s): i for i, s in enumerate(step_ids)}
    width = max(r for r, _ in waits) + 1
    mat = np.full((len(step_ids), width), np.nan)
    for (rank, seq), w in waits.items():
        mat[index[seq], rank] = w
    return _FrSteps(anchor, step_ids, mat, _periods(starts, step_ids, mat))


def _periods(starts: Mapping[tuple[int, int], float], step_ids: np.ndarray, waits: np.ndarray) -> np.ndarray | None:
    """Median over ranks of the time between a rank's start of consecutive marks (ns → s); None when
    the times cannot be steps: too few, not increasing (a clock that ticks in coarse quanta, such as
    a watchdog's discovery time), or shorter than the waits inside them."""
    gaps: dict[int, list[float]] = {}
    flat = 0
    total = 0
    for (rank, seq), t in starts.items():
        prev = starts.get((rank, seq - 1))
        if prev is None:
            continue
        total += 1
        if t > prev:
            gaps.setdefault(seq, []).append((t - prev) / 1e9)
        else:
            flat += 1
    if not total or flat > 0.1 * total:
        return None
    out = np.array([statistics.median(gaps[int(s)]) if int(s) in gaps else np.nan for s in step_ids])
    known = np.isfinite(out)
    if not len(out) or known.mean() < 0.5:
        return None
    with np.errstate(invalid="ignore"):
        longest_wait = np.nanmax(np.where(np.isfinite(waits), waits, -np.inf), axis=1)
    if (out[known] < longest_wait[known]).mean() > 0.1:
        return None
    return out
