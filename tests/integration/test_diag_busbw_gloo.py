"""Bus-bandwidth probe for real: Gloo ranks in separate processes, data checked, nccl-tests math."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpuhealth.config import DiagConfig
from gpuhealth.diag.busbw import COLLECTIVES, _Bench, bus_factor
from gpuhealth.diag.runner import DiagRunner

pytestmark = pytest.mark.integration


def test_three_gloo_ranks_run_every_collective_with_correct_data(tmp_path: Path) -> None:
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path)
    out = runner.run("busbw", ["--device", "cpu", "--world", "3", "--sizes", "49152,393216", "--iters", "3",
                               "--warmup", "1"], timeout_s=120)
    assert out.status == "ok", out.reason
    points = out.result["points"]
    assert {p["collective"] for p in points} == set(COLLECTIVES)
    assert len(points) == 12 and out.result["backend"] == "gloo" and out.result["world"] == 3
    for p in points:
        assert p["errors"] == 0, p
        assert p["size_bytes"] % (4 * 3) == 0
        assert p["algbw_gbps"] == pytest.approx(p["size_bytes"] / (p["time_us"] * 1e-6) / 1e9, rel=1e-6)
        assert p["busbw_gbps"] == pytest.approx(p["algbw_gbps"] * bus_factor(p["collective"], 3), rel=1e-6)
    assert out.result["judgement"]["topology"] == "cpu"
    assert out.findings == []  # no reference for the CPU: nothing judged, nothing invented


def test_a_threshold_file_judges_a_real_run(tmp_path: Path) -> None:
    thresholds = tmp_path / "t.yaml"
    thresholds.write_text("cpu:\n  all_reduce: {1024: 1000000.0}\n")  # 1 PB/s: no CPU meets it
    out = DiagRunner(DiagConfig(), state_dir=tmp_path).run(
        "busbw", ["--device", "cpu", "--world", "2", "--sizes", "65536", "--iters", "2", "--warmup", "1",
                  "--collectives", "all_reduce", "--judge-min-bytes", "1024", "--thresholds-file", str(thresholds),
                  "--node", "n7"], timeout_s=120)
    assert out.status == "ok", out.reason
    assert [(f.code, f.severity.name, f.entity.id) for f in out.findings] == [("busbw.low", "CRITICAL", "n7")]


def test_multi_node_mode_under_torchrun(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "gpuhealth.diag",
           "busbw", "--from-env", "--backend", "gloo", "--sizes", "32768", "--iters", "2", "--warmup", "1",
           "--collectives", "all_reduce,sendrecv"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    docs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == 1  # only rank 0 reports
    doc = docs[0]
    assert doc["status"] == "ok" and doc["result"]["world"] == 2
    assert [p["errors"] for p in doc["result"]["points"]] == [0, 0]


def test_the_data_check_catches_a_corrupted_result(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        for coll in COLLECTIVES:
            if coll == "sendrecv":
                continue  # a rank cannot send to itself in Gloo; checked with 3 ranks above
            bench = _Bench(torch, dist, coll, 4096, 0, 1, torch.device("cpu"))
            bench.run(1)
            assert bench.errors() == 0, coll
            target = bench.out if bench.out is not None else bench.inp
            target[17] += 1.0
            assert bench.errors() == 1, coll
    finally:
        dist.destroy_process_group()
