"""Screens never hold a GPU a job wants: a process appearing on a screened GPU (through the NVML backend
the agent uses) or a holder in the block directory ends the screen's child — its whole process group —
within a second, as ``aborted`` with the reason; the screen's own processes never abort it."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import running

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import DiagConfig
from gpuhealth.diag.runner import DiagOutcome, DiagRunner
from gpuhealth.diag.screen import ScreenBlock, ScreenWatch

UUIDS = ("GPU-00000000-1111-2222-3333-444444444440", "GPU-00000001-1111-2222-3333-444444444441")
GPUS = [GpuIdentity(0, UUIDS[0], "NVIDIA H200", "00000000:00:06.0"),
        GpuIdentity(1, UUIDS[1], "NVIDIA H200", "00000000:00:07.0")]

# A stand-in for ``python -m gpuhealth.diag …`` on GPUs: it holds a "GPU" (an exclusive flock on a file,
# released only when the process is gone), starts a "rank" of its own, says it started, then works for
# STANDIN_SECONDS before printing an ok document.
STANDIN = """#!{python}
import fcntl, json, os, subprocess, sys, time
args = sys.argv[3:]
state = os.environ["STANDIN_DIR"]
gpu = open(os.path.join(state, "gpu.standin"), "a+")
fcntl.flock(gpu, fcntl.LOCK_EX)
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(os.path.join(state, "rank.pid"), "w").write(str(rank.pid))
open(os.path.join(state, "started"), "w").write(str(os.getpid()))
time.sleep(float(os.environ.get("STANDIN_SECONDS", "120")))
rank.kill()
print(json.dumps({{"diag": args[0], "status": "ok", "reason": "", "findings": [], "result": {{"argv": args}},
                  "gpu_seconds": {{}}}}))
