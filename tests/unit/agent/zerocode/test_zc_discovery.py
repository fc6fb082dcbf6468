"""Job discovery over real child processes with set environments; GPU process listing when NVML's entries
carry no PID; what a process's environment says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpuhealth.agent.view import GpuProcess
from gpuhealth.agent.zerocode.discovery import discover, path_in_process
from gpuhealth.agent.zerocode.environ import launch_info, launch_variables, ras_address
from gpuhealth.agent.zerocode.gpuprocs import device_holders, gpu_processes
from gpuhealth.backends.nvml_real import plain
from gpuhealth.collectors.base import GpuIdentity

SLEEPER = "import sys, time; sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(120)"


def _spawn(env: dict[str, str], *, user: int | None = None) -> subprocess.Popen[bytes]:
    base = {"PATH": os.environ.get("PATH", "")}
    p = subprocess.Popen([sys.executable, "-c", SLEEPER], env={**base, **env}, stdout=subprocess.PIPE,
                         user=user)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    return p


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def _torchrun_env(run_id: str, rank: int, world: int, **extra: str) -> dict[str, str]:
    return {"TORCHELASTIC_RUN_ID": run_id, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", **extra}


def test_real_processes_become_jobs_and_ranks_and_others_stay_listed_by_gpu(procs: list[Any]) -> None:
    pipe = launch_variables("j1")
    a0 = _spawn(_torchrun_env("job-a", 0, 2, **pipe))
    a1 = _spawn(_torchrun_env("job-a", 1, 2, **pipe))
    b3 = _spawn({"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                 "MASTER_ADDR": "node7", "NCCL_RAS_ENABLE": "0"})
    other = _spawn({"HOME": "/root"})
    procs += [a0, a1, b3, other]
    nvml = [GpuProcess(0, "GPU-0", a0.pid, 1 << 30), GpuProcess(1, "GPU-1", a1.pid), GpuProcess(1, "GPU-1", b3.pid),
            GpuProcess(2, "GPU-2", b3.pid), GpuProcess(3, "GPU-3", other.pid), GpuProcess(3, "GPU-3", 999_999_999)]
    disc = discover(nvml)
    assert {p.pid for p in disc.processes} == {a0.pid, a1.pid, b3.pid, other.pid}  # the vanished PID is dropped
    jobs = {j.job_id: j for j in disc.jobs()}
    assert sorted(jobs) == ["4242", "job-a"]
    assert sorted(jobs["job-a"].ranks) == [0, 1] and jobs["job-a"].world_size == 2
    r0 = jobs["job-a"].ranks[0]
    assert r0.gpus == ((0, "GPU-0"),) and r0.used_memory_bytes == 1 << 30 and r0.uid == os.getuid()
    assert r0.launch is not None and r0.launch.dump_ready is None and r0.ns_pid == a0.pid
    slurm = jobs["4242"].ranks[3]
    assert slurm.gpus == ((1, "GPU-1"), (2, "GPU-2")) and slurm.launch is not None
    assert not slurm.launch.ras_enabled and slurm.launch.local_rank == 1
    assert "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" in (slurm.launch.dump_ready or "")
    plain_proc = disc.by_pid(other.pid)
    assert plain_proc is not None and not plain_proc.is_rank and plain_proc.to_dict()["gpus"] == [{"index": 3,
                                                                                                 "uuid": "GPU-3"}]
    ident = r0.identity("node-1")
    assert ident is not None and (ident.job_id, ident.rank, ident.world_size, ident.gpu_uuid, ident.found_by) == (
        "job-a", 0, 2, "GPU-0", "discovered")


def _as_user(uid: int, fn: Any) -> Any:
    """``fn()`` in a forked child that dropped to ``uid`` (its result comes back as JSON)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_another_users_process_is_listed_with_the_permission_it_lacks(procs: list[Any], tmp_path: Path) -> None:
    if os.getuid() == 0:  # as root: an unprivileged agent (a child that dropped to uid 65534) looks at a root process
        rank = _spawn(_torchrun_env("job-x", 0, 1))
        procs.append(rank)
        seen = _as_user(65534, lambda: discover([GpuProcess(0, "GPU-0", rank.pid)]).processes[0].to_dict())
    else:  # unprivileged already: PID 1 belongs to root
        seen = discover([GpuProcess(0, "GPU-0", 1)]).processes[0].to_dict()
    assert seen["rank"] is None and seen["uid"] == 0
    assert "permission denied" in seen["error"] and "CAP_SYS_PTRACE" in seen["error"]


