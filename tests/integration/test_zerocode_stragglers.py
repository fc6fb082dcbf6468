"""Stragglers of an unmodified job, with no code in it: the agent's periodic dumps through each rank's FIFO are
triaged on the node, and the coordinator keeps the result as the job's straggler (a discovered job sends no
steps, so its own detector never sees it).

The ranks are stand-ins that behave like NCCL's dump pipe and answer with the real dumps of a 1.3x straggler
recorded on 2 x H100 (tests/fixtures/zerocode/h100x2_nccl2.28.9/live_dumps_straggler_1.3): the hardware
boundary, replayed; the watcher, the triage child, the gRPC stream and the coordinator are real."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from zc_coordinator import coordinator_and_link, until

from gpuhealth.agent.view import GpuProcess
from gpuhealth.agent.zerocode.environ import launch_variables
from gpuhealth.agent.zerocode.watcher import ZeroCodeSettings, ZeroCodeWatcher

pytestmark = pytest.mark.integration
LIVE = Path(__file__).resolve().parents[1] / "fixtures" / "zerocode" / "h100x2_nccl2.28.9" / "live_dumps_straggler_1.3"

# NCCL's DumpPipe in a few lines: mkfifo 0666, read about once a second (here 0.2 s), and on any byte write
# the rank's dump in place — here the recorded one.
STAND_IN = r"""
import os, sys, time
env = os.environ
prefix, out, rank = env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"], env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"], env["RANK"]
data = open(sys.argv[1], "rb").read()
os.mkfifo(prefix + rank + ".pipe", 0o666)
fd = os.open(prefix + rank + ".pipe", os.O_RDONLY | os.O_NONBLOCK)
print("up", flush=True)
while True:
    time.sleep(0.2)
    try:
        got = os.read(fd, 128)
    except BlockingIOError:
        continue
    if got:
        with open(out + rank, "wb") as fh:
            fh.write(data)
"""


@pytest.fixture
def ranks() -> Iterator[dict[int, int]]:
    folder = Path("/tmp") / f"gpuhealth-zcs-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o755)
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # a RAS port nothing answers on
    closed.bind(("127.0.0.1", 0))
    env = {**launch_variables("zcs", folder=str(folder)), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999", "NCCL_RAS_ADDR": f"127.0.0.1:{closed.getsockname()[1]}",
           "PATH": os.environ.get("PATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", STAND_IN, str(LIVE / f"rank{r}.pkl")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE)
             for r in (0, 1)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"up\n"
        yield {r: p.pid for r, p in enumerate(procs)}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        closed.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_straggler_in_periodic_dumps_becomes_the_jobs_straggler_at_the_coordinator(
        ranks: dict[int, int], tmp_path: Path) -> None:
    gpus = [GpuProcess(0, "GPU-aaaa", ranks[0], 1 << 30), GpuProcess(1, "GPU-bbbb", ranks[1], 1 << 30)]
    watcher = ZeroCodeWatcher(ZeroCodeSettings(periodic_dump_s=0.5, dump_timeout_s=20,
                                               evidence_dir=str(tmp_path / "evidence")), processes=lambda: gpus)

    async def main() -> None:
        async with coordinator_and_link(tmp_path, watcher, pyspy=False) as (coord, link):
            first = await asyncio.to_thread(watcher.poll_once, 100.0)
            (job_id,) = [j.job_id for j in first.discovery.jobs()]
            # not dumped on discovery: a job's first collectives are warm-up, read as a straggler
            await asyncio.to_thread(watcher.poll_once, 100.3)
            await asyncio.sleep(1.0)
            dumps = {s.labels: s.value for s in watcher.samples() if s.name == "agent_fr_dumps"}
            assert dumps[(("result", "ok"),)] == 0, dumps

            async def stragglers() -> list[Any]:
                poll = await asyncio.to_thread(watcher.poll_once, time.monotonic() + 1000.0)
                return [f for f in poll.findings if f.code.startswith("rank.straggler")]

            found: list[Any] = []
            deadline = time.monotonic() + 90
            while not found and time.monotonic() < deadline:
                found = await stragglers()
                await asyncio.sleep(0.3)
            (f,) = found
            assert f.evidence["rank"] == 1 and f.evidence["job_id"] == job_id
            assert f.evidence["source"] == "periodic flight-recorder dumps"
            assert 1.2 <= f.evidence["ratio_to_median"] <= 1.4, f.evidence
            link.stream.on_findings(found)
            (doc,) = await until(lambda: coord.store.verdicts(job_id), timeout_s=90)
            assert doc["kind"] == "straggler" and doc["culprits"] == [1], doc["summary"]
            (culprit,) = doc["culprit_details"]
            assert (culprit["rank"], culprit["pid"], culprit["gpu_index"]) == (1, ranks[1], 1)
            job = coord.jobs.jobs[job_id]
            assert job.discovered_only and sorted(job.stragglers) == [1] and not job.hang_open
            # the same word again is the same episode; the agent no longer saying it ends it
            link.stream.on_findings(list(found))
            await asyncio.sleep(1.5)
            assert len(coord.store.verdicts(job_id)) == 1
            link.stream.on_findings([])
            await until(lambda: not coord.jobs.jobs[job_id].stragglers, timeout_s=20)

    try:
        asyncio.run(main())
    finally:
        watcher.stop()
