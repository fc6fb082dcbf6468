"""A silent mismatch in a running, unmodified job: its periodic flight-recorder dumps prove it, the agent raises a
critical finding, and the coordinator records a ``mismatch`` verdict naming the group, the sequence number and each
side.

The ranks are stand-ins that behave like NCCL's dump pipe (as in test_zerocode_stragglers.py) and answer with the
real dumps of an FSDP-style job on 2 x H200 whose rank 1 skipped one reduce_scatter and ran out of phase: NCCL
paired its all_gathers with rank 0's reduce_scatters, every result was wrong and the steps kept their time
(tests/fixtures/zerocode/h200x2_signals/fsdp_skip). The watcher, the triage child, the gRPC stream and the
coordinator are real. A healthy job's periodic dumps from the same run give nothing."""

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
from test_zerocode_stragglers import STAND_IN
from zc_coordinator import coordinator_and_link, until

from gpuhealth.agent.view import GpuProcess
from gpuhealth.agent.zerocode.environ import launch_variables
from gpuhealth.agent.zerocode.watcher import ZeroCodeSettings, ZeroCodeWatcher

pytestmark = pytest.mark.integration
SIGNALS = Path(__file__).resolve().parents[1] / "fixtures" / "zerocode" / "h200x2_signals"


def _stand_ins(dumps: Path) -> Iterator[dict[int, int]]:
    folder = Path("/tmp") / f"gpuhealth-zcm-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o755)
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # a RAS port nothing answers on
    closed.bind(("127.0.0.1", 0))
    env = {**launch_variables("zcm", folder=str(folder)), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29998", "NCCL_RAS_ADDR": f"127.0.0.1:{closed.getsockname()[1]}",
           "PATH": os.environ.get("PATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", STAND_IN, str(dumps / f"02_rank{r}.pkl")],
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


@pytest.fixture
def skipped() -> Iterator[dict[int, int]]:
    yield from _stand_ins(SIGNALS / "fsdp_skip" / "dumps")


@pytest.fixture
def healthy() -> Iterator[dict[int, int]]:
    yield from _stand_ins(SIGNALS / "healthy_fsdp" / "dumps")


def _watcher(ranks: dict[int, int], tmp_path: Path) -> ZeroCodeWatcher:
    gpus = [GpuProcess(0, "GPU-aaaa", ranks[0], 1 << 30), GpuProcess(1, "GPU-bbbb", ranks[1], 1 << 30)]
    return ZeroCodeWatcher(ZeroCodeSettings(periodic_dump_s=0.5, dump_timeout_s=20,
                                            evidence_dir=str(tmp_path / "evidence")), processes=lambda: gpus)


def _periodic(watcher: ZeroCodeWatcher, code_prefix: str, timeout_s: float = 90.0) -> list[Any]:
    watcher.poll_once(100.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        poll = watcher.poll_once(time.monotonic() + 1000.0)
        found = [f for f in poll.findings if f.code.startswith(code_prefix)]
        dumps = {s.labels: s.value for s in watcher.samples() if s.name == "agent_fr_dumps"}
        if found or dumps.get((("result", "ok"),), 0) >= 4:
            return found
        time.sleep(0.3)
    return []


def test_a_silent_mismatch_in_periodic_dumps_is_critical_and_the_coordinators_verdict(
        skipped: dict[int, int], tmp_path: Path) -> None:
    watcher = _watcher(skipped, tmp_path)

    async def main() -> None:
        async with coordinator_and_link(tmp_path, watcher, pyspy=False) as (coord, link):
            found: list[Any] = []
            deadline = time.monotonic() + 90
            while not found and time.monotonic() < deadline:
                poll = await asyncio.to_thread(watcher.poll_once, time.monotonic() + 1000.0)
                found = [f for f in poll.findings if f.code == "collective.type_mismatch"]
                await asyncio.sleep(0.3)
            (f,) = found
            job_id = f.evidence["job_id"]
            assert f.severity.name == "CRITICAL" and f.entity.kind.value == "job" and f.evidence["completed"]
            assert f.evidence["source"] == "periodic flight-recorder dumps"
            assert {v["op"] for v in f.evidence["variants"]} == {"_reduce_scatter_base", "_all_gather_base"}
            link.stream.on_findings(found)
            (doc,) = await until(lambda: coord.store.verdicts(job_id), timeout_s=90)
            assert doc["kind"] == "mismatch" and doc["culprits"] == [0, 1], doc["summary"]
            assert doc["group"] == "0" and isinstance(doc["seq"], int) and len(doc["sides"]) == 2
            assert doc["reported_by"]["source"] == "periodic flight-recorder dumps"
            assert "silently wrong" in doc["summary"]
            # the same word again is the same episode: no second verdict
            link.stream.on_findings(list(found))
            await asyncio.sleep(1.5)
            assert len(coord.store.verdicts(job_id)) == 1

    try:
        asyncio.run(main())
    finally:
        watcher.stop()


def test_a_healthy_jobs_periodic_dumps_give_no_mismatch(healthy: dict[int, int], tmp_path: Path) -> None:
    watcher = _watcher(healthy, tmp_path)
    try:
        assert _periodic(watcher, "collective.") == []
    finally:
        watcher.stop()
