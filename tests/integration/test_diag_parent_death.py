"""An agent killed while a screen's child is still starting leaves nothing running on the GPUs.

PR_SET_PDEATHSIG only covers a parent that dies after the child asked for it; the child asks once its
interpreter is up. An agent SIGKILLed in between (a slow start on a loaded node) used to leave the
child reparented, holding no lock (the per-GPU locks died with the agent), running its whole
diagnostic on GPUs the next job takes. Here the real ``python -m gpuhealth.diag`` child starts through
a wrapper that waits before ``exec`` (the slow start), and the agent stand-in is SIGKILLed meanwhile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import running

if not sys.platform.startswith("linux"):  # PR_SET_PDEATHSIG and /proc
    pytest.skip("Linux only", allow_module_level=True)

# A diagnostic that would run for minutes on the CPU if it ran at all.
LONG_DIAG = ["sdc", "--device", "cpu", "--repeats", "100000", "--reruns", "0"]


def _wait_for(path: Path, timeout_s: float) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def _agent_standin(tmp_path: Path, delay_s: float) -> tuple[subprocess.Popen[bytes], Path]:
    """A process that runs the diagnostic through ``DiagRunner`` as the agent does, with ``diag.python``
    a wrapper that records its PID, sleeps ``delay_s`` and then ``exec``s the real interpreter."""
    wrapper = tmp_path / "slow-python"
    pidfile = tmp_path / "child.pid"
    wrapper.write_text(f"#!/bin/sh\necho $$ > '{pidfile}'\nsleep {delay_s}\nexec '{sys.executable}' \"$@\"\n")
    wrapper.chmod(0o755)
    script = textwrap.dedent(f"""
        from gpuhealth.config import DiagConfig
        from gpuhealth.diag.runner import DiagRunner
        runner = DiagRunner(DiagConfig(), state_dir={str(tmp_path / 'state')!r}, python={str(wrapper)!r})
        print(runner.run({LONG_DIAG[0]!r}, {LONG_DIAG[1:]!r}, timeout_s=600).to_dict(), flush=True)
    """)
    agent = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    return agent, pidfile


def test_child_of_an_agent_killed_during_its_start_does_not_run(tmp_path: Path) -> None:
    agent, pidfile = _agent_standin(tmp_path, delay_s=1.0)
    try:
        child = int(_wait_for(pidfile, 30.0))
        os.kill(agent.pid, signal.SIGKILL)  # the child's interpreter has not started yet
        agent.wait()
        assert running(child), "the child must outlive the agent's death to test this"
        # it execs the real child after the wrapper's second; that must exit as soon as it is up
        end = time.monotonic() + 15.0
        while running(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not running(child), "the orphaned diagnostic child kept running after its agent died"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if pidfile.exists():
            pid = int(pidfile.read_text().strip() or 0)
            if pid and running(pid):
                os.kill(pid, signal.SIGKILL)


def test_child_whose_agent_lives_runs_through_a_wrapper(tmp_path: Path) -> None:
    """The check must not refuse a healthy run: the wrapper ``exec``s, and a wrapper that stays between
    (no ``exec``) is an ancestor, not a dead parent."""
    wrapper = tmp_path / "wrapping-python"
    wrapper.write_text(f"#!/bin/sh\n'{sys.executable}' \"$@\"\n")  # no exec: one more process between
    wrapper.chmod(0o755)
    script = textwrap.dedent(f"""
        import json
        from gpuhealth.config import DiagConfig
        from gpuhealth.diag.runner import DiagRunner
        runner = DiagRunner(DiagConfig(), state_dir={str(tmp_path / 'state')!r}, python={str(wrapper)!r})
        print(json.dumps(runner.run("probe", timeout_s=120).to_dict()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=True)
    assert '"status": "ok"' in out.stdout, out.stdout + out.stderr
