"""Point-to-point matching: which pending send/recv waits for which peer, and with what arguments.

Sends and receives between one ordered pair of ranks run in order (NCCL and Gloo both keep per-pair
order), and ops that completed were matched by the library. So the pending sends of ``src→dst`` line up,
in order, with the pending receives of ``dst←src`` (a receive from any source, ``recv 1<-?``, takes
the oldest pending send to it from any peer). Each pending op ends up:

* matched, same arguments: both sides posted; it waits for whatever holds either side;
* matched, different sizes or dtypes: a p2p mismatch (the send's tensor is not what the receiver
  expects) — the culprit is the side that differs from what this pair exchanged before;
* unmatched: the peer never posted its side — the peer is who this rank waits for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from gpuhealth.flightrec.calls import Signature
from gpuhealth.flightrec.groups import GroupView, P2POp


@dataclass(frozen=True, slots=True)
class P2PPair:
    """A pending op and what it is matched with (``partner`` None: the peer has not posted it)."""

    group: str
    op: P2POp
    partner: P2POp | None


@dataclass(frozen=True, slots=True)
class P2PMismatch:
    group: str
    send: P2POp
    recv: P2POp
    kind: str  # "size" | "dtype"
    culprits: tuple[int, ...]
    decided_by: str  # "history" | "undecided"


def pending_pairs(view: GroupView) -> list[P2PPair]:
    """Every pending send/recv of the group with its partner (or None). The partner may have completed:
    NCCL finishes a small send without waiting for the receiver, whose mismatched buffer then hangs alone."""
    sends: dict[tuple[int, int], list[P2POp]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[P2POp]] = defaultdict(list)
    any_source: dict[int, list[P2POp]] = defaultdict(list)
    for ops in view.p2p.values():
        for op in ops:
            if op.kind == "send" and op.peer is not None:
                sends[(op.rank, op.peer)].append(op)
            elif op.kind == "recv" and op.peer is not None:
                recvs[(op.peer, op.rank)].append(op)
            elif op.kind == "recv" and not op.done:
                any_source[op.rank].append(op)
    partner: dict[int, P2POp] = {}
    for key, ss in sends.items():
        rs = recvs.get(key, [])
        src, dst = key
        if view.whole_history.get(src) and view.whole_history.get(dst):
            pairs = list(zip(ss, rs, strict=False))  # both hold every op since the start: the k-th meets the k-th
        else:
            # Older ops fell out of a ring buffer: completed ops were matched by the library, so the
            # pending ones line up with each other.
            pairs = list(zip([s for s in ss if not s.done], [r for r in rs if not r.done], strict=False))
        for s, r in pairs:
            partner[id(s)], partner[id(r)] = r, s
    # Receives from any source take the oldest unclaimed pending send to their rank, from any peer.
    for rank, rs in any_source.items():
        free = sorted((s for (src, dst), ss in sends.items() if dst == rank for s in ss
                       if id(s) not in partner and not s.done), key=lambda s: s.entry.created_ns or 0)
        for s, r in zip(free, rs, strict=False):
            partner[id(s)], partner[id(r)] = r, s
    out = []
    for ops in view.p2p.values():
        for op in ops:
            if not op.done:
                out.append(P2PPair(view.name, op, partner.get(id(op))))
    return out


def _sig(op: P2POp, side: str) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    e = op.entry
    # A send's tensor is its input; a recv's is its output (older dumps put it in the input too).
    if side == "send":
        return e.in_sizes or e.out_sizes, e.in_dtypes or e.out_dtypes
    return e.out_sizes or e.in_sizes, e.out_dtypes or e.in_dtypes


def find_p2p_mismatches(view: GroupView, pairs: list[P2PPair]) -> list[P2PMismatch]:
    """Matched pending pairs whose tensors differ. The culprit is the side that departs from what the
    same pair (else the same kind of op in this group) exchanged before; else both are named."""
    out = []
    history = _history(view)
    seen: set[int] = set()
    for p in pairs:
        if p.partner is None:
            continue
        send, recv = (p.op, p.partner) if p.op.kind == "send" else (p.partner, p.op)
        if id(send) in seen:
            continue
        seen.add(id(send))
        s_sizes, s_dtypes = _sig(send, "send")
        r_sizes, r_dtypes = _sig(recv, "recv")
        if not s_sizes or not r_sizes or (s_sizes == r_sizes and (s_dtypes == r_dtypes or not r_dtypes)):
            continue
        kind = "size" if s_sizes != r_sizes else "dtype"
        usual = history.get((send.rank, recv.rank)) or history.get((-1, -1))
        culprits: tuple[int, ...]
        if usual is not None and usual == (s_sizes, s_dtypes) != (r_sizes, r_dtypes):
            culprits, decided = (recv.rank,), "history"
        elif usual is not None and usual == (r_sizes, r_dtypes) != (s_sizes, s_dtypes):
            culprits, decided = (send.rank,), "history"
        else:
            culprits, decided = tuple(sorted({send.rank, recv.rank})), "undecided"
        out.append(P2PMismatch(view.name, send, recv, kind, culprits, decided))
    return out


def _history(view: GroupView) -> Mapping[tuple[int, int], tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]]:
    """The last completed exchange per (src, dst), and (-1, -1) for the group's most common one."""
    last: dict[tuple[int, int], tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]] = {}
    counts: dict[tuple[tuple[tuple[int, ...], ...], tuple[str, ...]], int] = defaultdict(int)
    for ops in view.p2p.values():
        for op in ops:
            if op.done and op.kind == "send" and op.peer is not None:
                sig = _sig(op, "send")
                last[(op.rank, op.peer)] = sig
                counts[sig] += 1
    if counts:
        last[(-1, -1)] = max(counts.items(), key=lambda kv: kv[1])[0]
    return last


def p2p_signature(op: P2POp) -> Signature:
    e = op.entry
    return Signature(e.op, e.in_sizes, e.in_dtypes, e.out_sizes, e.out_dtypes)
