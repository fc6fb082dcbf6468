"""Privilege separation in the agent, through the real processes (issue 30, "the design change").

A real ``gpuhealth agent`` (on a recording, with a coordinator link to a real ``gpuhealth coordinator``) serves its
rank socket from an unprivileged child: the test finds that child under the agent and reads /proc — its uid
(65534 when the agent runs as root), ``NoNewPrivs: 1``, its address-space and CPU-time limits — and ``ss``
says every accepted rank connection is held by the child, none by the root part. Two real ranks (PyTorch
Gloo processes with the ``gpuhealth.instrument`` Tracker) deliver steps that reach ``/metrics`` and the
coordinator, a live triage (``gpuhealth triage --job``) gets both ranks' flight-recorder dumps through the
child, and when the child is killed the agent says so, keeps running, starts another, the Tracker reconnects
and its steps arrive again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from commands import (
    SCENARIO,
    Agent,
    Coordinator,
    metric_value,
    proc_limit,
    proc_status,
    rank_process_of,
    run_cli,
    until,
    write_config,
)

RANK_SCRIPT = r"""
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from gpuhealth.instrument import Tracker
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
tracker = Tracker(flush_interval_s=0.1)
t = torch.ones(64)
stop = sys.argv[1]
while not os.path.exists(stop):
    with tracker.step():
        time.sleep(0.05)
        with tracker.collective():
            dist.all_reduce(t)
tracker.close()
dist.destroy_process_group()
"""


def _holders(sock: Path) -> set[int]:
    """Pids holding an accepted connection of the listening socket ``sock`` (``ss`` names them)."""
    out = subprocess.run(["ss", "-xpH", "state", "established"], capture_output=True, text=True, check=True).stdout
    pids: set[int] = set()
    for line in out.splitlines():
        if f" {sock} " in f" {line} ":
            pids.update(int(p) for p in re.findall(r"pid=(\d+)", line))
    return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def work() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gh-privsep-") as d:  # short: a unix socket path is ≤ 107 bytes
        yield Path(d)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_rank_socket_is_served_by_an_unprivileged_child_that_is_restarted(work: Path) -> None:
    coord_cfg = write_config(work / "coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": str(work / "coord.db")}})
    coord = Coordinator(work / "coord", coord_cfg)
    sock = work / "run" / "agent.sock"
    agent_cfg = write_config(work / "agent.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "node_name": "privsep-node",
                  "socket_path": str(sock), "state_dir": str(work / "state"), "coordinator": coord.address(),
                  "rank_process_memory_mib": 320, "rank_process_cpu_seconds": 1800},
        "coordinator": {"link_batch_interval_s": 0.2}, "diag": {"enabled": False}})
    agent = Agent(work / "agent", agent_cfg)
    stop = work / "stop"
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        agent.wait_ready()
        child = until(lambda: rank_process_of(agent.proc.pid), 30, "the agent's rank process")
        until(lambda: f"rank process pid {child} serves" in agent.log(), 30, "the rank process serving")
        status = proc_status(child)
        want_uid = "65534" if os.geteuid() == 0 else str(os.geteuid())
        assert status["Uid"].split() == [want_uid] * 4, status["Uid"]
        assert status["Gid"].split()[0] == (want_uid if os.geteuid() == 0 else str(os.getegid()))
        assert status["Groups"].strip() == ("" if os.geteuid() == 0 else status["Groups"].strip())
        assert status["NoNewPrivs"].strip() == "1"
        assert status["CapEff"].strip() == "0000000000000000"
        assert proc_limit(child, "Max address space") == str(320 * 1024 * 1024)
        assert proc_limit(child, "Max cpu time") == "1800"
        assert proc_limit(child, "Max core file size") == "0"
        assert proc_status(agent.proc.pid)["Uid"].split()[0] == str(os.geteuid())  # the root part keeps its uid

        # Two real ranks, the hook in each.
        port = _free_port()
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCH_FR_BUFFER_SIZE": "2000", "GPUHEALTH_SOCKET": str(sock),
                   "GPUHEALTH_JOB_ID": "privsep-job", "PYTHONUNBUFFERED": "1"}
            log = (work / f"rank{rank}.log").open("wb")
            ranks.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(stop)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))

        def connected() -> bool:
            return metric_value(agent.get("/metrics"), "gpuhealth_agent_ranks_connected") == 2

        until(connected, 90, "both ranks connected to the agent")
        holders = until(lambda: _holders(sock), 10, "the ranks' connections in ss")
        assert holders == {child}, (holders, child, agent.proc.pid)  # the root part holds none of them

        until(lambda: (metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_step_records_total") or 0) >= 20,
              30, "step records on /metrics")

        def at_coordinator() -> bool:
            res = run_cli("jobs", "--coordinator", coord.address(), "--json")
            return res.returncode in (0, 1) and "privsep-job" in res.stdout and '"privsep-node"' in res.stdout

        until(at_coordinator, 30, "the job's steps at the coordinator", interval=0.5)

        # A live triage: the coordinator asks the agent, the agent asks the child, the ranks dump.
        res = run_cli("triage", "--job", "privsep-job", "--coordinator", coord.address(), "--json", timeout=120)
        live = json.loads(res.stdout)
        assert res.returncode in (0, 1, 2), res.stdout[:4000]
        assert live["ranks_seen"] == [0, 1], live
        assert live["verdict"] in ("healthy", "straggler", "hang", "mismatch"), live

        # The child killed: reported, the agent keeps running, another child serves, the ranks come back.
        os.kill(child, signal.SIGKILL)
        until(lambda: "rank process stopped" in agent.log(), 20, "the agent's report of the dead rank process")
        assert agent.alive()
        new = until(lambda: (p := rank_process_of(agent.proc.pid)) not in (None, child) and p, 30, "a new rank process")
        until(lambda: f"rank process pid {new} serves" in agent.log(), 30, "the new rank process serving")
        assert proc_status(new)["NoNewPrivs"].strip() == "1"
        assert proc_status(new)["Uid"].split() == [want_uid] * 4
        until(lambda: metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_process_restarts_total") == 1, 20,
              "the restart on /metrics")
        before = metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_step_records_total") or 0
        until(connected, 30, "the ranks reconnected to the new rank process")
        until(lambda: (metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_step_records_total") or 0)
              >= before + 10, 30, "steps through the new rank process")
        assert metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_process_up") == 1
        assert _holders(sock) == {new}
    finally:
        stop.touch()
        for p in ranks:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        agent.stop()
        coord.stop()
    assert not sock.exists()  # the root part removed the socket it made
    for rank in range(2):
        assert "Traceback" not in (work / f"rank{rank}.log").read_text(), (work / f"rank{rank}.log").read_text()


HELLO_SCRIPT = r"""
import os, socket, sys
from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord
path, job, rank, uid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if uid >= 0:
    os.setgid(uid)
    os.setuid(uid)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
