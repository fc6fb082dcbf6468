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

How long "stand still" must last is the job's own measure (issue 25, measured on 2 x H200, NCCL 2.28.9):

- **slow path**: ``threshold_s`` (30 s) whatever the job does — a rank busy for that long outside every
  collective while the others wait is named.
- **fast path**: a job that launches quickly (its rate is measured from the polls) and then launches nothing
  for ``max(fast_floor_s, fast_gaps x its gap between launches)`` — 5 s for a job of hundreds of collectives a
  second — is hung when every rank behind runs on this node and is **idle** over the stall: its own CPU time
  grew by less than ``idle_cpu_share`` of the wall time and it read or wrote (``/proc/<pid>/io``) less than
  ``idle_io_bytes_per_s``. A host-stuck rank measured 0.2 % of a core and no I/O; a rank writing a checkpoint
  alone for 20 s (the others waiting in the next collective) measured 55 % of a core and 640 MB/s: the first is
  named within seconds, the second is not named at all (its stall ends before the slow path's 30 s).

Silent mismatches while the job goes on (``diverged``): a rank that skipped one collective (or called an extra
one) runs out of phase from then on — NCCL pairs its calls with the others' next ones, every result is wrong
and the step time does not change. Its count of that collective type stays a fixed number behind (or ahead) of
the others' while all of them keep launching: measured on 2 x H200, ReduceScatter exactly one behind in every
snapshot for 30 s and more. A healthy job's counts agree, or differ for a few seconds at a time (a rank held
by a flight-recorder dump: 3 behind for up to 5 s); a slow rank's lag shows as equal launch counts. So a
per-type offset that stays the same over ``diverge_hold_s`` (20 s, four times the longest healthy one seen)
and ``min_polls`` polls while that type's count advanced by ``diverge_min_launches`` or more is a divergence,
naming the ranks on the smaller side.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


@dataclass(frozen=True, slots=True)
class Activity:
    """What a rank's process had done by a poll: CPU seconds (all its threads) and bytes read plus written
    (``/proc/<pid>/stat`` and ``/proc/<pid>/io``); what the fast path judges idleness by."""

    cpu_s: float
    io_bytes: float


@dataclass(slots=True)
class _Stall:
    signature: tuple[object, ...]
    since: float
    polls: int
    total: int | None  # the communicator's launches (every type) when the stall began


@dataclass(slots=True)
class _Offset:
    offsets: tuple[tuple[int, int], ...]  # (comm rank, its count minus the highest) for every rank
    since: float
    polls: int
    top: int  # the highest count when it began


