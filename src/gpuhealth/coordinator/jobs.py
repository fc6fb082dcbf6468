"""Jobs as the coordinator sees them: rank placement, progress, typical step time, liveness and
the per-job online straggler detector. Pure state, no I/O: the service feeds it and asks it
questions; the clock comes in as an argument.

Ingest is columnar (``StepColumns``) and touches each record once in a tight loop, so one core
keeps up with hundreds of thousands of rank-steps per second.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuhealth.coordinator.multinode import CommWatch
from gpuhealth.model import Finding, RankIdentity
from gpuhealth.proto.convert import StepColumns


class OnlineStragglerDetector(Protocol):
    """What the coordinator needs from the straggler analyzer (``gpuhealth.stragglers``)."""

    def feed(self, columns: StepColumns, now: float | None = None) -> None: ...

    def set_world_size(self, world_size: int) -> None: ...

    def evaluate(self) -> list[Finding]:
        """Current ``rank.straggler`` findings (empty on a healthy job)."""
        ...

    def resume(self, findings: Iterable[Finding]) -> None:
        """Continue episodes that were open before a coordinator restart (not announced again)."""
        ...

    def slowdown(self) -> Finding | None:
        """The whole job's open slowdown (``job.slowdown``), else None: never a straggler."""
        ...

    def scores(self) -> dict[int, float]:
        """Per-rank slowness score (≈ compute time / cross-rank median; 1.0 is typical)."""
        ...


@dataclass(slots=True)
class Placement:
    """Where a rank runs: the node whose agent reported it, and its GPU there."""

    node: str
    identity: RankIdentity


@dataclass(frozen=True, slots=True)
class HangCheck:
    stalled_s: float
    threshold_s: float
    typical_step_s: float | None
    last_step: int


