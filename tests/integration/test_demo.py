"""The README's run command: agent + coordinator on the bundled recording, labelled SIMULATED, with
the demo job's slow rank found by the coordinator."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.integration
def test_demo_runs_simulated_and_finds_the_slow_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run(
        [sys.executable, "-m", "gpuhealth.cli.main", "demo", "--simulate", "--duration", "1",
         "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, check=False,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines[0].startswith("[SIMULATED]") and "nvml_h200x2.json" in lines[0]
    assert "agent registered with the coordinator" in out.stdout
    assert "GPU 0 NVIDIA H200" in out.stdout and "healthy" in out.stdout
    # the job's straggler (rank 2, twice the compute) is named by the coordinator
    assert "straggler rank 2" in out.stdout, out.stdout
    # the straggling CPU rank stands in for a rank on recorded GPU 0: the coordinator joins the two
    assert "rank 2, node demo-node GPU 0" in " ".join(out.stdout.split()), out.stdout
    assert (tmp_path / "coordinator.db").exists()


@pytest.mark.integration
def test_sigterm_stops_the_demo_and_everything_it_started(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import signal
    import time

    import psutil

    demo = subprocess.Popen(
        [sys.executable, "-m", "gpuhealth.cli.main", "demo", "--simulate", "--no-job", "--duration", "0",
         "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    try:
        assert demo.stdout is not None
        deadline = time.monotonic() + 120
        for line in demo.stdout:  # until the agent has registered: both children are up
            if "agent registered with the coordinator" in line or time.monotonic() > deadline:
                break
        children = psutil.Process(demo.pid).children(recursive=True)
        commands = [" ".join(c.cmdline()) for c in children]
        assert any(" agent " in f" {c} " for c in commands) and any(" coordinator " in f" {c} " for c in commands)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=15)
        assert alive == [], [" ".join(p.cmdline()) for p in alive]
        assert "stopped" in demo.stdout.read()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
