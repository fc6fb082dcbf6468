"""Issue 30, item 4: one node's credential cannot drain another node's GPU through the fleet SDC vote.

Through the real ``gpuhealth coordinator`` (agents speak the wire), read with ``gpuhealth fleet --json``.
Before, node n2 outvoted n3's one real GPU — ``sdc.mismatch``, critical, drain on n3, "differs from 3 of
4" — by reporting another digest under pseudo-device ids (``cpu0``…: any id not starting ``GPU-``
counted as the node's own), or under GPUs it registered itself, or under n3's own UUID. Now a node has one
vote across nodes, a cross-node verdict needs two other nodes that agree, and a UUID two nodes claim is a
``gpu.uuid_conflict`` finding whose digests are not counted. The honest case still drains (control)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from commands import Coordinator, run_cli, write_config
from simagent import SimAgent, screen_result, screens_message

from gpuhealth.proto import gpuhealth_v1_pb2 as pb

pytestmark = pytest.mark.integration
KEY = "h100-132sm-cublas12.9-fp16-4096"


def _fleet(address: str) -> dict[str, Any]:
    res = run_cli("fleet", "--coordinator", address, "--json")
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


async def _vote(address: str, node: str, uuids: Sequence[str], digest: str, *, gpus: int = 1,
                uuid_node: str | None = None, as_digests: bool = False) -> SimAgent:
    """Register ``node`` (with ``gpus`` GPUs named after ``uuid_node``, default ``node``) and report
    ``digest`` for each of ``uuids``: as screens, or (``as_digests``) as a record of bare SDC digests."""
    agent = SimAgent(address, uuid_node or node, gpus=gpus)
    await agent.register(node=node)
    await agent.connect(node=node)
    now = time.time()
    if as_digests:
        sdc = pb.SdcDigests(digests=[pb.SdcDigest(gpu_uuid=u, key=KEY, digest=digest, at=now) for u in uuids])
        await agent.send(pb.AgentMessage(record=pb.Record(seq=1, sdc=sdc)).SerializeToString())
    else:
        await agent.send(screens_message(1, [screen_result(u, index=i, finished_at=now, digests=[(KEY, digest)])
                                             for i, u in enumerate(uuids)]))
    await agent.wait_acked(1)
    return agent


def _run(tmp_path: Path, body: Any) -> dict[str, Any]:
    cfg = write_config(tmp_path / "coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": str(tmp_path / "c.db")}})
    coord = Coordinator(tmp_path / "coordinator", cfg)
    try:
        address = coord.address()

        async def main() -> None:
            agents = await body(address)
            for a in agents:
                await a.close()

        asyncio.run(main())
        return _fleet(address)
    finally:
        coord.stop()


def test_pseudo_devices_of_one_node_do_not_outvote_a_real_gpu(tmp_path: Path) -> None:
    async def body(address: str) -> list[SimAgent]:
        n3 = await _vote(address, "n3", ["GPU-n3-0"], "aa")
        n2 = await _vote(address, "n2", ["cpu0", "cpu1", "cpu2"], "bb", as_digests=True)
        return [n3, n2]

    doc = _run(tmp_path, body)
    assert doc["sdc_digests"]["votes"] == 4  # n2's pseudo devices are counted — as one node's vote
    assert [f["entity"]["id"] for f in doc["sdc"] if f["entity"]["id"] == "GPU-n3-0"] == []


def test_gpus_one_node_registered_do_not_outvote_another_node(tmp_path: Path) -> None:
    async def body(address: str) -> list[SimAgent]:
        n3 = await _vote(address, "n3", ["GPU-n3-0"], "aa")
        n2 = await _vote(address, "n2", [f"GPU-n2-{i}" for i in range(4)], "bb", gpus=4)
        return [n3, n2]

    doc = _run(tmp_path, body)
    assert doc["sdc"] == []  # one node against one node: nobody can tell who is right


def test_a_uuid_claimed_by_two_nodes_is_a_finding_never_a_vote(tmp_path: Path) -> None:
    async def body(address: str) -> list[SimAgent]:
        n3 = await _vote(address, "n3", ["GPU-n3-0"], "aa")
        # n2 registers n3's GPU as its own and, with n4 and n5 honest but unrelated, votes against it
        n2 = await _vote(address, "n2", ["GPU-n3-0"], "bb", uuid_node="n3")
        others = [await _vote(address, n, [f"GPU-{n}-0"], "aa") for n in ("n4", "n5")]
        return [n3, n2, *others]

    doc = _run(tmp_path, body)
    assert doc["sdc"] == []
    [conflict] = doc["identity"]
    assert conflict["code"] == "gpu.uuid_conflict" and conflict["entity"]["id"] == "GPU-n3-0"
    assert conflict["evidence"]["nodes"] == ["n2", "n3"] and conflict["action"] == "monitor"


def test_two_other_nodes_that_agree_still_drain_the_odd_gpu(tmp_path: Path) -> None:
    """The control: an honest minority GPU is still named, with the nodes that outvoted it."""
    async def body(address: str) -> list[SimAgent]:
        agents = [await _vote(address, n, [f"GPU-{n}-0"], "aa") for n in ("n1", "n2")]
        agents.append(await _vote(address, "n3", ["GPU-n3-0"], "bb"))
        return agents

    doc = _run(tmp_path, body)
    [f] = doc["sdc"]
    assert f["entity"]["id"] == "GPU-n3-0" and f["action"] == "drain" and f["severity"] == "critical"
    assert f["evidence"]["agreeing_nodes"] == ["n1", "n2"] and f["evidence"]["scope"] == "fleet"
