"""Steps out of flight-recorder durations: a steps × ranks matrix of the seconds each rank spent in
collectives per step, without assuming one group that every rank is in.

Each rank's collectives repeat once per training step. Every rank gets a *mark*: one group it is in
and which of that group's collectives ends a step (a DP group with three gradient buckets has three
per step; the third ends it). A rank's wait in a step is the sum of its durations over one whole
cycle ending at its mark, so every group it waited in counts — a TP peer of a straggler waits for it
in the TP group, the others in their DP groups. The cycle is cut where the ranks compute: after the
collective followed by the most time outside collectives (from start times), else after the one
where each group's sequence ids say the step moves on; so one rank's slow step lands in one step
for every rank that waited for it. All ranks are cut at the same point of the program (one family
of groups: the world group, or all DP groups, …), and steps line up across ranks through the
sequence ids: a group's ids are the same on all its members, and the groups of one family run the
same program."""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

MAX_RANK = 1 << 21  # a rank id beyond this is bad input, not a job (it would size the matrices)
MAX_PER_STEP = 256  # collectives of one group per step looked for (gradient buckets, layers × microbatches)
_PATTERN_SHARE = 0.9  # share of a cycle's repetitions that must agree to call it the cycle
_MAX_CUTS = 8  # every residue tried up to this many collectives per step, when no start times place the compute

# (group, seq, duration_ms) as triage passes them, optionally with the collective's start time in ns
# (``created_ns``): with it, lateness is judged relative to the step.
DurationItem = tuple[str, int, float] | tuple[str, int, float, int | float | None]
# groups of one size, cadence (collectives per step) and disjoint set of them: all TP groups, all DP groups
Family = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Mark:
    """Where a rank's step ends: the ``group`` collective whose sequence id ≡ ``residue`` (mod
    ``per_step``). Step *k* ends at sequence id ``k · per_step + residue``."""

    group: str
    per_step: int
    residue: int

    def seq(self, step: int) -> int:
        return step * self.per_step + self.residue


@dataclass(frozen=True, slots=True)
class FrSteps:
    steps: np.ndarray  # step ids, increasing
    ranks: list[int]  # the rank of each column
    waits: np.ndarray  # steps × columns: seconds in collectives over the cycle ending at the rank's mark
    periods: np.ndarray | None  # seconds from one step's end to the next (from start times), if known
    marks: dict[int, Mark]  # rank -> its mark


@dataclass(frozen=True, slots=True)
class _Ops:
    """One rank's collectives in the order it ran them."""

    names: list[str]
    seqs: np.ndarray  # int64
    secs: np.ndarray  # duration in seconds
    starts: np.ndarray  # ns, NaN where unknown


def fr_steps(durations: Mapping[int, Sequence[DurationItem]]) -> FrSteps | None:
    ops = _clean(durations)
    if not ops:
        return None
    marks = _marks(ops)
    got = _matrix(ops, marks)
    if got is None:
        return None
    step_ids, ranks, waits, starts = got
    return FrSteps(step_ids, ranks, waits, _periods(step_ids, starts, waits), marks)


def _matrix(ops: Mapping[int, _Ops], marks: Mapping[int, Mark],
            ) -> tuple[np.ndarray, list[int], np.ndarray, np.ndarray] | None:
    """(step ids, the rank of each column, waits, start times of the marks), steps × columns: one
    column per rank with steps (sparse rank ids of a huge job do not size the matrix)."""
    rows: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
    for rank, mark in marks.items():
        got = _rank_steps(ops[rank], mark)
        if got is not None:
            rows.append((rank, *got))
    if not rows:
        return None
    rows.sort(key=lambda r: r[0])
    step_ids = np.unique(np.concatenate([r[1] for r in rows]))
    waits = np.full((len(step_ids), len(rows)), np.nan)
    starts = np.full((len(step_ids), len(rows)), np.nan)
    for column, (_, ids, wait, start) in enumerate(rows):
        at = np.searchsorted(step_ids, ids)
        waits[at, column] = wait
        starts[at, column] = start
    return step_ids, [r[0] for r in rows], waits, starts


