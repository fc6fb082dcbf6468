"""Cross-rank matching of flight-recorder entries (pure: dumps in, findings out).

Per process group (keyed by its *name*, the one id that is the same on every rank — ``pg_id`` is a
per-process counter and differs between ranks of one subgroup):

* membership: the job's description when given, else ``pg_config`` when it names real ranks
  (NCCL), else "every rank" for the default group, else the ranks that have entries in the group
  (Gloo records a useless ``{"": …}`` pg_config);
* progress per rank: last enqueued / completed sequence id from ``pg_status`` and the entries
  (Gloo: state is always "scheduled", progress shows only in ``retired`` and ``pg_status``);
* signatures per sequence id (op, sizes, dtypes): the first disagreement in a group is a
  mismatch, the culprit decided by majority — and on a tie by which side repeats what the group
  did before — never by whichever file came first; later sequence ids of that group are not
  compared (alignment after a mismatch is unreliable: that is where torchfrtrace gets noisy);
* stuck groups: ranks that never enqueued the oldest pending collective (host-side stuck,
  ``collective.missing_rank``) or, when all enqueued it, the ranks that did not finish it
  (``collective.gpu_stall``); pending sends/recvs without a partner (``collective.p2p_unmatched``).

Several stuck groups are usually one fault seen from several places. :func:`find_roots` picks
the root: a blocking rank that is not itself waiting in any collective; failing that, a rank that
is behind in one group while *ahead* of everyone in another (it skipped a collective); failing
that, a circular wait.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpuhealth.flightrec.load import Entry, PgStatus, RankDump

# Ops whose sizes legitimately differ across ranks (uneven splits, root-only buffers).
_SIZE_FREE_OPS = {"all_to_all", "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter",
                  "_allgather_base_uneven", "reduce_scatter_v", "all_gather_v"}
DEFAULT_GROUP_NAMES = {"0", "default_pg"}


class Signature(NamedTuple):
    """What must agree across ranks at one sequence id (a tuple: hashing is the hot path)."""

    op: str
    in_sizes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[str, ...]
    out_sizes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[str, ...]

    @classmethod
    def of(cls, e: Entry) -> Signature:
        if e.op in _SIZE_FREE_OPS:
            return cls(e.op, (), e.in_dtypes, (), e.out_dtypes)
        return cls(e.op, e.in_sizes, e.in_dtypes, e.out_sizes, e.out_dtypes)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "input_sizes": [list(s) for s in self.in_sizes], "input_dtypes": list(self.in_dtypes),
                "output_sizes": [list(s) for s in self.out_sizes], "output_dtypes": list(self.out_dtypes)}


@dataclass(slots=True)
class GroupView:
    """One process group across all ranks that dumped."""

    name: str
    desc: str
    members: tuple[int, ...]
    membership_source: str  # "job" | "pg_config" | "world" | "entries"
    dumped: tuple[int, ...]
    missing_dumps: tuple[int, ...]
    enqueued: dict[int, int] = field(default_factory=dict)
    completed: dict[int, int] = field(default_factory=dict)
    by_seq: dict[int, dict[int, Entry]] = field(default_factory=dict)  # rank -> seq -> entry
    oldest_seq: dict[int, int] = field(default_factory=dict)  # oldest loaded seq per rank (ring buffer)
    p2p_pending: dict[int, list[Entry]] = field(default_factory=dict)

    def pending(self, rank: int) -> bool:
        return self.enqueued.get(rank, 0) > self.completed.get(rank, 0)

    def entry(self, rank: int, seq: int) -> Entry | None:
        return self.by_seq.get(rank, {}).get(seq)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "desc": self.desc, "members": list(self.members),
            "membership_source": self.membership_source, "ranks_dumped": list(self.dumped),
            "ranks_missing": list(self.missing_dumps),
            "last_enqueued": {str(r): v for r, v in sorted(self.enqueued.items())},
            "last_completed": {str(r): v for r, v in sorted(self.completed.items())},
        }


@dataclass(frozen=True, slots=True)
class Mismatch:
    group: str
    seq: int
    kind: str  # "type" | "size" | "dtype"
    culprits: tuple[int, ...]
    expected: Signature
    by_rank: Mapping[int, Signature]
    decided_by: str  # "majority" | "history" | "undecided"
    completed: bool  # the collective finished anyway (silent corruption) vs stuck
    later_suppressed: int  # later mismatching sequence ids in this group not reported


@dataclass(frozen=True, slots=True)
class Blocker:
    """``rank`` has not enqueued collective ``seq`` of ``group`` that ``waiting`` ranks wait in."""

    group: str
    seq: int
    rank: int
    waiting: tuple[int, ...]
    dumped: bool  # False: the blocker left no dump, we only know it is absent


@dataclass(frozen=True, slots=True)
class Stall:
    """Every member enqueued ``seq`` of ``group``; ``not_done`` ranks did not finish it."""

    group: str
    seq: int
    not_done: tuple[int, ...]
    suspects: tuple[int, ...]  # ranks that did not even start it (NCCL), when that narrows it


@dataclass(frozen=True, slots=True)
class P2PUnmatched:
    group: str
    rank: int  # the rank that has NOT posted the matching op
    peer: int  # the rank waiting with a pending send/recv
    op: str  # the waiting op ("send"/"recv")
    entry: Entry


@dataclass(frozen=True, slots=True)
class Laggard:
    """Nobody waits in ``group`` any more, yet ``rank`` never enqueued collective ``seq`` that
    ``ahead`` ranks ran. After a process-group timeout Gloo marks the failed collective completed
    on the ranks that waited, so a dump taken late looks like this. ``timed_out``: the ranks ahead
    issued nothing for longer than the collective's timeout before their dump."""

    group: str
    seq: int
    rank: int
    ahead: tuple[int, ...]
    timed_out: bool
    idle_s: float | None
    timeout_s: float | None


