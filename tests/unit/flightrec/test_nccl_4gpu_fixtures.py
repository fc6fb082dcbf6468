"""Real NCCL dumps from 4 × H200 (torch 2.11, NCCL 2.28.9), taken by tests/integration/fr_jobs/run_nccl.sh
with TP groups of 2 ({0,1}, {2,3}) and TORCH_NCCL_ENABLE_TIMING=1 (see nccl_4gpu/run_log.txt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from frbuild import FIXTURES

from gpuhealth.flightrec.verdict import triage
from gpuhealth.model import Severity, StepRecord

NCCL4 = FIXTURES / "nccl_4gpu"


def _steps(folder: Path) -> list[StepRecord]:
    return [StepRecord.from_dict(json.loads(line)) for p in sorted(folder.glob("steps_rank*.jsonl"))
            for line in p.read_text().splitlines()]


def test_rank_that_skipped_its_tp_all_reduce_is_named_with_its_group() -> None:
    # Rank 3 skipped the TP all_reduce of step 10 and went on to the world all_reduce. Its TP peer (2)
    # waits in the TP group — and, NCCL being asynchronous, has the world all_reduce queued behind it,
    # "not started": that is the same fault seen again, not a GPU stall of rank 2.
    rep = triage(NCCL4 / "subgroup_skip" / "dumps", steps=_steps(NCCL4 / "subgroup_skip"))
    assert rep.verdict == "hang"
    # Only the root is blamed; timing read from the steps before the hang is at most context (info).
    assert [(f.code, f.evidence["rank"]) for f in rep.findings if f.severity >= Severity.WARNING] == \
        [("collective.missing_rank", 3)]
    ev = rep.findings[0].evidence
    assert ev["kind"] == "skipped" and ev["group"] == "2" and ev["seq"] == 11
    assert ev["waiting_ranks"] == [2] and ev["consequences"] == ["0"]
    assert rep.culprits == [3]


def test_healthy_four_rank_nccl_job_is_quiet() -> None:
    rep = triage(NCCL4 / "healthy" / "dumps", steps=_steps(NCCL4 / "healthy"))
    assert rep.verdict == "healthy" and rep.findings == []
    assert rep.ranks_seen == [0, 1, 2, 3]


def test_rank_doing_one_and_a_half_times_the_compute_is_the_straggler() -> None:
    # Rank 3 computes 36 ms instead of 24 ms per step from step 10; wall step times are equal on all
    # ranks (everyone waits for it at the all_reduce), so only the split or the FR durations show it.
    by_fr = triage(NCCL4 / "straggler" / "dumps")
    assert by_fr.verdict == "straggler"
    assert [(f.code, f.evidence["rank"]) for f in by_fr.findings] == [("rank.straggler", 3)]
    assert by_fr.findings[0].evidence["measure"] == "flight-recorder duration_ms"
    by_steps = triage(NCCL4 / "straggler" / "dumps", steps=_steps(NCCL4 / "straggler"))
    assert [(f.code, f.evidence["rank"]) for f in by_steps.findings] == [("rank.straggler", 3)]
    ev = by_steps.findings[0].evidence
    assert ev["measure"] == "step records" and ev["since_step"] == 10
    assert 1.4 <= ev["ratio_to_median"] <= 1.6


@pytest.mark.parametrize(("case", "rank", "factor"), [
    ("nccl_4gpu/straggler_1.1", 3, 1.1), ("nccl_4gpu/straggler_1.2", 3, 1.2), ("nccl_4gpu/straggler_1.3", 3, 1.3),
    ("nccl_2gpu/straggler_1.2", 1, 1.2),
])
def test_a_slightly_slow_rank_is_named_from_step_records_and_from_fr_durations_alone(case: str, rank: int,
                                                                                     factor: float) -> None:
    # Real 4 x H200 jobs (scripts/device/straggler_runs.sh): one rank's GPU does 1.1-1.3x the matmuls of the
    # others from step 10; the others wait for it at every all_reduce.
    folder = FIXTURES / case
    for rep in (triage(folder / "dumps", steps=_steps(folder)), triage(folder / "dumps")):
        assert rep.verdict == "straggler", rep.summary
        assert rep.culprits == [rank], rep.summary
        ev = rep.findings[0].evidence
        assert abs(ev["ratio_to_median"] - factor) <= 0.05, ev["ratio_to_median"]


def test_a_healthy_job_with_15_percent_jitter_on_every_rank_is_healthy() -> None:
    folder = NCCL4 / "healthy_jitter"
    for rep in (triage(folder / "dumps", steps=_steps(folder)), triage(folder / "dumps")):
        assert rep.verdict == "healthy" and rep.findings == [], rep.summary