@dataclass(slots=True)
class JobState:
    job_id: str
    world_size: int = 0
    first_seen: float = 0.0
    last_record_at: float = 0.0  # monotonic
    progress_at: float = 0.0  # monotonic time when some rank last finished a new step
    placements: dict[int, Placement] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)
    records: int = 0
    # mean wall step time of each recent batch: cheap to keep, enough for "typical step time"
    wall_means: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    step_samples: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # quantiles only
    # Every step record ever ingested (across restarts): the summary's _count/_sum must be cumulative
    # counters for rate(), which a bounded sample is not.
    step_count: int = 0
    step_sum: float = 0.0
    live_ranks: dict[str, set[int]] = field(default_factory=dict)  # node → live ranks of this job
    hang_open: bool = False  # a hang verdict was issued and no progress since
    hangs: int = 0
    stragglers: dict[int, Finding] = field(default_factory=dict)
    slowdown: Finding | None = None  # the whole job slower than its own best pace (job.slowdown)
    episodes_stored: set[int] | None = None  # ranks whose open episode is in the store; None: not read yet
    detector: OnlineStragglerDetector | None = None
    new_detector: Callable[[], OnlineStragglerDetector] | None = None  # a fresh one for a restarted run
    restarts: int = 0
    comm: CommWatch = field(default_factory=CommWatch)  # communication against its own best pace, per node
    comm_verdict: dict[str, Any] | None = None  # the open job.comm_slow episode's verdict
    cut_off: list[str] = field(default_factory=list)  # nodes judged cut off while the job waits
    refused_claims: int = 0  # unverified claims to a verified rank's place (kept out)
    unverified_records: int = 0  # step records not counted: not from a verified rank where it is placed

    # -- ingest ----------------------------------------------------------------------------------

    def accepts(self, node: str, identity: RankIdentity) -> bool:
        """May this claim place the rank? An unverified claim (no kernel evidence that the process is the
        job's) never moves a rank a verified claim placed; a verified claim takes over from anyone."""
        held = self.placements.get(identity.rank)
        if held is None or identity.verified or not held.identity.verified:
            return True
        return held.node == node and held.identity.pid == identity.pid  # the verified rank, said again

    @property
    def verified(self) -> bool:
        """Some rank of the job was placed on kernel evidence: from then on only such ranks make progress."""
        return any(p.identity.verified for p in self.placements.values())

    def counted(self, node: str, cols: StepColumns) -> StepColumns:
        """The records of ``cols`` (sent by ``node``'s agent) that count for the job: all of them while no
        rank is verified; else only those of verified ranks placed on that node (an intruder's steps, on
        another node or under an unverified claim, neither hide a hang nor feed the straggler detector)."""
        if not self.verified:
            return cols
        mine = {r for r, p in self.placements.items() if p.identity.verified and p.node == node}
        keep = [i for i, r in enumerate(cols.rank) if r in mine]
        if len(keep) == len(cols):
            return cols
        self.unverified_records += len(cols) - len(keep)

        def pick(xs: list[Any] | None) -> Any:
            return None if xs is None else [xs[i] for i in keep]

        return StepColumns(cols.job_id, pick(cols.rank), pick(cols.step), pick(cols.start_time), pick(cols.wall_s),
                           pick(cols.compute_s), pick(cols.comm_wait_s))

    def add_identity(self, node: str, identity: RankIdentity, now: float) -> None:
        if not self.accepts(node, identity):
            self.refused_claims += 1
            return
        if identity.world_size > self.world_size:
            self.world_size = identity.world_size
            if self.detector is not None:
                self.detector.set_world_size(identity.world_size)
            self.comm.world_size = identity.world_size
        self.placements[identity.rank] = Placement(node, identity)
        if identity.rank >= 0:
            self.comm.place(identity.rank, node)
        self.live_ranks.setdefault(node, set()).add(identity.rank)
        if not self.first_seen:
            self.first_seen = now
        if not self.progress_at:
            self.progress_at = now

    def add_steps(self, cols: StepColumns, now: float, node: str | None = None) -> None:
        """``node``: the agent that sent them (None: count them all)."""
        if node is not None:
            counted = self.counted(node, cols)
            if len(counted) < len(cols) and not len(counted):
                return
            cols = counted
        last = self.last_step
        progressed = False
        get = last.get
        restarted = False
        for rank, step in zip(cols.rank, cols.step, strict=True):
            prev = get(rank, -1)
            if step > prev:
                last[rank] = step
                progressed = True
            elif step < prev:  # steps went back: the job restarted (elastic restart, resumed checkpoint)
                last[rank] = step
                progressed = restarted = True
        if restarted:
            self._restart()
        n = len(cols)
        self.records += n
        self.last_record_at = now
        if not self.first_seen:
            self.first_seen = now
        if progressed:
            self.progress_at = now
            self.hang_open = False
        if n:
            total = sum(cols.wall_s)
            self.step_count += n
            self.step_sum += total
            self.wall_means.append(total / n)
            # A bounded sample of step times for quantiles (strided, so big batches cost little).
            stride = max(1, n // 64)
            self.step_samples.extend(cols.wall_s[::stride])
        if self.detector is not None:
            self.detector.feed(cols, now)
        self.comm.feed(cols.rank, cols.step, cols.wall_s, cols.compute_s, cols.comm_wait_s)

    def _restart(self) -> None:
        """A new run under the same job id: its steps count as progress (no false hang) and its
        stragglers are judged afresh (the old detector would ignore steps it has already judged)."""
        self.restarts += 1
        self.stragglers.clear()
        fresh = CommWatch(self.comm.settings)  # a new run's pace is its own; where ranks run still holds
        fresh.world_size = self.world_size
        for rank, placement in self.placements.items():
            if rank >= 0:
                fresh.place(rank, placement.node)
        self.comm, self.comm_verdict = fresh, None
        if self.new_detector is not None:
            self.detector = self.new_detector()
            if self.world_size:
                self.detector.set_world_size(self.world_size)

    def set_live(self, node: str, ranks: Iterable[int]) -> None:
        self.live_ranks[node] = set(ranks)

    def node_gone(self, node: str) -> None:
        """The node's agent disconnected: we no longer know its ranks are alive (nor dead)."""
        self.live_ranks.pop(node, None)

    # -- questions -------------------------------------------------------------------------------

    @property
    def discovered_only(self) -> bool:
        """Every rank known was found by an agent's discovery (no gpuhealth hook), and none sent a step."""
        return (not self.records and bool(self.placements)
                and all(p.identity.found_by == "discovered" for p in self.placements.values()))

    @property
    def finished(self) -> bool:
        """No agent reports any rank of this job alive (and we have heard from some)."""
        return bool(self.placements) and not any(self.live_ranks.values())

    def typical_step_s(self) -> float | None:
        if not self.wall_means:
            return None
        return statistics.median(self.wall_means)

    def hang_check(self, now: float, k: float, floor_s: float) -> HangCheck | None:
        """A new hang: no rank progressed for max(k × typical step, floor). Once per episode. Never for a job
        whose ranks were all found by discovery: they send no steps (no step is not a stall); their agents
        judge them from NCCL RAS and report a hang themselves (``Coordinator._reported_hangs``)."""
        if self.hang_open or self.finished or not self.progress_at or self.discovered_only:
            return None
        typical = self.typical_step_s()
        threshold = max(k * typical, floor_s) if typical is not None else floor_s
        stalled = now - self.progress_at
        if stalled < threshold:
            return None
        return HangCheck(stalled, threshold, typical, max(self.last_step.values(), default=-1))

    def step_quantiles(self, qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[float, float]:
        data = sorted(self.step_samples)
        if not data:
            return {}
        return {q: data[min(len(data) - 1, int(q * len(data)))] for q in qs}

    def slowest_ranks(self) -> list[int]:
        """Ranks whose last finished step is the lowest (those holding the others back)."""
        if not self.last_step:
            return []
        low = min(self.last_step.values())
        return sorted(r for r, s in self.last_step.items() if s == low)

    def summary(self, now: float) -> dict[str, Any]:
        typical = self.typical_step_s()
        return {
            "job_id": self.job_id,
            "world_size": self.world_size,
            "ranks_seen": len(self.placements) or len(self.last_step),
            "nodes": sorted({p.node for p in self.placements.values()}),
            "records": self.records,
            "last_step": max(self.last_step.values(), default=None),
            "typical_step_s": typical,
            "seconds_since_progress": round(now - self.progress_at, 3) if self.progress_at else None,
            "state": "finished" if self.finished else ("hung" if self.hang_open else "running"),
            "hangs": self.hangs,
            # Ranks placed on kernel evidence, and unverified claims kept from a verified rank's place.
            "ranks_verified": sum(p.identity.verified for p in self.placements.values()),
            "claims_ignored": self.refused_claims,
            "stragglers": sorted(self.stragglers),
            "comm_slow": None if self.comm_verdict is None else {
                k: self.comm_verdict.get(k) for k in ("ratio", "nodes", "candidates", "basis", "since_step",
                                                      "probe_advised", "summary")},
            "cut_off": list(self.cut_off),
            "slowdown": None if self.slowdown is None else {
                "ratio": self.slowdown.evidence.get("ratio_to_history"),
                "since_step": self.slowdown.evidence.get("onset_step"), "message": self.slowdown.message},
        }


class JobTable:
    """All jobs, with a factory for each job's straggler detector."""

    def __init__(self, detector_factory: Callable[[str], OnlineStragglerDetector] | None = None) -> None:
        self.jobs: dict[str, JobState] = {}
        self._factory = detector_factory

    def get(self, job_id: str, now: float) -> JobState:
        job = self.jobs.get(job_id)
        if job is None:
            job = JobState(job_id, first_seen=now, progress_at=now)
            factory = self._factory
            if factory is not None:
                job.detector = factory(job_id)
                job.new_detector = lambda: factory(job_id)
            self.jobs[job_id] = job
        return job

    def placement(self, job_id: str, rank: int) -> Placement | None:
        job = self.jobs.get(job_id)
        return None if job is None else job.placements.get(rank)

    def set_live(self, node: str, live: dict[str, list[int]]) -> None:
        for job_id, job in self.jobs.items():
            if job_id in live:
                job.set_live(node, live[job_id])
            elif node in job.live_ranks:
                job.set_live(node, ())

    def node_gone(self, node: str) -> None:
        for job in self.jobs.values():
            job.node_gone(node)