# ------------------------------------------------------------------------------------------ input


def _clean(durations: Mapping[int, Sequence[DurationItem]]) -> dict[int, _Ops]:
    out: dict[int, _Ops] = {}
    for rank, items in durations.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < MAX_RANK:
            continue
        ops = _fast(items)
        if ops is None:
            ops = _slow(items)
        if ops is not None and len(ops.names):
            out[rank] = ops
    return out


def _fast(items: Sequence[DurationItem]) -> _Ops | None:
    """Whole columns at once when every item is well formed (what triage passes); None otherwise."""
    n = len(items)
    try:
        if any(len(x) < 3 or type(x[1]) is not int for x in items):
            return None
        seqs = np.fromiter((x[1] for x in items), np.int64, n)
        ms = np.fromiter((x[2] for x in items), np.float64, n)
        starts = np.fromiter((x[3] if len(x) > 3 and x[3] is not None else math.nan for x in items),
                             np.float64, n)
    except (TypeError, ValueError, OverflowError):
        return None
    if not (np.isfinite(ms).all() and (ms >= 0).all()) or np.isinf(starts).any():
        return None
    return _Ops([x[0] if type(x[0]) is str else str(x[0]) for x in items], seqs, ms / 1000.0, starts)


def _slow(items: Sequence[DurationItem]) -> _Ops | None:
    """Item by item, skipping what cannot be read (a missing field, a text or NaN duration)."""
    names: list[str] = []
    seqs: list[int] = []
    secs: list[float] = []
    starts: list[float] = []
    for item in items:
        if not isinstance(item, tuple | list) or len(item) < 3:
            continue
        seq, ms = _number(item[1]), _number(item[2])
        if seq is None or ms is None or ms < 0 or abs(seq) > 2**62:
            continue
        start = _number(item[3]) if len(item) > 3 else None
        names.append(str(item[0]))
        seqs.append(int(seq))
        secs.append(ms / 1000.0)
        starts.append(math.nan if start is None else start)
    if not names:
        return None
    return _Ops(names, np.array(seqs, np.int64), np.array(secs), np.array(starts))


