"""Send/recv the flight recorder did not record (Gloo), read from the gaps in each rank's op numbering.

Gloo records no send/recv (torch 2.13), but it numbers every op of a process group, send and recv
included: an entry's ``op_id`` (and ``pg_status``) counts them. So between two recorded collectives of a
group, a rank ran ``op_id`` difference − 1 ops the dumps do not show — its point-to-point traffic.

That separates what the collectives alone cannot. A rank that never posted collective #s and waits in no
recorded op looks stuck on the host; but when it ran unrecorded ops every step, it may be blocked in one —
a ``recv`` whose sender went on without sending. A peer that also ran unrecorded ops every step and went on
to #s *without* them (fewer than in any earlier step) is that sender as much as the waiting rank is the
culprit: the dumps cannot tell the two apart, so both are named (``decided_by: undecided``); live stacks
settle it (``roots.with_stacks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from gpuhealth.flightrec.groups import GroupView
from gpuhealth.flightrec.load import RankDump
from gpuhealth.flightrec.report import RootCause, RootKind
from gpuhealth.flightrec.text import format_ranks

# Steps of history a rank's pattern needs before one step's gap can be said to break it.
MIN_HISTORY = 2


def unrecorded_before(view: GroupView, rank: int, dump: RankDump) -> dict[int, int] | None:
    """Collective seq → how many ops of this group the rank ran, unrecorded, since its previous collective
    (only where the previous one is in the window, or the ring buffer holds the rank's first op). None for
    a library that records its send/recv (NCCL: a gap is not hidden traffic) or numbering that is not one
    counter (ids that repeat or run backwards)."""
    if dump.backend != "gloo":
        return None
    calls = view.calls.get(rank, {})
    spans: dict[int, tuple[int, int]] = {}
    for seq, call in calls.items():
        ids = [e.op_id for e in (*call.ops, *((call.marker,) if call.marker else ())) if e.op_id > 0]
        if ids:
            spans[seq] = (min(ids), max(ids))
    out: dict[int, int] = {}
    for seq in sorted(spans):
        first, _ = spans[seq]
        if seq - 1 in spans:
            gap = first - spans[seq - 1][1] - 1
        elif seq == min(spans) and view.whole_history.get(rank):
            gap = first - 1
        else:
            continue
        if gap < 0:
            return None
        out[seq] = gap
    return out


def went_on_without(view: GroupView, rank: int, seq: int, dump: RankDump) -> tuple[int, int] | None:
    """(unrecorded ops before ``seq``, the fewest before any earlier collective) when the rank ran unrecorded
    ops before each of at least ``MIN_HISTORY`` earlier collectives and fewer than ever before ``seq``."""
    gaps = unrecorded_before(view, rank, dump)
    if not gaps or seq not in gaps:
        return None
    earlier = [g for s, g in gaps.items() if s < seq]
    if len(earlier) < MIN_HISTORY or min(earlier) == 0 or gaps[seq] >= min(earlier):
        return None
    return gaps[seq], min(earlier)


def ran_unrecorded(view: GroupView, rank: int, dump: RankDump) -> bool:
    """Whether the rank ran unrecorded ops in this group (send/recv the dumps do not show)."""
    gaps = unrecorded_before(view, rank, dump)
    return gaps is not None and any(gaps.values())


def name_unrecorded_peers(roots: Sequence[RootCause], groups: Mapping[str, GroupView],
                          dumps: Mapping[int, RankDump]) -> None:
    """A rank stuck outside any recorded op that runs unrecorded send/recv may wait in one for a peer that went
    on without its side: name such peers with it (``decided_by: undecided``)."""
    for root in roots:
        view = groups.get(root.group or "")
        if root.kind is not RootKind.HOST_STUCK or view is None or root.seq is None:
            continue
        seq = root.seq
        stuck = [r for r in root.ranks if r in dumps]
        if not stuck or not all(ran_unrecorded(view, r, dumps[r]) for r in stuck):
            continue
        peers = {r: got for r in view.dumped if r not in root.ranks
                 and (got := went_on_without(view, r, seq, dumps[r])) is not None}
        if not peers:
            continue
        root.ranks = tuple(sorted({*root.ranks, *peers}))
        root.waiting_ranks = tuple(r for r in root.waiting_ranks if r not in peers)
        root.affected_ranks = tuple(r for r in root.affected_ranks if r not in peers)
        root.blocks = tuple(dataclasses.replace(b, waiting_ranks=tuple(r for r in b.waiting_ranks if r not in peers))
                            for b in root.blocks)
        root.what = "; ".join(f"{b.what} (rank(s) {format_ranks(b.waiting_ranks)} wait)" for b in root.blocks[:4])
        root.decided_by = "undecided"
        name = next((c.name for r in view.dumped if (c := view.call(r, seq)) is not None), "collective")
        what = f"{name} #{seq} in group {root.group}"
        went = "; ".join(f"rank {r}: {n} before it, at least {usual} before each earlier one"
                         for r, (n, usual) in sorted(peers.items()))
        one = len(stuck) == 1
        root.why = (f"{_who(stuck)} never posted {what} and {'waits' if one else 'wait'} in no recorded op, but "
                    f"{'it runs' if one else 'they run'} send/recv every step, which Gloo does not record: "
                    f"{'it' if one else 'they'} may be blocked in one. {_who(list(peers)).capitalize()} went on to "
                    f"{what} without the unrecorded op(s) of every earlier step ({went}): the send or recv the "
                    "others may wait for. The dumps cannot tell a rank stuck on the host from one waiting for a "
                    "peer that skipped its side: all are named; live stacks (--stacks) settle it")


def _who(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def posted_peers(root: RootCause, groups: Mapping[str, GroupView]) -> list[int]:
    """The root's ranks that posted the collective it is about (named as peers that skipped unrecorded
    send/recv, not as ranks that never reached it)."""
    view = groups.get(root.group or "")
    if view is None or root.seq is None or root.kind is not RootKind.HOST_STUCK:
        return []
    return [r for r in root.ranks if view.call(r, root.seq) is not None]