@dataclass(slots=True)
class MatchResult:
    groups: dict[str, GroupView]
    mismatches: list[Mismatch]
    blockers: list[Blocker]
    stalls: list[Stall]
    p2p: list[P2PUnmatched]
    world_size: int
    notes: list[str] = field(default_factory=list)
    laggards: list[Laggard] = field(default_factory=list)


# -------------------------------------------------------------------------------------- groups


def build_groups(
    dumps: Mapping[int, RankDump], job: Mapping[str, Any] | None = None
) -> tuple[dict[str, GroupView], int]:
    """Group views and the world size. ``job`` may give ``world_size`` and ``groups`` {name: [ranks]}."""
    job = job or {}
    job_groups = {str(k): tuple(int(r) for r in v) for k, v in (job.get("groups") or {}).items()}
    per_group: dict[str, dict[int, list[Entry]]] = defaultdict(lambda: defaultdict(list))
    desc: dict[str, str] = {}
    for rank, d in dumps.items():
        for e in d.entries:
            per_group[e.group][rank].append(e)
            desc.setdefault(e.group, e.group_desc)
    cfg_members: dict[str, set[int]] = defaultdict(set)
    merged: set[tuple[str, int]] = set()
    for d in dumps.values():
        for key, cfg in d.pg_config.items():
            # Every rank repeats the world's list (the loader hands out one shared tuple per
            # distinct list): merge each list once, not once per rank (16k × 16k at 16k ranks).
            if key and cfg.ranks and (key, id(cfg.ranks)) not in merged:
                merged.add((key, id(cfg.ranks)))
                cfg_members[key].update(cfg.ranks)
    world = int(job.get("world_size") or 0)
    for name, ranks in cfg_members.items():
        if name in DEFAULT_GROUP_NAMES or desc.get(name) == "default_pg":
            world = max(world, len(ranks))
    if dumps:
        world = max(world, max(dumps) + 1)
    groups: dict[str, GroupView] = {}
    statuses: dict[int, dict[str, PgStatus]] = {}
    for name in sorted(set(per_group) | set(job_groups), key=_group_sort_key):
        if name in job_groups:
            members, source = job_groups[name], "job"
        elif name in cfg_members:
            members, source = tuple(sorted(cfg_members[name])), "pg_config"
        elif name in DEFAULT_GROUP_NAMES or desc.get(name) == "default_pg":
            members, source = tuple(range(world)), "world"
        else:
            members, source = tuple(sorted(per_group[name])), "entries"
        dumped = tuple(r for r in members if r in dumps)
        view = GroupView(name=name, desc=desc.get(name, ""), members=members, membership_source=source,
                         dumped=dumped, missing_dumps=tuple(r for r in members if r not in dumps))
        for rank in dumped:
            if rank not in statuses:
                statuses[rank] = dumps[rank].group_status()
            _fill_progress(view, rank, statuses[rank].get(name), per_group[name].get(rank, []))
        groups[name] = view
    return groups, world