s.sendall(protocol.encode(protocol.hello(RankIdentity(job, rank, 4, "h", os.getpid()))))
s.sendall(protocol.encode(protocol.steps([StepRecord(job, rank, 1, 1.7e9, 0.1, 0.08, 0.02)])))
print("sent", flush=True)
sys.stdin.read()
"""


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="another user's process needs setuid (root)")
def test_the_unprivileged_rank_process_still_verifies_a_job_through_the_root_part(work: Path) -> None:
    """A rank of another user joins a job only when its own environment names the job. The rank process
    (uid 65534) cannot read another user's /proc/<pid>/environ: it asks the root part over the channel."""
    os.chmod(work, 0o755)  # the other user's ranks reach the socket's folder
    sock = work / "run" / "agent.sock"
    cfg = write_config(work / "agent.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "socket_path": str(sock),
                  "state_dir": str(work / "state"), "pod_resources_socket": str(work / "none.sock")},
        "diag": {"enabled": False}})
    agent = Agent(work / "agent", cfg)
    procs: list[subprocess.Popen[str]] = []

    def rank(n: int, uid: int, job_env: bool) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("GPUHEALTH_JOB_ID", "SLURM_JOB_ID")}
        if job_env:
            env["GPUHEALTH_JOB_ID"] = "shared"
        p = subprocess.Popen([sys.executable, "-c", HELLO_SCRIPT, str(sock), "shared", str(n), str(uid)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "sent"

    def connected() -> float | None:
        return metric_value(agent.get("/metrics"), "gpuhealth_agent_job_ranks_connected", job_id="shared")

    try:
        agent.wait_ready()
        rank(0, -1, job_env=False)  # the job's owner here: root
        until(lambda: connected() == 1, 30, "the owner's rank")
        rank(1, 65533, job_env=False)  # another user, nothing naming the job: refused
        until(lambda: (metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_socket_refusals_total") or 0) >= 1,
              30, "the stranger refused")
        rank(2, 65533, job_env=True)  # another user whose environment names the job: verified by the root part
        until(lambda: connected() == 2, 30, "the verified rank of another user")
        assert "rank process" in agent.log() and "as uid 65534" in agent.log()
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        agent.stop()


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_root_agent_that_may_not_change_uids_still_gives_the_rank_process_no_capability(work: Path) -> None:
    """A container running as root with CAP_SETUID/CAP_SETGID dropped (the unprivileged overlay drops them all):
    the rank process cannot change uid, says so, and serves as uid 0 with empty capability sets and NoNewPrivs."""
    os.chmod(work, 0o755)
    sock = work / "run" / "agent.sock"
    cfg = write_config(work / "agent.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "socket_path": str(sock),
                  "state_dir": str(work / "state"), "pod_resources_socket": str(work / "none.sock")},
        "diag": {"enabled": False}})
    agent = Agent(work / "agent", cfg, argv_prefix=["setpriv", "--bounding-set=-setuid,-setgid"])
    procs: list[subprocess.Popen[str]] = []
    try:
        agent.wait_ready()
        child = until(lambda: rank_process_of(agent.proc.pid), 30, "the agent's rank process")
        until(lambda: f"rank process pid {child} serves" in agent.log(), 30, "the rank process serving")
        status = proc_status(child)
        assert status["Uid"].split() == ["0"] * 4
        assert status["CapEff"].strip() == status["CapPrm"].strip() == "0000000000000000"
        assert status["NoNewPrivs"].strip() == "1"
        assert "cannot change to uid 65534 (Operation not permitted)" in agent.log() and "runs as uid 0" in agent.log()
        p = subprocess.Popen([sys.executable, "-c", HELLO_SCRIPT, str(sock), "capless", "0", "-1"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        until(lambda: metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_step_records_total") == 1, 30,
              "the rank's step record")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        agent.stop()
