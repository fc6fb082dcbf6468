"""End to end on one machine: a coordinator, agents for two simulated nodes (n1: a clean H200 x2
recording; n2: GPU 1 in HW slowdown) each with its RankHub socket and coordinator link, and REAL
4-rank PyTorch Gloo jobs using the instrument hook (ranks 0,1 on n1, ranks 2,3 on n2; LOCAL_RANK
picks the GPU). The workers are this file run as a script.

(1) a rank doing 2x the compute is flagged as a straggler within 10 steps, with n2 GPU 1's
    throttling finding attached;
(2) a rank that stops entering collectives gives a hang verdict naming it, with its flight-recorder
    dump and Python stack, within 60 s;
(3) a healthy run gives nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
SCENARIOS = HERE.parent.parent / "fixtures" / "scenarios"
WORLD = 4


# -- worker side (rank processes) ----------------------------------------------------------------


def _worker(cfg: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gpuhealth.instrument import Tracker

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=os.environ["TEST_RENDEZVOUS"], rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    tracker = Tracker(flush_interval_s=0.1)
    grad = torch.ones(1024)
    for step in range(cfg["steps"]):
        with tracker.step():
            slow = rank == cfg.get("straggler") and step >= cfg.get("slow_from", 0)
            time.sleep(cfg["compute_s"] * (2 if slow else 1))
            if rank == cfg.get("stuck") and step == cfg["stuck_at"]:
                stuck_on_host(Path(cfg["release"]))
            with tracker.collective():
                dist.all_reduce(grad)
    tracker.close()
    dist.destroy_process_group()


def stuck_on_host(release: Path) -> None:
    """The hung rank: busy in Python (say, a data loader); it never enters the next collective."""
    while not release.exists():
        time.sleep(0.05)


# -- cluster side (the test process) -------------------------------------------------------------


class CoordinatorThread:
    """A real coordinator (gRPC server, SQLite store, detection tick) on its own event loop."""

    def __init__(self, tmp: Path) -> None:
        from gpuhealth.config import CoordinatorConfig
        from gpuhealth.coordinator.run import build

        cfg = CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", db_path=str(tmp / "coord.db"),
                                hang_k=10.0, hang_floor_s=4.0, tick_s=0.2, evidence_timeout_s=20.0,
                                heartbeat_interval_s=0.5)
        self.server = build(cfg)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(20), "coordinator did not start"
        assert self.server.endpoints is not None
        self.address = f"127.0.0.1:{self.server.endpoints.grpc_port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.start())
        self.ready.set()
        self.loop.run_forever()

    def verdicts(self, job_id: str) -> list[dict[str, Any]]:
        return self.server.coord.store.verdicts(job_id)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Node:
    name: str
    sock: Path
    agent: Any
    link: Any


def _start_node(name: str, scenario: Path | str, address: str, state: Path) -> Node:
    from gpuhealth.agent.coordinator_link import CoordinatorLink, LinkSettings
    from gpuhealth.agent.daemon import Agent
    from gpuhealth.agent.ranks import RankHub
    from gpuhealth.config import Config
    from gpuhealth.node import open_backend

    cfg = Config()
    cfg.agent.node_name = name
    cfg.agent.state_dir = str(state / name)
    cfg.collectors.fast_interval_s = 1.0
    cfg.collectors.sysfs_root = str(state / "no-sysfs")
    sock = state / f"{name}.sock"
    hub = RankHub(sock)
    link = CoordinatorLink(LinkSettings(address=address, spool_path=str(state / name / "spool.db"),
                                        batch_interval_s=0.1, work_dir=str(state / name / "fr")), rank_hub=hub)
    agent = Agent(cfg, open_backend(scenario), extensions=[hub, link], serve_http=False)
    agent.start()
    return Node(name, sock, agent, link)


@dataclass
class Cluster:
    coord: CoordinatorThread
    nodes: dict[str, Node]
    tmp: Path


def _until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Short paths: unix socket paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="gh-e2e-") as d:
        tmp = Path(d)
        coord = CoordinatorThread(tmp)
        nodes = {
            "n1": _start_node("n1", "nvml_h200x2.json", coord.address, tmp),
            "n2": _start_node("n2", SCENARIOS / "hw_slowdown.yaml", coord.address, tmp),
        }
        try:
            # Both agents connected and n2's throttling finding has reached the coordinator.
            def n2_throttled() -> bool:
                view = coord.server.coord.nodes.get("n2")
                return bool(view and view.connected and any(f.code == "throttle.hw_slowdown" for f in view.findings)
                            and coord.server.coord.nodes.get("n1") and coord.server.coord.nodes["n1"].connected)

            _until(n2_throttled, 30, "both agents connected and n2's HW slowdown finding at the coordinator")
            yield Cluster(coord, nodes, tmp)
        finally:
            for n in nodes.values():
                n.agent.stop()
            coord.stop()


def _launch(cluster: Cluster, job_id: str, cfg: dict[str, Any]) -> list[subprocess.Popen[bytes]]:
    rendezvous = f"file://{cluster.tmp / f'{job_id}.rendezvous'}"  # no port picked before it is bound
    procs = []
    for rank in range(WORLD):
        node = cluster.nodes["n1" if rank < 2 else "n2"]
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank % 2),
               "TEST_RENDEZVOUS": rendezvous, "TORCH_FR_BUFFER_SIZE": "2000",
               "GPUHEALTH_SOCKET": str(node.sock), "GPUHEALTH_JOB_ID": job_id, "PYTHONUNBUFFERED": "1"}
        log = open(cluster.tmp / f"{job_id}-rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, str(HERE), "worker", json.dumps(cfg)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def _finish(procs: list[subprocess.Popen[bytes]], cluster: Cluster, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        log = (cluster.tmp / f"{job_id}-rank{rank}.log").read_text()[-3000:]
        assert rc == 0, f"rank {rank} exit {rc}:\n{log}"


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _job(cluster: Cluster, job_id: str) -> Any:
    return cluster.coord.server.coord.jobs.jobs.get(job_id)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_straggler_flagged_within_10_steps_with_its_gpu_finding(cluster: Cluster) -> None:
    job_id = "e2e-straggler"
    procs = _launch(cluster, job_id, {"steps": 30, "compute_s": 0.12, "straggler": 3, "slow_from": 0})
    try:
        verdict = _until(lambda: next(iter(cluster.coord.verdicts(job_id)), None), 60, "a straggler verdict")
        assert verdict["kind"] == "straggler"
        assert verdict["culprits"] == [3]
        detail = verdict["culprit_details"][0]
        assert (detail["rank"], detail["node"], detail["gpu_index"]) == (3, "n2", 1)
        assert detail["gpu_inferred_from_local_rank"] is True  # CPU ranks: GPU from LOCAL_RANK
        codes = [f["code"] for f in detail["gpu_findings"]]
        assert "throttle.hw_slowdown" in codes
        assert detail["line"].startswith("rank 3, node n2 GPU 1: ")
        assert "slowdown" in detail["line"].lower()
        finding = verdict["findings"][0]
        assert finding["code"] == "rank.straggler" and finding["evidence"]["rank"] == 3
        assert 1.5 < finding["evidence"]["ratio_to_median"] < 2.6
        # Within 10 steps: when the verdict was stored, no rank had finished more than 10 steps.
        assert verdict["at_step"] is not None and verdict["at_step"] <= 10, verdict["at_step"]
        # Live triage of the running job (what `gpuhealth triage --job` prints): every rank's dump.
        from gpuhealth.coordinator.query import live_triage
        from gpuhealth.coordinator.triage_wire import reply_to_dict

        live = reply_to_dict(live_triage(cluster.coord.address, job_id, timeout_s=40))
        assert {"verdict", "findings", "ranks_seen", "ranks_missing", "groups", "culprits"} <= set(live)
        assert live["verdict"] in ("hang", "mismatch", "straggler", "healthy", "incomplete")
        assert live["ranks_seen"] == [0, 1, 2, 3] and live["ranks_missing"] == []
        assert sorted(live["stacks"]) == ["0", "1", "2", "3"]
        _finish(procs, cluster, job_id)
        assert [v["culprits"] for v in cluster.coord.verdicts(job_id)] == [[3]]  # flagged once, no others
    finally:
        _kill(procs)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(150)
def test_hang_verdict_names_the_rank_with_fr_evidence_and_stack(cluster: Cluster) -> None:
    job_id = "e2e-hang"
    release = cluster.tmp / "release-hang"
    procs = _launch(cluster, job_id, {"steps": 12, "compute_s": 0.05, "stuck": 2, "stuck_at": 5,
                                      "release": str(release)})
    try:
        _until(lambda: _job(cluster, job_id) is not None and _job(cluster, job_id).last_step.get(0, -1) >= 3, 60,
               "the job to make progress")
        stuck_since = time.monotonic()
        verdict = _until(lambda: next((v for v in cluster.coord.verdicts(job_id) if v["kind"] == "hang"), None),
                         60, "a hang verdict")
        took = time.monotonic() - stuck_since
        assert took < 60
        assert verdict["culprits"] == [2], verdict["summary"]
        detail = verdict["culprit_details"][0]
        assert (detail["node"], detail["gpu_index"]) == ("n2", 0)
        assert detail["line"] == "rank 2, node n2 GPU 0: no health findings on this GPU"
        codes = {f["code"] for f in verdict["findings"] if f.get("evidence", {}).get("rank") == 2}
        assert "collective.missing_rank" in codes, verdict["findings"]
        # Evidence: every rank's flight-recorder dump, as JSON files the analyzer read.
        dumps = verdict["evidence"]["fr_dumps"]
        assert Path(verdict["evidence"]["dir"]).stat().st_mode & 0o077 == 0  # private to the service
        assert sorted(dumps) == ["0", "1", "2", "3"]
        assert all(json.loads(Path(p).read_text())["entries"] is not None for p in dumps.values())
        # The culprit's Python stack shows where it is stuck.
        stack = detail["stack"]
        assert stack is not None and stack["source"] in ("py-spy", "hook")
        hook_frames = [f["function"] for t in stack["hook"]["threads"] if t["main"] for f in t["frames"]]
        assert "stuck_on_host" in hook_frames
        if "py_spy" in stack:
            spy_frames = [f["name"] for t in stack["py_spy"] for f in t["frames"]]
            assert "stuck_on_host" in spy_frames
        assert verdict["hang"]["stalled_s"] >= 4.0
        release.touch()
        _finish(procs, cluster, job_id)
    finally:
        release.touch()
        _kill(procs)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(150)
def test_healthy_run_produces_nothing(cluster: Cluster) -> None:
    job_id = "e2e-healthy"
    procs = _launch(cluster, job_id, {"steps": 20, "compute_s": 0.1})
    try:
        _finish(procs, cluster, job_id)
        job = _until(lambda: _job(cluster, job_id), 10, "the job at the coordinator")
        _until(lambda: job.last_step and min(job.last_step.values()) == 19, 10, "every step record")
        _until(lambda: job.finished, 10, "the agents to report the ranks gone")
        time.sleep(5.0)  # longer than the hang floor: a finished job is not a hung one
        assert cluster.coord.verdicts(job_id) == []
        assert job.stragglers == {} and job.hangs == 0
        assert job.records == WORLD * 20
    finally:
        _kill(procs)


@pytest.mark.integration
def test_fleet_and_jobs_cli_against_the_live_coordinator(cluster: Cluster) -> None:
    from click.testing import CliRunner

    from gpuhealth.cli.main import cli

    runner = CliRunner()
    res = runner.invoke(cli, ["fleet", "--coordinator", cluster.coord.address, "--json"])
    assert res.output.startswith("{"), res.output
    doc = json.loads(res.output)
    assert res.exit_code == 1  # a degraded GPU in the fleet
    assert [(g["node"], g["gpu"], g["codes"]) for g in doc["unhealthy_gpus"]] == [
        ("n2", 1, ["throttle.hw_slowdown"])]
    assert doc["version_drift"] == [] and doc["sdc"] == []
    assert {n["name"]: n["versions"]["driver"] for n in doc["nodes"]} == {"n1": "580.159.04", "n2": "580.159.04"}
    res = runner.invoke(cli, ["jobs", "--coordinator", cluster.coord.address, "--json"])
    assert res.exit_code in (0, 1), res.output
    assert isinstance(json.loads(res.output)["jobs"], list)
    res = runner.invoke(cli, ["jobs", "--coordinator", "127.0.0.1:1", "--json"])
    assert res.exit_code == 3 and "UNAVAILABLE" in res.output
    # A fleet-wide SDC check through the agents (CPU "devices" here): digests are stored and voted;
    # two nodes are too few voters to accuse anyone.
    res = runner.invoke(cli, ["fleet", "--coordinator", cluster.coord.address, "--sdc", "--device", "cpu",
                              "--timeout", "120", "--json"])
    assert res.output.startswith("{"), res.output
    doc = json.loads(res.output)
    run = doc["sdc_run"]
    assert sorted(run["results"]) == ["n1", "n2"] and run["errors"] == {}, run["errors"]
    assert run["sdc_digests_stored"] > 0 and doc["sdc_digests"]["votes"] == run["sdc_digests_stored"]
    assert doc["sdc"] == []
    # `gpuhealth triage --job` goes through query.live_triage: a job with no rank connected anywhere
    # gets an "incomplete" verdict from what the agents (none) could give.
    async def known_job() -> None:
        cluster.coord.server.coord.jobs.get("e2e-no-ranks", time.monotonic())

    asyncio.run_coroutine_threadsafe(known_job(), cluster.coord.loop).result(10)
    res = runner.invoke(cli, ["triage", "--job", "e2e-no-ranks", "--coordinator", cluster.coord.address, "--json"])
    live = json.loads(res.output)
    assert live["verdict"] == "incomplete" and live["ranks_seen"] == [], res.output
    res = runner.invoke(cli, ["triage", "--job", "no-such-job", "--coordinator", cluster.coord.address, "--json"])
    assert res.exit_code == 3 and "NOT_FOUND" in res.output


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    _worker(json.loads(sys.argv[2]))
    # Skip finalization, where torch + Gloo can abort a finished worker (see test_instrument_ddp.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
