"""A multi-node job judged by node (coordinator/multinode.py): communication against the job's own best pace
(``job.comm_slow``) with the nodes the evidence names, and nodes cut off (``node.cut_off``)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.jobs import JobState
from gpuhealth.coordinator.multinode import (
    CommSettings,
    CommWatch,
    comm_slow_verdict,
    cut_off_nodes,
    cut_off_verdict,
    localise,
)
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.model import Entity, EntityKind, Finding, RankIdentity, Severity
from gpuhealth.proto.convert import StepColumns

NODES = ["n0", "n1", "n2", "n3"]


def _job(world: int = 8) -> JobState:
    job = JobState("j")
    for r in range(world):
        job.add_identity(NODES[r // 2], RankIdentity("j", r, world, "h", 100 + r, local_rank=r % 2), now=0.0)
    return job


def _step(job: JobState, step: int, comm: float, compute: float = 0.05, rng: random.Random | None = None,
          skew: dict[int, float] | None = None) -> None:
    rng = rng or random.Random(step)
    ranks = list(range(job.world_size))
    waits = [comm * (1 + 0.05 * rng.uniform(-1, 1)) * (1 + (skew or {}).get(r, 0.0)) for r in ranks]
    comps = [compute * (1 + 0.05 * rng.uniform(-1, 1)) for _ in ranks]
    job.add_steps(StepColumns("j", ranks, [step] * len(ranks), [0.0] * len(ranks),
                              [c + w for c, w in zip(comps, waits, strict=True)], comps, waits), now=float(step))


def test_healthy_noisy_job_never_opens_an_episode() -> None:
    job = _job()
    rng = random.Random(1)
    for s in range(400):
        _step(job, s, 0.05 * (1 + 0.4 * rng.random()), rng=rng)  # up to 40 % jitter in the wait
        assert job.comm.judge() == (None, False)


def test_communication_slower_while_compute_holds_opens_one_episode_then_closes() -> None:
    job = _job()
    for s in range(40):
        _step(job, s, 0.05)
    opened = []
    for s in range(40, 60):
        _step(job, s, 0.5)  # a link at a tenth: ten times the wait
        episode, new = job.comm.judge()
        if new:
            opened.append(s)
    assert len(opened) == 1 and opened[0] < 40 + 8, opened  # within a window of steps
    episode, _ = job.comm.judge()
    assert episode is not None and 9 < episode.ratio < 11 and abs(episode.compute_s - 0.05) < 0.005
    assert episode.since_step >= 40
    for s in range(60, 80):
        _step(job, s, 0.05)
    assert job.comm.judge() == (None, False)  # back to its pace: closed


def test_a_job_slower_in_compute_too_is_not_comm_slow() -> None:
    job = _job()
    for s in range(40):
        _step(job, s, 0.05)
    for s in range(40, 80):
        _step(job, s, 0.5, compute=0.2)  # everything slower: job.slowdown's, not the network's
        assert job.comm.judge()[0] is None


def test_a_small_growth_of_a_tiny_wait_is_not_comm_slow() -> None:
    job = _job()
    for s in range(40):
        _step(job, s, 0.002, compute=0.5)
    for s in range(40, 80):
        _step(job, s, 0.01, compute=0.5)  # 5x a 2 ms wait: 2 % of a step
        assert job.comm.judge()[0] is None


def test_a_late_rank_does_not_hold_the_judgement_back() -> None:
    watch = CommWatch(CommSettings())
    watch.world_size = 8
    for s in range(40):
        watch.feed(list(range(7)), [s] * 7, [0.1] * 7, [0.05] * 7, [0.05] * 7)  # rank 7 never reports
    assert watch.closed >= 36  # judged once later steps came


def _nic(code: str) -> Finding:
    return Finding(code, Severity.WARNING, Entity(EntityKind.NODE, "n1"), "port mlx5_0/1 errors grew",
                   source="infiniband")


def test_nic_findings_name_the_node_wait_pattern_next_else_the_candidates() -> None:
    settings = CommSettings()
    job = _job()
    for s in range(40):
        _step(job, s, 0.05)
    for s in range(40, 60):
        _step(job, s, 0.5)
    episode, _ = job.comm.judge()
    assert episode is not None
    where = localise(NODES, {"n1": [_nic("ib.errors")], "n2": [_nic("pcie.replay_rate")]}, episode, settings)
    assert where.nodes == ["n1"] and where.basis == "nic_findings"
    doc = comm_slow_verdict("j", episode, where, 1.0)
    assert "node n1" in doc["summary"] and "ib.errors" in doc["summary"] and not doc["probe_advised"]
    # Every node with a NIC finding separates nothing.
    assert localise(NODES, {n: [_nic("nic.errors")] for n in NODES}, episode, settings).nodes == []
    where = localise(NODES, {}, episode, settings)
    assert where.nodes == [] and where.candidates == NODES and where.basis == "none"
    doc = comm_slow_verdict("j", episode, where, 1.0)
    assert doc["probe_advised"] and "gpuhealth diag fabric" in doc["summary"] and "n0, n1, n2, n3" in doc["summary"]


def test_a_node_whose_wait_stands_apart_since_the_slowdown_is_named() -> None:
    job = _job()
    for s in range(40):
        _step(job, s, 0.05)
    for s in range(40, 60):
        _step(job, s, 0.5, skew={4: -0.2, 5: -0.2})  # node n2's ranks wait a fifth less: the others wait on it
    episode, _ = job.comm.judge()
    assert episode is not None
    where = localise(NODES, {}, episode, CommSettings())
    assert where.nodes == ["n2"] and where.basis == "wait_pattern"


def test_cut_off_needs_silence_a_stalled_job_and_others_heard() -> None:
    ranks = {"n0": [0, 1], "n1": [2, 3], "n2": [4, 5]}
    heard = {"n0": 199.0, "n1": 100.0, "n2": 198.0}
    cuts = cut_off_nodes(ranks, heard, progress_at=99.5, now=200.0, silent_after_s=27.0, step_s=0.1, heard_every_s=10)
    assert [c.node for c in cuts] == ["n1"] and cuts[0].ranks == [2, 3]
    # Not yet silent long enough; or the job still progresses; or nobody is heard (the coordinator's network).
    assert cut_off_nodes(ranks, heard, 99.5, 120.0, 27.0, 0.1, 10) == []
    assert cut_off_nodes(ranks, heard, 195.0, 200.0, 27.0, 0.1, 10) == []
    assert cut_off_nodes(ranks, dict.fromkeys(ranks, 100.0), 99.5, 200.0, 27.0, 0.1, 10) == []
    # A node that went quiet long after the job had stalled did not stop it: a hang's, not a cut-off.
    assert cut_off_nodes(ranks, {**heard, "n1": 150.0}, 99.5, 200.0, 27.0, 0.1, 10) == []
    # An agent silent since long before the stall (dead, or its node gone an hour ago) says nothing about it.
    assert cut_off_nodes(ranks, {**heard, "n1": 50.0}, 99.5, 200.0, 27.0, 0.1, 10) == []
    doc = cut_off_verdict("j", cuts, ["n0", "n2"], 1.0, 41)
    assert doc["nodes"] == ["n1"] and doc["cause"] == "network" and doc["culprits"] == [2, 3]
    assert doc["summary"].startswith("cut_off: node n1 lost its network")


class _Mono:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_service_names_a_cut_off_node_instead_of_investigating_a_hang(tmp_path: Path) -> None:
    """Hang floor 15 s, heartbeat 10 s: a node silent since the job stopped holds the hang investigation back
    (before: after 15 s an "incomplete" hang asking that node for evidence), and at 27 s it is cut off."""
    mono = _Mono()
    coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(hang_floor_s=15.0, hang_k=10.0,
                                                                    evidence_dir=str(tmp_path / "ev")),
                        monotonic=mono)
    job = coord.jobs.get("j", mono())
    for r in range(6):
        job.add_identity(NODES[r // 2], RankIdentity("j", r, 6, "h", 100 + r, local_rank=r % 2), mono())
    for s in range(50):
        mono.now += 0.1
        _step(job, s, 0.05)
        job.progress_at = mono.now
        for n in NODES[:3]:
            coord.heard_at[n] = mono.now
    stop = mono.now
    for t in range(1, 40):  # n1 is never heard again; n0 and n2 heartbeat every 10 s; nobody progresses
        mono.now = stop + t
        if t % 10 == 0:
            coord.heard_at["n0"] = coord.heard_at["n2"] = mono.now
        coord.tick()
        assert not coord.investigating and coord.counters.hangs == 0, t  # no hang investigation at all
        if t < 27:
            assert coord.store.verdicts("j") == [], t
    (doc,) = coord.store.verdicts("j")
    assert doc["kind"] == "cut_off" and doc["nodes"] == ["n1"] and doc["culprits"] == [2, 3]
    assert job.cut_off == ["n1"] and job.hang_open
    coord.heard_at["n1"] = mono.now  # heard again: no longer cut off
    coord.tick()
    assert job.cut_off == []


def test_without_a_silent_node_a_stalled_job_is_still_a_hang(tmp_path: Path) -> None:
    mono = _Mono()
    coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(hang_floor_s=10.0, evidence_timeout_s=1.0,
                                                                    evidence_dir=str(tmp_path / "ev")),
                        monotonic=mono)
    job = coord.jobs.get("j", mono())
    for r in range(6):
        job.add_identity(NODES[r // 2], RankIdentity("j", r, 6, "h", 100 + r), mono())
    for s in range(50):
        _step(job, s, 0.05)
    job.progress_at = mono.now
    for _t in range(1, 12):
        mono.now += 1
        for n in NODES[:3]:
            coord.heard_at[n] = mono.now  # every agent heard: the job hung by itself

        async def tick() -> None:
            coord.tick()
            await asyncio.sleep(0)

        asyncio.run(tick())
    assert coord.counters.hangs == 1 and job.cut_off == []