"""


class Clock:
    """The fake NVML's scenario clock, stepped by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[tuple[str, dict[str, str], Path]]:
    script = tmp_path / "standin-python"
    script.write_text(STANDIN.format(python=sys.executable))
    script.chmod(0o755)
    state = tmp_path / "standin"
    state.mkdir()
    env = {**os.environ, "STANDIN_DIR": str(state)}
    yield str(script), env, state
    pid_file = state / "rank.pid"
    if pid_file.exists():  # never leave a stand-in rank behind, whatever the test did
        try:
            os.kill(int(pid_file.read_text()), 9)
        except ProcessLookupError:
            pass


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    """A 'job' process that NVML will list on a GPU (a real process, not in the screen's group)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def _wait_file(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _gpu_free(state: Path) -> bool:
    with open(state / "gpu.standin", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


def _run_in_thread(runner: DiagRunner, watch: Any, box: list[DiagOutcome]) -> tuple[threading.Thread, list[float]]:
    ended: list[float] = []

    def go() -> None:
        box.append(runner.run("sdc", [], gpus=GPUS, timeout_s=60, watch=watch))
        ended.append(time.monotonic())

    t = threading.Thread(target=go)
    t.start()
    return t, ended


def test_a_process_appearing_on_a_screened_gpu_aborts_the_screen_within_a_second(
        tmp_path: Path, standin: tuple[str, dict[str, str], Path], job: subprocess.Popen[bytes]) -> None:
    python, env, state = standin
    clock = Clock()
    # the job's process appears on GPU 1 when the scenario clock passes 50 s: the same seam (NVML's
    # compute-process list) the agent reads on a real node
    backend = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "events": [
        {"at": 50, "type": "set", "gpu": 1, "key": "ComputeRunningProcesses",
         "value": [{"pid": job.pid, "usedGpuMemory": 1 << 30}]}]}, clock=clock)
    backend.init()
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path / "diag", backend=backend, python=python, env=env)
    box: list[DiagOutcome] = []
    thread, ended = _run_in_thread(runner, ScreenWatch(None, backend), box)
    _wait_file(state / "started")
    time.sleep(0.3)  # the screen runs, the watch polls and finds only the screen's own processes
    assert not box and not _gpu_free(state)
    rank = int((state / "rank.pid").read_text())
    started_job = time.monotonic()
    clock.t = 100.0  # the job starts
    thread.join(timeout=10)
    latency = ended[0] - started_job
    out = box[0]
    assert out.status == "aborted" and out.reason == f"pid {job.pid} started on GPU 1"
    assert latency < 1.0, f"GPUs held {latency:.2f} s after the job started"
    assert _gpu_free(state) and not running(rank)  # the child and the rank it started are gone
    assert out.gpus == list(UUIDS) and runner.budget.spent(UUIDS[0]) > 0  # the time it held is charged


def test_the_block_directory_aborts_a_running_screen_and_holds_off_the_next(
        tmp_path: Path, standin: tuple[str, dict[str, str], Path]) -> None:
    python, env, state = standin
    blocks = tmp_path / "screen-block"
    blocks.mkdir()
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path / "diag", python=python, env=env)
    watch = ScreenWatch(ScreenBlock(blocks), None)
    box: list[DiagOutcome] = []
    thread, ended = _run_in_thread(runner, watch, box)
    _wait_file(state / "started")
    rank = int((state / "rank.pid").read_text())
    taken = time.monotonic()
    # what the Slurm prolog writes (gpuhealth-slurm-lib.sh gh_screen_block)
    (blocks / "job-88").write_text(json.dumps({"holder": "prolog of job 88", "at": time.time(),
                                               "expires": time.time() + 3600}))
    thread.join(timeout=10)
    assert box[0].status == "aborted" and box[0].reason == "screen lock held by prolog of job 88"
    assert ended[0] - taken < 1.0 and _gpu_free(state) and not running(rank)
    # while it is held, the next screen does not start at all
    (state / "started").unlink()
    held = runner.run("sdc", [], gpus=GPUS, watch=watch)
    assert held.status == "skipped" and "prolog of job 88" in held.reason and not (state / "started").exists()


def test_a_screen_runs_to_its_end_when_nothing_wants_the_gpus(
        tmp_path: Path, standin: tuple[str, dict[str, str], Path]) -> None:
    python, env, _ = standin
    backend = FakeNvml.bundled()
    backend.init()
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path / "diag", backend=backend, python=python,
                        env={**env, "STANDIN_SECONDS": "0.5"})
    out = runner.run("sdc", [], gpus=GPUS, watch=ScreenWatch(ScreenBlock(tmp_path / "no-such-dir"), backend))
    assert out.status == "ok" and out.result["argv"][-2:] == ["--device", "cuda:0,cuda:1"]


class ListedProcesses:
    """NVML at the hardware boundary: each GPU lists the PIDs the test puts there."""

    def __init__(self) -> None:
        self.pids: dict[int, list[int]] = {}

    def query(self, index: int, key: str) -> Any:
        assert key == "ComputeRunningProcesses"
        return [{"pid": p, "usedGpuMemory": 1} for p in self.pids.get(index, [])]


def test_the_screens_own_processes_are_not_a_job(job: subprocess.Popen[bytes]) -> None:
    # a screen child in its own session with a rank of its own, as the runner starts them
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(rank.pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout is not None
        rank = int(child.stdout.readline())
        nvml = ListedProcesses()
        watch = ScreenWatch(None, nvml)  # type: ignore[arg-type]
        nvml.pids = {0: [child.pid], 1: [rank]}
        assert watch(child.pid, GPUS) is None
        nvml.pids[1] = [rank, job.pid]
        assert watch(child.pid, GPUS) == f"pid {job.pid} started on GPU 1"
        # PIDs of another PID namespace (an agent in a container without the host's): one per GPU may be
        # the screen's own rank, a second one is not
        nvml.pids = {0: [3_999_999], 1: []}
        assert watch(child.pid, GPUS) is None
        nvml.pids[0].append(3_999_998)
        assert watch(child.pid, GPUS) == "pid 3999998 started on GPU 0"
        # a GPU outside the screen is not its business, unless asked to watch it (collectives)
        nvml.pids = {1: [job.pid]}
        assert watch(child.pid, GPUS[:1]) is None
        assert ScreenWatch(None, nvml, also=GPUS)(child.pid, GPUS[:1]) is not None  # type: ignore[arg-type]
    finally:
        os.killpg(child.pid, 9)
        child.wait()


def test_block_files_that_no_longer_count(tmp_path: Path) -> None:
    now = 1_000_000.0
    block = ScreenBlock(tmp_path, clock=lambda: now)
    assert block.reason() is None
    (tmp_path / ".job-1.tmp").write_text("{}")  # a hook still writing: not yet a holder
    assert block.reason() is None
    (tmp_path / "job-2").write_text(json.dumps({"holder": "prolog of job 2", "at": now - 10, "expires": now - 1}))
    assert block.reason() is None  # expired: a lost epilog does not block screening for ever
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "op").write_text(json.dumps({"holder": "operator", "at": now, "pid": dead.pid}))
    assert block.reason() is None  # its holder process is gone
    (tmp_path / "op").write_text(json.dumps({"holder": "operator", "at": now, "pid": os.getpid()}))
    assert block.reason() == "screen lock held by operator"
    (tmp_path / "garbled").write_text("job 9 was here")  # unreadable: blocks, from its mtime, for a day
    assert block.reason() == "screen lock held by garbled and 1 more"
    os.utime(tmp_path / "garbled", (now - 2 * 86400, now - 2 * 86400))
    assert block.reason() == "screen lock held by operator"
