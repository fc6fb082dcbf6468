"""Quick qualification in one warm process per GPU (diag/quick.py), on the CPU path: real rank
processes, a real Gloo process group, the real SDC, bandwidth and busbw code. Ranks stand in for
GPUs; the judgement across them is the one a GPU node gets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhealth.config import DiagConfig
from gpuhealth.diag.qualify import split_quick
from gpuhealth.diag.quick import PHASES
from gpuhealth.diag.runner import DiagRunner

pytestmark = pytest.mark.integration

SMALL = ["--sizes", "65536,1048576", "--iters", "3", "--warmup", "1", "--d2d-mib", "16", "--reps", "2"]


def _run(tmp_path: Path, *extra: str) -> tuple[list, dict]:
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path / "state")
    outcome = runner.run("quick", ["--device", "cpu", "--world", "3", "--golden-dir", str(tmp_path / "gold"),
                                   "--node", "n1", *SMALL, *extra], timeout_s=240)
    assert outcome.status == "ok", outcome.reason
    return split_quick(outcome)


@pytest.mark.slow
def test_one_warm_rank_per_device_runs_every_diagnostic_with_its_own_judgement(tmp_path: Path) -> None:
    (sdc, busbw, bandwidth), phases = _run(tmp_path)
    assert [(o.diag, o.status) for o in (sdc, busbw, bandwidth)] == [("sdc", "ok"), ("busbw", "ok"),
                                                                       ("bandwidth", "ok")]
    # SDC on three devices, judged together: unanimous, so the golden is recorded as one run records it
    assert [d["device"] for d in sdc.result["devices"]] == ["cpu:0", "cpu:1", "cpu:2"]
    assert sdc.result["golden"]["status"] == "recorded" and sdc.findings == []
    assert busbw.result["world"] == 3 and {p["collective"] for p in busbw.result["points"]} == {"all_reduce",
                                                                                                 "all_gather"}
    assert all(p["errors"] == 0 for p in busbw.result["points"])
    assert bandwidth.result["cpu_copy_gbps"] > 0
    assert set(phases) == set(PHASES) and all(v >= 0 for v in phases.values())
    # a second run compares with the golden the first recorded
    (sdc2, _, _), _ = _run(tmp_path)
    assert sdc2.result["golden"]["status"] == "compared" and sdc2.findings == []


def test_a_corrupting_device_is_named_and_its_reruns_come_from_its_own_rank(tmp_path: Path) -> None:
    (sdc, _, _), _ = _run(tmp_path, "--corrupt-rank", "1:single_bit")
    bad = [f for f in sdc.findings if f.code == "sdc.mismatch"]
    assert bad and {f.entity.id for f in bad} == {"cpu-1"}
    # re-run on rank 1 (the only process that holds that device): still wrong → persistent
    assert {f.evidence["persistence"] for f in bad} == {"persistent"}
    assert all(len(f.evidence["reruns"]) == 2 for f in bad)


@pytest.mark.slow
def test_the_same_cases_and_digests_as_the_standalone_sdc(tmp_path: Path) -> None:
    (sdc, _, _), _ = _run(tmp_path)
    alone = subprocess.run([sys.executable, "-m", "gpuhealth.diag", "sdc", "--device", "cpu", "--cpu-peers", "3"],
                           capture_output=True, text=True, timeout=240)
    doc = json.loads(alone.stdout.strip().splitlines()[-1])
    ours = {c["case"]: c["digest"] for c in sdc.result["devices"][0]["cases"]}
    theirs = {c["case"]: c["digest"] for c in doc["result"]["devices"][0]["cases"]}
    assert ours == theirs and len(ours) >= 2