def test_environment_rules() -> None:
    li = launch_info({"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                      "MASTER_PORT": "29500"})
    assert li.job_id == "torch:h:29500" and li.is_rank  # torchrun without --rdzv-id: named by its rendezvous
    assert launch_info({"RANK": "4", "WORLD_SIZE": "2"}).rank is None  # contradicting variables say nothing
    assert not launch_info({"HOME": "/root"}).torch_like
    assert ras_address({}) == ("localhost", 28028)
    assert ras_address({"NCCL_RAS_ADDR": "127.0.0.1:28100"}) == ("127.0.0.1", 28100)
    assert ras_address({"NCCL_RAS_ADDR": "[::1]:28101"}) == ("::1", 28101)
    assert ras_address({"NCCL_RAS_ADDR": "myhost"}) == ("myhost", 28028)
    v = launch_variables("job 7/x", folder="/scratch")
    assert v["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == "/scratch/gpuhealth-job_7_x-pipe-"
    assert launch_info(v).dump_ready is None
    assert path_in_process(12, "/tmp/x") == Path("/proc/12/root/tmp/x")
    assert path_in_process(12, "rel/x") == Path("/proc/12/cwd/rel/x")


class _Backend:
    """NVML as a backend may answer: entries with and without a readable PID."""

    simulated = False

    def __init__(self, entries: dict[int, list[Any]]) -> None:
        self.entries = entries

    def query(self, index: int, key: str) -> Any:
        if key == "ComputeRunningProcesses":
            return self.entries[index]
        if key == "MinorNumber":
            return 3 if index == 0 else 7
        raise KeyError(key)


def test_gpu_processes_from_nvml_and_from_device_holders_when_nvml_gives_no_pid(procs: list[Any]) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import time; f = open('/dev/null'); print('up', flush=True); "
                               "time.sleep(120)"], stdout=subprocess.PIPE)
    procs.append(holder)
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"up"
    friendly = pynvml.nvmlFriendlyObject({"pid": holder.pid, "usedGpuMemory": 1 << 20})
    # pynvml's process objects become plain dicts with their PID (they were reprs once, on 2 x H200)
    assert plain(friendly) == {"pid": holder.pid, "usedGpuMemory": 1 << 20}
    gpus = [GpuIdentity(0, "GPU-a", "H200", "0000:01:00.0", 0), GpuIdentity(1, "GPU-b", "H200", "0000:02:00.0", 1)]
    backend = _Backend({0: [repr(friendly)], 1: [{"pid": 4321, "usedGpuMemory": 2**64 - 1}]})
    found = gpu_processes(backend, gpus, major=os.major(os.stat("/dev/null").st_rdev))  # /dev/null stands in
    assert GpuProcess(1, "GPU-b", 4321, None) in found
    assert GpuProcess(0, "GPU-a", holder.pid, None) in found  # found holding the "GPU" device (minor 3)
    assert all(p.pid != os.getpid() for p in device_holders({3: gpus[0]}, major=1))  # never the agent itself


def test_the_zerocode_section_of_the_config_sets_the_watcher(tmp_path: Path) -> None:
    """Operators tune zero-code like every other part: a ``zerocode:`` section or GPUHEALTH_ZEROCODE_* variables
    (the periodic dump interval was fixed at 300 s before)."""
    from gpuhealth.agent.extensions import default_extensions
    from gpuhealth.agent.zerocode.watcher import ZeroCodeWatcher, settings_from
    from gpuhealth.config import ConfigError, load_config

    cfg = load_config(env={"GPUHEALTH_ZEROCODE_PERIODIC_DUMP_S": "60", "GPUHEALTH_ZEROCODE_HANG_THRESHOLD_S": "45",
                           "GPUHEALTH_AGENT_SOCKET_PATH": str(tmp_path / "agent.sock")})
    got = settings_from(cfg)
    assert (got.periodic_dump_s, got.hang_threshold_s, got.poll_interval_s) == (60.0, 45.0, 5.0)
    assert got.evidence_dir == str(tmp_path / "zerocode")  # beside the rank socket
    (tmp_path / "z.yaml").write_text("zerocode:\n  enabled: false\n")
    off = load_config(tmp_path / "z.yaml", env={"GPUHEALTH_AGENT_SOCKET_PATH": ""})
    assert not any(isinstance(e, ZeroCodeWatcher) for e in default_extensions(off))
    with pytest.raises(ConfigError, match=r"zerocode\.hang_threshold_s"):
        load_config(env={"GPUHEALTH_ZEROCODE_HANG_THRESHOLD_S": "0"})
