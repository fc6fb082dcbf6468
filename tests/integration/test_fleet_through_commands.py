"""The fleet view and the jobs table through the shipped commands: ``gpuhealth coordinator`` fed by a real
``gpuhealth agent`` (or by agents speaking the wire), read with ``gpuhealth fleet``, ``gpuhealth jobs`` and a
Prometheus scrape of the coordinator's ``/metrics``.

- A GPU whose PCIe link trained at x8 (critical, drain; the finding's entity is the link) is an unhealthy
  GPU of the fleet view, as ``status`` says (it was left out: only GPU-entity findings counted).
- The coordinator's cross-node SDC vote is on ``/metrics`` (``gpuhealth_fleet_findings``), where the alert
  GpuhealthSdcMismatch reads it (deploy/prometheus/alerts_test.yaml); it was only in ``gpuhealth fleet``.
- ``gpuhealth jobs``: two counts side by side (stragglers, hangs), and each straggler said once.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from commands import SCENARIO, Agent, Coordinator, http_get, metric_value, run_cli, until, write_config
from simagent import SimAgent, screen_result, screens_message, step_batch_message

pytestmark = pytest.mark.integration


def _coordinator(tmp_path: Path, **extra: Any) -> Coordinator:
    cfg = write_config(tmp_path / "coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "db_path": str(tmp_path / "c.db"), **extra}})
    return Coordinator(tmp_path / "coordinator", cfg)


@pytest.mark.slow
def test_fleet_names_the_gpu_behind_a_degraded_link(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path)
    agent = None
    try:
        address = coord.address()
        cfg = write_config(tmp_path / "agent.yaml", {
            "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "node_name": "faulty",
                      "coordinator": address, "state_dir": str(tmp_path), "socket_path": str(tmp_path / "r.sock")},
            "diag": {"enabled": False}})
        agent = Agent(tmp_path / "agent", cfg)
        agent.wait_ready()
        # what gpuhealth status / the agent says: GPU 3's link at x8, GPU 5 fell off the bus
        def unhealthy() -> set[int] | None:
            gpus = {g["index"] for g in agent.health()["gpus"] if g["health"] == "unhealthy"}
            return gpus if {3, 5} <= gpus else None

        status_gpus = until(unhealthy, 30, "GPUs 3 and 5 unhealthy on the agent")

        def fleet() -> dict[str, Any] | None:
            res = run_cli("fleet", "--coordinator", address, "--json")
            doc: dict[str, Any] = json.loads(res.stdout) if res.stdout else {}
            gpus = {g["gpu"] for g in doc.get("unhealthy_gpus", [])}
            return doc if status_gpus <= gpus else None

        doc = until(fleet, 30, "the agent's unhealthy GPUs in gpuhealth fleet")
        row = next(g for g in doc["unhealthy_gpus"] if g["gpu"] == 3)
        assert row["codes"] == ["pcie.link_degraded"] and row["health"] == "unhealthy" and row["action"] == "drain"
        assert row["uuid"].startswith("GPU-") and row["pci_bus_id"] == "00000000:48:00.0"
        [node] = doc["nodes"]
        assert node["health"] == "unhealthy"
        # the agent replays a scenario: marked SIMULATED, as status, the agent's log and /metrics mark it
        assert node["simulated"] is True and node["backend"].startswith("simulated from")
        assert doc["simulated_nodes"] == 1
        res = run_cli("fleet", "--coordinator", address)
        assert res.returncode == 1
        assert "node faulty GPU 3" in res.stdout and "pcie.link_degraded" in res.stdout, res.stdout
        assert "SIMULATED: 1 of 1 node(s) replay a recording, not real GPUs: faulty" in res.stdout, res.stdout
        assert "faulty (SIMULATED)" in res.stdout
    finally:
        if agent is not None:
            agent.stop()
        coord.stop()


def test_the_fleet_sdc_vote_is_on_the_coordinators_metrics(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path)
    try:
        ports = coord.wait()
        address = f"127.0.0.1:{ports['grpc_port']}"

        async def four_nodes_vote() -> None:
            agents = [SimAgent(address, f"n{i}", gpus=1) for i in range(4)]
            for i, a in enumerate(agents):
                await a.register()
                await a.connect()
                digest = "bad0" if i == 3 else "600d"  # n3's GPU computed another result
                await a.send(screens_message(1, [screen_result(a.gpu_uuids()[0], index=0, finished_at=time.time(),
                                                               digests=[("sdc-key-1", digest)])]))
                await a.wait_acked(1)
            for a in agents:
                await a.close()

        asyncio.run(four_nodes_vote())

        def scraped() -> str | None:
            code, body = http_get(f"http://127.0.0.1:{ports['metrics_port']}/metrics")
            return body if code == 200 and 'code="sdc.mismatch"' in body else None

        body = until(scraped, 20, "sdc.mismatch on the coordinator's /metrics")
        assert metric_value(body, "gpuhealth_fleet_findings", code="sdc.mismatch", node="n3", gpu="0",
                            uuid="GPU-n3-0", severity="critical", action="drain") == 1.0
        assert metric_value(body, "gpuhealth_fleet_findings", code="sdc.mismatch", node="n0") is None
        # The same finding as gpuhealth fleet shows it.
        doc = json.loads(run_cli("fleet", "--coordinator", address, "--json").stdout)
        assert [f["entity"]["id"] for f in doc["sdc"]] == ["GPU-n3-0"]
        assert doc["simulated_nodes"] == 0 and not any(n["simulated"] for n in doc["nodes"])  # none said so
    finally:
        coord.stop()


def test_the_jobs_table_counts_and_says_each_straggler_once(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path)
    try:
        address = coord.address()

        async def straggling_job() -> None:
            agent = SimAgent(address, "n1")
            await agent.register()
            await agent.connect()
            for step in range(60):  # rank 2 computes twice as long as the others, every step
                await agent.send(step_batch_message(step + 1, "strag", [0, 1, 2, 3], step, wall_s=0.2,
                                                    compute=[0.05, 0.05, 0.1, 0.05]))
            await agent.wait_acked(60)
            await agent.close()

        asyncio.run(straggling_job())

        def verdict() -> dict[str, Any] | None:
            doc = json.loads(run_cli("jobs", "strag", "--coordinator", address, "--json").stdout)
            job: dict[str, Any] = doc["jobs"][0]
            return job if job.get("stragglers") and job.get("verdicts") else None

        job = until(verdict, 30, "rank 2 flagged a straggler")
        assert job["stragglers"] == [2]
        res = run_cli("jobs", "strag", "--coordinator", address)
        assert res.returncode == 1, res.stderr
        [row] = [ln for ln in res.stdout.splitlines() if ln.startswith("│ strag")]
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[-2:] == ["1", "0"], cells  # 1 straggler rank, 0 hangs: two counts
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("strag:")]
        assert len([ln for ln in lines if "rank 2" in ln]) == 1, res.stdout  # said once
        # An unknown job is an error, not an empty table with exit 0.
        res = run_cli("jobs", "no-such-job", "--coordinator", address)
        assert res.returncode == 3 and "knows no job 'no-such-job'" in res.stderr, (res.returncode, res.stderr)
    finally:
        coord.stop()


def _ranks_message(seq: int, job_id: str, ranks: list[int], node: str) -> bytes:
    from gpuhealth.proto import gpuhealth_v1_pb2 as pb

    ids = [pb.RankIdentity(job_id=job_id, rank=r, world_size=len(ranks), host=node, pid=1000 + r, local_rank=r,
                           gpu_index=-1) for r in ranks]
    return pb.AgentMessage(record=pb.Record(seq=seq, ranks=pb.RankIdentities(ranks=ids))).SerializeToString()


def test_a_finished_jobs_straggler_is_history_not_an_alarm(tmp_path: Path) -> None:
    """Issue 33: ``gpuhealth jobs`` exited 1 for a straggler in a job that had already finished. Its verdict is
    still shown; the exit code says whether a job needs a look now."""
    coord = _coordinator(tmp_path)
    try:
        address = coord.address()

        async def finished_job() -> None:
            agent = SimAgent(address, "n1", simulated=True)
            await agent.register()
            await agent.connect()
            await agent.send(_ranks_message(1, "done", [0, 1, 2, 3], "n1"))
            for step in range(60):  # rank 2 computes twice as long as the others, every step
                await agent.send(step_batch_message(step + 2, "done", [0, 1, 2, 3], step, wall_s=0.2,
                                                    compute=[0.05, 0.05, 0.1, 0.05]))
            await agent.wait_acked(61)
            await agent.close()  # no agent reports a rank of it alive: the job is finished

        asyncio.run(finished_job())

        def finished() -> dict[str, Any] | None:
            doc = json.loads(run_cli("jobs", "done", "--coordinator", address, "--json").stdout)
            job: dict[str, Any] = doc["jobs"][0]
            return job if job.get("verdicts") and job["state"] == "finished" else None

        job = until(finished, 30, "the finished job's straggler verdict")
        assert any(v["kind"] == "straggler" for v in job["verdicts"])
        res = run_cli("jobs", "done", "--coordinator", address)
        assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
        assert "finished" in res.stdout and "rank 2" in res.stdout  # still shown
        # its node replays a recording: marked, as in fleet and status
        assert "n1 (SIMULATED)" in res.stdout and "SIMULATED: node(s) n1 replay a recording" in res.stdout
        assert job["simulated_nodes"] == ["n1"]
        assert run_cli("jobs", "--coordinator", address).returncode == 0
    finally:
        coord.stop()


def test_a_coordinator_with_no_nodes_says_so_and_judges_nothing(tmp_path: Path) -> None:
    """Issue 33: ``gpuhealth fleet`` on a coordinator no agent had registered with printed "0 of 0 GPUs (100.0 %)
    screened" and exited 0. No node is nothing to judge: say so, exit 3 (could not check)."""
    coord = _coordinator(tmp_path)
    try:
        address = coord.address()
        res = run_cli("fleet", "--coordinator", address)
        assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
        assert "no nodes: no agent has registered with the coordinator" in " ".join(res.stdout.split())
        assert "100.0 %" not in res.stdout
        res = run_cli("fleet", "--coordinator", address, "--json")
        assert res.returncode == 3 and json.loads(res.stdout)["nodes"] == []
    finally:
        coord.stop()
