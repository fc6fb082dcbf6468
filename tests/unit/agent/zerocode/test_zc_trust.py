"""Zero-code trusts the kernel, not what a job says about itself (issue 24, item 4): a job id from a process's
environment is bound to the user that runs it, and NCCL RAS is asked only on loopback whatever NCCL_RAS_ADDR says.
(A FIFO the rank's own user could not write is refused: test_zc_fifo.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpuhealth
from gpuhealth.agent.view import GpuProcess
from gpuhealth.agent.zerocode import ras
from gpuhealth.agent.zerocode.discovery import discover
from gpuhealth.agent.zerocode.watcher import ZeroCodeSettings, ZeroCodeWatcher

SLEEPER = "import sys, time; sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(120)"


def _spawn(env: dict[str, str], user: int | None = None) -> subprocess.Popen[bytes]:
    if user is not None:  # another user cannot run this checkout's interpreter: a plain sleep holds the environment
        return subprocess.Popen(["sleep", "120"], env={"PATH": "/usr/bin:/bin", **env}, user=user, group=user,
                                extra_groups=[], cwd="/")
    p = subprocess.Popen([sys.executable, "-c", SLEEPER], env={"PATH": os.environ.get("PATH", ""), **env},
                         stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    return p


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def _rank(job: str, rank: int, **extra: str) -> dict[str, str]:
    return {"GPUHEALTH_JOB_ID": job, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", **extra}


def test_another_users_process_cannot_join_a_job_by_naming_it(procs: list[Any]) -> None:
    if os.getuid() != 0:
        pytest.fail("this test runs processes as two users; run the suite as root (scripts/test.sh does)")
    victim = [_spawn(_rank("victimjob", r), user=65534) for r in (0, 1)]
    procs += victim
    for p in victim:  # wait until each has exec'd sleep: its environment is then the one given
        deadline = time.monotonic() + 30
        while not Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"sleep"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    owners: dict[str, int] = {}
    gpus = [GpuProcess(r, f"GPU-{r}", p.pid) for r, p in enumerate(victim)]
    first = discover(gpus, owners=owners)
    assert [(j.job_id, sorted(j.ranks)) for j in first.jobs()] == [("victimjob", [0, 1])]
    assert owners == {"victimjob": 65534}
    # root's (or any other user's) process names the job and rank 0, twice over: it stays apart
    intruders = [_spawn(_rank("victimjob", 0)), _spawn(_rank("victimjob", 0))]
    procs += intruders
    gpus += [GpuProcess(2, "GPU-2", p.pid) for p in intruders]
    later = discover(gpus, owners=owners)
    jobs = {j.job_id: j for j in later.jobs()}
    assert sorted(jobs) == ["victimjob", "victimjob~uid0"]
    assert {p.pid for p in jobs["victimjob"].ranks.values()} == {p.pid for p in victim}
    assert all(i.job_id == "victimjob" for p in victim for i in [later.by_pid(p.pid).identity("n")]  # type: ignore
               if i is not None)


def test_nccl_ras_is_asked_only_on_loopback(procs: list[Any], tmp_path: Path) -> None:
    elsewhere = [_spawn(_rank("far", r, NCCL_RAS_ADDR="203.0.113.5:28028")) for r in (0, 1)]
    local = [_spawn(_rank("near", r, NCCL_RAS_ADDR="127.0.0.1:28099")) for r in (0, 1)]
    procs += elsewhere + local
    asked: list[tuple[str, int]] = []

    def query(host: str, port: int, **_kw: Any) -> ras.RasReply:
        asked.append((host, port))
        raise ras.RasUnavailable("nothing listens here")

    gpus = [GpuProcess(i, f"GPU-{i}", p.pid) for i, p in enumerate(elsewhere + local)]
    watcher = ZeroCodeWatcher(ZeroCodeSettings(evidence_dir=str(tmp_path)), processes=lambda: gpus, query=query)
    findings = {f.entity.id: f for f in watcher.poll_once(1000.0).findings if f.code == "ras.unavailable"}
    assert asked == [("localhost", 28099)]  # never 203.0.113.5, whatever the job's environment says
    assert "not loopback" in findings["far"].message


def test_a_known_process_is_read_once_and_a_new_one_with_its_pid_again(procs: list[Any], monkeypatch: Any) -> None:
    # issue 27: a poll reads /proc/<pid>/stat of a process it knows, not its environ, status, cmdline and cgroup
    from gpuhealth.agent.zerocode import discovery

    p = _spawn(_rank("cached", 0))
    procs.append(p)
    cache = discovery.InspectCache()
    gpus = [GpuProcess(0, "GPU-0", p.pid)]
    first = discover(gpus, cache=cache)
    reads: list[int] = []
    real = discovery.inspect_process
    monkeypatch.setattr(discovery, "inspect_process", lambda pid, *a, **k: reads.append(pid) or real(pid, *a, **k))
    again = discover([GpuProcess(1, "GPU-1", p.pid, 5)], cache=cache)
    assert reads == [] and again.processes[0].launch == first.processes[0].launch
    assert again.processes[0].gpus == ((1, "GPU-1"),) and again.processes[0].used_memory_bytes == 5
    p.kill()
    p.wait()
    assert discover(gpus, cache=cache).processes == ()  # gone: forgotten
    q = _spawn(_rank("cached", 1))
    procs.append(q)
    discover([GpuProcess(0, "GPU-0", q.pid)], cache=cache)
    assert reads == [q.pid]  # a new process is read in full


def test_the_triage_child_is_capped_under_the_pod_limit_and_killed_first(tmp_path: Path) -> None:
    # The agent's triage child shares the agent's cgroup (256 Mi on Kubernetes): 768 MiB of address space and the
    # OOM killer's first pick, so a triage that runs the pod short of memory costs the child, never the agent.
    from gpuhealth.agent.zerocode.evidence import _CHILD, TRIAGE_MEMORY_BYTES

    (tmp_path / "oomprobe.py").write_text("import resource\nprint(open('/proc/self/oom_score_adj').read().strip(), "
                                          "resource.getrlimit(resource.RLIMIT_AS)[0])\n")
    out = subprocess.run([sys.executable, "-c", _CHILD.replace("gpuhealth.cli.main", "oomprobe"),
                          str(TRIAGE_MEMORY_BYTES), "60"], capture_output=True, text=True, timeout=60, check=True,
                         env={"PYTHONPATH": f"{tmp_path}:{Path(gpuhealth.__file__).parents[1]}"})  # + the sandbox
    assert out.stdout.split() == ["1000", str(768 << 20)]
