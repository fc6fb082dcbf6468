"""``gpuhealth_coordinator_job_step_seconds_count``/``_sum`` are counters a user ``rate()``s: they must
count every step record ever ingested, not the bounded quantile sample (which stopped at 4,096 and
whose sum fell as old samples left it)."""

from __future__ import annotations

import itertools

from prometheus_client import generate_latest

from gpuhealth.coordinator.jobs import JobState
from gpuhealth.coordinator.metrics import CoordinatorCollector, make_registry
from gpuhealth.proto.convert import StepColumns


def _batch(first_step: int, ranks: int, wall: float) -> StepColumns:
    r = list(range(ranks))
    return StepColumns("j", r, [first_step] * ranks, [1.7e9] * ranks, [wall] * ranks, [wall / 2] * ranks, None)


def _scrape(job: JobState) -> dict[str, float]:
    collector = CoordinatorCollector()
    collector.update({"jobs": [{"job_id": job.job_id, "quantiles": job.step_quantiles(), "scores": [],
                                "step_count": job.step_count, "step_sum": job.step_sum, "stragglers": 0,
                                "hangs": 0, "records": job.records, "stalled_s": 0.0}]})
    out: dict[str, float] = {}
    for line in generate_latest(make_registry(collector)).decode().splitlines():
        if line.startswith("gpuhealth_coordinator_job_step_seconds_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)
    return out


def test_count_and_sum_keep_growing_past_the_quantile_sample() -> None:
    job = JobState("j")
    seen: list[tuple[float, float]] = []
    for step in range(100):  # 100 batches x 120 ranks = 12,000 records, wall 0.1 s then 0.01 s
        job.add_steps(_batch(step, 120, 0.1 if step < 50 else 0.01), now=float(step))
        scraped = _scrape(job)
        seen.append((scraped["gpuhealth_coordinator_job_step_seconds_count"],
                     scraped["gpuhealth_coordinator_job_step_seconds_sum"]))
    assert seen[-1][0] == 12_000 and job.records == 12_000
    assert abs(seen[-1][1] - (6_000 * 0.1 + 6_000 * 0.01)) < 1e-6
    # monotonic, as counters must be: rate() over any window is right
    assert all(b[0] > a[0] and b[1] > a[1] for a, b in itertools.pairwise(seen))
    assert len(job.step_samples) <= 4096  # the quantile sample stays bounded


def test_counters_survive_a_job_restart() -> None:
    job = JobState("j")
    job.add_steps(_batch(10, 4, 1.0), now=1.0)
    job.add_steps(_batch(0, 4, 1.0), now=2.0)  # steps went back: a restarted run under the same id
    assert job.restarts == 1
    assert job.step_count == 8 and job.step_sum == 8.0