class HangJudge:
    """Remembers, per communicator and collective type, how long counts with a rank behind stood still, and how
    long per-rank offsets of a type held while it advanced.

    A communicator whose counts all stand still (a rank behind in one type) is hung: after ``threshold_s``
    (slow path), or after a few of its own launch gaps when the ranks behind are idle on this node (fast path,
    ``activity``). One whose counts of one type stand still apart while it keeps launching others, or whose
    per-rank offsets of a type hold while that type advances, has *diverged*: its ranks called different
    collectives that NCCL paired (measured on 2 x H200: rank 1 broadcast where rank 0 all-reduced and the job ran
    on with "Broadcast 1 vs 0"; rank 1 skipped a reduce_scatter and ran one collective out of phase for good).
    Telling these apart needs every rank's counts: the JSON report; in a text report a type NCCL does not list is
    not seen to move."""

    def __init__(self, threshold_s: float, *, min_polls: int = 2, fast_floor_s: float = 5.0, fast_gaps: float = 50.0,
                 idle_cpu_share: float = 0.05, idle_io_bytes_per_s: float = 1 << 20,
                 diverge_min_launches: int = 10, diverge_hold_s: float = 20.0) -> None:
        self.threshold_s = threshold_s
        self.min_polls = max(2, min_polls)
        self.fast_floor_s = fast_floor_s
        self.fast_gaps = fast_gaps
        self.idle_cpu_share = idle_cpu_share
        self.idle_io_bytes_per_s = idle_io_bytes_per_s
        self.diverge_min_launches = diverge_min_launches
        self.diverge_hold_s = diverge_hold_s
        self._seen: dict[tuple[str, str], _Stall] = {}
        self._offsets: dict[tuple[str, str], _Offset] = {}
        self._last_total: dict[str, tuple[float, int]] = {}  # communicator -> (when, its launches then)
        self._rates: dict[str, list[float]] = {}  # communicator -> recent launch rates (launches/s) while it ran
        self._activity_at: dict[Process, tuple[float, Activity]] = {}  # a process's activity when a stall began
        self.last_advance: float | None = None  # the last poll at which some communicator launched more

    def rate(self, comm: str) -> float | None:
        """The communicator's launches per second while it ran (the median of the recent polls), if seen."""
        rates = sorted(self._rates.get(comm, ()))
        return rates[len(rates) // 2] if rates else None

    def fast_after_s(self, comm: str) -> float | None:
        """How long this communicator must stand still for the fast path, or None (no rate, or no faster)."""
        rate = self.rate(comm)
        if not rate:
            return None
        wait = max(self.fast_floor_s, self.fast_gaps / rate)
        return wait if wait < self.threshold_s else None

    def observe(self, status: RasStatus, now: float,
                activity: Mapping[Process, Activity] | None = None) -> list[HangVerdict]:
        """Feed one poll; returns what holds now: a hang (or a hung mismatch) first, then divergences.
        ``activity``: the local ranks' processes (host and pid as RAS names them) as read at this poll."""
        activity = activity or {}
        seen: dict[tuple[str, str], _Stall] = {}
        offsets: dict[tuple[str, str], _Offset] = {}
        slow: list[tuple[RasCommunicator, float, int]] = []
        fast: list[tuple[RasCommunicator, float, int]] = []
        diverged: dict[str, list[HangVerdict]] = {}
        for comm in status.communicators:
            total = sum(sum(r.counts.values()) for r in comm.ranks) if comm.complete else None
            self._learn_rate(comm.key, total, now)
            comm_stall: tuple[float, int] | None = None
            for op in dict.fromkeys(b.op for b in behind_ranks(comm)):
                sig = tuple(sorted((g.count, g.n, tuple(r.comm_rank for r in g.ranks)) for g in comm.ops_groups(op)))
                old = self._seen.get((comm.key, op))
                st = (_Stall(sig, old.since, old.polls + 1, old.total) if old is not None and old.signature == sig
                      else _Stall(sig, now, 1, total))
                seen[(comm.key, op)] = st
                if st.polls < self.min_polls:
                    continue
                if total is not None and st.total is not None and total > st.total:
                    if now - st.since >= self.threshold_s:
                        diverged.setdefault(comm.key, []).append(_diverged(comm, op, now - st.since, st.polls))
                elif comm_stall is None or now - st.since > comm_stall[0]:
                    comm_stall = (now - st.since, st.polls)
            for op, v in self._offset_divergence(comm, now, offsets):
                if not any(d.culprits and d.culprits[0].op == op for d in diverged.get(comm.key, [])):
                    diverged.setdefault(comm.key, []).append(v)
            if comm_stall is None:
                continue
            stalled_s, polls = comm_stall
            if stalled_s >= self.threshold_s:
                slow.append((comm, stalled_s, polls))
            else:
                after = self.fast_after_s(comm.key)
                if after is not None and stalled_s >= after:
                    fast.append((comm, stalled_s, polls))
        self._seen, self._offsets = seen, offsets
        self._remember_activity(activity, now)
        verdict = self._verdict(slow, fast, activity, now)
        out = [verdict] if verdict is not None else []
        for vs in diverged.values():
            out.append(vs[0] if len(vs) == 1 else _merge(vs))
        return out

    # -- the launch rate --------------------------------------------------------------------------------

    def _learn_rate(self, comm: str, total: int | None, now: float) -> None:
        if total is None:
            return
        last = self._last_total.get(comm)
        self._last_total[comm] = (now, total)
        if last is None or now <= last[0] or total <= last[1]:
            return
        self.last_advance = now
        rates = self._rates.setdefault(comm, [])
        rates.append((total - last[1]) / (now - last[0]))
        del rates[:-12]  # the last minute or so

    # -- idle ranks (the fast path) -----------------------------------------------------------------------

    def _remember_activity(self, activity: Mapping[Process, Activity], now: float) -> None:
        """Keep each process's activity from when its communicator's stall began (the first poll of it)."""
        stalled_since = min((st.since for st in self._seen.values()), default=None)
        kept: dict[Process, tuple[float, Activity]] = {}
        for proc, act in activity.items():
            old = self._activity_at.get(proc)
            if old is not None and stalled_since is not None and old[0] >= stalled_since - 1e-9:
                kept[proc] = old  # the baseline taken at (or after) the stall's start stays
            else:
                kept[proc] = (now, act)
        self._activity_at = kept

    def _idle(self, proc: Process | None, activity: Mapping[Process, Activity], now: float) -> bool:
        if proc is None or proc not in activity or proc not in self._activity_at:
            return False  # not on this node, or not measured: only the slow path may name it
        then, before = self._activity_at[proc]
        span = now - then
        if span <= 0:
            return False
        act = activity[proc]
        return ((act.cpu_s - before.cpu_s) / span < self.idle_cpu_share
                and (act.io_bytes - before.io_bytes) / span < self.idle_io_bytes_per_s)

    def _verdict(self, slow: list[tuple[RasCommunicator, float, int]], fast: list[tuple[RasCommunicator, float, int]],
                 activity: Mapping[Process, Activity], now: float) -> HangVerdict | None:
        if slow:
            return judge([c for c, _, _ in slow], max(s for _, s, _ in slow), max(p for _, _, p in slow))
        if not fast:
            return None
        v = judge([c for c, _, _ in fast], max(s for _, s, _ in fast), max(p for _, _, p in fast))
        if v is None or v.kind != "hang" or not all(self._idle(c.process, activity, now) for c in v.culprits):
            return None  # a rank behind that works (a checkpoint), or one not on this node: the slow path decides
        return v

    # -- per-type offsets that hold while the type advances -----------------------------------------------

    def _offset_divergence(self, comm: RasCommunicator, now: float, offsets: dict[tuple[str, str], _Offset]
                           ) -> list[tuple[str, HangVerdict]]:
        """Types whose per-rank offsets held over ``diverge_hold_s`` while the type advanced — and while the
        ranks apart in it stayed level in another type that advanced too. A rank uniformly behind is a lag, not
        a mismatch: a slow rank of an all_reduce-only job held its count one behind for as long as it was slow
        (measured on 2 x H200: a host-side 1.3x straggler, AllReduce -1 at every 5 s poll)."""
        out: list[tuple[str, HangVerdict]] = []
        if not comm.complete:
            return out
        held: dict[str, tuple[tuple[tuple[int, int], ...], _Offset]] = {}
        advanced: dict[str, int] = {}
        for op in dict.fromkeys(o for r in comm.ranks for o in r.counts):
            counts = [(r.comm_rank, r.counts.get(op, 0)) for r in comm.ranks]
            top = max(c for _, c in counts)
            sig = tuple(sorted((rank, c - top) for rank, c in counts))
            old = self._offsets.get((comm.key, op))
            st = (_Offset(sig, old.since, old.polls + 1, old.top) if old is not None and old.offsets == sig
                  else _Offset(sig, now, 1, top))
            offsets[(comm.key, op)] = st
            advanced[op] = top - st.top
            if (any(off for _, off in sig) and st.polls >= self.min_polls and now - st.since >= self.diverge_hold_s
                    and top - st.top >= self.diverge_min_launches):
                held[op] = (sig, st)
        for op, (sig, st) in held.items():
            apart = {rank for rank, off in sig if off}
            level_elsewhere = any(
                advanced.get(other, 0) >= self.diverge_min_launches
                and all(off == 0 for rank, off in offsets[(comm.key, other)].offsets if rank in apart)
                for other in advanced if other != op)
            if level_elsewhere:
                out.append((op, _offset_diverged(comm, op, now - st.since, st.polls)))
        return out


def _offset_diverged(comm: RasCommunicator, op: str, held_s: float, polls: int) -> HangVerdict:
    """The ranks of ``comm`` on the smaller side of a held ``op`` offset. On a tie both sides, the lower count
    first: launch counts cannot tell a skipped collective from an extra one."""
    groups = sorted(comm.ops_groups(op), key=lambda g: g.count)
    top = max(g.count for g in groups)
    sizes = {g.count: g.n for g in groups}
    smallest = min(sizes.values())
    named = [g for g in groups if g.n == smallest] if len(set(sizes.values())) > 1 else groups
    ahead = sum(g.n for g in groups if g.count == top)
    culprits = tuple(BehindRank(comm.key, op, r, g.count, top, ahead) for g in named for r in g.ranks)
    behind = tuple(b for b in behind_ranks(comm) if b.op == op)
    return HangVerdict("diverged", culprits, behind, (comm.key,), held_s, polls)


def _merge(verdicts: list[HangVerdict]) -> HangVerdict:
    """Several collective types of one communicator diverged: one verdict (the culprits of each type)."""
    seen: set[object] = set()
    culprits: list[BehindRank] = []
    for v in verdicts:
        for c in v.culprits:
            key = (c.op, c.process or c.rank.comm_rank)
            if key not in seen:
                seen.add(key)
                culprits.append(c)
    return HangVerdict("diverged", tuple(culprits), tuple(b for v in verdicts for b in v.behind), verdicts[0].comms,
                       max(v.stalled_s for v in verdicts), max(v.polls for v in verdicts))


__all__ = ["Activity", "BehindRank", "HangJudge", "HangVerdict", "Process", "behind_ranks", "judge"]
