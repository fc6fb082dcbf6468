"""Root causes → findings (one per culprit rank, or one job-level finding when no rank can be named),
with the evidence an operator acts on: the op (group, sequence id, sizes, dtypes), who waits, what else
is stuck because of it, where the rank was last seen, and the call site when a pickle carried frames."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from gpuhealth.flightrec.calls import Call, Signature
from gpuhealth.flightrec.checks import Mismatch
from gpuhealth.flightrec.groups import GroupView
from gpuhealth.flightrec.load import Entry, RankDump
from gpuhealth.flightrec.p2p import P2PMismatch
from gpuhealth.flightrec.report import RootCause, RootKind
from gpuhealth.flightrec.stacks import MainThread
from gpuhealth.flightrec.text import format_ranks
from gpuhealth.flightrec.unrecorded import posted_peers
from gpuhealth.model import Action, Entity, EntityKind, Finding, Severity

SOURCE = "flightrec"
MAX_STACK_FRAMES = 8

CODES = {
    RootKind.HOST_STUCK: "collective.missing_rank", RootKind.SKIPPED: "collective.missing_rank",
    RootKind.TIMED_OUT: "collective.missing_rank", RootKind.BEHIND: "collective.rank_behind",
    RootKind.P2P_UNMATCHED: "collective.p2p_unmatched", RootKind.GPU_STALL: "collective.gpu_stall",
    RootKind.CIRCULAR: "job.hang", RootKind.DUMP_MISSING: "flightrec.dump_missing",
    RootKind.DUMP_UNREADABLE: "flightrec.dump_unreadable",
}
MISMATCH_CODES = {"type": "collective.type_mismatch", "size": "collective.size_mismatch",
                  "dtype": "collective.dtype_mismatch"}


def code_of(root: RootCause) -> str:
    if root.kind is RootKind.MISMATCH:
        return MISMATCH_CODES[root.mismatch or "size"]
    return CODES[root.kind]


def stack_of(e: Entry | None) -> list[str]:
    if e is None or not e.frames:
        return []
    # Skip torch.distributed's own frames: the user's call site is what helps.
    frames = [f for f in e.frames if "/torch/distributed/" not in f.filename] or list(e.frames)
    return [str(f) for f in frames[:MAX_STACK_FRAMES]]


def _job(job: Mapping[str, Any]) -> Entity:
    return Entity(EntityKind.JOB, str(job.get("job_id") or "job"))


def op_info(view: GroupView | None, seq: int | None, ranks: Sequence[int]) -> tuple[dict[str, Any], Entry | None]:
    """Group, sequence id and the majority signature of collective ``seq`` (from ``ranks``' calls)."""
    if view is None or seq is None:
        return {}, None
    calls: list[Call] = [c for r in ranks if (c := view.call(r, seq)) is not None] or \
        [c for r in view.dumped if (c := view.call(r, seq)) is not None]
    info: dict[str, Any] = {"group": view.name, "group_desc": view.desc, "seq": seq}
    if view.pg_name != view.name:
        info["pg_name"] = view.pg_name
    if not calls:
        return info, None
    counts: dict[tuple[Signature, ...], list[Call]] = defaultdict(list)
    for c in calls:
        counts[c.signature()].append(c)
    majority = max(counts.values(), key=len)
    c = majority[0]
    e = c.head
    info.update(op=c.name, input_sizes=[list(s) for s in e.in_sizes], input_dtypes=list(e.in_dtypes),
                output_sizes=[list(s) for s in e.out_sizes], output_dtypes=list(e.out_dtypes))
    if c.coalesced:
        info["coalesced_ops"] = [s.to_dict() for s in c.signature()]
    return info, next((x.frames_entry() for x in majority if x.frames_entry() is not None), None)


def describe(info: Mapping[str, Any]) -> str:
    op = info.get("op", "collective")
    desc = f" ({info['group_desc']})" if info.get("group_desc") and info["group_desc"] not in ("undefined",) else ""
    s = f"{op} #{info.get('seq')} in group {info.get('group')}{desc}"
    if info.get("input_sizes") is not None:
        s += f", sizes {info['input_sizes']}"
    if info.get("input_dtypes"):
        s += f", dtypes {info['input_dtypes']}"
    return s


def last_seen(dump: RankDump | None) -> dict[str, Any] | None:
    if dump is None or not dump.entries:
        return None
    e = dump.entries[-1]
    return {"group": e.group, "seq": e.seq, "op": e.profiling_name, "state": e.state,
            "completed": e.retired or e.state == "completed", "stack": stack_of(e)}


def root_findings(root: RootCause, groups: Mapping[str, GroupView], dumps: Mapping[int, RankDump],
                  job: Mapping[str, Any], mismatches: Sequence[Mismatch],
                  p2p_mismatches: Sequence[P2PMismatch], mains: Mapping[int, MainThread] | None = None
                  ) -> list[Finding]:
    """The findings of one root cause (its nested consequences go into the evidence; a culprit's live
    stack, when one was captured, too)."""
    found = _root_findings(root, groups, dumps, job, mismatches, p2p_mismatches)
    out = []
    for f in found:
        rank = f.evidence.get("rank")
        main = (mains or {}).get(rank) if isinstance(rank, int) else None
        if main is not None:
            extra: dict[str, Any] = {"live_stack": main.call_site()}
            busy = main.in_communication()
            if busy:
                extra["live_stack_in"] = f"torch.distributed.{busy}"
            f = dataclasses.replace(f, evidence={**f.evidence, **extra})
        out.append(f)
    return out


def _root_findings(root: RootCause, groups: Mapping[str, GroupView], dumps: Mapping[int, RankDump],
                   job: Mapping[str, Any], mismatches: Sequence[Mismatch],
                   p2p_mismatches: Sequence[P2PMismatch]) -> list[Finding]:
    view = groups.get(root.group) if root.group else None
    base: dict[str, Any] = {"kind": root.kind.value, "why": root.why, "waiting_ranks": list(root.waiting_ranks),
                            "affected_ranks": list(root.affected_ranks), "consequences": list(root.consequences)}
    if root.decided_by:
        base["decided_by"] = root.decided_by
    if root.followed_by:
        base["followed_by"] = [r.to_dict() for r in root.followed_by]
    if root.blocks:
        base["blocks"] = [b.to_dict() for b in root.blocks]
    if root.kind in (RootKind.TIMED_OUT, RootKind.BEHIND):
        base["idle_s"], base["timeout_s"] = root.idle_s, root.timeout_s
    code = code_of(root)
    if root.kind is RootKind.MISMATCH:
        return _mismatch_findings(root, view, dumps, base, mismatches, p2p_mismatches)
    if root.op in ("send", "recv") or root.kind is RootKind.P2P_UNMATCHED:
        info: dict[str, Any] = {"group": root.group, "p2p_seq": root.seq, "op": root.op}
        call_site = None
    else:
        info, call_site = op_info(view, root.seq, root.waiting_ranks)
    stack = stack_of(call_site)
    out: list[Finding] = []
    sev = Severity.INFO if root.kind is RootKind.BEHIND else (
        Severity.WARNING if root.decided_by == "undecided" else Severity.CRITICAL)
    action = Action.MONITOR if root.kind is RootKind.BEHIND else Action.CHECK_JOB
    if root.kind is RootKind.CIRCULAR or (root.kind is RootKind.GPU_STALL and len(root.ranks) > 1):
        ev = {**info, **base, "ranks": list(root.ranks)}
        if stack:
            ev["stack"] = stack
        msg = root.why if root.kind is RootKind.CIRCULAR else (
            f"{describe(info)} was enqueued by every rank and completed by none of {format_ranks(root.ranks)}: "
            "GPU or network stall (check the GPUs and links of these ranks)")
        return [Finding(code, Severity.CRITICAL, _job(job), msg, Action.CHECK_JOB, ev, SOURCE)]
    peers = posted_peers(root, groups)
    for rank in root.ranks:
        d = dumps.get(rank)
        ev = {**info, **base, "rank": rank, "host": d.host if d else None}
        if root.kind in (RootKind.HOST_STUCK, RootKind.SKIPPED, RootKind.TIMED_OUT, RootKind.BEHIND,
                         RootKind.P2P_UNMATCHED):
            ev["last_seen"] = last_seen(d)
        if root.kind is RootKind.P2P_UNMATCHED and root.waiting_ranks:
            ev["peer"] = root.waiting_ranks[0]
        if stack:
            ev["stack"] = stack
        if root.kind in (RootKind.TIMED_OUT, RootKind.BEHIND):
            ev["ahead_ranks"] = list(root.waiting_ranks)
            ev.pop("waiting_ranks", None)
        msg = _message(root, rank, info)
        if rank in peers:  # it posted the collective: named for an unrecorded send/recv it went on without
            msg = (f"rank {rank} went on to {describe(info)} without the send/recv it ran before each earlier one "
                   f"(Gloo does not record them); rank(s) {format_ranks([r for r in root.ranks if r not in peers])}, "
                   "which never reached it, may be waiting for that op")
        out.append(Finding(code, sev, Entity.rank(rank), msg, action, ev, SOURCE))
    return out


def _message(root: RootCause, rank: int, info: Mapping[str, Any]) -> str:
    also = f" (also holds up group(s) {', '.join(root.consequences)})" if root.consequences else ""
    waiting = format_ranks(root.waiting_ranks) if root.waiting_ranks else "other ranks"
    k = root.kind
    what = describe(info) if info.get("seq") is not None else (root.what or root.op or "an op")
    blocks = root.blocks
    more = f" and {len(blocks) - 1} more op(s) other ranks wait in" if len(blocks) > 1 else ""
    if k is RootKind.HOST_STUCK:
        return f"rank {rank} never reached {what}{more}; rank(s) {waiting} wait in it{also}"
    if k is RootKind.SKIPPED:
        return f"rank {rank} skipped {what}; rank(s) {waiting} wait in it{also}"
    if k is RootKind.P2P_UNMATCHED:
        first = blocks[0].what if blocks else what
        return f"rank {rank} never posted {first}{more}; rank(s) {waiting} wait in it{also}"
    if k is RootKind.TIMED_OUT:
        return f"rank {rank} never reached {what}; rank(s) {waiting} timed out waiting for it"
    if k is RootKind.BEHIND:
        return (f"rank {rank} is behind in group {root.group}: it has not enqueued {what} that rank(s) {waiting} "
                "ran; nobody waits, so this is likely dump timing")
    if k is RootKind.GPU_STALL and root.decided_by == "started":
        return (f"rank {rank} never started its part of {what}, which every other participant posted: its GPU is "
                f"stuck{also}")
    if k is RootKind.GPU_STALL:
        return root.why + also
    if k in (RootKind.DUMP_MISSING, RootKind.DUMP_UNREADABLE):
        left = "left a dump that could not be read" if k is RootKind.DUMP_UNREADABLE else "left no dump"
        return (f"rank {rank} {left} and rank(s) {waiting} wait for it in {what}: it is the prime suspect "
                "(crashed, killed, or stuck before dumping)")
    return root.why


def _mismatch_findings(root: RootCause, view: GroupView | None, dumps: Mapping[int, RankDump], base: dict[str, Any],
                       mismatches: Sequence[Mismatch], p2p_mismatches: Sequence[P2PMismatch]) -> list[Finding]:
    code = code_of(root)
    sev = Severity.CRITICAL if root.decided_by != "undecided" else Severity.WARNING
    state = ("the op completed anyway: results are silently wrong" if root.completed
             else "the op cannot complete: the job hangs here")
    if root.op == "send/recv":
        pm = next(m for m in p2p_mismatches if m.group == root.group and m.send.entry.p2p_seq == root.seq)
        out = []
        for rank in root.ranks:
            ev = {**base, "rank": rank, "group": root.group, "p2p_seq": root.seq, "shape": "p2p",
                  "send": {"rank": pm.send.rank, **_sig(pm.send.entry)}, "recv": {"rank": pm.recv.rank,
                                                                               **_sig(pm.recv.entry)},
                  "host": dumps[rank].host if rank in dumps else None}
            out.append(Finding(code, sev, Entity.rank(rank), f"rank {rank}: {root.why}; {state}", _CHECK, ev, SOURCE))
        return out
    mm = next(m for m in mismatches if m.group == root.group and m.seq == root.seq)
    by_sig: dict[Signature, list[int]] = defaultdict(list)
    for r, s in sorted(mm.by_rank.items()):
        by_sig[s].append(r)
    variants = [{**s.to_dict(), "ranks": rs} for s, rs in sorted(by_sig.items(), key=lambda kv: -len(kv[1]))]
    exp = mm.expected
    how = {"majority": "the other ranks agree", "history": "the others repeat what this group ran before",
           "own_record": "its own record of the op is impossible",
           "undecided": "a tie: cannot tell which side is wrong"}[mm.decided_by]
    out = []
    for rank in mm.culprits:
        got = mm.by_rank.get(rank)
        what = _what(mm, got, exp)
        where = f"collective #{mm.seq} of group {mm.group}" + (f" ({mm.detail})" if mm.detail and mm.shape != "self"
                                                                 else "")
        msg = f"rank {rank} {what} at {where} ({how}); {state}"
        evidence: dict[str, Any] = {
            **base, "rank": rank, "group": mm.group, "group_desc": view.desc if view else "", "seq": mm.seq,
            "kind": mm.kind, "shape": mm.shape, "actual": got.to_dict() if got else None,
            "expected": exp.to_dict() if exp else None, "variants": variants, "decided_by": mm.decided_by,
            "completed": mm.completed, "host": dumps[rank].host if rank in dumps else None,
        }
        if mm.op_index is not None:
            evidence["coalesced_index"] = mm.op_index
        if mm.detail:
            evidence["detail"] = mm.detail
        evidence.update(mm.extra)
        if mm.later_suppressed:
            evidence["later_mismatches_not_compared"] = mm.later_suppressed
        call = view.call(rank, mm.seq) if view else None
        stack = stack_of(call.frames_entry() if call else None)
        if stack:
            evidence["stack"] = stack
        out.append(Finding(code, sev, Entity.rank(rank), msg, _CHECK, evidence, SOURCE))
    return out


_CHECK = Action.CHECK_JOB


def _sig(e: Entry) -> dict[str, Any]:
    return {"op": e.profiling_name, "input_sizes": [list(s) for s in e.in_sizes], "input_dtypes": list(e.in_dtypes),
            "output_sizes": [list(s) for s in e.out_sizes], "output_dtypes": list(e.out_dtypes)}


def _what(mm: Mismatch, got: Signature | None, exp: Signature | None) -> str:
    if mm.shape == "self":
        return mm.detail or "recorded an op whose own sizes do not fit"
    if mm.shape == "all_to_all":
        return "sends and receives element counts that do not balance the group's all_to_all"
    if got is None or exp is None:
        return "disagrees with the group"
    others = sorted(r for r, s in mm.by_rank.items() if s == exp)
    they = f"rank(s) {format_ranks(others)}" if 0 < len(others) <= 3 else "the others"
    if mm.decided_by == "undecided":
        other = next((s for s in mm.by_rank.values() if s != got), None)
        if other is not None:
            exp = other
            they = f"rank(s) {format_ranks(r for r, s in mm.by_rank.items() if s == other)}"
    if mm.kind == "type":
        return f"calls {got.op} where {they} call {exp.op}"
    if mm.kind == "dtype":
        return f"uses dtypes {list(got.in_dtypes or got.out_dtypes)} where {they} use " \
               f"{list(exp.in_dtypes or exp.out_dtypes)}"
    return (f"passes sizes {[list(s) for s in got.in_sizes]}→{[list(s) for s in got.out_sizes]} where {they} "
            f"pass {[list(s) for s in exp.in_sizes]}→{[list(s) for s in exp.out_sizes]}")