def _group_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _fill_progress(view: GroupView, rank: int, status: PgStatus | None, entries: Sequence[Entry]) -> None:
    enq = status.enqueued if status and status.enqueued is not None else 0
    done = status.completed if status and status.completed is not None else 0
    seqs: dict[int, Entry] = {}
    pending_p2p = []
    for e in entries:
        if e.is_p2p or e.p2p_src is not None:
            if e.state != "completed" and not e.retired:
                pending_p2p.append(e)
            continue
        if e.seq <= 0:
            continue
        seqs[e.seq] = e
        enq = max(enq, e.seq)
        if e.state == "completed" or e.retired:
            done = max(done, e.seq)
    view.by_seq[rank] = seqs
    view.enqueued[rank] = enq
    view.completed[rank] = min(done, enq) if enq else done
    if seqs:
        view.oldest_seq[rank] = min(seqs)
    if pending_p2p:
        view.p2p_pending[rank] = pending_p2p


# ------------------------------------------------------------------------------------ mismatches


def find_mismatches(view: GroupView) -> Mismatch | None:
    """The first sequence id where ranks disagree on op/size/dtype, with the culprit by vote."""
    ranks = [r for r in view.dumped if view.by_seq.get(r)]
    if len(ranks) < 2:
        return None
    all_seqs = sorted({s for r in ranks for s in view.by_seq[r]})
    seen: Counter[Signature] = Counter()
    first: Mismatch | None = None
    later = 0
    for seq in all_seqs:
        sigs = {r: Signature.of(e) for r in ranks if (e := view.by_seq[r].get(seq)) is not None}
        if len(sigs) < 2:
            seen.update(sigs.values())
            continue
        counts = Counter(sigs.values())
        if len(counts) == 1:
            seen.update(counts)
            continue
        if first is not None:
            later += 1
            continue
        expected, decided_by = _vote(counts, seen)
        if expected is None:
            culprits = tuple(sorted(sigs))
            expected = counts.most_common(1)[0][0]
        else:
            culprits = tuple(sorted(r for r, s in sigs.items() if s != expected))
        odd = sigs[culprits[0]] if culprits else expected
        kind = _kind(expected, odd if odd != expected else next(s for s in counts if s != expected))
        done = all(view.completed.get(r, 0) >= seq for r in sigs)
        first = Mismatch(view.name, seq, kind, culprits, expected, dict(sigs), decided_by, done, 0)
    if first is None:
        return None
    return Mismatch(first.group, first.seq, first.kind, first.culprits, first.expected, first.by_rank,
                    first.decided_by, first.completed, later)


def _vote(counts: Counter[Signature], seen: Counter[Signature]) -> tuple[Signature | None, str]:
    ranked = counts.most_common()
    if len(ranked) == 1 or ranked[0][1] > ranked[1][1]:
        return ranked[0][0], "majority"
    # A tie (two ranks, or 2 vs 2): the side that repeats what this group ran before is the
    # expected one; a signature never seen before is the odd one out.
    top = [s for s, c in ranked if c == ranked[0][1]]
    familiar = [s for s in top if seen[s] > 0]
    if len(familiar) == 1:
        return familiar[0], "history"
    return None, "undecided"


def _kind(expected: Signature, odd: Signature) -> str:
    if expected.op != odd.op:
        return "type"
    if expected.in_dtypes != odd.in_dtypes or expected.out_dtypes != odd.out_dtypes:
        return "dtype"
    return "size"


# ------------------------------------------------------------------------------------ hangs


