"""Argument checks on one process group's collective calls: do the ranks agree, and does each
rank's own record make sense? (pure: group view in, at most one mismatch out)

The first disagreement in a group is the finding; later sequence ids are not compared (alignment
after a mismatch is unreliable — that is where torchfrtrace gets noisy), only counted. The culprit
is decided by majority; on a tie by history (the side that repeats what the group ran before); else
both sides are named and the finding says it could not decide — never by whichever file came first.

Three shapes beyond "ranks passed different arguments":

* inside a coalesced group every op is compared, not only the group's end marker;
* all_to_all: sizes may differ per rank, but the group's inputs must add up to its outputs; the
  ranks whose own inputs and outputs do not balance (when the others' do) are the culprits;
* one rank's own record cannot be right (all_gather output ≠ input × group size, all_reduce
  input ≠ output): that rank is the culprit when the other ranks' records are consistent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuhealth.flightrec.calls import (
    ALL_TO_ALL_OPS,
    SAME_SHAPE_OPS,
    SURE_OPS,
    Call,
    CallSignature,
    Signature,
    numel,
    self_inconsistency,
)
from gpuhealth.flightrec.groups import GroupView


@dataclass(frozen=True, slots=True)
class Mismatch:
    group: str
    seq: int
    kind: str  # "type" | "size" | "dtype"
    shape: str  # "collective" | "coalesced" | "all_to_all" | "self" | "p2p"
    culprits: tuple[int, ...]
    expected: Signature | None
    by_rank: Mapping[int, Signature]  # the differing op of each rank (inside a coalesced group: that op)
    decided_by: str  # "majority" | "history" | "own_record" | "undecided"
    completed: bool  # the collective finished anyway (silently wrong results) vs stuck
    later_suppressed: int = 0  # later mismatching sequence ids in this group, not reported
    detail: str = ""  # the shape-specific explanation (coalesced position, totals, the record's fault)
    op_index: int | None = None  # position of the differing op inside a coalesced group
    created_ns: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


def find_mismatch(view: GroupView) -> Mismatch | None:
    """The first sequence id of ``view`` where ranks disagree (or one rank's record is impossible)."""
    ranks = [r for r in view.dumped if view.calls.get(r)]
    if len(ranks) < 2:
        return None
    seqs = sorted({s for r in ranks for s in view.calls[r]})
    seen: Counter[CallSignature] = Counter()
    previous: dict[str, dict[int, tuple[int, int]]] = {}  # op -> rank -> (in, out) at its last all_to_all
    first: Mismatch | None = None
    later = 0
    for seq in seqs:
        calls = {r: c for r in ranks if (c := view.calls[r].get(seq)) is not None}
        if len(calls) < 2:
            seen.update(c.signature() for c in calls.values())
            continue
        sigs = {r: c.signature() for r, c in calls.items()}
        counts = Counter(sigs.values())
        found = (_disagreement(view, seq, calls, sigs, counts, seen) if len(counts) > 1
                 else _all_to_all(view, seq, calls, previous) or _own_record(view, seq, calls))
        _remember_all_to_all(calls, previous)
        if found is None:
            seen.update(counts.elements())
            continue
        if first is not None:
            later += 1
            continue
        first = found
    if first is None:
        return None
    return Mismatch(first.group, first.seq, first.kind, first.shape, first.culprits, first.expected, first.by_rank,
                    first.decided_by, first.completed, later, first.detail, first.op_index, first.created_ns,
                    first.extra)


def _completed(view: GroupView, seq: int, ranks: list[int] | tuple[int, ...] | Mapping[int, Call]) -> bool:
    return all(view.completed.get(r, 0) >= seq for r in ranks)


def _created(calls: Mapping[int, Call]) -> int | None:
    times = [c.created_ns for c in calls.values() if c.created_ns]
    return min(times) if times else None


def _disagreement(view: GroupView, seq: int, calls: Mapping[int, Call], sigs: Mapping[int, CallSignature],
                  counts: Counter[CallSignature], seen: Counter[CallSignature]) -> Mismatch:
    expected, decided_by = _vote(counts, seen)
    same_ops = len({tuple(s.op for s in sig) for sig in sigs.values()}) == 1
    if expected is None and same_ops:
        # A size tie history cannot break: a side whose own records cannot be right is the wrong one.
        faulty = {r for r, c in calls.items() if any(self_inconsistency(e, len(view.members)) for e in c.ops)}
        if faulty and len(faulty) < len(calls) and len({sigs[r] for r in calls if r not in faulty}) == 1:
            expected = sigs[next(r for r in sorted(calls) if r not in faulty)]
            decided_by = "own_record"
    if expected is None:
        culprits = tuple(sorted(sigs))
        expected = counts.most_common(1)[0][0]
    else:
        culprits = tuple(sorted(r for r, s in sigs.items() if s != expected))
    odd = next((sigs[r] for r in culprits if sigs[r] != expected),
               next((s for s in counts if s != expected), expected))
    index = next((i for i, (a, b) in enumerate(zip(expected, odd, strict=False)) if a != b),
                 min(len(expected), len(odd)))
    coalesced = any(c.coalesced for c in calls.values())
    exp_op = expected[index] if index < len(expected) else None
    odd_op = odd[index] if index < len(odd) else None
    by_rank = {r: (s[index] if index < len(s) else _absent(s)) for r, s in sigs.items()}
    # One side has an op the other side does not: a type mismatch.
    kind = "type" if exp_op is None or odd_op is None else _kind(exp_op, odd_op)
    detail = ""
    if coalesced:
        sizes = Counter(len(s) for s in sigs.values())
        detail = (f"op {index + 1} of the coalesced group (ops sharing sequence id #{seq})"
                  if len(sizes) == 1 else
                  f"the coalesced group at #{seq} holds {'/'.join(str(n) for n in sorted(sizes))} ops on "
                  "different ranks")
    return Mismatch(view.name, seq, kind, "coalesced" if coalesced else "collective", culprits,
                    exp_op or _absent(expected), by_rank, decided_by, _completed(view, seq, calls), 0, detail,
                    index if coalesced else None, _created(calls))


def _absent(sig: CallSignature) -> Signature:
    return Signature("(nothing)", (), (), (), ())


def _vote(counts: Counter[CallSignature], seen: Counter[CallSignature]) -> tuple[CallSignature | None, str]:
    ranked = counts.most_common()
    if len(ranked) == 1 or ranked[0][1] > ranked[1][1]:
        return ranked[0][0], "majority"
    # A tie (two ranks, or 2 vs 2): the side that repeats what this group ran before is the
    # expected one; a signature never seen before is the odd one out.
    top = [s for s, c in ranked if c == ranked[0][1]]
    familiar = [s for s in top if seen[s] > 0]
    if len(familiar) == 1:
        return familiar[0], "history"
    # Else the side whose tensors have the shapes and dtypes this group has always moved (a broadcast of
    # the gradient's shape on one rank, of twice that on the other: the first time this op runs at all).
    shapes = {(op.in_sizes, op.in_dtypes) for sig in seen for op in sig} | \
        {(op.out_sizes, op.out_dtypes) for sig in seen for op in sig}
    known = [s for s in top if all((op.in_sizes, op.in_dtypes) in shapes for op in s)]
    if len(known) == 1 and not familiar:
        return known[0], "history"
    return None, "undecided"


def _kind(expected: Signature, odd: Signature) -> str:
    if expected.op != odd.op:
        return "type"
    if expected.in_dtypes != odd.in_dtypes or expected.out_dtypes != odd.out_dtypes:
        return "dtype"
    return "size"


def _all_to_all(view: GroupView, seq: int, calls: Mapping[int, Call],
                previous: Mapping[str, Mapping[int, tuple[int, int]]]) -> Mismatch | None:
    """An all_to_all whose inputs and outputs do not add up across the whole group."""
    if len(calls) != len(view.members) or not all(len(c.ops) == 1 and c.ops[0].op in ALL_TO_ALL_OPS
                                                  for c in calls.values()):
        return None
    totals = {r: (numel(c.ops[0].in_sizes), numel(c.ops[0].out_sizes)) for r, c in calls.items()}
    if any(not c.ops[0].in_sizes or not c.ops[0].out_sizes for c in calls.values()):
        return None
    total_in = sum(i for i, _ in totals.values())
    total_out = sum(o for _, o in totals.values())
    if total_in == total_out:
        return None
    unbalanced = sorted(r for r, (i, o) in totals.items() if i != o)
    op = next(iter(calls.values())).ops[0].op
    before = previous.get(op, {})
    changed = sorted(r for r in totals if r in before and before[r] != totals[r])
    if unbalanced and len(unbalanced) * 2 < len(totals):
        culprits, decided_by = tuple(unbalanced), "majority"
    elif 0 < len(changed) < len(totals) and len(before) == len(totals):
        culprits, decided_by = tuple(changed), "history"
    else:
        culprits, decided_by = tuple(unbalanced or sorted(totals)), "undecided"
    by_rank = {r: Signature.of(c.ops[0]) for r, c in calls.items()}
    detail = (f"the group sends {total_in} element(s) in all but receives {total_out}: "
              + ", ".join(f"rank {r} {i} in / {o} out" for r, (i, o) in sorted(totals.items()) if r in culprits))
    ref = next((r for r in sorted(totals) if r not in culprits), None)
    expected = by_rank[ref] if ref is not None else None
    return Mismatch(view.name, seq, "size", "all_to_all", culprits, expected, by_rank, decided_by,
                    _completed(view, seq, calls), 0, detail, None, _created(calls),
                    {"totals": {str(r): {"in": i, "out": o} for r, (i, o) in sorted(totals.items())}})


def _remember_all_to_all(calls: Mapping[int, Call], previous: dict[str, dict[int, tuple[int, int]]]) -> None:
    for r, c in calls.items():
        if len(c.ops) == 1 and c.ops[0].op in ALL_TO_ALL_OPS:
            e = c.ops[0]
            previous.setdefault(e.op, {})[r] = (numel(e.in_sizes), numel(e.out_sizes))


# Where a group's members come from a record of them (not guessed from the ranks that dumped): its size,
# which an all_gather's or reduce_scatter's record is checked against, is known.
_SIZE_KNOWN = frozenset({"job", "pg_config"})


def _own_record(view: GroupView, seq: int, calls: Mapping[int, Call]) -> Mismatch | None:
    """Ranks whose own record of this call cannot be right: when most ranks' records are consistent, or —
    for an op whose rule holds for every producer (``SURE_OPS``), in a group of known size (or an op that
    keeps its shape) — however many ranks recorded it so: an all_gather of [8] into [24] over two ranks
    is wrong on every rank that asked for it, and the collective can never complete."""
    size = len(view.members)
    faults: dict[int, str] = {}
    sure: set[int] = set()
    for r, c in calls.items():
        for e in c.ops:
            why = self_inconsistency(e, size)
            if why is not None:
                faults[r] = why
                if e.op in SURE_OPS and (e.op in SAME_SHAPE_OPS or view.membership_source in _SIZE_KNOWN):
                    sure.add(r)
                break
    if not faults or (len(faults) * 2 >= len(calls) and sure != set(faults)):
        return None  # all (or half) inconsistent on an op we may not model: more likely ours than a bug
    culprits = tuple(sorted(faults))
    by_rank = {r: Signature.of(c.head) for r, c in calls.items()}
    ref = next((r for r in sorted(calls) if r not in faults), culprits[0])
    why = faults[culprits[0]]
    kind = "dtype" if "reads" in why and "writes" in why else "size"
    return Mismatch(view.name, seq, kind, "self", culprits, by_rank[ref], by_rank, "own_record",
                    _completed(view, seq, calls), 0, why, None, _created(calls),
                    {"record_faults": {str(r): w for r, w in sorted(faults.items())}})
