"""Requests down the stream, executed by a real CoordinatorLink: refusals are answered (never a
hang of the request), only validated parameters reach the diagnostic's command line, and a live
triage of a job on a node without a rank hub comes back incomplete instead of failing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gpuhealth.agent.coordinator_link import CoordinatorLink, LinkSettings
from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.requests import PendingRequest
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import WireError

pytestmark = pytest.mark.integration


async def _unchecked(coord: Coordinator, node: str, name: str, params: dict[str, str]) -> dict[str, str]:
    """Send a diagnostic request straight down the node's stream (no coordinator-side check); the
    agent's errors."""
    rid = 1_000_000 + len(name)
    pending = PendingRequest(rid, pb.RUN_DIAGNOSTIC, "", {node})
    coord.requests[rid] = pending
    coord.by_node[node].push(pb.AgentRequest(request_id=rid, kind=pb.RUN_DIAGNOSTIC, diagnostic=name, params=params,
                                             timeout_s=10.0, rank=-1))
    try:
        await pending.wait(15)
    finally:
        coord.forget_request(rid)
    assert not pending.node_answers
    return dict(pending.node_errors)


def test_requests_are_answered_even_when_they_cannot_run(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(evidence_dir=str(tmp_path / "ev")))
        server = CoordinatorServer(coord, listen="127.0.0.1:0", metrics_listen=None, policy=AuthPolicy())
        endpoints = await server.start()
        link = CoordinatorLink(LinkSettings(address=f"127.0.0.1:{endpoints.grpc_port}",
                                            spool_path=str(tmp_path / "spool.db"), pyspy=False))
        link.start(None)
        try:
            deadline = time.monotonic() + 20
            while not any(s.connected for s in coord.by_node.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            node = next(iter(coord.by_node))
            # A name outside the known set, or a device string that is not cpu/cuda[:N], is refused by the
            # coordinator before any agent hears it ...
            for name, params in (("rm -rf /", {}), ("../../bin/sh", {}), ("sdcx", {}), ("", {}),
                                 ("sdc", {"device": "cpu; touch /tmp/pwned"}), ("sdc", {"args": "--golden /etc"})):
                with pytest.raises(WireError):
                    await coord.run_diagnostic([], name, params, 20)
            assert not coord.requests
            # ... and by the agent too (a coordinator that does not check: another version, or a bypass).
            assert await _unchecked(coord, node, "sdc", {"device": "cpu; touch /tmp/pwned"}) == {
                node: "bad device 'cpu; touch /tmp/pwned'"}
            assert await _unchecked(coord, node, "../../bin/sh", {}) == {node: "bad diagnostic '../../bin/sh'"}
            assert await _unchecked(coord, node, "rm -rf /", {}) == {node: "bad diagnostic 'rm -rf /'"}
            assert "unknown diagnostic 'sdcx'" in (await _unchecked(coord, node, "sdcx", {}))[node]
            doc = await coord.run_diagnostic(["not-connected"], "sdc", {}, 5)
            assert doc["errors"] == {"not-connected": "not connected"}
            # Dumps/stacks from an agent without a rank hub: answered with the reason, quickly.
            coord.jobs.get("j", time.monotonic())
            started = time.monotonic()
            live = await coord.live_triage("j", 20)
            assert time.monotonic() - started < 10
            assert live.report.verdict == pb.VERDICT_INCOMPLETE and list(live.report.ranks_seen) == []
            assert dict(live.evidence.errors) == {f"node/{node}": "no rank hub on this agent"}
            # Every triage is counted on /metrics by verdict and headline root kind.
            assert coord.metrics_snapshot()["triage"] == {("incomplete", "none"): 1}
        finally:
            link.stop()
            await server.stop(0)

    asyncio.run(main())


def test_the_coordinator_knows_the_diagnostics_the_agent_runs() -> None:
    from gpuhealth.agent.coordinator_requests import _DEVICE
    from gpuhealth.coordinator.service import KNOWN_DIAGNOSTICS, check_diagnostic
    from gpuhealth.diag.ondemand import DIAGNOSTICS

    assert tuple(KNOWN_DIAGNOSTICS) == tuple(DIAGNOSTICS)
    for device in ("cpu", "cuda", "cuda:0", "cuda:0,cuda:7", "cuda:", "cpu ", "cuda:0;", "gpu"):
        agent_ok = bool(_DEVICE.fullmatch(device))
        try:
            check_diagnostic("sdc", {"device": device})
            coordinator_ok = True
        except WireError:
            coordinator_ok = False
        assert coordinator_ok == agent_ok, device
