"""Hang judgement from NCCL RAS launch counts: pure, fed one ``RasStatus`` per poll.

A snapshot alone proves nothing: launches are asynchronous, so a healthy job's ranks disagree by a
few operations at any moment (seen on 4 × H200: "3 ranks have launched up to operation 2154; Rank 1
… up to 2151"). A hang is a communicator whose counts **stop advancing with a rank behind**: the
same counts on at least ``min_polls`` polls spanning ``threshold_s`` or more.

Who is to blame: in each stalled communicator, the ranks at the highest count of a collective type
wait for the ranks below it. Over all stalled communicators that is a wait-for graph between
processes (host, pid); a process behind somewhere that waits for nobody is a root — the rank that
stopped launching (host-stuck, or skipped a collective). A rank that waits in one communicator and is
behind in another (a pipeline stage held up upstream) is a consequence, not a root. When every
process behind also waits for another (different collectives launched: a mismatch), the smallest
group behind is named and the verdict says "mismatch".

RAS cannot see a GPU stall: there every rank *launched* the same count (NVML utilisation and power,
or the flight recorder, must show it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuhealth.agent.zerocode.ras import CountGroup, RasCommunicator, RasRank, RasStatus

Process = tuple[str, int]  # (host as NCCL prints it, pid in the job's namespace)


@dataclass(frozen=True, slots=True)
class BehindRank:
    """One rank that launched fewer operations of one type than its communicator's others."""

    comm: str
    op: str
    rank: RasRank
    count: int  # launched up to
    ahead_count: int  # what the ranks waiting for it launched
    ahead_ranks: int  # how many ranks wait for it in this communicator

    @property
    def process(self) -> Process | None:
        return (self.rank.host, self.rank.pid) if self.rank.pid is not None else None

    def describe(self) -> str:
        gpu = f", GPU {self.rank.nvml_dev}" if self.rank.nvml_dev is not None else ""
        where = f" (process {self.rank.pid} on {self.rank.host or '?'}{gpu})" if self.rank.pid is not None else ""
        return (f"rank {self.rank.comm_rank} of communicator {self.comm} launched {self.op} up to operation "
                f"{self.count}; {self.ahead_ranks} rank(s) reached {self.ahead_count}{where}")


@dataclass(frozen=True, slots=True)
class HangVerdict:
    kind: str  # "hang" (roots wait for nobody), "mismatch" (hung, everyone behind also waits),
    # or "diverged" (the job goes on, but its ranks launched different collectives)
    culprits: tuple[BehindRank, ...]  # one entry per culprit process (its first behind position)
    behind: tuple[BehindRank, ...]  # every position behind, culprits included
    comms: tuple[str, ...]  # the stalled communicators
    stalled_s: float  # how long the counts have not moved (at least; polls are apart)
    polls: int

    def culprit_processes(self) -> list[Process]:
        return [p for p in (c.process for c in self.culprits) if p is not None]

    def summary(self) -> str:
        head = "; ".join(c.describe() for c in self.culprits) or "ranks behind could not be named"
        return (f"{self.kind.upper()} (NCCL RAS): {head}; counts unchanged for {self.stalled_s:.0f} s over "
                f"{self.polls} polls")


def _signature(comm: RasCommunicator) -> tuple[tuple[str, int, int, tuple[int, ...]], ...]:
    return tuple(sorted((g.op, g.count, g.n, tuple(r.comm_rank for r in g.ranks)) for g in comm.groups))


def behind_ranks(comm: RasCommunicator) -> list[BehindRank]:
    """Named ranks below the highest count of each collective type, with who waits for them."""
    out: list[BehindRank] = []
    for op in dict.fromkeys(g.op for g in comm.groups):
        groups: list[CountGroup] = comm.ops_groups(op)
        if len(groups) < 2:
            continue
        top = max(g.count for g in groups)
        ahead = sum(g.n for g in groups if g.count == top)
        out += [BehindRank(comm.key, op, r, g.count, top, ahead) for g in groups if g.count < top for r in g.ranks]
    return out


def _waiting(comm: RasCommunicator) -> set[Process]:
    """Processes at the highest count of some collective type that others have not reached."""
    out: set[Process] = set()
    for op in dict.fromkeys(g.op for g in comm.groups):
        groups = comm.ops_groups(op)
        if len(groups) < 2:
            continue
        top = max(g.count for g in groups)
        out |= {(r.host, r.pid) for g in groups if g.count == top for r in g.ranks if r.pid is not None}
    return out


