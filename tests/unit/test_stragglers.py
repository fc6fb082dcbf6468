"""Straggler detection from step records and flight-recorder durations."""

from __future__ import annotations

import random

from gpuhealth.model import Severity, StepRecord
from gpuhealth.stragglers import StragglerConfig, StragglerDetector, detect_from_durations, detect_stragglers


def _records(world: int, steps: int, *, slow_rank: int | None = None, factor: float = 2.0, onset: int = 0,
             compute: float = 0.050, jitter: float = 0.03, seed: int = 1, split: str = "compute") -> list[StepRecord]:
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        comps = {r: compute * (1 + rng.uniform(-jitter, jitter)) for r in range(world)}
        if slow_rank is not None and step >= onset:
            comps[slow_rank] *= factor
        wall = max(comps.values()) + 0.005  # everybody waits for the slowest: equal wall times
        for r in range(world):
            wait = wall - comps[r]
            out.append(StepRecord("j", r, step, 1000.0 + step, wall,
                                  compute_s=comps[r] if split == "compute" else None,
                                  comm_wait_s=wait if split == "wait" else None))
    return out


def test_healthy_run_with_jitter_and_a_blip_gives_nothing() -> None:
    recs = _records(16, 60, jitter=0.08)
    # One rank has a single 3x hiccup (GC pause): not persistent, not a straggler.
    recs = [StepRecord(r.job_id, r.rank, r.step, r.start_time, r.wall_s, r.compute_s * 3, None)
            if (r.rank == 4 and r.step == 30) else r for r in recs]
    assert detect_stragglers(recs) == []


def test_wall_time_alone_finds_nothing_but_compute_does() -> None:
    recs = _records(8, 40, slow_rank=6, onset=12)
    walls = {r.wall_s for r in recs if r.step == 20}
    assert len(walls) == 1  # synchronous training: identical wall times
    found = detect_stragglers(recs)
    assert [f.evidence["rank"] for f in found] == [6]
    f = found[0]
    assert f.code == "rank.straggler" and f.severity is Severity.CRITICAL
    assert 1.8 <= f.evidence["ratio_to_median"] <= 2.2
    assert f.evidence["since_step"] == 12
    assert "since step 12" in f.message and "× the median" in f.message


def test_comm_wait_only_records_find_the_rank_that_waits_least() -> None:
    found = detect_stragglers(_records(4, 30, slow_rank=1, factor=1.5, onset=5, split="wait"))
    assert [f.evidence["rank"] for f in found] == [1]
    assert found[0].severity is Severity.WARNING
    assert found[0].evidence["since_step"] == 5


def test_two_rank_job() -> None:
    found = detect_stragglers(_records(2, 20, slow_rank=0, onset=3))
    assert [f.evidence["rank"] for f in found] == [0]


def test_online_detector_reports_new_changed_and_recovered() -> None:
    det = StragglerDetector(config=StragglerConfig(), world_size=4)
    events = []
    recs = _records(4, 20, slow_rank=2, factor=2.0, onset=5)
    recs += [StepRecord(r.job_id, r.rank, r.step + 20, r.start_time, r.wall_s, r.compute_s * (2.0 if r.rank == 2
             else 1.0), None) for r in _records(4, 10, slow_rank=2, factor=2.0, onset=0, seed=2)]  # now 4x
    recs += [StepRecord(r.job_id, r.rank, r.step + 30, r.start_time, r.wall_s, r.compute_s, None)
             for r in _records(4, 12, seed=3)]  # recovered
    for rec in sorted(recs, key=lambda r: (r.step, r.rank)):
        events += det.add(rec)
    assert next((e.evidence["rank"], e.evidence["active"]) for e in events) == (2, True)
    ratios = [e.evidence["ratio_to_median"] for e in events if e.evidence["active"]]
    assert ratios[0] < 2.5 and max(ratios) > 3.0  # the change was reported
    assert events[-1].evidence["active"] is False and events[-1].severity is Severity.INFO
    assert det.active_findings() == []
    assert det.scores()[2] < 1.3


def test_online_detector_memory_is_bounded_when_a_rank_goes_silent() -> None:
    det = StragglerDetector(config=StragglerConfig(max_pending_steps=16), world_size=4)
    for rec in _records(4, 500):
        if rec.rank != 3:  # rank 3 stopped reporting: steps never complete
            det.add(rec)
    assert len(det._pending) <= 17
    assert all(len(st.flags) <= det.config.window for st in det._ranks.values())


def test_records_without_a_split_are_counted_not_guessed() -> None:
    det = StragglerDetector()
    assert det.add(StepRecord("j", 0, 0, 0.0, 1.0)) == []
    assert det.skipped_no_split == 1


def test_fr_durations_straggler_is_the_rank_whose_collectives_are_shortest() -> None:
    # MEASUREMENTS.md: 7.7 ms on the fast rank, 0.25 ms on the slow one.
    rng = random.Random(0)
    durations = {r: [("0", s, (0.25 if r == 3 and s >= 10 else 7.7) * rng.uniform(0.95, 1.05))
                     for s in range(1, 40)] for r in range(4)}
    found = detect_from_durations(durations)
    assert [f.evidence["rank"] for f in found] == [3]
    assert "waits least" in found[0].message
    assert found[0].evidence["since_collective"] == "group 0 collective #10"


def test_fr_durations_healthy() -> None:
    rng = random.Random(0)
    durations = {r: [("0", s, 3.0 * rng.uniform(0.8, 1.2)) for s in range(1, 60)] for r in range(8)}
    assert detect_from_durations(durations) == []
