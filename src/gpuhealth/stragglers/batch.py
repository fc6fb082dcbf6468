"""Stragglers in a finished run: step records (:func:`detect_stragglers`) or flight-recorder
durations alone (:func:`detect_from_durations`). Both build a steps × ranks matrix and run the same
online detector over it (:class:`~gpuhealth.stragglers.detector.StragglerDetector`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from gpuhealth.model import Finding, StepRecord
from gpuhealth.stragglers.config import StragglerConfig
from gpuhealth.stragglers.detector import CODE, StragglerDetector
from gpuhealth.stragglers.frsteps import MAX_RANK, DurationItem, fr_steps

MAX_SECTIONS = 64  # distinct code sections judged per run (a section per record would be a bug, not a profile)


def detect_stragglers(records: Sequence[StepRecord], config: StragglerConfig | None = None, *,
                      job_slowdown: bool = False) -> list[Finding]:
    """Stragglers in a finished run: one ``rank.straggler`` finding per rank that was a straggler
    (its latest episode; ``evidence.active`` False if it recovered before the end). Healthy run → [].
    ``job_slowdown``: also the ``job.slowdown`` finding (no ``rank``) when the whole job slowed down
    against its own best pace.

    Records with a ``section`` time one code section of a step: each section is judged on its own, like
    a job of its own, and its findings say which (``evidence.section``): a rank 2× slower in one of two
    sections is named for that section."""
    whole = [r for r in records if r.section is None]
    by_section: dict[str, list[StepRecord]] = {}
    for r in records:
        if r.section is not None and (r.section in by_section or len(by_section) < MAX_SECTIONS):
            by_section.setdefault(r.section, []).append(r)
    out = _detect(whole, config, job_slowdown=job_slowdown) if whole else []
    for name, recs in sorted(by_section.items()):
        out += [_in_section(f, name) for f in _detect(recs, config, job_slowdown=False)]
    return out


def _in_section(f: Finding, section: str) -> Finding:
    return dataclasses.replace(f, message=f"in section {section!r}: {f.message}", evidence={**f.evidence,
                                                                                           "section": section})


def _detect(records: Sequence[StepRecord], config: StragglerConfig | None, *, job_slowdown: bool) -> list[Finding]:
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
    rank_ids, cols = np.unique(np.asarray(ranks, np.int64), return_inverse=True)  # one column per rank seen
    mat = np.full((len(step_ids), len(rank_ids)), np.nan)
    mat[inv, cols] = values
    wall = np.full((len(step_ids), len(rank_ids)), np.nan)
    wall[inv, cols] = walls
    det = StragglerDetector(config, job_id=job_id, world_size=len(rank_ids))
    det.rank_ids = rank_ids.tolist()
    det.add_steps(step_ids, mat, wall)
    det.flush()
    return [f for f in det.findings() if job_slowdown or f.code == CODE]


def detect_from_durations(
    durations: Mapping[int, Sequence[DurationItem]], config: StragglerConfig | None = None
) -> list[Finding]:
    """Stragglers from flight-recorder ``duration_ms`` per rank: {rank: [(group, seq, ms[, start_ns]), …]},
    each rank's collectives in the order it ran them.

    A collective lasts from a rank's arrival to the end, so the rank that arrives last waits least.
    A rank's wait in a step is the sum of its durations over one cycle of its collectives — every
    group it waited in, so a tensor-parallel peer that waited for the straggler in their TP group
    waits as much as everyone else over the step. Steps are marked per rank by one group it is in
    (the world group, else one family of same-sized groups such as all TP groups; see
    :mod:`gpuhealth.stragglers.frsteps`), no group need span the job. With start times (the
    collective's ``created_ns``: the watchdog's ``started_ns`` ticks too coarsely and is refused),
    the step is the time between consecutive marks and compute = step − wait, judged like step
    records; without usable start times, ranks are compared by lateness in seconds
    (``fr_min_lateness_s`` at least)."""
    fr = fr_steps(durations)
    if fr is None:
        return []
    marks = fr.marks

    def label(rank: int, step: int) -> str:
        mark = marks.get(rank)
        return f"group {mark.group} collective #{mark.seq(step)}" if mark else f"step {step}"

    if fr.periods is not None:
        period = fr.periods[:, None]
        compute = np.where(np.isfinite(fr.waits), np.maximum(period - fr.waits, 0.01 * period), np.nan)
        # Not against the fastest rank in small jobs: from durations alone a pipeline's stages (whose
        # send/recv are not timed) reach the world collective later stage by stage, a graded pattern by design.
        det = StragglerDetector(config, world_size=fr.waits.shape[1], source_label="flight-recorder duration_ms",
                                unit="collective", small_job_fastest=False)
        det.label_of, det.rank_ids = label, fr.ranks
        det.add_steps(fr.steps, compute, np.broadcast_to(period, compute.shape))
    else:
        det = StragglerDetector(config, world_size=fr.waits.shape[1], source_label="flight-recorder duration_ms",
                                unit="collective", relative=False)
        det.label_of, det.rank_ids = label, fr.ranks
        det.add_steps(fr.steps, -fr.waits)  # larger = slower: the rank that waited least
    det.flush()
    return [f for f in det.findings() if f.code == CODE]