def find_blockers(view: GroupView) -> tuple[list[Blocker], Stall | None]:
    """Who keeps this group's oldest pending collective from running."""
    waiting = [r for r in view.dumped if view.pending(r)]
    if not waiting:
        return [], None
    frontier = min(view.completed.get(r, 0) + 1 for r in waiting)
    waiters = tuple(sorted(r for r in waiting if view.completed.get(r, 0) + 1 == frontier))
    absent = [r for r in view.dumped if view.enqueued.get(r, 0) < frontier]
    blockers = [Blocker(view.name, frontier, r, waiters, True) for r in absent]
    blockers += [Blocker(view.name, frontier, r, waiters, False) for r in view.missing_dumps]
    if blockers:
        return blockers, None
    not_done = tuple(sorted(r for r in view.dumped if view.completed.get(r, 0) < frontier))
    states = {r: e.state for r in not_done if (e := view.entry(r, frontier)) is not None}
    started = {r for r, s in states.items() if s == "started"}
    suspects = tuple(sorted(r for r, s in states.items() if s == "scheduled")) if started else ()
    return [], Stall(view.name, frontier, not_done, suspects)


def find_laggards(view: GroupView, idle_s: Mapping[int, float]) -> list[Laggard]:
    """Ranks behind the others in a group where nobody is pending (see :class:`Laggard`)."""
    if any(view.pending(r) for r in view.dumped) or len(view.dumped) < 2:
        return []
    top = max(view.enqueued.get(r, 0) for r in view.dumped)
    behind = [r for r in view.dumped if view.enqueued.get(r, 0) < top]
    out = []
    for rank in behind:
        seq = view.enqueued.get(rank, 0) + 1
        ahead = tuple(sorted(r for r in view.dumped if view.enqueued.get(r, 0) >= seq))
        timeouts = [e.timeout_ms for r in ahead if (e := view.entry(r, seq)) is not None and e.timeout_ms]
        timeout_s = min(timeouts) / 1000.0 if timeouts else None
        idles = [idle_s[r] for r in ahead if r in idle_s]
        idle = min(idles) if idles else None
        timed_out = timeout_s is not None and idle is not None and len(idles) * 2 >= len(ahead) and idle >= timeout_s
        out.append(Laggard(view.name, seq, rank, ahead, timed_out, idle, timeout_s))
    return out


def find_p2p_unmatched(view: GroupView) -> list[P2PUnmatched]:
    out = []
    members = sorted(view.members)
    for rank, pend in sorted(view.p2p_pending.items()):
        for e in pend:
            if e.p2p_src is None or e.p2p_dst is None:
                continue
            try:
                src, dst = members[e.p2p_src], members[e.p2p_dst]
            except IndexError:
                continue
            peer = dst if e.op == "send" else src
            if peer not in view.dumped:
                continue
            want = "recv" if e.op == "send" else "send"
            if not any(p.op == want and p.p2p_src == e.p2p_src and p.p2p_dst == e.p2p_dst
                       for p in view.p2p_pending.get(peer, [])):
                out.append(P2PUnmatched(view.name, peer, rank, e.op, e))
    return out


def match(dumps: Mapping[int, RankDump], job: Mapping[str, Any] | None = None) -> MatchResult:
    groups, world = build_groups(dumps, job)
    result = MatchResult(groups=groups, mismatches=[], blockers=[], stalls=[], p2p=[], world_size=world)
    idle_s = _idle_seconds(dumps)
    for view in groups.values():
        result.laggards += find_laggards(view, idle_s)
        mm = find_mismatches(view)
        if mm is not None:
            result.mismatches.append(mm)
        blockers, stall = find_blockers(view)
        result.blockers += blockers
        if stall is not None:
            result.stalls.append(stall)
        result.p2p += find_p2p_unmatched(view)
        if view.membership_source == "entries" and len(view.members) < 2:
            result.notes.append(f"group {view.name}: only rank(s) {list(view.members)} have entries; "
                                "membership may be incomplete (Gloo dumps do not record it)")
    return result


def _idle_seconds(dumps: Mapping[int, RankDump]) -> dict[int, float]:
    """Per rank: seconds between its newest entry and its dump (when the dump time is known)."""
    out = {}
    for rank, d in dumps.items():
        newest = max((e.created_ns for e in d.entries if e.created_ns), default=None)
        if newest and d.dump_time_ns:
            out[rank] = max(0.0, (d.dump_time_ns - newest) / 1e9)
    return out


