"""The triage report on the wire (the coordinator's Triage RPC): the analyser's
:class:`~gpuhealth.flightrec.report.TriageReport` ⇄ ``pb.TriageReport``, and a coordinator's ``pb.TriageReply``
as the JSON document ``gpuhealth triage --json`` prints (one shape for offline and live triage)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpuhealth.flightrec.load import Problem
from gpuhealth.flightrec.report import Blocked, RootCause, RootKind, TriageReport, Verdict
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import finding_from_pb, finding_to_pb

_VERDICT_TO_PB = {v: getattr(pb, f"VERDICT_{v.name}") for v in Verdict}
_VERDICT_FROM_PB = {n: v for v, n in _VERDICT_TO_PB.items()}
_KIND_TO_PB = {k: getattr(pb, f"ROOT_{k.name}") for k in RootKind}
_KIND_FROM_PB = {n: k for k, n in _KIND_TO_PB.items()}


def root_to_pb(r: RootCause) -> pb.RootCause:
    m = pb.RootCause(kind=_KIND_TO_PB[r.kind], ranks=list(r.ranks), why=r.why, group=r.group or "", op=r.op or "",
                     mismatch=r.mismatch or "", waiting_ranks=list(r.waiting_ranks),
                     affected_ranks=list(r.affected_ranks), consequences=list(r.consequences),
                     followed_by=[root_to_pb(x) for x in r.followed_by], decided_by=r.decided_by or "", what=r.what,
                     blocks=[pb.Blocked(what=b.what, group=b.group, waiting_ranks=list(b.waiting_ranks),
                                        **({"seq": b.seq} if b.seq is not None else {})) for b in r.blocks])
    if r.seq is not None:
        m.seq = r.seq
    if r.completed is not None:
        m.completed = r.completed
    if r.created_ns is not None:
        m.created_ns = r.created_ns
    if r.idle_s is not None:
        m.idle_s = r.idle_s
    if r.timeout_s is not None:
        m.timeout_s = r.timeout_s
    return m


def root_from_pb(m: pb.RootCause) -> RootCause:
    return RootCause(
        kind=_KIND_FROM_PB.get(m.kind, RootKind.CIRCULAR), ranks=tuple(m.ranks), why=m.why, group=m.group or None,
        seq=m.seq if m.HasField("seq") else None, op=m.op or None, mismatch=m.mismatch or None,
        waiting_ranks=tuple(m.waiting_ranks), affected_ranks=tuple(m.affected_ranks),
        consequences=tuple(m.consequences), followed_by=[root_from_pb(x) for x in m.followed_by],
        decided_by=m.decided_by or None, completed=m.completed if m.HasField("completed") else None,
        created_ns=m.created_ns if m.HasField("created_ns") else None, what=m.what,
        blocks=tuple(Blocked(b.what, b.group, b.seq if b.HasField("seq") else None, tuple(b.waiting_ranks))
                     for b in m.blocks),
        idle_s=m.idle_s if m.HasField("idle_s") else None, timeout_s=m.timeout_s if m.HasField("timeout_s") else None)


def report_to_pb(r: TriageReport) -> pb.TriageReport:
    return pb.TriageReport(
        verdict=_VERDICT_TO_PB[r.verdict], summary=r.summary, roots=[root_to_pb(x) for x in r.roots],
        findings=[finding_to_pb(f) for f in r.findings], ranks_seen=r.ranks_seen, ranks_missing=r.ranks_missing,
        ranks_unreadable=r.ranks_unreadable, groups=[_group_to_pb(g) for g in r.groups],
        problems=[pb.DumpProblem(path=p.path, message=p.message, severity=p.severity,
                                 **({"rank": p.rank} if p.rank is not None else {})) for p in r.problems],
        notes=r.notes, rank_identity={int(k): v for k, v in r.identity.items()})


def report_from_pb(m: pb.TriageReport) -> TriageReport:
    return TriageReport(
        verdict=_VERDICT_FROM_PB.get(m.verdict, Verdict.INCOMPLETE), summary=m.summary,
        findings=[finding_from_pb(f) for f in m.findings], ranks_seen=list(m.ranks_seen),
        ranks_missing=list(m.ranks_missing), groups=[_group_from_pb(g) for g in m.groups],
        roots=[root_from_pb(x) for x in m.roots],
        problems=[Problem(p.path, p.message, p.rank if p.HasField("rank") else None, p.severity) for p in m.problems],
        identity=dict(m.rank_identity), notes=list(m.notes), ranks_unreadable=list(m.ranks_unreadable))


def _group_to_pb(g: Mapping[str, Any]) -> pb.GroupState:
    return pb.GroupState(
        name=str(g.get("name", "")), pg_name=str(g.get("pg_name", "")), desc=str(g.get("desc", "")),
        members=list(g.get("members", [])), membership_source=str(g.get("membership_source", "")),
        ranks_dumped=list(g.get("ranks_dumped", [])), ranks_missing=list(g.get("ranks_missing", [])),
        last_enqueued={int(k): int(v) for k, v in (g.get("last_enqueued") or {}).items()},
        last_completed={int(k): int(v) for k, v in (g.get("last_completed") or {}).items()})


def _group_from_pb(m: pb.GroupState) -> dict[str, Any]:
    return {"name": m.name, "pg_name": m.pg_name, "desc": m.desc, "members": list(m.members),
            "membership_source": m.membership_source, "ranks_dumped": list(m.ranks_dumped),
            "ranks_missing": list(m.ranks_missing),
            "last_enqueued": {str(k): v for k, v in sorted(m.last_enqueued.items())},
            "last_completed": {str(k): v for k, v in sorted(m.last_completed.items())}}


def reply_to_dict(m: pb.TriageReply) -> dict[str, Any]:
    """A coordinator's triage reply as one JSON document: the report's fields (as ``gpuhealth triage --json``
    prints them) plus the job, the culprits' placement and GPU health, the evidence and the stacks."""
    doc = report_from_pb(m.report).to_dict()
    doc.update({
        "job_id": m.job_id, "reason": m.reason, "summary": m.summary or doc["summary"],
        "culprits": list(m.culprits) or doc["culprits"],
        "culprit_details": [_culprit_to_dict(c) for c in m.culprit_details],
        "evidence": {
            "dir": m.evidence.dir, "fr_dumps": {str(k): v for k, v in sorted(m.evidence.fr_dumps.items())},
            "stacks_ranks": list(m.evidence.stacks_ranks), "fr_missing_ranks": list(m.evidence.fr_missing_ranks),
            "errors": dict(m.evidence.errors), "collect_seconds": m.evidence.collect_seconds,
            "agents_asked": list(m.evidence.agents_asked)},
        "stacks": {str(k): _json_or_text(v) for k, v in sorted(m.stacks_json.items())},
        "created_at": m.created_at,
    })
    for detail in doc["culprit_details"]:  # where each culprit is stuck, next to where it runs
        detail["stack"] = doc["stacks"].get(str(detail["rank"]))
    if m.HasField("hang"):
        doc["hang"] = {"stalled_s": m.hang.stalled_s, "threshold_s": m.hang.threshold_s,
                       "typical_step_s": m.hang.typical_step_s if m.hang.HasField("typical_step_s") else None,
                       "last_step": m.hang.last_step}
    if m.error:
        doc["error"] = m.error
    return doc


def _culprit_to_dict(c: pb.Culprit) -> dict[str, Any]:
    return {"rank": c.rank, "node": c.node or None, "host": c.host or None,
            "pid": c.pid if c.HasField("pid") else None,
            "local_rank": c.local_rank if c.HasField("local_rank") else None,
            "gpu_index": c.gpu_index if c.HasField("gpu_index") else None, "gpu_uuid": c.gpu_uuid or None,
            "gpu_inferred_from_local_rank": c.gpu_inferred, "line": c.line,
            "gpu_findings": [finding_from_pb(f).to_dict() for f in c.gpu_findings]}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
