"""A multi-node job judged by node (coordinator/multinode.py): communication against the job's own best pace
(``job.comm_slow``) with the nodes the evidence names, and nodes cut off (``node.cut_off``)."""

from __future__ import annotations

import random

from gpuhealth.coordinator.jobs import JobState
from gpuhealth.coordinator.multinode import (
    CommSettings,
    CommWatch,
    comm_slow_verdict,
    cut_off_nodes,
    cut_off_verdict,
    localise,
)
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
    assert doc["probe_advised"] and "gpuhealth probe" in doc["summary"] and "n0, n1, n2, n3" in doc["summary"]


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
