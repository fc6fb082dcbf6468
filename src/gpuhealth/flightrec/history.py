"""Reading a rank's own history: did it go past the place where a missing collective belongs?

Between two consecutive collectives of one group a rank runs some number of collectives of each other
group, in a pattern that repeats every training step (TP all_reduces, then the data-parallel gradient
buckets, …). The gap that should end at collective ``seq`` sits at the same place of that cycle as the
gap ending one cycle earlier. If, since its ``seq - 1``, the rank ran MORE of some other group than
that gap holds, it did not stop before ``seq``: it skipped it. A rank merely waiting earlier in the
step ran at most that many.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence

from gpuhealth.flightrec.groups import GroupView

# How far back one group's history is read (gaps between its consecutive collectives), and the longest
# repeating pattern of gaps looked for (collectives of that group per training step). A tensor-parallel
# group runs ~2 collectives per layer: 100+ per step is ordinary.
GAP_HISTORY = 1024
MAX_CYCLE = 256


def cycle_length(gaps: Sequence[int]) -> int | None:
    """The length p of the repeating gap pattern (gaps newest first): the smallest p that repeats over
    the WHOLE window read, at least twice; else None — a pattern longer than MAX_CYCLE, a step
    shape that changes (gradient accumulation, an evaluation step), or too little history. Guessing a
    shorter cycle there would compare with a mid-step gap and name a rank that is merely waiting."""
    if not any(gaps):
        return None  # the window never left this group: it may all lie inside one step
    for p in range(1, min(MAX_CYCLE, len(gaps) // 2) + 1):
        if all(gaps[i] == gaps[i + p] for i in range(len(gaps) - p)):
            return p
    return None


def _outgrown(gaps: Sequence[int], leading: int, since: int) -> int | None:
    """The gap that exceeds every one before it — the open one (ops since the last anchor), or the last
    closed one when the op after it is really the *next* step's (NCCL lets a rank that skipped one post the
    next, so the skip hides one anchor back) — or None. ``leading``: what ran before the first anchor,
    a lower bound of a gap. Needs one closed gap to judge the open one, two to judge the last closed one."""
    if not gaps:
        return None
    if since > max([*gaps, leading]):
        return since
    if len(gaps) >= 2 and gaps[-1] > max([*gaps[:-1], leading]):
        return gaps[-1]
    return None


def order_break(rank: int, gname: str, groups: Mapping[str, GroupView]) -> tuple[str, int, int, int] | None:
    """Did this rank, between two consecutive collectives of ``gname`` (or since its last one), run more
    collectives of another group than in any gap of its history before? Then it did not stop where a
    collective of ``gname`` belongs: it skipped it. A rank merely waiting for it is still inside its longest
    gap.

    Weaker than :func:`ran_past` (it compares with the longest gap, not the gap at the same point of the
    step) but needs only one gap of history, where ``ran_past`` needs three repeats of the step's pattern:
    a fault in the second step of a job is judged too. Returns (other group, its last seq, the gap, the
    longest gap before it) or None."""
    mine = groups[gname].calls.get(rank, {})
    anchors = sorted(c.record_id for c in mine.values())
    if len(anchors) < 2:
        return None
    for hname, h in groups.items():
        if hname == gname:
            continue
        calls = h.calls.get(rank, {})
        theirs = sorted(c.record_id for c in calls.values())
        if not theirs:
            continue
        bounds = [a for a in anchors if a > theirs[0]] if h.oldest_seq.get(rank, 1) > 1 else anchors
        gaps = [bisect.bisect_left(theirs, hi) - bisect.bisect_right(theirs, lo)
                for lo, hi in itertools.pairwise(bounds)]
        leading = bisect.bisect_left(theirs, bounds[0]) if bounds else 0
        since = [c for c in calls.values() if c.record_id > anchors[-1]]
        grown = _outgrown(gaps, leading, len(since))
        if grown is not None:
            before = max([*(gaps[:-1] if grown != len(since) else gaps), leading])
            return hname, max(c.seq for c in calls.values()), grown, before
    return None


OpKey = tuple[str, ...]  # ("c", group) a collective of a group; ("p", kind, peer) a send/recv to/from a peer


def stream_break(rank: int, key: OpKey, groups: Mapping[str, GroupView]) -> tuple[int, int] | None:
    """:func:`order_break` over everything the rank posted — collectives and send/recv ops alike: since its
    last op ``key`` (a collective of a group, or a send to / recv from one peer), has it posted more ops than
    it ever did between two of them? A pipeline stage whose step always held "send to rank 2" and that went
    on without it breaks here. Returns (ops since, the longest gap) or None."""
    stream: list[tuple[int, OpKey]] = []
    for name, g in groups.items():
        stream += [(c.record_id, ("c", name)) for c in g.calls.get(rank, {}).values()]
        stream += [(op.entry.record_id, ("p", op.kind, str(op.peer))) for op in g.p2p.get(rank, [])]
    stream.sort()
    marks = [i for i, (_, k) in enumerate(stream) if k == key]
    if len(marks) < 2:
        return None
    gaps = [b - a - 1 for a, b in itertools.pairwise(marks)]
    since = len(stream) - 1 - marks[-1]
    grown = _outgrown(gaps, marks[0], since)
    return None if grown is None else (grown, max([*gaps, marks[0]]))


def ran_past(rank: int, gname: str, seq: int, groups: Mapping[str, GroupView]) -> tuple[str, int, int, int] | None:
    """Did ``rank`` go past the place where collective ``seq`` of ``gname`` belongs in its program?
    Returns (other group, its last seq, count since, the gap's usual count) or None — also when the
    ring buffer holds too little history, or no repeating cycle, to tell."""
    mine = groups[gname].calls.get(rank, {})
    anchors: list[int] = []  # record ids of seq-1, seq-2, …: newest first
    for s in range(seq - 1, max(0, seq - 2 - GAP_HISTORY), -1):
        c = mine.get(s)
        if c is None:
            break
        anchors.append(c.record_id)
    if len(anchors) < 3:
        return None
    for hname, h in groups.items():
        if hname == gname:
            continue
        calls = h.calls.get(rank, {})
        theirs = sorted(c.record_id for c in calls.values())
        if not theirs:
            continue
        bounds = anchors
        if h.oldest_seq.get(rank, 1) > 1:  # this group's ring buffer lost its oldest entries
            bounds = [a for a in anchors if a > theirs[0]]
        gaps = [bisect.bisect_left(theirs, hi) - bisect.bisect_right(theirs, lo)
                for hi, lo in itertools.pairwise(bounds)]  # gaps[k] ends at seq-1-k
        period = cycle_length(gaps)
        if period is None:
            continue
        expected = gaps[period - 1]  # the gap one cycle before the one that should end at seq
        since = [c for c in calls.values() if c.record_id > anchors[0]]
        if len(since) > expected:
            return hname, max(c.seq for c in since), len(since), expected
    return None
