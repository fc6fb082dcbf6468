"""Issue 30, item 5: a rank's claim to a job needs kernel evidence; an unverified claim never hides a hang,
moves a verified rank or refuses one.

Through the real processes: ``gpuhealth coordinator``, two ``gpuhealth agent``s on simulated nodes, ranks
as processes of non-root users. Job 4242's ranks run as uid 65534 in the job's Slurm cgroup
(``…/job_4242/…``, which only root can join: ``slurm_cgroup.py``), save rank 2, which runs outside it as
the same user (verified by the uid of the job's verified ranks). Two intruders of uid 65533:

- on the job's node, with ``GPUHEALTH_JOB_ID=4242`` in its own environment, it claims rank 3 before the
  real rank 3 starts. Before, its environment made it "verified" and the real rank 3 was refused.
- on another node, with nothing at all, it claims rank 1 and keeps sending steps. Before, its steps were
  the job's progress (the job stayed "running" when its ranks hung) and rank 1's placement moved to its
  node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from commands import SCENARIO, Agent, Coordinator, metric_value, run_cli, until, write_config
from slurm_cgroup import SlurmCgroup

pytestmark = pytest.mark.integration
JOB = "4242"
USER, INTRUDER = 65534, 65533

# A rank: hello, then ``steps`` steps every ``period`` s (-1: forever), then it stays connected (hung).
# It prints what the agent said to it ("refused …") or "ok".
RANK = r"""
import json, os, socket, sys, time
from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord
path, job, rank, world, first, steps, period, uid = sys.argv[1:9]
rank, world, first, steps, period, uid = int(rank), int(world), int(first), int(steps), float(period), int(uid)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)  # before connecting: the kernel records who connected, at connect
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
s.sendall(protocol.encode(protocol.hello(RankIdentity(job, rank, world, "h", os.getpid()))))
s.settimeout(1.5)
try:
    said = s.recv(65536).decode(errors="replace")
    print("refused " + said if said else "refused (closed)", flush=True)
except socket.timeout:
    print("ok", flush=True)
step = first
while steps < 0 or step < first + steps:
    try:
        s.sendall(protocol.encode(protocol.steps([StepRecord(job, rank, step, time.time(), period, period * .8,
                                                             period * .2)])))
    except OSError:
        print("closed", flush=True)
        break
    step += 1
    time.sleep(period)
print("sent", flush=True)
sys.stdin.read()
"""


class RankProc:
    def __init__(self, sock: Path, rank: int, *, uid: int, first: int = 0, steps: int = 40, period: float = 0.05,
                 env: dict[str, str] | None = None, cgroup: SlurmCgroup | None = None) -> None:
        clean = {k: v for k, v in os.environ.items() if k not in ("GPUHEALTH_JOB_ID", "SLURM_JOB_ID",
                                                                   "TORCHELASTIC_RUN_ID")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RANK, str(sock), JOB, str(rank), "4", str(first), str(steps), str(period),
             str(uid)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**clean, **(env or {})},
            preexec_fn=None if cgroup is None else cgroup.enter())
        assert self.proc.stdout is not None
        self.answer = self.proc.stdout.readline().strip()

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(f"/tmp/gh-claims-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def _agent(work: Path, name: str, address: str, sock: Path) -> Agent:
    cfg = write_config(work / f"{name}.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "node_name": name, "coordinator": address,
                  "socket_path": str(sock), "state_dir": str(work / name),
                  "pod_resources_socket": str(work / "no-kubelet.sock")},
        "diag": {"enabled": False}})
    return Agent(work / name, cfg)


def _job(address: str) -> dict[str, Any] | None:
    res = run_cli("jobs", JOB, "--coordinator", address, "--json")
    jobs = json.loads(res.stdout)["jobs"] if res.stdout else []
    return jobs[0] if jobs else None


def test_an_unverified_claim_neither_hides_a_hang_nor_moves_or_refuses_a_verified_rank(
        tmp_path: Path, sock_dir: Path) -> None:
    coord_cfg = write_config(tmp_path / "coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": str(tmp_path / "c.db"),
        "hang_floor_s": 4.0, "hang_k": 1.0, "tick_s": 0.2, "evidence_timeout_s": 1.0}})
    coord = Coordinator(tmp_path / "coordinator", coord_cfg)
    procs: list[Any] = [coord]
    ranks: list[RankProc] = []
    cgroup = SlurmCgroup(JOB, USER)
    try:
        address = coord.address()
        real_sock, other_sock = sock_dir / "real.sock", sock_dir / "other.sock"
        real_node = _agent(tmp_path, "real-node", address, real_sock)
        other_node = _agent(tmp_path, "other-node", address, other_sock)
        procs += [real_node, other_node]
        until(lambda: real_sock.exists() and other_sock.exists(), 30, "both agents' rank sockets")

        # Rank 0 starts the job on its node (verified: the job's cgroup).
        ranks.append(RankProc(real_sock, 0, uid=USER, cgroup=cgroup))
        assert ranks[-1].answer == "ok", ranks[-1].answer
        # The local intruder names the job in its own environment and claims rank 3 before rank 3 starts.
        squatter = RankProc(real_sock, 3, uid=INTRUDER, env={"GPUHEALTH_JOB_ID": JOB}, steps=-1, first=1000,
                            period=0.2)
        ranks.append(squatter)
        assert squatter.answer == "ok", squatter.answer  # it may join (unverified)…
        # …but the job's own rank 3 takes the rank over (before: refused, "connected already").
        real3 = RankProc(real_sock, 3, uid=USER, cgroup=cgroup)
        ranks.append(real3)
        assert real3.answer == "ok", real3.answer
        assert squatter.line() == "closed"
        ranks.append(RankProc(real_sock, 1, uid=USER, cgroup=cgroup))
        ranks.append(RankProc(real_sock, 2, uid=USER))  # the job's user, outside the cgroup: its uid verifies
        assert all(r.answer == "ok" for r in ranks[-2:]), [r.answer for r in ranks]
        until(lambda: (_job(address) or {}).get("records", 0) >= 4 * 20, 60, "the ranks' steps at the coordinator")

        # The remote intruder: another node, another user, nothing naming the job; it claims rank 1 and sends
        # steps far ahead, forever.
        remote = RankProc(other_sock, 1, uid=INTRUDER, steps=-1, first=10_000, period=0.1)
        ranks.append(remote)
        assert remote.answer == "ok", remote.answer
        until(lambda: metric_value(other_node.get("/metrics"), "gpuhealth_agent_rank_step_records_total") or 0,
              30, "the intruder's steps at its agent")
        for r in ranks[:1] + ranks[2:5]:
            assert r.line() == "sent"  # the job's ranks finished their steps and hang (still connected)

        # The job hangs: no verified rank progresses, whatever the intruder sends.
        def hung() -> dict[str, Any] | None:
            j = _job(address)
            return j if j and j["state"] == "hung" and any(
                v.get("kind") == "hang" for v in j.get("verdicts") or []) else None

        try:
            job = until(hung, 60, "the job's hang and its verdict")
        except AssertionError:
            raise AssertionError(f"no hang verdict: {_job(address)}") from None
        assert job["nodes"] == ["real-node"], job  # rank 1 stays placed where the job runs
        assert job["last_step"] < 1000, job  # neither intruder's steps counted
        assert job["ranks_verified"] == 4 and job["claims_ignored"] >= 1, job
        assert "an unverified claim to rank 1 of job 4242" in coord.log()
    finally:
        for r in ranks:
            r.kill()
        for p in reversed(procs):
            p.stop()
        cgroup.remove()