def _number(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


# ------------------------------------------------------------------------------------------ marks


def _marks(ops: Mapping[int, _Ops]) -> dict[int, Mark]:
    """Each rank's mark: the collective after which the ranks compute, at the same point of the
    program on every rank (one *family* of groups — same size, same collectives per step, one group
    per rank — and one residue), so that one rank's slow compute lands in the same step for every
    rank that waited for it. With start times: the majority of the ranks' own step ends (see
    :func:`_step_end`). Without: of every family and residue, the cut whose steps' waits differ
    least between ranks — cut anywhere else, the ranks that waited for one slow step in one group
    and those that waited in the next group fall in two different steps. Where no family covers the
    ranks, groups are tried largest first and used only if none of their members has a mark yet."""
    members: dict[str, list[int]] = {}
    counts: dict[int, Counter[str]] = {}
    for rank in sorted(ops):
        counts[rank] = Counter(ops[rank].names)
        for g in counts[rank]:
            members.setdefault(g, []).append(rank)
    cadence: dict[str, tuple[int, int, bool]] = {}

    def cadence_of(g: str) -> tuple[int, int, bool]:
        if g not in cadence:
            best = max(members[g], key=lambda r: counts[r][g])  # the longest history of this group
            cadence[g] = _cadence(ops[best], g)
        return cadence[g]

    family = _families(members, cadence_of)
    groups_of: dict[Family, dict[int, str]] = {}  # family -> rank -> its group in it
    for g in sorted(members, key=_name_key):
        for rank in members[g]:
            groups_of.setdefault(family[g], {}).setdefault(rank, g)
    regular = {family[g] for g in members if cadence_of(g)[2]}
    covering = sorted((f for f in groups_of if len(groups_of[f]) >= 0.9 * len(ops)),
                      key=lambda f: (f not in regular, -f[0], f[1], f[2]))
    if covering:
        cut = _cut_by_time(ops, cadence_of, family) if _times_usable(ops.values()) else None
        if cut is None or cut[0] not in covering:
            candidates = [f for f in covering if f in regular] or covering[:1]
            cut = _cut_by_spread(ops, groups_of, candidates, cadence_of)
        chosen, residue = cut
        return {rank: Mark(g, chosen[1], residue) for rank, g in groups_of[chosen].items()}
    return _disjoint_marks(ops, members, counts, cadence_of)


def _families(members: Mapping[str, list[int]], cadence_of: Callable[[str], tuple[int, int, bool]],
              ) -> dict[str, Family]:
    """Each group's family: groups of one size and cadence, split into sets of disjoint groups (TP
    pairs and DP pairs of a 2 × 2 job are two families), in creation order."""
    out: dict[str, Family] = {}
    taken: dict[tuple[int, int], list[set[int]]] = {}  # (size, cadence) -> ranks covered by each family
    for g in sorted(members, key=_name_key):
        kind = (len(members[g]), cadence_of(g)[0])
        sets = taken.setdefault(kind, [])
        ranks = set(members[g])
        i = next((i for i, covered in enumerate(sets) if not covered & ranks), len(sets))
        if i == len(sets):
            sets.append(set())
        sets[i] |= ranks
        out[g] = (*kind, i)
    return out


def _cut_by_time(ops: Mapping[int, _Ops], cadence_of: Callable[[str], tuple[int, int, bool]],
                 family: Mapping[str, Family]) -> tuple[Family, int] | None:
    """(family, residue) of the majority of the ranks' step ends found from start times."""
    ends = Counter((family[g], r) for rank in sorted(ops)
                   if (end := _step_end(ops[rank], cadence_of)) is not None for g, r in [end])
    return ends.most_common(1)[0][0] if ends else None


def _cut_by_spread(ops: Mapping[int, _Ops], groups_of: Mapping[Family, Mapping[int, str]],
                   families: Sequence[Family], cadence_of: Callable[[str], tuple[int, int, bool]],
                   ) -> tuple[Family, int]:
    """Of the families' cuts, the one whose steps' waits differ least between ranks (mean over steps
    of the interquartile range): cut where the ranks compute, a rank waits in a step for everything
    computed before it; cut between two groups, part of the job waits for one slow step in one step
    and the rest in the next. Ties keep the order given (larger groups first)."""
    best: tuple[float, int, tuple[Family, int]] | None = None
    for order, f in enumerate(families):
        some = next(iter(groups_of[f].values()))
        residues = range(f[1]) if f[1] <= _MAX_CUTS else sorted({0, f[1] - 1, cadence_of(some)[1]})
        for residue in residues:
            got = _matrix(ops, {r: Mark(g, f[1], residue) for r, g in groups_of[f].items()})
            if got is None:
                continue
            waits = got[2]
            waits = waits[np.isfinite(waits).sum(axis=1) >= 2]
            if not len(waits):
                continue
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                q1, q3 = np.nanpercentile(waits, [25, 75], axis=1)
            score = float(np.mean(q3 - q1))
            if best is None or (score, order) < best[:2]:
                best = (score, order, (f, residue))
    return best[2] if best is not None else (families[0], 0)


def _disjoint_marks(ops: Mapping[int, _Ops], members: Mapping[str, list[int]], counts: Mapping[int, Counter[str]],
                    cadence_of: Callable[[str], tuple[int, int, bool]]) -> dict[int, Mark]:
    def key(g: str) -> tuple[bool, int, int, tuple[int, int, str]]:
        per_step, _, regular = cadence_of(g)
        return not regular, -len(members[g]), per_step, _name_key(g)

    marks: dict[int, Mark] = {}
    for disjoint in (True, False):  # then a rank every one of whose groups overlaps a used one
        for rank in sorted(ops):
            if rank in marks:
                continue
            for g in sorted(counts[rank], key=key):
                if disjoint and any(m in marks for m in members[g]):
                    continue
                per_step, residue, _ = cadence_of(g)
                for m in members[g] if disjoint else [rank]:
                    marks[m] = Mark(g, per_step, residue)
                break
    return marks


def _times_usable(ranks: Iterable[_Ops]) -> bool:
    """Start times can place compute when most collectives have one and they increase from one
    collective to the next (a clock ticking in coarse quanta, like the watchdog's, does not)."""
    pairs = flat = 0
    for ops in ranks:
        t = ops.starts
        known = np.isfinite(t[1:]) & np.isfinite(t[:-1]) & (ops.seqs[1:] != ops.seqs[:-1])
        pairs += int(known.sum())
        flat += int((t[1:][known] <= t[:-1][known]).sum())
    return pairs > 0 and flat <= 0.1 * pairs


def _step_end(ops: _Ops, cadence_of: Callable[[str], tuple[int, int, bool]]) -> tuple[str, int] | None:
    """(group, residue) of the collective that ends the rank's step: the one followed by the most
    time outside collectives (the step's compute; median over the steps, the first ones of a job
    wait for NCCL's setup). None when the rank never leaves time between its collectives."""
    n = len(ops.names)
    if n < 4:
        return None
    index: dict[str, int] = {}
    codes = np.fromiter((index.setdefault(g, len(index)) for g in ops.names), np.int64, n)
    groups = list(index)
    per_step = np.array([cadence_of(g)[0] for g in groups], np.int64)[codes]
    residue = ops.seqs % per_step
    # of entries repeating one collective (a coalesced block), only the last is followed by the next
    last = (codes[1:] != codes[:-1]) | (ops.seqs[1:] != ops.seqs[:-1])
    after = np.maximum(ops.starts[1:] - ops.starts[:-1] - ops.secs[:-1] * 1e9, 0.0)
    use = last & np.isfinite(after)
    if not use.any():
        return None
    width = int(per_step.max())
    key = (codes[:-1] * width + residue[:-1])[use]
    score = after[use]
    order = np.lexsort((score, key))
    keys, first, seen = np.unique(key[order], return_index=True, return_counts=True)
    ranked = score[order]
    median = (ranked[first + (seen - 1) // 2] + ranked[first + seen // 2]) / 2
    median[seen < 2] = -1.0
    best = int(np.argmax(median))
    if median[best] <= 0:
        return None
    return groups[int(keys[best]) // width], int(keys[best]) % width


def _name_key(name: str) -> tuple[int, int, str]:
    # torch names groups "0", "1", … in creation order; the groups of one family are created together
    return (0, int(name), "") if name.isdigit() and len(name) < 19 else (1, 0, name)


def _cadence(ops: _Ops, group: str) -> tuple[int, int, bool]:
    """(collectives of ``group`` per step, the residue mod that of the sequence id that ends a step,
    whether a pattern was found), from one member's history: the step is the smallest repeating
    pattern of the gaps between the group's collectives — counted in the rank's collectives, or,
    where the group's collectives come back to back, in the time the rank spent outside collectives
    between them (two gradient buckets with no compute between them, then a step of compute) — and
    the one followed by the longest gap ends it."""
    pos = _positions(ops, group)
    if len(pos) < 3:
        return 1, 0, False
    gaps = np.diff(pos).astype(np.float64)
    per_step = _repeating(gaps)
    if not per_step:
        return 1, 0, False
    if per_step == 1 and np.median(gaps) == 1:
        # enqueued before the previous one ended (the host ran ahead): no idle time at all
        idle = np.maximum(ops.starts[pos[1:]] - ops.starts[pos[:-1]] - ops.secs[pos[:-1]] * 1e9, 0.0)
        if np.isfinite(idle).all():
            gaps = idle
            per_step = _levels(idle)
    if per_step == 1:
        return 1, 0, True
    phase = ops.seqs[pos[:-1]] % per_step
    counts = np.bincount(phase, minlength=per_step)
    sums = np.bincount(phase, weights=gaps, minlength=per_step)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), -np.inf)
    return per_step, int(np.argmax(means)), True


def _positions(ops: _Ops, group: str) -> np.ndarray:
    """Indices of the group's collectives; of entries repeating one sequence id (a coalesced block
    and its end marker), the last."""
    pos = np.fromiter((i for i, g in enumerate(ops.names) if g == group), np.int64)
    if len(pos) > 1:
        seqs = ops.seqs[pos]
        pos = pos[np.append(seqs[1:] != seqs[:-1], True)]
    return pos


def _repeating(gaps: np.ndarray) -> int:
    """The smallest period of a pattern that repeats in ``gaps`` (0 when none does)."""
    for c in range(1, min(MAX_PER_STEP, len(gaps) // 2) + 1):
        if (gaps[c:] == gaps[:-c]).mean() >= _PATTERN_SHARE:
            return c
    return 0


def _levels(gaps: np.ndarray) -> int:
    """The smallest period whose phases explain the gaps (short, long, short, long: 2), where the
    shortest phase is less than half the longest; 1 when none does."""
    total = float(((gaps - gaps.mean()) ** 2).sum())
    if not total > 0:
        return 1
    for c in range(2, min(MAX_PER_STEP, len(gaps) // 3) + 1):
        phase = np.arange(len(gaps)) % c
        means = np.bincount(phase, weights=gaps, minlength=c) / np.bincount(phase, minlength=c)
        within = float(((gaps - means[phase]) ** 2).sum())
        if within <= (1 - _PATTERN_SHARE) * total and means.min() < 0.5 * means.max():
            return c
    return 1


# ------------------------------------------------------------------------------------------ steps


def _rank_steps(ops: _Ops, mark: Mark) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(step ids, waits, start times of the marks) of one rank: the wait of a step is the sum of the
    durations since the previous step's mark, or over the cycle's length of collectives before the
    first mark (when the dump holds them all: the ring buffer may have dropped the start)."""
    pos = _positions(ops, mark.group)
    pos = pos[ops.seqs[pos] % mark.per_step == mark.residue]
    if not len(pos):
        return None
    ids = (ops.seqs[pos] - mark.residue) // mark.per_step
    rising = ids > np.maximum.accumulate(np.concatenate(([ids[0] - 1], ids[:-1])))
    pos, ids = pos[rising], ids[rising]  # a sequence id seen again out of order is not a new step
    cum = np.concatenate(([0.0], np.cumsum(ops.secs)))
    follows = np.concatenate(([False], np.diff(ids) == 1))
    span = int(np.median(np.diff(pos)[follows[1:]])) if follows.any() else 0
    waits = np.full(len(pos), np.nan)
    prev = np.concatenate(([0], pos[:-1]))
    waits[follows] = cum[pos[follows] + 1] - cum[prev[follows] + 1]
    whole = ~follows & (span > 0) & (pos + 1 >= span)  # a cycle's worth of collectives before it
    waits[whole] = cum[pos[whole] + 1] - cum[pos[whole] + 1 - span]
    keep = np.isfinite(waits)
    if not keep.any():
        return None
    return ids[keep], waits[keep], ops.starts[pos[keep]]


def _periods(step_ids: np.ndarray, starts: np.ndarray, waits: np.ndarray) -> np.ndarray | None:
    """Per step, the median over ranks of the time since their previous step's mark (ns → s); None
    when the times cannot be steps: too few, not increasing (a clock that ticks in coarse quanta,
    such as the watchdog's discovery time), or shorter than the waits inside them. A step without
    its own (the first one kept) gets the typical step."""
    follows = np.diff(step_ids) == 1
    if not follows.any():
        return None
    gaps = (starts[1:] - starts[:-1])[follows]
    known = np.isfinite(gaps)
    total = int(known.sum())
    if not total or int((gaps[known] <= 0).sum()) > 0.1 * total:
        return None
    gaps = np.where(gaps > 0, gaps, np.nan) / 1e9
    out = np.full(len(step_ids), np.nan)
    have = np.isfinite(gaps).any(axis=1)
    rows = np.flatnonzero(follows)[have] + 1
    out[rows] = np.nanmedian(gaps[have], axis=1)
    measured = np.isfinite(out)
    if measured.mean() < 0.5:
        return None
    with np.errstate(invalid="ignore"):
        longest_wait = np.nanmax(np.where(np.isfinite(waits), waits, -np.inf), axis=1)
    if (out[measured] < longest_wait[measured]).mean() > 0.1:
        return None
    typical = statistics.median(out[measured].tolist())
    return np.where(measured, out, typical)
