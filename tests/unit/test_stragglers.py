"""Straggler detection from step records: what a user relies on — a slow rank is named with its
onset, ratio and cost; healthy noise, spikes, checkpoints and whole-job slowdowns are never a
straggler; episodes neither flicker nor end while the rank is still slow."""

from __future__ import annotations

import numpy as np

from gpuhealth.model import Severity, StepRecord
from gpuhealth.stragglers import StragglerConfig, StragglerDetector, detect_stragglers


def _job(world: int, steps: int, *, noise: float = 0.03, base: float = 0.050, seed: int = 1,
         slow: dict[int, float] | None = None, onset: int = 0, end: int | None = None, alternate: bool = False,
         job: np.ndarray | None = None, spikes: float = 0.0) -> np.ndarray:
    """compute[rank, step] = base × factor × job[step] × noise (noise independent per rank and step)."""
    rng = np.random.default_rng(seed)
    comp = base * np.maximum(0.2, 1.0 + noise * rng.normal(size=(world, steps)))
    hit = rng.random((world, steps)) < spikes
    comp[hit] *= rng.uniform(2.0, 6.0, int(hit.sum()))
    for rank, factor in (slow or {}).items():
        cols = np.arange(onset, end if end is not None else steps)
        if alternate:
            cols = cols[(cols - onset) % 2 == 1]
        comp[rank, cols] *= factor
    if job is not None:
        comp *= job[None, :]
    return comp


def _records(comp: np.ndarray, split: str = "compute", first_step: int = 0) -> list[StepRecord]:
    wall = comp.max(axis=0) + 0.005  # everybody waits for the slowest: equal wall times
    out = []
    for step in range(comp.shape[1]):
        for rank in range(comp.shape[0]):
            c, w = float(comp[rank, step]), float(wall[step])
            out.append(StepRecord("j", rank, first_step + step, 1000.0 + step, w,
                                  compute_s=c if split == "compute" else None,
                                  comm_wait_s=w - c if split == "wait" else None))
    return out


def _stragglers(records: list[StepRecord]) -> dict[int, dict[str, object]]:
    return {int(f.evidence["rank"]): dict(f.evidence) for f in detect_stragglers(records) if f.code == "rank.straggler"}


def test_healthy_noise_and_a_blip_give_nothing() -> None:
    comp = _job(16, 120, noise=0.08)
    comp[4, 30] *= 3  # one GC pause
    assert detect_stragglers(_records(comp)) == []


def test_wall_time_alone_finds_nothing_but_compute_does() -> None:
    recs = _records(_job(8, 40, slow={6: 2.0}, onset=12))
    assert len({r.wall_s for r in recs if r.step == 20}) == 1  # synchronous training: identical wall times
    found = detect_stragglers(recs)
    assert [f.evidence["rank"] for f in found] == [6]
    f = found[0]
    assert f.code == "rank.straggler" and f.severity is Severity.CRITICAL and f.evidence["active"] is True
    assert 1.8 <= f.evidence["ratio_to_median"] <= 2.2
    assert f.evidence["since_step"] == f.evidence["onset_step"] == 12
    # The others wait 50 ms of a 105 ms step for it.
    assert 0.43 <= f.evidence["cost_share"] <= 0.5
    assert "since step 12" in f.message and "× the median" in f.message and "costs the job 4" in f.message


def test_comm_wait_only_records_find_the_rank_that_waits_least() -> None:
    found = detect_stragglers(_records(_job(4, 30, slow={1: 1.5}, onset=5), split="wait"))
    assert [f.evidence["rank"] for f in found] == [1]
    assert found[0].severity is Severity.WARNING  # 25 ms of an 80 ms step: under a third
    assert found[0].evidence["since_step"] == 5


def test_two_rank_job() -> None:
    assert list(_stragglers(_records(_job(2, 30, slow={0: 2.0}, onset=3)))) == [0]


def test_a_one_point_one_rank_in_noisy_jobs_is_found_and_only_it() -> None:
    # 10 % slower under 10 % per-step noise: no single step shows it, the window does.
    for world, rank in ((4, 2), (64, 17), (1024, 700)):
        found = _stragglers(_records(_job(world, 200, noise=0.10, slow={rank: 1.1}, seed=world)))
        assert list(found) == [rank], world
        assert 1.05 <= float(found[rank]["ratio_to_median"]) <= 1.15  # type: ignore[arg-type]


def test_four_ranks_at_thirty_percent_noise_are_all_healthy() -> None:
    for seed in range(3):
        assert detect_stragglers(_records(_job(4, 200, noise=0.30, seed=seed))) == []