# ------------------------------------------------------------------------------------ roots


@dataclass(frozen=True, slots=True)
class Root:
    """The fault the other stuck groups follow from."""

    kind: str  # host_stuck | skipped | circular | stall | dump_missing | mismatch | p2p | timed_out | behind
    ranks: tuple[int, ...]
    group: str
    seq: int
    why: str
    consequences: tuple[str, ...] = ()  # other stuck groups explained by this root


def waiting_in(groups: Mapping[str, GroupView]) -> dict[int, list[tuple[str, int]]]:
    """rank -> [(group, oldest pending seq)] for every group the rank waits in."""
    out: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for g in groups.values():
        for r in g.dumped:
            if g.pending(r):
                out[r].append((g.name, g.completed.get(r, 0) + 1))
        for r, pend in g.p2p_pending.items():
            if pend:
                out[r].append((g.name, -1))
    return out


def find_roots(result: MatchResult) -> list[Root]:
    groups = result.groups
    waits = waiting_in(groups)
    roots: list[Root] = []
    # A collective that all ranks entered with different arguments is its own root.
    for mm in result.mismatches:
        if not mm.completed:
            roots.append(Root("mismatch", mm.culprits, mm.group, mm.seq,
                              f"ranks disagree on the {mm.kind} of collective #{mm.seq} in group {mm.group}"))
    blocked_by: dict[int, list[Blocker]] = defaultdict(list)
    for b in result.blockers:
        blocked_by[b.rank].append(b)
    free = sorted(r for r, bs in blocked_by.items() if bs[0].dumped and not waits.get(r))
    explained: set[str] = {r.group for r in roots}
    for rank in free:
        primary = _earliest(blocked_by[rank], groups)
        roots.append(Root(
            "host_stuck", (rank,), primary.group, primary.seq,
            f"rank {rank} never enqueued collective #{primary.seq} of group {primary.group} that ranks "
            f"{_fmt(primary.waiting)} wait in, and it is not waiting in any collective itself: it is stuck on "
            "the host (Python code, data loading, a sleep, a deadlock outside torch.distributed) or took "
            "another code path",
            tuple(sorted({b.group for b in blocked_by[rank]} - {primary.group})),
        ))
        explained.update(b.group for b in blocked_by[rank])
    if not free:
        # Every blocker waits somewhere else too. Best evidence first: a rank whose own history shows it
        # ran past the place where the missing collective belongs (see _ran_past); only when no rank
        # does, the weaker sign that it is ahead of everyone in another group.
        # Reading history is per candidate; a wait that involves very many ranks (a pipeline-wide cycle)
        # is left to the counting rule rather than reading thousands of histories.
        candidates = sorted(blocked_by) if len(blocked_by) <= _MAX_HISTORY_CANDIDATES else []
        past = {r: hit for r in candidates
                if (hit := _ran_past_any([b for b in blocked_by[r] if b.dumped], groups)) is not None}
        if len(past) > 1:
            past = {}  # two ranks that each "ran past" the other: history cannot tell, fall back
        for rank in sorted(blocked_by):
            bs = [b for b in blocked_by[rank] if b.dumped]
            if not bs:
                continue
            if past:
                if rank not in past:
                    continue
                b, (hname, hseq, ran, period) = past[rank]
                why = (f"rank {rank} never enqueued collective #{b.seq} of group {b.group} (ranks {_fmt(b.waiting)} "
                       f"wait in it) but went on without it: after #{b.seq - 1} of group {b.group} it ran {ran} "
                       f"collective(s) of group {hname} (up to #{hseq}), where its own earlier steps ran {period} "
                       f"at that point. It skipped a collective (a code path that differs on this rank)")
                culprits: tuple[int, ...] = (rank,)
                # the group it ran on in is where the others now wait: _propagate folds it in
                ahead_group: str | None = None
            else:
                ahead = _ahead_in(rank, groups, waits)
                if ahead is None:
                    continue
                b = _earliest(bs, groups)
                # Counting alone cannot tell "this rank skipped #b" from "a rank it waits for in the group it
                # is ahead in skipped one there" (mirror images); without enough history, name both.
                also = sorted({x.rank for x in result.blockers if x.group == ahead[0] and x.rank != rank
                               and x.dumped})
                why = (f"rank {rank} never enqueued collective #{b.seq} of group {b.group} (ranks {_fmt(b.waiting)} "
                       f"wait in it) but went on to collective #{ahead[1]} of group {ahead[0]} that no other member "
                       "has reached: it skipped a collective (a code path that differs on this rank)")
                if also:
                    why += (f" — or rank(s) {_fmt(also)}, missing from #{ahead[1]} of group {ahead[0]}, skipped that "
                            "one: the flight recorder holds too little repeating history to tell which")
                culprits = (rank, *also)
                ahead_group = ahead[0]
            roots.append(Root("skipped", culprits, b.group, b.seq, why,
                              tuple(sorted({x.group for x in blocked_by[rank]} - {b.group}))))
            explained.update(x.group for x in blocked_by[rank])
            if ahead_group is not None:
                explained.add(ahead_group)
    _propagate(roots, explained, result.blockers, waits)
    # Groups held only by ranks that left no dump.
    missing_only: dict[str, list[Blocker]] = defaultdict(list)
    for b in result.blockers:
        if b.group not in explained:
            missing_only[b.group].append(b)
    for gname, bs in sorted(missing_only.items(), key=lambda kv: _group_sort_key(kv[0])):
        if all(not b.dumped for b in bs):
            ranks = tuple(sorted({b.rank for b in bs}))
            roots.append(Root("dump_missing", ranks, gname, bs[0].seq,
                              f"ranks {_fmt(bs[0].waiting)} wait in collective #{bs[0].seq} of group {gname}; "
                              f"rank(s) {_fmt(ranks)} left no dump, so whether they reached it is unknown"))
            explained.add(gname)
    leftover = [b for b in result.blockers if b.group not in explained and b.dumped]
    if leftover:
        b = min(leftover, key=lambda x: _created(groups[x.group], x))
        cyc = tuple(sorted({x.rank for x in leftover}))
        roots.append(Root("circular", cyc, b.group, b.seq,
                          f"circular wait: every blocking rank ({_fmt(cyc)}) is itself waiting in another group; "
                          f"the oldest wait is collective #{b.seq} of group {b.group}",
                          tuple(sorted({x.group for x in leftover} - {b.group}))))
        explained.update(x.group for x in leftover)
    for st in result.stalls:
        if st.group in explained or any(m.group == st.group and m.seq == st.seq for m in result.mismatches):
            continue
        ranks = st.suspects or st.not_done
        # NCCL queues collectives without blocking the host: a rank stuck in an explained group's
        # collective has the next one queued behind it on the same stream, "not started". That is the
        # explained root seen again, not a GPU stall of its own.
        causes = [{g for g, _ in waits.get(r, []) if g in explained and g != st.group} for r in ranks]
        if ranks and all(causes):
            _add_consequence(roots, set().union(*causes), st.group)
            explained.add(st.group)
            continue
        why = (f"every member enqueued collective #{st.seq} of group {st.group} but rank(s) {_fmt(st.not_done)} "
               "did not complete it: the GPU or network side is stuck")
        if st.suspects:
            why += f"; rank(s) {_fmt(st.suspects)} never even started it (their GPU is busy or hung)"
        roots.append(Root("stall", ranks, st.group, st.seq, why))
    # Groups where nobody waits any more but a rank is behind: the others timed out (or the dumps
    # were taken at slightly different moments of a running job: then it is only "behind").
    lag_by_rank: dict[int, list[Laggard]] = defaultdict(list)
    for lg in result.laggards:
        if lg.group not in explained and not waits.get(lg.rank):
            lag_by_rank[lg.rank].append(lg)
    for rank, lags in sorted(lag_by_rank.items()):
        lg = min(lags, key=lambda x: (_created_ahead(groups[x.group], x), _group_sort_key(x.group)))
        others = tuple(sorted({x.group for x in lags} - {lg.group}))
        if lg.timed_out:
            why = (f"rank {rank} never enqueued collective #{lg.seq} of group {lg.group}; ranks {_fmt(lg.ahead)} "
                   f"waited in it until the {lg.timeout_s:g} s process-group timeout and then stopped (the dump was "
                   "taken after the timeout, so their side shows the collective as finished)")
            roots.append(Root("timed_out", (rank,), lg.group, lg.seq, why, others))
        else:
            why = (f"rank {rank} has not enqueued collective #{lg.seq} of group {lg.group} that ranks "
                   f"{_fmt(lg.ahead)} already ran; nobody is waiting, so this is most likely dump timing")
            roots.append(Root("behind", (rank,), lg.group, lg.seq, why, others))
        explained.update(x.group for x in lags)
    for p in result.p2p:
        if p.group in explained:
            continue
        roots.append(Root("p2p", (p.rank,), p.group, p.entry.p2p_seq,
                          f"rank {p.peer} waits in a {p.op} with rank {p.rank}, which has no matching "
                          f"{'recv' if p.op == 'send' else 'send'} pending"))
    return roots


