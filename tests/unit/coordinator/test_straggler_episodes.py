"""The coordinator's straggler episodes: one verdict per rank and episode, also across a restart of
the coordinator on the same database; the budgeted feed samples whole runs of steps."""

from __future__ import annotations

from pathlib import Path

from simagent import step_batch_message

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.coordinator.straggler_feed import BudgetedStragglerFeed
from gpuhealth.model import Action, Entity, Finding, Severity
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import StepColumns

JOB = "train"
RANKS = list(range(8))


class _Agent:
    """Step batches straight into a coordinator (no loop: each record commits on its own)."""

    def __init__(self, coord: Coordinator, incarnation: str) -> None:
        self.coord = coord
        reply = coord.register(pb.RegisterRequest(node_name="n1", incarnation=incarnation))
        self.session = coord.sessions[reply.session_id]
        self.seq = reply.acked_seq

    def steps(self, first: int, last: int, slow: float = 1.0) -> None:
        for step in range(first, last):
            self.seq += 1
            compute = [0.06 * (slow if r == 3 else 1.0) * (1 + 0.01 * ((r * 7 + step * 3) % 5 - 2)) for r in RANKS]
            raw = step_batch_message(self.seq, JOB, RANKS, step, wall_s=0.2, compute=compute)
            self.coord.handle_record(self.session, raw, pb.AgentMessage.FromString(raw).record)
            if step % 4 == 3:
                self.coord.tick()


def _coordinator(tmp_path: Path) -> Coordinator:
    return Coordinator(Store(tmp_path / "coord.db"),
                       CoordinatorConfig(evidence_dir=str(tmp_path / "ev"), hang_floor_s=3600),
                       detector_factory=lambda job: BudgetedStragglerFeed(job))


def test_a_restarted_coordinator_continues_the_episode_instead_of_announcing_it_again(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path)
    _Agent(coord, "a").steps(0, 60, slow=1.6)
    assert [v["culprits"] for v in coord.store.verdicts(JOB)] == [[3]]
    assert coord.counters.verdicts == {"straggler": 1}
    onset = coord.jobs.jobs[JOB].stragglers[3].evidence["onset_step"]
    coord.store.close()

    again = _coordinator(tmp_path)  # the same database: steps replayed, the open episode read back
    again.tick()
    agent = _Agent(again, "b")
    agent.steps(60, 120, slow=1.6)
    assert len(again.store.verdicts(JOB)) == 1  # still the one episode
    assert again.counters.verdicts == {}  # nothing announced (verdicts_total counts nothing twice)
    job = again.jobs.jobs[JOB]
    assert list(job.stragglers) == [3] and job.stragglers[3].evidence["onset_step"] == onset

    agent.steps(120, 200)  # rank 3 recovers: the episode closes, in memory and in the store
    assert again.jobs.jobs[JOB].stragglers == {} and again.store.straggler_episodes(JOB) == {}
    agent.steps(200, 260, slow=1.6)  # slow again: a new episode, a new verdict
    assert [v["culprits"] for v in again.store.verdicts(JOB)] == [[3], [3]]
    assert again.counters.verdicts == {"straggler": 1}


def test_store_keeps_exactly_the_open_episodes(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    f = Finding("rank.straggler", Severity.WARNING, Entity.rank(2), "slow", Action.CHECK_JOB,
                {"rank": 2, "active": True, "onset_step": 10, "ratio_to_median": 1.3})
    with store.transaction():
        store.set_straggler_episodes("j", {2: f, 5: f}, 1.0)
    assert sorted(store.straggler_episodes("j")) == [2, 5]
    with store.transaction():
        store.set_straggler_episodes("j", {2: f}, 2.0)
    assert store.straggler_episodes("j") == {2: f} and store.straggler_episodes("other") == {}
    with store.transaction():
        store.set_straggler_episodes("j", {}, 3.0)
    assert store.straggler_episodes("j") == {}


def _cols(step: int, slow_on_odd_steps: bool) -> StepColumns:
    compute = [0.2 if (r == 5 and slow_on_odd_steps and step % 2 == 1) else 0.1 for r in range(64)]
    return StepColumns(JOB, list(range(64)), [step] * 64, [1.7e9] * 64, [1.0] * 64, compute, None)


def test_above_its_budget_the_feed_judges_whole_runs_of_steps() -> None:
    # A rank slow on every odd step: sampling every 2nd step would see it always fast (even steps)
    # or always slow; whole runs keep the pattern, so it is found with its true 1.5x mean.
    feed = BudgetedStragglerFeed(JOB, budget_records_s=320.0, rate_window_s=1.0, run_steps=16)
    t = 0.0
    for step in range(400):
        feed.feed(_cols(step, slow_on_odd_steps=True), now=t)
        t += 0.1  # 640 rank-steps/s: twice the budget
    assert feed.stride == 2
    taken = [s for s in range(400) if feed.sampled(s)]
    runs = [taken[i:i + 16] for i in range(0, len(taken), 16)]
    assert all(r == list(range(r[0], r[0] + 16)) for r in runs)  # contiguous runs of 16 steps…
    assert len(taken) < 0.6 * 400  # …about half of them after the first rate window
    found = feed.evaluate()
    assert [f.evidence["rank"] for f in found] == [5]
    assert 1.4 <= found[0].evidence["ratio_to_median"] <= 1.6


def test_a_whole_job_slowdown_is_surfaced_and_never_a_straggler(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path)
    agent = _Agent(coord, "a")
    agent.steps(0, 80)
    assert coord.jobs.jobs[JOB].slowdown is None
    for step in range(80, 180):  # every rank 1.5x slower together (a slower dataset, a checkpoint writer)
        agent.seq += 1
        compute = [0.09 * (1 + 0.01 * ((r * 7 + step * 3) % 5 - 2)) for r in RANKS]
        raw = step_batch_message(agent.seq, JOB, RANKS, step, wall_s=0.3, compute=compute)
        coord.handle_record(agent.session, raw, pb.AgentMessage.FromString(raw).record)
        if step % 4 == 3:
            coord.tick()
    job = coord.jobs.jobs[JOB]
    assert job.slowdown is not None and job.slowdown.code == "job.slowdown", job.summary(0.0)
    assert 1.4 < job.slowdown.evidence["ratio_to_history"] < 1.6
    assert job.stragglers == {} and coord.store.verdicts(JOB) == []  # no rank is blamed
    summary = job.summary(0.0)["slowdown"]
    assert summary["ratio"] == job.slowdown.evidence["ratio_to_history"] and summary["since_step"] >= 70
    [entry] = [j for j in coord.metrics_snapshot()["jobs"] if j["job_id"] == JOB]
    assert entry["slowdown_ratio"] == job.slowdown.evidence["ratio_to_history"]
