"""Job state: hang threshold max(k × typical step, floor), finished jobs are not hung, and the
budgeted straggler feed over columnar batches."""

from __future__ import annotations

from gpuhealth.coordinator.jobs import JobState
from gpuhealth.coordinator.straggler_feed import BudgetedStragglerFeed
from gpuhealth.model import RankIdentity
from gpuhealth.proto.convert import StepColumns


def _cols(step: int, ranks: int = 4, wall: float = 1.0, slow: int | None = None) -> StepColumns:
    r = list(range(ranks))
    return StepColumns("j", r, [step] * ranks, [1.7e9] * ranks, [wall] * ranks,
                       [0.2 if i == slow else 0.1 for i in r], None)


def test_hang_after_k_typical_steps_or_floor_once_per_episode() -> None:
    job = JobState("j")
    for s in range(5):
        job.add_steps(_cols(s, wall=2.0), now=100.0 + s)
    assert job.hang_check(now=104.0 + 19.0, k=10, floor_s=5) is None  # 10 × 2 s = 20 s not yet
    check = job.hang_check(now=104.0 + 21.0, k=10, floor_s=5)
    assert check is not None and check.threshold_s == 20.0 and check.last_step == 4
    job.hang_open = True
    assert job.hang_check(now=200.0, k=10, floor_s=5) is None  # reported once
    job.add_steps(_cols(5, wall=2.0), now=201.0)  # progress closes the episode
    assert not job.hang_open
    assert job.hang_check(now=201.0 + 3, k=1, floor_s=5) is None  # the floor holds for fast steps


def test_finished_job_is_not_hung() -> None:
    job = JobState("j")
    job.add_identity("n1", RankIdentity("j", 0, 2, "h", 1), now=0.0)
    job.add_identity("n1", RankIdentity("j", 1, 2, "h", 2), now=0.0)
    job.add_steps(_cols(0, ranks=2), now=1.0)
    job.set_live("n1", [])
    assert job.finished and job.hang_check(now=1000.0, k=10, floor_s=5) is None


def test_a_job_found_only_by_discovery_is_never_hung_for_sending_no_steps() -> None:
    """Zero-code ranks send no steps: 60 s after the coordinator heard of them is not a stall (on 2 x H100 a
    running mismatch job and two jobs already reported hung were called hung again this way)."""
    found = JobState("z")
    for rank in (0, 1):
        found.add_identity("n1", RankIdentity("z", rank, 2, "h", 10 + rank, found_by="discovered"), now=1.0)
    assert found.discovered_only and found.hang_check(now=3600.0, k=10, floor_s=60) is None
    hooked = JobState("j")  # a hooked job stuck before its first step is still caught by the floor
    hooked.add_identity("n1", RankIdentity("j", 0, 2, "h", 1), now=1.0)
    hooked.add_identity("n1", RankIdentity("j", 1, 2, "h", 2, found_by="discovered"), now=1.0)
    assert not hooked.discovered_only and hooked.hang_check(now=62.0, k=10, floor_s=60) is not None


def test_straggler_feed_flags_the_slow_rank_only() -> None:
    feed = BudgetedStragglerFeed("j")
    healthy = BudgetedStragglerFeed("j")
    for s in range(10):
        feed.feed(_cols(s, slow=2))
        healthy.feed(_cols(s))
    found = feed.evaluate()
    assert [int(f.evidence["rank"]) for f in found] == [2]
    assert healthy.evaluate() == []
    assert round(feed.scores()[2], 2) == 2.0


def test_feed_samples_steps_above_its_budget() -> None:
    feed = BudgetedStragglerFeed("j", budget_records_s=100.0, rate_window_s=1.0)
    feed.feed(_cols(0, ranks=100), now=0.0)
    feed.feed(_cols(1, ranks=100), now=1.0)  # 200 records in 1 s → every 2nd step
    assert feed.stride == 2


def test_stride_change_in_the_middle_of_a_step_does_not_stall_detection() -> None:
    feed = BudgetedStragglerFeed("j", budget_records_s=1000.0, rate_window_s=1.0)
    t = 0.0
    flagged_at = None
    for step in range(200):
        for half in (0, 1):  # each step arrives from two "agents"; the stride may change between them
            ranks = list(range(half * 50, half * 50 + 50))
            feed.feed(StepColumns("j", ranks, [step] * 50, [1.7e9] * 50, [1.0] * 50,
                                  [0.2 if (r == 7 and step >= 100) else 0.1 for r in ranks], None), now=t)
            t += 0.01
        if feed.evaluate() and flagged_at is None:
            flagged_at = step
    assert feed.stride > 1
    assert flagged_at is not None and flagged_at < 100 + 8 * feed.stride, (flagged_at, feed.stride)


def test_a_restarted_run_is_progress_and_its_straggler_is_judged_afresh() -> None:
    """Steps that go back (elastic restart, resume from a checkpoint) under the same job id are a new
    run: no false hang while it runs, and a straggler in it is found without waiting for the old
    step count to be passed."""
    from gpuhealth.coordinator.jobs import JobTable

    table = JobTable(lambda job_id: BudgetedStragglerFeed(job_id))
    job = table.get("j", 0.0)
    t = 0.0
    for s in range(200):
        t += 0.5
        job.add_steps(_cols(s, wall=0.5), now=t)
    for s in range(40):  # the restarted run: rank 3 now computes twice as long
        t += 0.5
        job.add_steps(_cols(s, wall=0.5, slow=3), now=t)
        assert job.hang_check(now=t + 1.0, k=10, floor_s=5) is None
    assert job.restarts == 1
    assert job.detector is not None
    assert [f.evidence["rank"] for f in job.detector.evaluate()] == [3]