def test_a_rank_slow_on_every_other_step_is_found() -> None:
    # Its median step is normal; its trimmed mean is not.
    found = _stragglers(_records(_job(16, 120, noise=0.05, slow={5: 2.0}, alternate=True)))
    assert list(found) == [5]
    assert 1.35 <= float(found[5]["ratio_to_median"]) <= 1.65  # type: ignore[arg-type]


def test_when_most_ranks_are_slow_they_are_named_against_the_fastest_ranks() -> None:
    # Ten of sixteen ranks (a slow node and a half) are 1.3x: the median is theirs, so only the
    # fastest ranks show what the job could do.
    slow = {r: 1.3 for r in range(6, 16)}
    found = _stragglers(_records(_job(16, 120, noise=0.05, slow=slow)))
    assert sorted(found) == list(range(6, 16))
    assert all(f["compared_with"] == "fastest quarter of the ranks" for f in found.values())
    assert all(1.2 <= float(f["ratio_to_median"]) <= 1.4 and f["active"] for f in found.values())  # type: ignore[arg-type]
    assert detect_stragglers(_records(_job(16, 120, noise=0.05, slow={r: 1.3 for r in range(8)}))) != []


def test_ranks_slow_by_different_amounts_in_a_small_job_are_all_named_against_the_fastest() -> None:
    # 1x, 1.1x, 1.2x, 1.3x among four: the 1.1x rank is below the median of the other three.
    for seed in range(3):
        found = _stragglers(_records(_job(4, 100, noise=0.03, seed=seed, slow={1: 1.1, 2: 1.2, 3: 1.3})))
        assert sorted(found) == [1, 2, 3], seed
        ratio = float(found[1]["ratio_to_median"])  # type: ignore[arg-type]
        assert found[1]["compared_with"] == "fastest quarter of the ranks" and 1.05 <= ratio <= 1.15


def test_one_fast_rank_in_a_small_job_makes_nobody_a_straggler() -> None:
    # Three ranks agree on one pace, one is 10 % faster: it is the odd one out, not they. (Compared step by step,
    # the median of the other three is the smaller of two normal ranks: a normal rank was named in 4 of 6 seeds.)
    for seed in range(6):
        assert _stragglers(_records(_job(4, 150, noise=0.05, seed=seed, slow={0: 0.9}))) == {}, seed


def test_ranks_straggling_together_carry_the_worst_ones_severity() -> None:
    recs = _records(_job(4, 60, slow={1: 2.0, 2: 3.0, 3: 4.0}))
    found = {int(f.evidence["rank"]): f for f in detect_stragglers(recs)}  # type: ignore[call-overload]
    assert sorted(found) == [1, 2, 3]
    assert {f.severity for f in found.values()} == {Severity.CRITICAL}
    assert found[1].evidence["straggling_with"] == [2, 3]
    assert float(found[1].evidence["cost_share"]) < 1 / 3  # type: ignore[arg-type]  # its own cost alone: warning


def test_a_rank_slow_in_one_code_section_is_named_for_that_section() -> None:
    # Two sections of 10 ms each; rank 2 takes 1.3x in "backward" only; records per section and per step.
    rng = np.random.default_rng(3)
    recs = []
    for step in range(80):
        times = {(s, r): 0.010 * (1.3 if (s, r) == ("backward", 2) else 1.0) * (1 + 0.05 * rng.normal())
                 for s in ("forward", "backward") for r in range(4)}
        for r in range(4):
            for s in ("forward", "backward"):
                recs.append(StepRecord("j", r, step, 1000.0 + step, 0.03, times[s, r], None, s))
    found = [f for f in detect_stragglers(recs) if f.code == "rank.straggler"]
    assert [(f.evidence["section"], f.evidence["rank"]) for f in found] == [("backward", 2)]
    assert found[0].message.startswith("in section 'backward': rank 2 is a straggler")
    # Without the section names the two sections of one step collide and nothing is right.
    assert _stragglers([StepRecord(r.job_id, r.rank, r.step, r.start_time, r.wall_s, r.compute_s)
                        for r in recs]) != {2: found[0].evidence}


def test_spikes_and_checkpoints_are_never_a_straggler() -> None:
    spiky = _job(16, 200, noise=0.10, spikes=0.03)
    assert detect_stragglers(_records(spiky)) == []
    job = np.ones(200)
    job[49::50] = 8.0  # every rank saves a checkpoint every 50 steps
    assert detect_stragglers(_records(_job(16, 200, noise=0.05, job=job))) == []
    rank0 = _job(16, 200, noise=0.05)
    rank0[0, 49::50] *= 8.0  # rank 0 alone saves it
    assert detect_stragglers(_records(rank0)) == []