def judge(comms: Iterable[RasCommunicator], stalled_s: float, polls: int) -> HangVerdict | None:
    """The verdict over stalled communicators (pure; ``HangJudge`` decides which ones are stalled)."""
    comms = list(comms)
    behind = [b for c in comms for b in behind_ranks(c)]
    if not behind:
        return None
    waiting: set[Process] = set().union(*(_waiting(c) for c in comms))
    roots = [b for b in behind if b.process is None or b.process not in waiting]
    kind = "hang"
    if not roots:  # everyone behind also waits for someone: different collectives were launched
        kind = "mismatch"
        smallest = min(b.ahead_ranks for b in behind)
        roots = [b for b in behind if b.ahead_ranks == smallest] or behind
    seen: set[object] = set()
    culprits: list[BehindRank] = []
    for b in roots:
        key = b.process or (b.comm, b.rank.comm_rank)
        if key not in seen:
            seen.add(key)
            culprits.append(b)
    return HangVerdict(kind, tuple(culprits), tuple(behind), tuple(c.key for c in comms), stalled_s, polls)


def _diverged(comm: RasCommunicator, op: str, stalled_s: float, polls: int) -> HangVerdict:
    """Ranks of ``comm`` disagree on how many ``op`` they launched while the communicator goes on: they
    called different collectives and NCCL paired them anyway. The smallest side is named (both on a tie)."""
    groups = comm.ops_groups(op)
    top = max(g.count for g in groups)
    smallest = min(g.n for g in groups)
    named = [g for g in groups if g.n == smallest] if len({g.n for g in groups}) > 1 else groups
    culprits = tuple(BehindRank(comm.key, op, r, g.count, top, sum(x.n for x in groups if x.count == top))
                     for g in named for r in g.ranks)
    behind = tuple(b for b in behind_ranks(comm) if b.op == op)
    return HangVerdict("diverged", culprits, behind, (comm.key,), stalled_s, polls)


class HangJudge:
    """Remembers, per communicator and collective type, how long counts with a rank behind stood still.

    A communicator whose counts all stand still (a rank behind in one type) is hung. One whose counts
    of one type stand still apart while it keeps launching others has *diverged*: its ranks called
    different collectives that NCCL paired (measured on 2 x H200: rank 1 broadcast where rank 0
    all-reduced, and the job ran on with "Broadcast 1 vs 0" for good). Telling the two apart needs every
    rank's counts: the JSON report; in a text report a type NCCL does not list is not seen to move."""

    def __init__(self, threshold_s: float, *, min_polls: int = 2) -> None:
        self.threshold_s = threshold_s
        self.min_polls = max(2, min_polls)
        # (communicator, collective type) -> (signature, since, polls, the communicator's total then)
        self._seen: dict[tuple[str, str], tuple[tuple[object, ...], float, int, int | None]] = {}

    def observe(self, status: RasStatus, now: float) -> list[HangVerdict]:
        """Feed one poll; returns what holds now: a hang (or a hung mismatch) first, then divergences."""
        current: dict[tuple[str, str], tuple[tuple[object, ...], float, int, int | None]] = {}
        hung: list[RasCommunicator] = []
        out: list[HangVerdict] = []
        longest, most = 0.0, 0
        for comm in status.communicators:
            total = sum(sum(r.counts.values()) for r in comm.ranks) if comm.complete else None
            comm_hung = False
            for op in dict.fromkeys(b.op for b in behind_ranks(comm)):
                sig = tuple(sorted((g.count, g.n, tuple(r.comm_rank for r in g.ranks)) for g in comm.ops_groups(op)))
                old = self._seen.get((comm.key, op))
                since, n, base = (old[1], old[2] + 1, old[3]) if old is not None and old[0] == sig else (now, 1, total)
                current[(comm.key, op)] = (sig, since, n, base)
                if n < self.min_polls or now - since < self.threshold_s:
                    continue
                if total is not None and base is not None and total > base:
                    out.append(_diverged(comm, op, now - since, n))
                elif not comm_hung:
                    comm_hung = True
                    hung.append(comm)
                    longest, most = max(longest, now - since), max(most, n)
        self._seen = current
        verdict = judge(hung, longest, most) if hung else None
        return ([verdict] if verdict is not None else []) + out


__all__ = ["BehindRank", "HangJudge", "HangVerdict", "Process", "behind_ranks", "judge"]
