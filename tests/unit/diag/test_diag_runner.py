"""The child-process runner: GPU-time budget, per-GPU locks, busy GPUs, timeouts, bad children."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import DiagConfig
from gpuhealth.diag.runner import DiagRunner, GpuBudget, GpuLocks, user_processes

GPUS = [GpuIdentity(0, "GPU-a", "NVIDIA H200", "00000000:00:06.0"),
        GpuIdentity(1, "GPU-b", "NVIDIA H200", "00000000:00:07.0")]


class Clock:
    def __init__(self) -> None:
        self.t = 10_000.0

    def __call__(self) -> float:
        return self.t


def fake_child(tmp_path: Path, body: str) -> str:
    """A stand-in interpreter: a script that accepts ``-m gpuhealth.diag ARGS`` and runs ``body``."""
    script = tmp_path / "fakepython"
    script.write_text(f"#!{sys.executable}\nimport json, sys, time, os\nargs = sys.argv[3:]\n"
                      + textwrap.dedent(body))
    script.chmod(0o755)
    return str(script)


OK_CHILD = """
devs = args[args.index("--device") + 1].split(",") if "--device" in args else []
uuids = {"cuda:0": "GPU-a", "cuda:1": "GPU-b"}
print(json.dumps({"diag": args[0], "status": "ok", "reason": "", "findings": [],
                  "gpu_seconds": {uuids[d]: 4.0 for d in devs}, "result": {"argv": args,
                  "env": os.environ.get("CUDA_DEVICE_ORDER")}}))
"""


def test_budget_is_a_sliding_hour(tmp_path: Path) -> None:
    clock = Clock()
    b = GpuBudget(tmp_path / "b.json", per_hour=10.0, clock=clock)
    assert b.remaining("g") == 10.0
    b.charge("sdc", "g", 4.0)
    clock.t += 1800
    b.charge("sdc", "g", 5.0)
    assert b.remaining("g") == pytest.approx(1.0)
    assert b.estimate("sdc", "g") == 5.0  # the last measured run
    clock.t += 1801  # the first charge left the window
    assert b.remaining("g") == pytest.approx(5.0)


def test_runs_are_refused_once_the_budget_is_spent_and_charged_what_the_child_reports(tmp_path: Path) -> None:
    clock = Clock()
    runner = DiagRunner(DiagConfig(gpu_seconds_per_hour=10.0), state_dir=tmp_path, clock=clock,
                        python=fake_child(tmp_path, OK_CHILD))
    first = runner.run("sdc", gpus=GPUS)
    assert first.status == "ok" and first.gpus == ["GPU-a", "GPU-b"]
    assert first.result["argv"][-2:] == ["--device", "cuda:0,cuda:1"]
    assert first.result["env"] == "PCI_BUS_ID"  # CUDA numbering = NVML numbering
    assert runner.budget.spent("GPU-a") == pytest.approx(4.0)
    runner.run("sdc", gpus=GPUS)  # 8 of 10 s spent; the next needs ~4 s
    third = runner.run("sdc", gpus=GPUS)
    assert third.status == "skipped" and "budget" in third.reason
    assert set(third.skipped_gpus) == {"GPU-a", "GPU-b"}
    assert runner.budget.spent("GPU-a") == pytest.approx(8.0)  # a refused run costs nothing
    forced = runner.run("sdc", gpus=GPUS, enforce_budget=False)  # a person asked: run, but charge it
    assert forced.status == "ok" and runner.budget.spent("GPU-a") == pytest.approx(12.0)
    clock.t += 3601
    assert runner.run("sdc", gpus=GPUS).status == "ok"


def test_a_locked_gpu_is_left_out(tmp_path: Path) -> None:
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path, python=fake_child(tmp_path, OK_CHILD))
    with GpuLocks(tmp_path / "locks").hold(["GPU-a"]) as (mine, busy):
        assert mine == ["GPU-a"] and busy == []
        with GpuLocks(tmp_path / "locks").hold(["GPU-a", "GPU-b"]) as (mine2, busy2):
            assert mine2 == ["GPU-b"] and busy2 == ["GPU-a"]
        out = runner.run("sdc", gpus=GPUS)
        assert out.gpus == ["GPU-b"] and "lock" in out.skipped_gpus["GPU-a"]
        assert out.result["argv"][-1] == "cuda:1"
    assert runner.run("sdc", gpus=GPUS).gpus == ["GPU-a", "GPU-b"]  # released


def test_gpus_with_user_processes_are_skipped_unless_forced(tmp_path: Path) -> None:
    backend = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "overrides": {
        "1": {"ComputeRunningProcesses": [{"pid": 4242, "usedGpuMemory": 1 << 30}]}}})
    backend.init()
    assert user_processes(backend, 0) == [] and user_processes(backend, 1) == [4242]
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path, backend=backend, python=fake_child(tmp_path, OK_CHILD))
    out = runner.run("sdc", gpus=GPUS)
    assert out.gpus == ["GPU-a"] and "4242" in out.skipped_gpus["GPU-b"]
    busbw = runner.run("busbw", gpus=GPUS, min_gpus=2)
    assert busbw.status == "skipped" and "needs 2" in busbw.reason
    assert runner.run("sdc", gpus=GPUS, force=True).gpus == ["GPU-a", "GPU-b"]
    assert DiagRunner(DiagConfig(run_on_busy_gpus=True), state_dir=tmp_path / "other", backend=backend,
                      python=fake_child(tmp_path, OK_CHILD)).run("sdc", gpus=GPUS).gpus == ["GPU-a", "GPU-b"]


def test_a_hung_child_is_killed_and_charged_its_wall_time(tmp_path: Path) -> None:
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path, python=fake_child(tmp_path, "time.sleep(60)\n"))
    out = runner.run("sdc", gpus=GPUS[:1], timeout_s=1.0)
    assert out.status == "timeout" and out.wall_s < 10
    assert runner.budget.spent("GPU-a") >= 1.0


def test_a_child_that_prints_garbage_is_a_failure_with_its_stderr(tmp_path: Path) -> None:
    body = "print('not json'); sys.stderr.write('boom: CUDA error\\n'); sys.exit(1)\n"
    out = DiagRunner(DiagConfig(), state_dir=tmp_path, python=fake_child(tmp_path, body)).run("sdc", gpus=GPUS[:1])
    assert out.status == "failed" and "boom: CUDA error" in out.reason


def test_a_missing_interpreter_is_a_failure_not_an_exception(tmp_path: Path) -> None:
    out = DiagRunner(DiagConfig(), state_dir=tmp_path, python=str(tmp_path / "nope")).run("sdc", gpus=GPUS)
    assert out.status == "failed" and "cannot start" in out.reason


def test_a_child_that_skipped_costs_no_gpu_time(tmp_path: Path) -> None:
    body = ('print(json.dumps({"diag": "sdc", "status": "skipped", "reason": "CUDA is not available", '
            '"findings": [], "gpu_seconds": {}, "result": {}}))\n')
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path, python=fake_child(tmp_path, body))
    out = runner.run("sdc", gpus=GPUS)
    assert out.status == "skipped" and out.reason == "CUDA is not available"
    assert runner.budget.spent("GPU-a") == 0.0


def test_a_clock_stepped_back_holds_the_budget_for_an_hour_not_for_the_step(tmp_path: Path) -> None:
    clock = Clock()
    clock.t = 1_800_000_000.0
    b = GpuBudget(tmp_path / "b.json", per_hour=10.0, clock=clock)
    b.charge("sdc", "g", 10.0)
    clock.t -= 86_400  # NTP steps the clock back a day
    assert b.remaining("g") == 0.0  # what was spent still counts…
    clock.t += 3601
    assert b.remaining("g") == 10.0  # …for an hour from the step, not for a day
    b.charge("sdc", "g", 3.0)
    assert GpuBudget(tmp_path / "b.json", per_hour=10.0, clock=clock).remaining("g") == pytest.approx(7.0)


def test_two_processes_charging_one_budget_at_once_are_both_counted(tmp_path: Path) -> None:
    """The agent's screens and an operator's ``gpuhealth diag`` share ``diag-budget.json``."""
    script = textwrap.dedent(f"""
        from gpuhealth.diag.runner import GpuBudget
        b = GpuBudget({str(tmp_path / 'diag-budget.json')!r}, per_hour=1e9)
        for _ in range(150):
            b.charge("sdc", "GPU-a", 0.01)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert GpuBudget(tmp_path / "diag-budget.json", per_hour=1e9).spent("GPU-a") == pytest.approx(3.0)