def test_a_whole_job_slowdown_is_its_own_finding_never_a_straggler() -> None:
    job = np.ones(200)
    job[100:] = 1.4  # every rank 40 % slower from step 100 (throttled fabric, longer sequences)
    assert detect_stragglers(_records(_job(16, 200, noise=0.05, job=job))) == []
    found = detect_stragglers(_records(_job(16, 200, noise=0.05, job=job)), job_slowdown=True)
    assert [f.code for f in found] == ["job.slowdown"]
    f = found[0]
    assert f.severity is Severity.WARNING and f.entity.kind.value == "job"
    assert 1.3 <= f.evidence["ratio_to_history"] <= 1.5 and 96 <= f.evidence["since_step"] <= 104
    # Steps whose length varies with the data (the same on every rank) are neither.
    varying = np.random.default_rng(3).uniform(0.6, 1.4, 200)
    assert detect_stragglers(_records(_job(16, 200, noise=0.05, job=varying)), job_slowdown=True) == []


def test_a_transient_slowdown_is_one_episode_with_onset_and_recovery() -> None:
    comp = _job(16, 200, noise=0.05, slow={3: 1.5}, onset=60, end=120)
    det = StragglerDetector(world_size=16)
    events = []
    for rec in _records(comp):
        events += det.add(rec)
    events += det.flush()
    mine = [e for e in events if e.code == "rank.straggler"]
    assert all(e.evidence["rank"] == 3 for e in mine)
    assert [e.evidence["active"] for e in mine] == [True, False]  # no flicker: one entry, one exit
    end = mine[-1]
    assert end.severity is Severity.INFO and "no longer a straggler" in end.message
    assert end.evidence["onset_step"] == 60 and end.evidence["recovered_step"] == 120
    assert 1.4 <= end.evidence["ratio_to_median"] <= 1.6
    assert det.active_findings() == []


def test_a_weak_noisy_straggler_is_not_declared_recovered_while_still_slow() -> None:
    comp = _job(16, 400, noise=0.15, slow={9: 1.2})
    det = StragglerDetector(world_size=16)
    events = []
    for rec in _records(comp):
        events += det.add(rec)
    assert [(e.evidence["rank"], e.evidence["active"]) for e in events if e.code == "rank.straggler"] == [(9, True)]
    assert [f.evidence["rank"] for f in det.active_findings()] == [9]


def test_online_detector_reports_new_changed_and_recovered() -> None:
    comp = np.concatenate((_job(4, 40, slow={2: 2.0}, onset=5), _job(4, 40, slow={2: 4.0}, seed=2),
                           _job(4, 40, seed=3)), axis=1)
    det = StragglerDetector(config=StragglerConfig(), world_size=4)
    events = []
    for rec in _records(comp):
        events += det.add(rec)
    events += det.flush()
    assert (events[0].evidence["rank"], events[0].evidence["active"]) == (2, True)
    ratios = [e.evidence["ratio_to_median"] for e in events if e.evidence["active"]]
    assert ratios[0] < 2.3 and max(ratios) > 3.0  # the change was reported
    assert events[-1].evidence["active"] is False and events[-1].severity is Severity.INFO
    assert events[-1].evidence["recovered_step"] == 80
    assert det.active_findings() == []
    assert det.scores()[2] < 1.2


def test_online_detector_memory_is_bounded_when_a_rank_goes_silent() -> None:
    det = StragglerDetector(config=StragglerConfig(max_pending_steps=16, history=64), world_size=4)
    for rec in _records(_job(4, 500)):
        if rec.rank != 3:  # rank 3 stopped reporting: steps never complete
            det.add(rec)
    assert len(det._pending) <= 17
    assert det._ring.shape == (4, 64)  # ranks × the last 64 steps


def test_records_without_a_split_are_counted_not_guessed() -> None:
    det = StragglerDetector()
    assert det.add(StepRecord("j", 0, 0, 0.0, 1.0)) == []
    assert det.skipped_no_split == 1


def test_bad_values_are_skipped_not_a_traceback() -> None:
    recs = _records(_job(4, 60, slow={1: 1.5}))
    recs += [StepRecord("j", 2, 5, 0.0, float("nan"), compute_s=float("nan")),
             StepRecord("j", 3, 6, 0.0, 1.0, compute_s=-1.0), StepRecord("j", -1, 7, 0.0, 1.0, compute_s=0.05),
             StepRecord("j", 10**12, 7, 0.0, 1.0, compute_s=0.05)]
    assert list(_stragglers(recs)) == [1]
    assert detect_stragglers([]) == []
