"""All root causes of one job, in the order an operator should read them (pure).

Sources: the wait-for graph's sinks (:mod:`waits`), argument mismatches (:mod:`checks`, :mod:`p2p`) and
late ranks in groups nobody waits in (:mod:`lag`). Then the *headline rule*: the first root is the fault
everything else follows from, and what follows from it is nested under it, never listed beside it:

* a stall whose participants disagree on the arguments is that mismatch;
* a mismatch that completed silently (a broadcast leaf on Gloo) comes first when a later hang involves
  the same ranks or group, or names no rank (a stall, a circular wait): the hang is its consequence;
* otherwise roots that name a culprit come before those that do not, then the one holding up the most
  ranks, then the oldest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuhealth.flightrec.calls import Signature
from gpuhealth.flightrec.checks import Mismatch
from gpuhealth.flightrec.groups import GroupView
from gpuhealth.flightrec.lag import Laggard
from gpuhealth.flightrec.p2p import P2PMismatch
from gpuhealth.flightrec.report import RootCause, RootKind
from gpuhealth.flightrec.stacks import MainThread
from gpuhealth.flightrec.text import format_ranks
from gpuhealth.flightrec.unrecorded import posted_peers

_NEVER = 1 << 62
_RANKLESS = frozenset({RootKind.GPU_STALL, RootKind.CIRCULAR})


def mismatch_root(mm: Mismatch, view: GroupView) -> RootCause:
    how = {"majority": "the other ranks agree", "history": "the others repeat what this group ran before",
           "own_record": "its own record of the op is impossible",
           "undecided": "a tie: cannot tell which side is wrong"}
    state = ("it completed anyway: results are silently wrong" if mm.completed
             else "it cannot complete: the job hangs here")
    what = {"type": "op", "size": "sizes", "dtype": "dtypes"}[mm.kind]
    where = f"collective #{mm.seq} of group {mm.group}" + (f" ({mm.detail})" if mm.detail else "")
    why = (f"rank(s) {format_ranks(mm.culprits)} disagree with the group on the {what} of {where} "
           f"({how[mm.decided_by]}); {state}")
    op = mm.by_rank[mm.culprits[0]].op if mm.culprits and mm.culprits[0] in mm.by_rank else None
    return RootCause(RootKind.MISMATCH, mm.culprits, why, group=mm.group, seq=mm.seq, op=op, mismatch=mm.kind,
                     decided_by=mm.decided_by, completed=mm.completed, created_ns=mm.created_ns,
                     waiting_ranks=tuple(sorted(set(mm.by_rank) - set(mm.culprits))))


def p2p_mismatch_root(mm: P2PMismatch) -> RootCause:
    s, r = mm.send, mm.recv
    why = (f"rank {s.rank} sends {list(map(list, s.entry.in_sizes or s.entry.out_sizes))} "
           f"{list(s.entry.in_dtypes)} to rank {r.rank}, which expects "
           f"{list(map(list, r.entry.out_sizes or r.entry.in_sizes))} {list(r.entry.out_dtypes or r.entry.in_dtypes)}"
           + (": the side that differs from what this pair exchanged before is at fault"
              if mm.decided_by == "history" else ": nothing before tells which side is wrong"))
    return RootCause(RootKind.MISMATCH, mm.culprits, why, group=mm.group, seq=s.entry.p2p_seq, op="send/recv",
                     mismatch=mm.kind, decided_by=mm.decided_by, completed=False,
                     waiting_ranks=tuple(sorted({s.rank, r.rank} - set(mm.culprits))),
                     created_ns=min(t for t in (s.entry.created_ns, r.entry.created_ns, _NEVER) if t))


def laggard_root(lg: Laggard) -> RootCause:
    if lg.timed_out:
        why = (f"rank {lg.rank} never enqueued collective #{lg.seq} of group {lg.group}; rank(s) "
               f"{format_ranks(lg.ahead)} waited in it until the {lg.timeout_s:g} s process-group timeout and then "
               "stopped (the dump was taken after the timeout, so their side shows the collective as finished)")
        kind = RootKind.TIMED_OUT
    else:
        why = (f"rank {lg.rank} has not enqueued collective #{lg.seq} of group {lg.group} that rank(s) "
               f"{format_ranks(lg.ahead)} already ran; nobody is waiting, so this is most likely dump timing")
        kind = RootKind.BEHIND
    return RootCause(kind, (lg.rank,), why, group=lg.group, seq=lg.seq, waiting_ranks=lg.ahead,
                     created_ns=lg.created_ns,
                     idle_s=None if lg.idle_s is None else round(lg.idle_s, 1), timeout_s=lg.timeout_s)


def assemble(groups: Mapping[str, GroupView], hang_roots: Sequence[RootCause], mismatches: Sequence[Mismatch],
             p2p_mismatches: Sequence[P2PMismatch], laggards: Sequence[Laggard],
             waiting: Mapping[int, bool]) -> list[RootCause]:
    """Every root cause, ordered, with consequences nested (see the module doc)."""
    by_seq = {(m.group, m.seq): m for m in mismatches}
    roots: list[RootCause] = []
    used: set[tuple[str, int]] = set()
    for h in hang_roots:
        mm = by_seq.get((h.group or "", h.seq or 0)) if h.kind is RootKind.GPU_STALL else None
        if mm is not None and h.op not in ("send", "recv"):
            r = mismatch_root(mm, groups[mm.group])
            r.affected_ranks, r.consequences = h.affected_ranks, h.consequences
            roots.append(r)
            used.add((mm.group, mm.seq))
            continue
        p2p = _p2p_mismatch_of(h, p2p_mismatches)
        if p2p is not None:
            r = p2p_mismatch_root(p2p)
            r.affected_ranks, r.consequences = h.affected_ranks, h.consequences
            roots.append(r)
            continue
        roots.append(h)
    for mm in mismatches:
        if (mm.group, mm.seq) in used:
            continue
        roots.append(mismatch_root(mm, groups[mm.group]))
    have_p2p = {(r.group, r.seq) for r in roots if r.op == "send/recv"}
    for pm in p2p_mismatches:
        if (pm.group, pm.send.entry.p2p_seq) not in have_p2p:
            roots.append(p2p_mismatch_root(pm))
    explained = {g for r in roots for g in (r.group, *r.consequences) if g}
    lagging: dict[int, list[Laggard]] = {}
    for lg in laggards:
        if lg.group not in explained and not waiting.get(lg.rank):
            lagging.setdefault(lg.rank, []).append(lg)
    for _rank, lags in sorted(lagging.items()):
        first = min(lags, key=lambda x: (x.created_ns or _NEVER, x.group))
        r = laggard_root(first)
        r.consequences = tuple(sorted({x.group for x in lags} - {first.group}))
        roots.append(r)
    return _order(roots)


def _p2p_mismatch_of(h: RootCause, p2p_mismatches: Sequence[P2PMismatch]) -> P2PMismatch | None:
    if h.kind is not RootKind.GPU_STALL or h.op not in ("send", "recv"):
        return None
    both = set(h.waiting_ranks)
    return next((m for m in p2p_mismatches if m.group == h.group and {m.send.rank, m.recv.rank} == both), None)


def _order(roots: list[RootCause]) -> list[RootCause]:
    def rank_of(r: RootCause) -> tuple[int, int, int, int]:
        if r.kind is RootKind.BEHIND:
            tier = 9
        elif r.kind is RootKind.MISMATCH and not r.completed:
            tier = 0
        elif r.kind is RootKind.MISMATCH:
            tier = 5  # silent: after the hangs it does not explain (see below)
        elif r.kind in _RANKLESS:
            tier = 3
        elif r.kind in (RootKind.DUMP_MISSING, RootKind.DUMP_UNREADABLE):
            tier = 2
        else:
            tier = 1
        undecided = 1 if r.decided_by == "undecided" else 0
        return (tier, undecided, -len(r.affected_ranks), r.created_ns or _NEVER)

    ordered = sorted(roots, key=rank_of)
    silent = [r for r in ordered if r.kind is RootKind.MISMATCH and r.completed]
    for mm in silent:
        later = [r for r in ordered if r is not mm and r.kind is not RootKind.BEHIND and r not in silent
                 and (r.created_ns or _NEVER) >= (mm.created_ns or 0) and _follows(mm, r)]
        if not later:
            continue
        for r in later:
            ordered.remove(r)
            mm.followed_by.append(r)
            mm.affected_ranks = tuple(sorted({*mm.affected_ranks, *r.ranks, *r.affected_ranks} - set(mm.ranks)))
            mm.consequences = tuple(sorted({*mm.consequences, *(g for g in (r.group, *r.consequences) if g)}
                                           - {mm.group}))
        ordered.remove(mm)
        ordered.insert(0, mm)
    return ordered


def _follows(mm: RootCause, r: RootCause) -> bool:
    """Whether hang ``r`` plausibly follows from silent mismatch ``mm``."""
    if r.kind is RootKind.MISMATCH:
        return False
    return (r.kind in _RANKLESS or bool(set(r.ranks) & set(mm.ranks)) or r.group == mm.group
            or mm.group in r.consequences)


def signature_text(sig: Signature | None) -> str:
    if sig is None:
        return "?"
    return f"{sig.op} {[list(s) for s in sig.in_sizes]} {list(sig.in_dtypes)}"


_NOT_POSTED = frozenset({RootKind.HOST_STUCK, RootKind.P2P_UNMATCHED, RootKind.TIMED_OUT})


def with_stacks(roots: Sequence[RootCause], mains: Mapping[int, MainThread],
                groups: Mapping[str, GroupView] | None = None) -> None:
    """Correct roots with live stacks: of several ranks that "never posted" an op, those whose main thread
    is inside torch.distributed are waiting in communication the flight recorder does not show (Gloo records
    no send/recv), not stuck on the host — they are consequences, not culprits."""
    if not mains:
        return
    for root in roots:
        if groups is not None and _settle_unrecorded_peers(root, mains, groups):
            continue
        if root.kind not in _NOT_POSTED or len(root.ranks) < 2:
            continue
        busy = {r: fn for r in root.ranks if (m := mains.get(r)) is not None and (fn := m.in_communication())}
        if not busy or len(busy) == len(root.ranks):
            continue
        root.ranks = tuple(r for r in root.ranks if r not in busy)
        root.affected_ranks = tuple(sorted({*root.affected_ranks, *busy}))
        calls = sorted(set(busy.values()))
        who = f"rank {root.ranks[0]}" if len(root.ranks) == 1 else f"ranks {format_ranks(root.ranks)}"
        root.why = (f"{who} never posted {root.what or 'the op'} and "
                    f"{'is' if len(root.ranks) == 1 else 'are'} not in any communication call: stuck on the host "
                    f"(Python code, data loading, a sleep, a deadlock outside torch.distributed). Rank(s) "
                    f"{format_ranks(busy)} never posted it either, but their stacks show them blocked in "
                    f"torch.distributed ({', '.join(calls)}): waiting in communication the flight recorder did not "
                    "record (Gloo records no send/recv), held up by the rank(s) above")
        root.decided_by = "stacks"


def _settle_unrecorded_peers(root: RootCause, mains: Mapping[int, MainThread], groups: Mapping[str, GroupView]
                             ) -> bool:
    """A root naming a rank that never posted the collective together with peers that went on without their
    unrecorded send/recv (``unrecorded.name_unrecorded_peers``): the stuck ranks' stacks decide. Blocked in
    torch.distributed (a recv, a send), they wait for the peers, who are the culprits; anywhere else, they
    are stuck on the host and the peers merely wait for them in the collective."""
    peers = posted_peers(root, groups)
    stuck = [r for r in root.ranks if r not in peers]
    if not peers or not stuck or any(r not in mains for r in stuck):
        return False
    busy = {r: fn for r in stuck if (fn := mains[r].in_communication())}
    if busy and len(busy) == len(stuck):
        root.ranks = tuple(peers)
        root.affected_ranks = tuple(sorted({*root.affected_ranks, *stuck}))
        root.why = (f"rank(s) {format_ranks(stuck)} never posted {root.what or 'the collective'}, but their stacks "
                    f"show them blocked in torch.distributed ({', '.join(sorted(set(busy.values())))}): waiting for a "
                    f"send/recv the flight recorder does not record (Gloo). Rank(s) {format_ranks(peers)} went on "
                    "without their usual unrecorded op(s): the side the others wait for")
    elif not busy:
        root.ranks = tuple(stuck)
        root.waiting_ranks = tuple(sorted({*root.waiting_ranks, *peers}))
        root.why = (f"rank(s) {format_ranks(stuck)} never posted {root.what or 'the collective'} and are in no "
                    "communication call (live stacks): stuck on the host (Python code, data loading, a sleep, a "
                    "deadlock outside torch.distributed)")
    else:
        return False
    root.decided_by = "stacks"
    return True