def test_an_aborted_run_does_not_make_a_whole_one_look_cheap(tmp_path: Path) -> None:
    """A screen aborted 0.1 s in is charged what it held, but the next screen is still estimated at what a
    whole one cost: a budget that cannot pay for that does not start it."""
    child = fake_child(tmp_path, """
if os.environ.get("SLOW"):
    time.sleep(30)
print(json.dumps({"diag": args[0], "status": "ok", "reason": "", "findings": [], "result": {},
                  "gpu_seconds": {"GPU-a": 6.0}}))
""")
    clock = Clock()
    runner = DiagRunner(DiagConfig(gpu_seconds_per_hour=10.0), state_dir=tmp_path, clock=clock, python=child)
    assert runner.run("quick", gpus=GPUS[:1]).status == "ok"  # a whole screen: 6 GPU-s
    clock.t += 3601  # a fresh hour
    runner.env["SLOW"] = "1"
    aborted = runner.run("quick", gpus=GPUS[:1], watch=lambda pid, _gpus: "a job started" if pid else None)
    assert aborted.status == "aborted" and runner.budget.spent("GPU-a") < 6.0
    assert runner.budget.estimate("quick", "GPU-a") == 6.0
    del runner.env["SLOW"]
    assert runner.run("quick", gpus=GPUS[:1]).status == "ok"  # 6 + the abort's fraction: within 10
    refused = runner.run("quick", gpus=GPUS[:1])
    assert refused.status == "skipped" and "the run needs ~6.0 s" in refused.reason
    clock.t += 3601
    runner.env["SLOW"] = "1"
    assert runner.run("quick", gpus=GPUS[:1], timeout_s=0.5).status == "timeout"
    assert runner.budget.estimate("quick", "GPU-a") == 6.0


def test_the_child_keeps_compiled_kernels_beside_the_runners_state(tmp_path: Path) -> None:
    # Triton's default cache (~/.triton) is unwritable for the systemd agent: without this every screen recompiled
    # the SDC hash. A site's own TRITON_CACHE_DIR wins.
    child = """
print(json.dumps({"diag": args[0], "status": "ok", "reason": "", "findings": [], "gpu_seconds": {},
                  "result": {"triton": os.environ.get("TRITON_CACHE_DIR")}}))
"""
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path / "st", python=fake_child(tmp_path, child), env={})
    assert runner.run("sdc", gpus=GPUS).result["triton"] == str(tmp_path / "st" / "triton-cache")
    site = DiagRunner(DiagConfig(), state_dir=tmp_path / "st", python=fake_child(tmp_path, child),
                      env={"TRITON_CACHE_DIR": "/srv/triton"})
    assert site.run("sdc", gpus=GPUS).result["triton"] == "/srv/triton"
