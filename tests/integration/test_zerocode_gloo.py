"""Zero-code end to end on CPU: a real, unmodified torchrun job (Gloo) that hangs, found from its processes,
judged from NCCL RAS replies (a fake RAS server replaying NCCL's format with the job's own pids), and its
evidence taken live through the FIFO (the job's stand-in for NCCL's dump pipe), py-spy and triage — on the
node, and at a real coordinator over gRPC."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import running

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "agent" / "zerocode"))
from zc_coordinator import coordinator_and_link, until
from zc_fakes import Comm, FakeRas, Rank, json_reply

from gpuhealth.agent.view import GpuProcess
from gpuhealth.agent.zerocode.environ import launch_variables
from gpuhealth.agent.zerocode.ranksource import CombinedRanks
from gpuhealth.agent.zerocode.watcher import ZeroCodeSettings, ZeroCodeWatcher
from gpuhealth.model import RankIdentity, Severity

pytestmark = pytest.mark.integration
JOB = Path(__file__).resolve().parent / "zerocode_job" / "train.py"


class TorchrunJob:
    def __init__(self, tmp: Path, env: dict[str, str], *args: str) -> None:
        self.log = tmp / "job.log"
        self.fh = open(self.log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
             f"--master-port={29600 + os.getpid() % 300}", str(JOB), "--backend", "gloo", *args],
            env={**os.environ, **env}, stdout=self.fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp)

    def wait_for(self, pattern: str, timeout_s: float = 90.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log.read_text())
            if m:
                return m
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in the job's output: {self.log.read_text()[-2000:]}")

    def pids(self) -> dict[int, int]:
        self.wait_for(r"rank 1/2 pid \d+ ready")
        self.wait_for(r"rank 0/2 pid \d+ ready")
        return {int(r): int(p) for r, p in re.findall(r"rank (\d+)/2 pid (\d+) ready", self.log.read_text())}

    def stop(self) -> None:
        # torchrun starts its workers in sessions of their own: killing its group alone left them running
        # (and spinning a CPU each) for the rest of the test session
        workers = [int(p) for p in re.findall(r"rank \d+/2 pid (\d+) ready", self.log.read_text())]
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the job's own process group
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(running(pid) for pid in workers):
            time.sleep(0.05)
        self.fh.close()


@pytest.fixture
def hung_job(tmp_path: Path) -> Iterator[tuple[TorchrunJob, FakeRas, dict[int, int]]]:
    ras_server = FakeRas([{"json": ""}])  # replies are set once the job's pids are known
    env = {**launch_variables("zc-test", folder=str(tmp_path)), "NCCL_RAS_ADDR": f"127.0.0.1:{ras_server.port}"}
    job = TorchrunJob(tmp_path, env, "--steps", "0", "--compute-s", "0.01", "--hang-rank", "1", "--hang-step", "30",
                      "--emulate-pipe")
    try:
        pids = job.pids()
        job.wait_for(r"rank 1 hangs at step 30")
        ras_server.replies = [{"json": json_reply([Comm(0x7E67, [Rank(0, pids[0], 0, {"AllReduce": 33}),
                                                                 Rank(1, pids[1], 1, {"AllReduce": 30})])])}]
        yield job, ras_server, pids
    finally:
        job.stop()
        ras_server.close()


def test_the_stuck_rank_of_an_unmodified_job_is_named_with_its_dumps_stacks_and_triage(
        hung_job: tuple[TorchrunJob, FakeRas, dict[int, int]], tmp_path: Path) -> None:
    _job, ras_server, pids = hung_job
    gpus = [GpuProcess(0, "GPU-aaaa", pids[0], 1 << 30), GpuProcess(1, "GPU-bbbb", pids[1], 1 << 30)]
    settings = ZeroCodeSettings(hang_threshold_s=5, evidence_dir=str(tmp_path / "evidence"), dump_timeout_s=20)
    watcher = ZeroCodeWatcher(settings, processes=lambda: gpus)
    seen: list[RankIdentity] = []
    watcher.add_listener(on_identity=seen.append)
    try:
        first = watcher.poll_once(now=100.0)
        job_id = first.discovery.jobs()[0].job_id
        assert sorted((i.rank, i.pid, i.gpu_index, i.found_by) for i in seen) == [
            (0, pids[0], 0, "discovered"), (1, pids[1], 1, "discovered")]
        assert not first.verdicts and not [f for f in first.findings if f.code == "rank.stuck"]
        assert ras_server.commands[0][-1] == "VERBOSE STATUS"  # asked at the job's own NCCL_RAS_ADDR
        second = watcher.poll_once(now=106.0)
        (stuck,) = [f for f in second.findings if f.code == "rank.stuck"]
        assert stuck.severity is Severity.CRITICAL and stuck.entity.id == "1" and stuck.entity.gpu_index == 1
        assert stuck.evidence["host_pid"] == pids[1] and stuck.evidence["gpu_uuid"] == "GPU-bbbb"
        assert "rank 1 (process" in stuck.message and "AllReduce #30" in stuck.message
        # the evidence arrives in the background: both dumps through the FIFO, both stacks, the triage
        deadline = time.monotonic() + 90
        evidence: Any = None
        while time.monotonic() < deadline:
            now = 107.0 + (time.monotonic() - deadline + 90)
            found = [f for f in watcher.poll_once(now=now).findings if f.code == "rank.stuck"]
            evidence = found[0].evidence.get("evidence") if found else None
            if isinstance(evidence, dict):
                break
            time.sleep(0.5)
        assert isinstance(evidence, dict), evidence
        assert evidence["dumps"] == [0, 1] and evidence["dump_errors"] == {} and evidence["stack_errors"] == {}
        assert evidence["triage_verdict"] == "hang" and evidence["triage_culprits"] == [1]
        folder = Path(evidence["folder"])
        assert (folder / "fr" / "rank0.pkl").read_bytes()[:1] == b"\x80" and (folder / "stacks.json").is_file()
        # The coordinator's requests reach discovered ranks through the same FIFO.
        ranks = CombinedRanks(None, watcher)
        assert [i.rank for i in ranks.ranks(job_id)] == [0, 1]
        got = dict(ranks.iter_dumps(job_id, 1, timeout_s=20))
        assert isinstance(got[1], bytes) and got[1][:1] == b"\x80"
        names = {s.name for s in watcher.samples()}
        assert {"agent_gpu_processes", "agent_discovered_ranks", "agent_ras_available", "agent_fr_dumps"} <= names
    finally:
        watcher.stop()


def test_a_job_without_ras_or_pipe_variables_is_listed_and_says_why(tmp_path: Path) -> None:
    # A port bound but not listening: connecting is refused, and nothing else (the job's own Gloo sockets
    # take ephemeral ports) can take it while the test runs, as it could a port merely closed.
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))
    job = TorchrunJob(tmp_path, {"NCCL_RAS_ADDR": f"127.0.0.1:{closed.getsockname()[1]}"}, "--steps", "0",
                      "--compute-s", "0.05")
    try:
        pids = job.pids()
        others = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not a torch rank
        gpus = [GpuProcess(0, "GPU-aaaa", pids[0]), GpuProcess(1, "GPU-bbbb", pids[1]),
                GpuProcess(1, "GPU-bbbb", others.pid)]
        watcher = ZeroCodeWatcher(ZeroCodeSettings(evidence_dir=str(tmp_path / "ev")), processes=lambda: gpus)
        try:
            result = watcher.poll_once(now=1.0)
            kinds = {(p.pid, p.is_rank) for p in result.discovery.processes}
            assert kinds == {(pids[0], True), (pids[1], True), (others.pid, False)}
            (unavailable,) = [f for f in result.findings if f.code == "ras.unavailable"]
            assert "nothing listens" in unavailable.message and unavailable.severity is Severity.INFO
            (job_id,) = [j.job_id for j in result.discovery.jobs()]
            (answer,) = watcher.iter_dumps(job_id, 0, timeout_s=2)
            assert isinstance(answer[1], Exception) and "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" in str(answer[1])
            samples = {(s.name, s.gpu, s.labels): s.value for s in watcher.samples()}
            assert samples[("agent_gpu_processes", 1, (("kind", "other"),))] == 1
            assert samples[("agent_ras_available", None, (("job_id", job_id),))] == 0
        finally:
            watcher.stop()
            others.kill()
            others.wait()
    finally:
        job.stop()
        closed.close()


@pytest.mark.slow
def test_a_hang_the_agent_judged_reaches_the_coordinator_with_every_dump_stacks_and_verdict(
        hung_job: tuple[TorchrunJob, FakeRas, dict[int, int]], tmp_path: Path) -> None:
    """The agent's own RAS judgement (``rank.stuck``) opens the coordinator's hang investigation of a job
    that sends no steps: NCCL-style pickled dumps of both ranks come up through the FIFO, py-spy stacks
    beside them, and the verdict names rank 1 with its process and GPU."""
    _job, _ras, pids = hung_job
    gpus = [GpuProcess(0, "GPU-aaaa", pids[0], 1 << 30), GpuProcess(1, "GPU-bbbb", pids[1], 1 << 30)]
    watcher = ZeroCodeWatcher(ZeroCodeSettings(hang_threshold_s=5, evidence_dir=str(tmp_path / "evidence"),
                                               dump_timeout_s=20), processes=lambda: gpus)

    async def main() -> None:
        async with coordinator_and_link(tmp_path, watcher) as (coord, link):
            first = await asyncio.to_thread(watcher.poll_once, 100.0)
            job_id = first.discovery.jobs()[0].job_id
            await until(lambda: len(getattr(coord.jobs.jobs.get(job_id), "placements", {})) == 2)
            node = next(iter(coord.by_node))
            second = await asyncio.to_thread(watcher.poll_once, 106.0)
            assert [f.entity.id for f in second.findings if f.code == "rank.stuck"] == ["1"]
            link.stream.on_findings(second.findings)
            (doc,) = await until(lambda: coord.store.verdicts(job_id), timeout_s=90)
            assert doc["kind"] == "hang" and doc["verdict"] == "hang" and doc["culprits"] == [1], doc["summary"]
            assert doc["reported_by"]["node"] == node and doc["reported_by"]["rank"] == 1
            assert doc["reported_by"]["source"] == "NCCL RAS"
            dumps = doc["evidence"]["fr_dumps"]
            assert sorted(dumps) == ["0", "1"] and all(p.endswith(".pkl") for p in dumps.values()), doc["evidence"]
            assert Path(dumps["1"]).read_bytes()[:1] == b"\x80"
            assert doc["evidence"]["stacks_ranks"] == [0, 1] and doc["evidence"]["fr_missing_ranks"] == []
            (culprit,) = doc["culprit_details"]
            assert (culprit["rank"], culprit["pid"], culprit["gpu_index"], culprit["node"]) == (1, pids[1], 1, node)
            job = coord.jobs.jobs[job_id]
            assert job.hang_open and coord.counters.hangs == 1
            # the same report again is the same episode, and so is one after an update that lacked it (a poll
            # that missed the process); the node not reporting it for the grace ends the episode
            link.stream.on_findings([])
            await asyncio.sleep(0.5)
            link.stream.on_findings(list(second.findings))
            await asyncio.sleep(1.0)
            assert job.hang_open and coord.counters.hangs == 1
            coord.reported_hang_grace_s = 1.0
            link.stream.on_findings([])
            await until(lambda: not job.hang_open, timeout_s=20)
            # a job found by discovery sends no steps: the coordinator's own step check never calls it hung
            assert job.discovered_only and job.hang_check(time.monotonic() + 3600, 10, 60) is None

    try:
        asyncio.run(main())
    finally:
        watcher.stop()
