"""Real NCCL dumps from 2 × H200 (torch 2.11, NCCL 2.28.9), taken by tests/integration/fr_jobs/job.py
with TORCH_NCCL_ENABLE_TIMING=1 (see tests/fixtures/flightrec/nccl_2gpu/run_log.txt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from frbuild import FIXTURES

from gpuhealth.flightrec.verdict import triage
from gpuhealth.model import StepRecord

NCCL = FIXTURES / "nccl_2gpu"


def _steps(mode: str) -> list[StepRecord]:
    return [StepRecord.from_dict(json.loads(line)) for p in sorted((NCCL / mode).glob("steps_rank*.jsonl"))
            for line in p.read_text().splitlines()]


@pytest.mark.parametrize(("mode", "verdict", "code", "rank"), [
    ("hang_sleep", "hang", "collective.missing_rank", 1),
    ("type_mismatch", "mismatch", "collective.type_mismatch", 1),
    ("dtype_mismatch", "mismatch", "collective.dtype_mismatch", 1),
    ("straggler", "straggler", "rank.straggler", 1),
])
def test_real_nccl_faults(mode: str, verdict: str, code: str, rank: int) -> None:
    rep = triage(NCCL / mode / "dumps")
    assert rep.verdict == verdict
    assert [(f.code, f.evidence["rank"]) for f in rep.findings] == [(code, rank)]
    assert rep.ranks_seen == [0, 1] and rep.ranks_missing == []


def test_real_nccl_hang_details() -> None:
    f = triage(NCCL / "hang_sleep" / "dumps").findings[0]
    assert f.evidence["op"] == "nccl:all_reduce" and f.evidence["seq"] == 11
    assert f.evidence["waiting_ranks"] == [0]
    assert any("job.py" in s for s in f.evidence["stack"])


def test_real_nccl_straggler_from_durations_and_from_steps_agree() -> None:
    by_fr = triage(NCCL / "straggler" / "dumps").findings
    by_steps = triage(NCCL / "straggler" / "dumps", steps=_steps("straggler")).findings
    assert by_fr[0].evidence["measure"] == "flight-recorder duration_ms"
    assert [(f.code, f.evidence["rank"]) for f in by_steps] == [("rank.straggler", 1)]
    assert by_steps[0].evidence["measure"] == "step records"
    assert by_steps[0].evidence["since_step"] == 10


def test_real_nccl_healthy_is_quiet() -> None:
    rep = triage(NCCL / "healthy" / "dumps", steps=_steps("healthy"))
    assert rep.verdict == "healthy" and rep.findings == []


def test_real_nccl_tail_mode_agrees(tmp_path: Path) -> None:
    rep = triage(NCCL / "type_mismatch" / "dumps", tail_entries=4)
    assert [(f.code, f.evidence["rank"]) for f in rep.findings] == [("collective.type_mismatch", 1)]
