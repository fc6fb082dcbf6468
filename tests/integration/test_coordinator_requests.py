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
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

pytestmark = pytest.mark.integration


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
            # A device string that is not cpu/cuda[:N] never reaches a command line.
            doc = await coord.run_diagnostic([], "sdc", {"device": "cpu; touch /tmp/pwned"}, 20)
            assert doc["errors"] == {node: "bad device 'cpu; touch /tmp/pwned'"}
            assert doc["results"] == {} and doc["sdc_digests_stored"] == 0
            doc = await coord.run_diagnostic([], "../../bin/sh", {}, 20)
            assert doc["errors"] == {node: "bad diagnostic '../../bin/sh'"}
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
