"""Issue 30, item 1: the coordinator bounds a caller's cost before it knows who it is.

Before, 16 concurrent unauthenticated ``Register`` calls with ~60 MiB bodies took the coordinator from
~62 MiB to 1.4–2.9 GiB (the chart's limit is 1 Gi); every call was answered UNAUTHENTICATED, after its
body had been buffered. Through the real ``gpuhealth coordinator`` with node tokens: the same attack
leaves its peak memory (VmHWM) within 200 MiB of where it was, every call is refused, and an
authenticated Register over its method's limit is RESOURCE_EXHAUSTED while the real node still
registers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from commands import Coordinator, write_config, write_secret

from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.options import client_options
from gpuhealth.runtime.credentials import node_token
from gpuhealth.runtime.tls import token_metadata

pytestmark = pytest.mark.integration
REGISTER = "/gpuhealth.v1.Coordinator/Register"
BODY_BYTES = 60 << 20
CALLS = 16


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _big_register(node: str) -> bytes:
    return pb.RegisterRequest(node_name=node, incarnation="x", versions={"pad": "x" * BODY_BYTES}).SerializeToString()


async def _call(address: str, body: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address, options=client_options()) as channel:
        reg = channel.unary_unary(REGISTER, request_serializer=None,
                                  response_deserializer=pb.RegisterResponse.FromString)
        try:
            await reg(body, timeout=30, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_unauthenticated_bodies_are_never_read(tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "cluster.secret")
    cfg = write_config(tmp_path / "coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": str(tmp_path / "c.db"),
        "node_secret_file": str(tmp_path / "cluster.secret")}})
    coord = Coordinator(tmp_path / "coordinator", cfg)
    try:
        address = coord.address()
        before = _status_kib(coord.proc.pid, "VmHWM")
        body = _big_register("n1")

        async def attack() -> list[grpc.StatusCode]:
            return list(await asyncio.gather(*(_call(address, body) for _ in range(CALLS))))

        codes = asyncio.run(attack())
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * CALLS
        grown_mib = (_status_kib(coord.proc.pid, "VmHWM") - before) >> 10
        print(f"coordinator VmHWM grew {grown_mib} MiB under {CALLS} unauthenticated {BODY_BYTES >> 20} MiB Registers")
        assert grown_mib < 200, f"the coordinator's peak memory grew {grown_mib} MiB on unauthenticated calls"

        # An authenticated caller is held to the method's own limit; the node then registers as usual.
        node_md = token_metadata(node_token(secret, "n1"))
        assert asyncio.run(_call(address, body, node_md)) is grpc.StatusCode.RESOURCE_EXHAUSTED
        small = pb.RegisterRequest(node_name="n1", incarnation="i1").SerializeToString()
        assert asyncio.run(_call(address, small, node_md)) is grpc.StatusCode.OK
        assert coord.alive()
    finally:
        coord.stop()


def _hostile_findings(n: int = 980) -> bytes:
    # 64 KiB of evidence each that parses to ~32,000 Python objects: what a node's credential can send.
    evidence = '{"a":[' + ",".join(["1"] * 32_000) + "]}"
    findings = [pb.Finding(code="thermal.hot", severity="warning", entity_kind="gpu", entity_id=f"GPU-x-{i}",
                           gpu_index=0, message="hot", action="monitor", evidence_json=evidence, source="x")
                for i in range(n)]
    findings.append(pb.Finding(code="ecc.dbe", severity="critical", entity_kind="gpu", entity_id="GPU-x-0",
                               gpu_index=0, message="DBE", action="drain", evidence_json='{"count": 3}', source="x"))
    return pb.AgentMessage(record=pb.Record(seq=1, findings=pb.FindingsSnapshot(at=1.0, findings=findings))
                           ).SerializeToString()


def test_one_nodes_credential_cannot_grow_the_coordinator_past_its_quota(tmp_path: Path) -> None:
    """Issue 30, item 2: one record of 980 findings x 64 KiB evidence took the coordinator to 1.95 GiB, and a
    restart on the same database back to 1.5 GiB within seconds (an OOM loop under the chart's 1 Gi). Now a
    node's evidence is parsed only within its quota (the worst findings first): the coordinator stays small,
    and so does a restart; every finding is still there, the critical one with its evidence."""
    from simagent import SimAgent

    secret = write_secret(tmp_path / "cluster.secret")
    cfg = write_config(tmp_path / "coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": str(tmp_path / "c.db"),
        "node_secret_file": str(tmp_path / "cluster.secret")}})
    node_md = token_metadata(node_token(secret, "n1"))
    coord = Coordinator(tmp_path / "coordinator", cfg)
    try:
        address = coord.address()
        before = _status_kib(coord.proc.pid, "VmHWM")

        async def flood() -> None:
            agent = SimAgent(address, "n1", gpus=1, metadata=node_md)
            await agent.register()
            await agent.connect()
            await agent.send(_hostile_findings())
            await agent.wait_acked(1, timeout_s=60)
            await agent.close()

        asyncio.run(flood())
        grown_mib = (_status_kib(coord.proc.pid, "VmHWM") - before) >> 10
        print(f"coordinator VmHWM grew {grown_mib} MiB on one 61 MiB findings record")
        assert grown_mib < 400, f"the coordinator's peak memory grew {grown_mib} MiB"
    finally:
        coord.stop()
    again = Coordinator(tmp_path / "coordinator2", cfg)
    try:
        again.address()
        import json as _json

        from commands import run_cli, until

        def fleet() -> dict[str, object] | None:
            res = run_cli("fleet", "--coordinator", again.address(), "--json",
                          env={"GPUHEALTH_TOKEN": node_token(secret, "n1")})
            return _json.loads(res.stdout) if res.returncode in (0, 1) and res.stdout else None

        doc = until(fleet, 30, "the restarted coordinator's fleet view")
        rss_mib = _status_kib(again.proc.pid, "VmHWM") >> 10
        print(f"restarted coordinator VmHWM {rss_mib} MiB")
        assert rss_mib < 200, f"the restarted coordinator reloaded into {rss_mib} MiB"
        [node] = doc["nodes"]  # type: ignore[index]
        assert node["findings"] == 981  # nothing lost: each finding kept, over-quota evidence dropped
    finally:
        again.stop()