def _add_consequence(roots: list[Root], causes: set[str], gname: str) -> None:
    for i, root in enumerate(roots):
        if root.group in causes or set(root.consequences) & causes:
            roots[i] = dataclasses.replace(root, consequences=tuple(sorted({*root.consequences, gname},
                                                                           key=_group_sort_key)))
            return


def _propagate(roots: list[Root], explained: set[str], blockers: Sequence[Blocker],
               waits: Mapping[int, list[tuple[str, int]]]) -> None:
    """A group whose every blocker is waiting in an already explained group is a consequence of
    that group's root (e.g. the world group waits for the TP ranks stuck in a mismatched TP
    collective): fold it into that root instead of calling it a circular wait."""
    by_group: dict[str, list[Blocker]] = defaultdict(list)
    for b in blockers:
        by_group[b.group].append(b)
    changed = True
    while changed:
        changed = False
        for gname, bs in by_group.items():
            if gname in explained or not all(b.dumped for b in bs):
                continue
            causes = set()
            for b in bs:
                inside = {g for g, _ in waits.get(b.rank, []) if g in explained}
                if not inside:
                    break
                causes |= inside
            else:
                _add_consequence(roots, causes, gname)
                explained.add(gname)
                changed = True


# How far back _ran_past reads one group's history (gaps between its consecutive collectives), and the
# longest repeating pattern of gaps it looks for (collectives of that group per training step).
# A tensor-parallel group runs ~2 collectives per layer: 100+ per step is ordinary.
_GAP_HISTORY = 1024
_MAX_CYCLE = 256
_MAX_HISTORY_CANDIDATES = 64


