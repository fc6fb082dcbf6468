"""What one rank called: collective calls (one op, or a coalesced group sharing a sequence id) and
point-to-point ops, with the per-op rules for what must agree across ranks.

Rules by op family (what PyTorch records, checked on torch 2.13 Gloo and 2.11 NCCL dumps):

* gather: only the root records outputs; the other ranks record ``output_sizes: []``;
* scatter: only the root records inputs;
* all_to_all (``all_to_all_single`` with splits too): each rank's sizes may differ (uneven splits);
  what must hold is conservation — the group's inputs add up to its outputs;
* all_gather / _all_gather_base: outputs = inputs × group size; reduce_scatter: inputs = outputs ×
  group size; all_reduce / broadcast / reduce: outputs = inputs (PyTorch's analyser checks the same);
* coalesced groups (``_coalescing_manager``, ``all_reduce_coalesced``, NCCL's ``coalesced`` end
  marker): every op inside the group must agree, not only the end marker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from gpuhealth.flightrec.load import Entry

GATHER_OPS = frozenset({"gather"})
SCATTER_OPS = frozenset({"scatter"})
ALL_TO_ALL_OPS = frozenset({"all_to_all", "alltoall", "alltoall_base", "all_to_all_single", "all_to_all_v_single"})
# Sizes differ across ranks by design and carry no conservation rule we can check.
UNEVEN_OPS = frozenset({"_allgather_base_uneven", "reduce_scatter_v", "all_gather_v"})
ALL_GATHER_OPS = frozenset({"all_gather", "_all_gather_base", "all_gather_into_tensor", "all_gather_single",
                            "all_gather_into_tensor_coalesced", "allgather", "allgather_base"})
REDUCE_SCATTER_OPS = frozenset({"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor",
                                "reduce_scatter_single", "reduce_scatter_tensor_coalesced"})
SAME_SHAPE_OPS = frozenset({"all_reduce", "allreduce", "allreduce_coalesced", "broadcast", "_broadcast_oop",
                            "reduce", "_reduce_oop", "all_reduce_barrier"})
# End markers of a coalescing group (NCCL records each op inside the group, then one of these).
COALESCED_MARKERS = frozenset({"coalesced", "ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced",
                               "ALLREDUCE_coalesced", "allgather_coalesced", "reduce_scatter_coalesced"})


class Signature(NamedTuple):
    """What must agree across ranks for one op (a tuple: hashing is the hot path)."""

    op: str
    in_sizes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[str, ...]
    out_sizes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[str, ...]

    @classmethod
    def of(cls, e: Entry) -> Signature:
        op = e.op
        if op in ALL_TO_ALL_OPS or op in UNEVEN_OPS:
            return cls(op, (), _nonempty(e.in_dtypes), (), _nonempty(e.out_dtypes))
        if op in GATHER_OPS or op in SCATTER_OPS:
            sizes, dtypes = per_rank_side(e)
            return cls(op, sizes, dtypes, (), ())
        return cls(op, e.in_sizes, e.in_dtypes, e.out_sizes, e.out_dtypes)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "input_sizes": [list(s) for s in self.in_sizes], "input_dtypes": list(self.in_dtypes),
                "output_sizes": [list(s) for s in self.out_sizes], "output_dtypes": list(self.out_dtypes)}


def _absent(sizes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...]) -> bool:
    """A buffer the rank did not pass: recorded as nothing (Gloo), an undefined tensor (NCCL: [0],
    UNKNOWN_SCALAR), or a list of shapeless tensors with no dtype (``[[]]`` and ``""``, as PyTorch's own
    analyser tests write a gather's non-root output: a real scalar carries a dtype)."""
    return (not sizes or all(math.prod(s) == 0 for s in sizes)
            or bool(dtypes and all(d == "UNKNOWN_SCALAR" for d in dtypes))
            or (not dtypes and all(not s for s in sizes)))


def per_rank_side(e: Entry) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """Of a gather/scatter, the buffer every rank passes (its own chunk), not the root's list of all chunks.
    Backends record them differently (Gloo: the root's list as one stacked tensor, the others nothing; NCCL:
    the root's list as N tensors, the others an undefined one; inputs and outputs swapped between the two for
    scatter), so: the side that is present, and on the root the smaller of the two."""
    has_in, has_out = not _absent(e.in_sizes, e.in_dtypes), not _absent(e.out_sizes, e.out_dtypes)
    use_in = numel(e.in_sizes) <= numel(e.out_sizes) if has_in and has_out else has_in
    if not (has_in or has_out):
        return (), ()
    return (e.in_sizes, e.in_dtypes) if use_in else (e.out_sizes, e.out_dtypes)


def _nonempty(dtypes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(set(dtypes)))


CallSignature = tuple[Signature, ...]


@dataclass(slots=True)
class Call:
    """One collective call of one rank: a single op, or the ops of one coalesced group (they share a
    collective sequence id), with the group's end marker when it was recorded."""

    seq: int
    ops: tuple[Entry, ...]
    marker: Entry | None = None

    @property
    def head(self) -> Entry:
        """The entry that stands for the call (call site, creation time, timeout)."""
        return self.ops[0] if self.ops else self.marker  # type: ignore[return-value]

    @property
    def last(self) -> Entry:
        return self.marker or self.ops[-1]

    @property
    def record_id(self) -> int:
        return self.head.record_id

    @property
    def created_ns(self) -> int | None:
        return self.head.created_ns

    @property
    def done(self) -> bool:
        e = self.last
        return e.retired or e.state == "completed"

    @property
    def state(self) -> str:
        states = {e.state for e in (*self.ops, *((self.marker,) if self.marker else ()))}
        for s in ("started", "completed"):
            if s in states:
                return "completed" if self.done else s
        return "completed" if self.done else "scheduled"

    @property
    def coalesced(self) -> bool:
        return self.marker is not None or len(self.ops) > 1

    @property
    def name(self) -> str:
        if not self.ops:
            return self.marker.profiling_name if self.marker else "?"
        if len(self.ops) == 1 and self.marker is None:
            return self.ops[0].profiling_name
        inner = sorted({e.op for e in self.ops})
        backend = self.head.backend
        return f"{backend + ':' if backend else ''}coalesced[{len(self.ops)}× {'/'.join(inner)}]"

    def signature(self) -> CallSignature:
        if self.ops:
            return tuple(Signature.of(e) for e in self.ops)
        return (Signature.of(self.marker),) if self.marker else ()

    def frames_entry(self) -> Entry | None:
        return next((e for e in self.ops if e.frames), self.marker if self.marker and self.marker.frames else None)


def build_calls(entries: Sequence[Entry]) -> dict[int, Call]:
    """Collective calls of one rank in one group by sequence id (entries in record order, p2p excluded)."""
    by_seq: dict[int, list[Entry]] = {}
    for e in entries:
        by_seq.setdefault(e.seq, []).append(e)
    calls: dict[int, Call] = {}
    for seq, items in by_seq.items():
        if len(items) == 1:
            e = items[0]
            calls[seq] = Call(seq, (), e) if e.op in COALESCED_MARKERS else Call(seq, (e,))
            continue
        ops = tuple(e for e in items if e.op not in COALESCED_MARKERS)
        markers = [e for e in items if e.op in COALESCED_MARKERS]
        calls[seq] = Call(seq, ops, markers[-1] if markers else None)
    return calls


def numel(sizes: tuple[tuple[int, ...], ...]) -> int:
    return sum(math.prod(s) for s in sizes)


# Ops whose relation between input and output holds for every producer we know of — PyTorch's process groups
# and c10d's FlightRecorderHook (list-form all_gather/reduce_scatter: one buffer per rank; flattened: one of
# world × the chunk): a record that breaks it is wrong even when every rank recorded it so. The ``*_single``
# spellings are left out: producers record them with input and output alike (PyTorch's analyser tests).
SURE_OPS = (SAME_SHAPE_OPS - {"reduce"}) | (ALL_GATHER_OPS - {"all_gather_single"}) | \
    (REDUCE_SCATTER_OPS - {"reduce_scatter_single"})


def self_inconsistency(e: Entry, group_size: int) -> str | None:
    """Why one rank's own record of an op cannot be right (its buffers cannot fit the op), or None.
    Only ops with a fixed relation between input and output sizes are checked."""
    if not e.in_sizes or not e.out_sizes or any(x < 0 for s in (*e.in_sizes, *e.out_sizes) for x in s):
        return None
    n_in, n_out = numel(e.in_sizes), numel(e.out_sizes)
    if e.op in SAME_SHAPE_OPS and e.op != "reduce":
        if e.in_sizes != e.out_sizes:
            return (f"its {e.op} has inputs {[list(s) for s in e.in_sizes]} but outputs "
                    f"{[list(s) for s in e.out_sizes]} (they must be the same)")
    elif e.op in ALL_GATHER_OPS and group_size > 0:
        if n_out != n_in * group_size:
            return (f"its {e.op} gathers {n_in} element(s) from each of {group_size} ranks into an output of "
                    f"{n_out} (expected {n_in * group_size})")
    elif e.op in REDUCE_SCATTER_OPS and group_size > 0 and n_in != n_out * group_size:
        return (f"its {e.op} scatters an input of {n_in} element(s) over {group_size} ranks into an output of "
                f"{n_out} (expected {n_in // group_size if n_in % group_size == 0 else n_in / group_size:g})")
    if e.op in SAME_SHAPE_OPS | ALL_GATHER_OPS | REDUCE_SCATTER_OPS and e.in_dtypes and e.out_dtypes \
            and set(e.in_dtypes) != set(e.out_dtypes):
        return f"its {e.op} reads {list(e.in_dtypes)} but writes {list(e.out_dtypes)}"
    return None
