"""Real gRPC (grpc.aio on loopback) against an in-process coordinator: registration, acks with
seq dedup, malformed messages answered with a status (never a crash), token auth, node binding,
health checking and reflection, /metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from simagent import SimAgent, step_batch_message

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.query import CoordinatorQueryError, fleet, list_jobs, live_triage, run_diagnostic
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.coordinator.straggler_feed import BudgetedStragglerFeed
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.runtime.tls import token_metadata

pytestmark = pytest.mark.integration


async def _server(tmp_path: Path, token: str | None = None, operator_token: str | None = None) -> CoordinatorServer:
    store = Store(tmp_path / "c.db")
    coord = Coordinator(store, CoordinatorConfig(evidence_dir=str(tmp_path / "ev"), tick_s=0.1, hang_floor_s=3600),
                        detector_factory=lambda j: BudgetedStragglerFeed(j))
    server = CoordinatorServer(coord, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0",
                               policy=AuthPolicy(token=token, operator_token=operator_token), metrics_interval_s=0.1)
    await server.start()
    return server


def _with_server(tmp_path: Path, body: Callable[[CoordinatorServer], Awaitable[None]],
                 token: str | None = None, operator_token: str | None = None) -> None:
    """pytest has no asyncio plugin here: each test runs its own loop with a fresh server."""

    async def main() -> None:
        srv = await _server(tmp_path, token, operator_token)
        try:
            await asyncio.wait_for(body(srv), 60)
        finally:
            await srv.stop(0)

    asyncio.run(main())


def _addr(srv: CoordinatorServer) -> str:
    assert srv.endpoints is not None
    return f"127.0.0.1:{srv.endpoints.grpc_port}"


def test_records_are_acked_once_and_duplicates_ignored(tmp_path: Path) -> None:
    _with_server(tmp_path, _records_are_acked_once_and_duplicates_ignored)


async def _records_are_acked_once_and_duplicates_ignored(server: CoordinatorServer) -> None:
    agent = SimAgent(_addr(server), "n1", gpus=2)
    await agent.register()
    await agent.connect()
    for seq in range(1, 6):
        await agent.send(step_batch_message(seq, "job1", [0, 1, 2, 3], seq))
    await agent.wait_acked(5)
    # Resend 3..5 (as after a lost ack) plus a new one: only the new one counts.
    for seq in (3, 4, 5):
        await agent.send(step_batch_message(seq, "job1", [0, 1, 2, 3], seq))
    await agent.send(step_batch_message(6, "job1", [0, 1, 2, 3], 6))
    await agent.wait_acked(6)
    coord = server.coord
    assert coord.counters.duplicates == 3
    assert coord.store.step_record_count("job1") == 6 * 4
    assert coord.jobs.jobs["job1"].last_step == {0: 6, 1: 6, 2: 6, 3: 6}
    # A re-registration reports the committed seq, so a restarted agent resumes after it.
    again = SimAgent(_addr(server), "n1")
    assert (await again.register()).acked_seq == 6
    await agent.close()
    await again.close()


def test_malformed_messages_get_a_status_and_the_server_lives(tmp_path: Path) -> None:
    _with_server(tmp_path, _malformed_messages_get_a_status_and_the_server_lives)


async def _malformed_messages_get_a_status_and_the_server_lives(server: CoordinatorServer) -> None:
    addr = _addr(server)
    async with grpc.aio.insecure_channel(addr) as ch:
        raw_register = ch.unary_unary("/gpuhealth.v1.Coordinator/Register")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw_register(b"\xff\xff\xff garbage", timeout=5)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw_register(pb.RegisterRequest(node_name="", incarnation="x").SerializeToString(), timeout=5)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # A stream with garbage, then one with columns of different lengths, then a NaN step time.
    bad_batches = [
        b"\x0a\xff\xff\xff\xff",
        pb.AgentMessage(record=pb.Record(seq=1, steps=pb.StepBatch(
            job_id="j", rank=[0, 1], step=[1], start_time=[1.0], wall_s=[1.0]))).SerializeToString(),
        pb.AgentMessage(record=pb.Record(seq=2, steps=pb.StepBatch(job_id="j", rank=[0], step=[1], start_time=[1.0],
                                                                    wall_s=[float("nan")]))).SerializeToString(),
        pb.AgentMessage(record=pb.Record(seq=3, findings=pb.FindingsSnapshot(findings=[
            pb.Finding(code="x.y", severity="catastrophic", entity_kind="gpu", entity_id="u")]))).SerializeToString(),
    ]
    for raw in bad_batches:
        agent = SimAgent(addr, "n-bad")
        await agent.register()
        await agent.connect()
        await agent.send(raw)
        assert await agent.status() is grpc.StatusCode.INVALID_ARGUMENT
        await agent.close()
    # The rejected seqs are consumed: a fresh registration resumes after them (no poison loop).
    agent = SimAgent(addr, "n-bad")
    assert (await agent.register()).acked_seq == 3
    await agent.connect()
    await agent.send(step_batch_message(4, "j", [0], 1))
    await agent.wait_acked(4)
    await agent.close()
    assert server.coord.counters.rejected == 3
    # Still serving queries.
    doc = await asyncio.to_thread(list_jobs, addr)
    assert [j["job_id"] for j in doc["jobs"]] == ["j"]


def test_stream_is_bound_to_the_registered_node(tmp_path: Path) -> None:
    _with_server(tmp_path, _stream_is_bound_to_the_registered_node)


async def _stream_is_bound_to_the_registered_node(server: CoordinatorServer) -> None:
    agent = SimAgent(_addr(server), "n1")
    await agent.register()
    await agent.connect(node="n2")  # claims another node on n1's session
    await agent.send(step_batch_message(1, "j", [0], 1))
    assert await agent.status() is grpc.StatusCode.PERMISSION_DENIED
    await agent.close()
    # Without Register there is no session at all.
    stranger = SimAgent(_addr(server), "n3")
    await stranger.register()
    stranger.session = pb.RegisterResponse(session_id="made-up")
    await stranger.connect()
    await stranger.send(step_batch_message(1, "j", [0], 1))
    assert await stranger.status() is grpc.StatusCode.UNAUTHENTICATED
    await stranger.close()
    assert server.coord.store.step_record_count() == 0


def test_token_is_required_when_configured(tmp_path: Path) -> None:
    _with_server(tmp_path, _token_is_required, token="s3cret")


async def _token_is_required(srv: CoordinatorServer) -> None:
    addr = _addr(srv)
    if addr:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await SimAgent(addr, "n1").register()
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await SimAgent(addr, "n1", metadata=token_metadata("wrong")).register()
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        ok = SimAgent(addr, "n1", metadata=token_metadata("s3cret"))
        await ok.register()
        await ok.connect()
        await ok.send(step_batch_message(1, "j", [0, 1], 1))
        await ok.wait_acked(1)
        await ok.close()
        with pytest.raises(CoordinatorQueryError, match="UNAUTHENTICATED"):
            await asyncio.to_thread(fleet, addr)
        assert (await asyncio.to_thread(fleet, addr, token="s3cret"))["nodes"][0]["name"] == "n1"


def test_only_an_operator_may_act_on_nodes(tmp_path: Path) -> None:
    _with_server(tmp_path, _operator_only, token="agent-tok", operator_token="op-tok")


async def _operator_only(srv: CoordinatorServer) -> None:
    # Every node holds the agent token: it reports and reads, but must not make other nodes' ranks
    # dump or run GPU diagnostics.
    addr = _addr(srv)
    agent = SimAgent(addr, "n1", metadata=token_metadata("agent-tok"))
    await agent.register()
    await agent.connect()
    await agent.send(step_batch_message(1, "j", [0, 1], 1))
    await agent.wait_acked(1)
    assert (await asyncio.to_thread(fleet, addr, token="agent-tok"))["nodes"][0]["name"] == "n1"
    with pytest.raises(CoordinatorQueryError, match=r"PERMISSION_DENIED.*operator"):
        await asyncio.to_thread(live_triage, addr, "j", token="agent-tok")
    with pytest.raises(CoordinatorQueryError, match="PERMISSION_DENIED"):
        await asyncio.to_thread(run_diagnostic, addr, "sdc", token="agent-tok")
    # The operator token passes authorisation (and reads too).
    assert (await asyncio.to_thread(fleet, addr, token="op-tok"))["nodes"][0]["name"] == "n1"
    with pytest.raises(CoordinatorQueryError, match="NOT_FOUND"):
        await asyncio.to_thread(live_triage, addr, "no-such-job", token="op-tok", timeout_s=2.0)
    await agent.close()


def test_without_operator_credentials_actions_are_refused_with_how_to(tmp_path: Path) -> None:
    _with_server(tmp_path, _no_operators, token="agent-tok")


async def _no_operators(srv: CoordinatorServer) -> None:
    with pytest.raises(CoordinatorQueryError, match="--operator-token"):
        await asyncio.to_thread(live_triage, _addr(srv), "j", token="agent-tok")


def test_health_reflection_and_metrics(tmp_path: Path) -> None:
    _with_server(tmp_path, _health_reflection_and_metrics)


async def _health_reflection_and_metrics(server: CoordinatorServer) -> None:
    addr = _addr(server)
    agent = SimAgent(addr, "n1")
    await agent.register()
    await agent.connect()
    for seq in range(1, 4):
        await agent.send(step_batch_message(seq, "jobm", [0, 1], seq, wall_s=0.25))
    await agent.wait_acked(3)
    async with grpc.aio.insecure_channel(addr) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="gpuhealth.v1.Coordinator"), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def one() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for r in refl.ServerReflectionInfo(one(), timeout=5):
            names = [s.name for s in r.list_services_response.service]
        assert "gpuhealth.v1.Coordinator" in names
    await asyncio.sleep(0.3)
    assert server.endpoints is not None and server.endpoints.metrics_port
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.endpoints.metrics_port}/metrics", timeout=5)  # type: ignore[union-attr]
        .read().decode())
    assert "gpuhealth_coordinator_connected_agents 1.0" in text
    assert 'gpuhealth_coordinator_job_step_seconds{job_id="jobm",quantile="0.5"} 0.25' in text
    assert "gpuhealth_coordinator_step_records_total 6.0" in text
    lint = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, check=False)
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
    await agent.close()
    doc = json.loads(json.dumps(await asyncio.to_thread(list_jobs, addr, "jobm")))
    assert doc["jobs"][0]["records"] == 6


def test_fleet_votes_sdc_digests_and_finds_version_drift(tmp_path: Path) -> None:
    _with_server(tmp_path, _fleet_votes)


async def _fleet_votes(server: CoordinatorServer) -> None:
    addr = _addr(server)
    key = "H100-132SM-cublas12.9-bf16-8192"
    agents = []
    for i in range(4):
        driver = "570.86.15" if i != 3 else "565.57.01"
        agent = SimAgent(addr, f"n{i}", gpus=1, versions={"driver": driver, "torch": "2.13.0"})
        await agent.register()
        await agent.connect()
        digest = "c0ffee" if i != 1 else "badbad"  # n1's GPU computes a different result
        await agent.send(pb.AgentMessage(record=pb.Record(seq=1, sdc=pb.SdcDigests(digests=[
            pb.SdcDigest(gpu_uuid=f"GPU-n{i}-0", key=key, digest=digest, at=time.time())]))).SerializeToString())
        await agent.wait_acked(1)
        agents.append(agent)
    # A GPU finding on n2 makes it unhealthy in the fleet view.
    await agents[2].send(pb.AgentMessage(record=pb.Record(seq=2, findings=pb.FindingsSnapshot(findings=[
        pb.Finding(code="ecc.dbe_volatile", severity="critical", entity_kind="gpu", entity_id="GPU-n2-0",
                   gpu_index=0, message="double-bit ECC", action="reset_gpu")]))).SerializeToString())
    await agents[2].wait_acked(2)
    doc = await asyncio.to_thread(fleet, addr)
    assert [(f["entity"]["id"], f["evidence"]["agree"]) for f in doc["sdc"]] == [("GPU-n1-0", 3)]
    assert [(f["entity"]["id"], f["evidence"]["key"]) for f in doc["version_drift"]] == [("n3", "driver")]
    assert [(g["node"], g["gpu"], g["codes"]) for g in doc["unhealthy_gpus"]] == [("n2", 0, ["ecc.dbe_volatile"])]
    assert sorted(n["name"] for n in doc["nodes"] if n["connected"]) == ["n0", "n1", "n2", "n3"]
    for a in agents:
        await a.close()


def test_a_newer_registration_of_the_node_ends_the_old_stream(tmp_path: Path) -> None:
    _with_server(tmp_path, _newer_registration)


async def _newer_registration(server: CoordinatorServer) -> None:
    old = SimAgent(_addr(server), "n1")
    await old.register()
    await old.connect()
    await old.send(step_batch_message(1, "j", [0], 1))
    await old.wait_acked(1)
    new = SimAgent(_addr(server), "n1")
    assert (await new.register()).acked_seq == 1
    assert await old.status() is grpc.StatusCode.ABORTED
    await new.connect()
    await new.send(step_batch_message(2, "j", [0], 2))
    await new.wait_acked(2)
    await old.close()
    await new.close()


def test_a_session_has_one_stream(tmp_path: Path) -> None:
    _with_server(tmp_path, _one_stream_per_session)


async def _one_stream_per_session(server: CoordinatorServer) -> None:
    first = SimAgent(_addr(server), "n1")
    await first.register()
    await first.connect()
    await first.send(step_batch_message(1, "j", [0], 1))
    await first.wait_acked(1)
    second = SimAgent(_addr(server), "n1")
    second.channel = grpc.aio.insecure_channel(_addr(server))
    second.session = first.session  # the same session id, a second stream
    await second.connect()
    # The coordinator refuses the second stream as it opens, before reading it: await that answer, then
    # write. Writing while the refusal is on its way raced it: grpc.aio reports a write that meets the
    # closing stream as INTERNAL "Internal error from Core" in place of the server's status (grpc/grpc#36066).
    assert await second.status() is grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(asyncio.InvalidStateError):  # the refused stream takes no records
        await second.send(step_batch_message(2, "j", [0], 2))
    await first.send(step_batch_message(3, "j", [0], 3))
    await first.wait_acked(3)  # the first stream is untouched
    await first.close()
    await second.close()