def _cycle(gaps: Sequence[int]) -> int | None:
    """The length p of the repeating gap pattern (gaps newest first): the smallest p that repeats over
    the WHOLE window read, at least three times; else None — a pattern longer than _MAX_CYCLE, a step
    shape that changes (gradient accumulation, an evaluation step), or too little history. Guessing a
    shorter cycle there would compare with a mid-step gap and name a rank that is merely waiting."""
    if not any(gaps):
        return None  # the window never left this group: it may all lie inside one step
    for p in range(1, min(_MAX_CYCLE, len(gaps) // 3) + 1):
        if all(gaps[i] == gaps[i + p] for i in range(len(gaps) - p)):
            return p
    return None


def _ran_past(rank: int, gname: str, seq: int, groups: Mapping[str, GroupView]) -> tuple[str, int, int, int] | None:
    """Did ``rank`` go past the place where collective ``seq`` of ``gname`` belongs in its program?

    Between two consecutive collectives of ``gname`` a rank runs some number of collectives of each
    other group, in a pattern that repeats every training step (TP all_reduces, then the data-parallel
    gradient buckets, …). The gap that should end at ``seq`` sits at the same place of that cycle as
    the gap ending one cycle earlier. If, since its ``seq - 1``, the rank ran MORE of some other group
    than that gap holds, it did not stop before ``seq``: it skipped it. A rank merely waiting earlier
    in the step ran at most that many. Returns (other group, its last seq, count since, the gap's count)
    or None — also when the ring buffer holds too little history, or no repeating cycle, to tell.
    """
    mine = groups[gname].by_seq.get(rank, {})
    anchors: list[int] = []  # record ids of seq-1, seq-2, …: newest first
    for s in range(seq - 1, max(0, seq - 2 - _GAP_HISTORY), -1):
        e = mine.get(s)
        if e is None:
            break
        anchors.append(e.record_id)
    if len(anchors) < 3:
        return None
    for hname, h in groups.items():
        if hname == gname:
            continue
        theirs = sorted(e.record_id for e in h.by_seq.get(rank, {}).values())
        if not theirs:
            continue
        bounds = anchors
        if h.oldest_seq.get(rank, 1) > 1:  # this group's ring buffer lost its oldest entries
            bounds = [a for a in anchors if a > theirs[0]]
        gaps = [bisect.bisect_left(theirs, hi) - bisect.bisect_right(theirs, lo)
                for hi, lo in itertools.pairwise(bounds)]  # gaps[k] ends at seq-1-k
        period = _cycle(gaps)
        if period is None:
            continue
        expected = gaps[period - 1]  # the gap one cycle before the one that should end at seq
        since = [e for e in h.by_seq[rank].values() if e.record_id > anchors[0]]
        if len(since) > expected:
            return hname, max(e.seq for e in since), len(since), expected
    return None


def _ran_past_any(blockers: Sequence[Blocker], groups: Mapping[str, GroupView]
                  ) -> tuple[Blocker, tuple[str, int, int, int]] | None:
    for b in sorted(blockers, key=lambda x: (_created(groups[x.group], x), _group_sort_key(x.group))):
        hit = _ran_past(b.rank, b.group, b.seq, groups)
        if hit is not None:
            return b, hit
    return None


def _ahead_in(rank: int, groups: Mapping[str, GroupView], waits: Mapping[int, list[tuple[str, int]]]
              ) -> tuple[str, int] | None:
    for gname, seq in waits.get(rank, []):
        g = groups[gname]
        others = [g.enqueued.get(r, 0) for r in g.dumped if r != rank]
        if seq > 0 and others and g.enqueued.get(rank, 0) > max(others):
            return gname, g.enqueued[rank]
    return None


def _created(view: GroupView, b: Blocker) -> int:
    times = [e.created_ns for r in b.waiting if (e := view.entry(r, b.seq)) is not None and e.created_ns]
    return min(times) if times else 1 << 62


def _created_ahead(view: GroupView, lg: Laggard) -> int:
    times = [e.created_ns for r in lg.ahead if (e := view.entry(r, lg.seq)) is not None and e.created_ns]
    return min(times) if times else 1 << 62


def _earliest(blockers: Iterable[Blocker], groups: Mapping[str, GroupView]) -> Blocker:
    # The collective the others started waiting in first is the one this rank was due to run next.
    return min(blockers, key=lambda b: (_created(groups[b.group], b), _group_sort_key(b.group)))


def _fmt(ranks: Iterable[int]) -> str:
    return format_ranks(ranks)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def format_ranks(ranks: Iterable[int], max_chars: int = 100) -> str:
    """Compact rank list for people: "0-3,7,9-12", "5-1021 every 8th (128 ranks)", or a cut list
    with the count when it would be long (evidence keeps the full list)."""
    rs = sorted(set(ranks))
    if len(rs) >= 4:
        stride = Counter(b - a for a, b in itertools.pairwise(rs)).most_common(1)[0][0]
        if stride > 1 and all((r - rs[0]) % stride == 0 for r in rs):
            gaps = sorted(set(range(rs[0], rs[-1] + 1, stride)) - set(rs))
            if len(gaps) <= 3:
                every = f"{rs[0]}-{rs[-1]} every {_ordinal(stride)}"
                if gaps:
                    every += " except " + ",".join(map(str, gaps))
                return f"{every} ({len(rs)} ranks)"
    parts = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    text = ",".join(parts)
    if len(text) <= max_chars:
        return text
    shown, used = [], 0
    for part in parts:
        if used + len(part) + 1 > max_chars - 20:
            break
        shown.append(part)
        used += len(part) + 1
    return ",".join(shown) + f",… ({len(rs)} ranks)"
