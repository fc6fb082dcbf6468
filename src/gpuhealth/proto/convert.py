"""Model ↔ protobuf conversions, with validation of everything that arrives from the wire.

``from_pb`` functions raise ``WireError`` (message says which field) on values a well-behaved
agent never sends; the coordinator turns that into ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuhealth.model import MAX_RANKS, Action, Entity, EntityKind, Finding, RankIdentity, Severity, StepRecord
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

MAX_NAME_LEN = 253  # a DNS name
MAX_JOB_ID_LEN = 256
MAX_WORLD_SIZE = MAX_RANKS
MAX_BATCH_RECORDS = 1 << 20
MAX_FINDINGS = 10_000
MAX_EVIDENCE_BYTES = 64 * 1024
# What one node's findings may hold at the coordinator, whatever its credential sends: evidence JSON is
# parsed only within this budget (parsed JSON takes up to ~30x its bytes), messages are cut. A record's
# findings are a node's whole current set, so this is also all the coordinator keeps, and reloads, for it.
MAX_NODE_EVIDENCE_BYTES = 256 * 1024
MAX_MESSAGE_CHARS = 2048
MAX_STEP_SECONDS = 7 * 86_400.0  # a "step" longer than a week is a bug, not data


class WireError(ValueError):
    """A message field with a value the API does not allow."""


def check_name(value: str, what: str, max_len: int = MAX_NAME_LEN) -> str:
    if not value or len(value) > max_len or any(ord(c) < 0x20 for c in value):
        raise WireError(f"{what}: must be 1..{max_len} printable characters, got {value[:40]!r}")
    return value


# -- findings -------------------------------------------------------------------------------------


def finding_to_pb(f: Finding) -> pb.Finding:
    return pb.Finding(
        code=f.code, severity=str(f.severity), entity_kind=f.entity.kind.value, entity_id=f.entity.id,
        gpu_index=-1 if f.entity.gpu_index is None else f.entity.gpu_index, message=f.message,
        action=str(f.action), evidence_json=json.dumps(dict(f.evidence), default=str, allow_nan=False),
        source=f.source,
    )


def finding_from_pb(m: pb.Finding, *, parse_evidence: bool = True) -> Finding:
    """``parse_evidence`` False: the evidence is not parsed (over the node's budget) and says so."""
    try:
        severity = Severity.parse(m.severity)
        kind = EntityKind(m.entity_kind)
        action = Action.parse(m.action or "none")
    except (KeyError, ValueError) as exc:
        raise WireError(f"finding {m.code!r}: bad severity/entity/action: {exc}") from exc
    check_name(m.code, "finding.code", 128)
    if len(m.evidence_json) > MAX_EVIDENCE_BYTES:
        raise WireError(f"finding {m.code!r}: evidence over {MAX_EVIDENCE_BYTES} bytes")
    evidence: Any = {}
    if m.evidence_json and not parse_evidence:
        evidence = {"evidence_dropped": f"over the node's {MAX_NODE_EVIDENCE_BYTES} byte evidence quota",
                    "evidence_bytes": len(m.evidence_json)}
    elif m.evidence_json:
        try:
            evidence = json.loads(m.evidence_json)
        except (ValueError, RecursionError) as exc:
            raise WireError(f"finding {m.code!r}: evidence is not JSON: {exc}") from exc
        if not isinstance(evidence, dict):
            raise WireError(f"finding {m.code!r}: evidence must be a JSON object")
    message = m.message if len(m.message) <= MAX_MESSAGE_CHARS else m.message[:MAX_MESSAGE_CHARS] + "…"
    return Finding(
        code=m.code, severity=severity,
        entity=Entity(kind, m.entity_id[:MAX_NAME_LEN], None if m.gpu_index < 0 else m.gpu_index),
        message=message, action=action, evidence=evidence, source=m.source[:MAX_NAME_LEN],
    )


def findings_from_pb(items: Sequence[pb.Finding]) -> list[Finding]:
    """A node's findings within its quota: evidence is parsed, worst finding first, until the node's
    evidence budget is spent; the rest keep code, severity, entity, message and action."""
    if len(items) > MAX_FINDINGS:
        raise WireError(f"findings: {len(items)} is over {MAX_FINDINGS}")
    rank = {"critical": 0, "warning": 1, "info": 2}
    order = sorted(range(len(items)), key=lambda i: (rank.get(items[i].severity, 3), len(items[i].evidence_json)))
    budget = MAX_NODE_EVIDENCE_BYTES
    parse = [False] * len(items)
    for i in order:
        size = len(items[i].evidence_json)
        if size <= budget:
            parse[i], budget = True, budget - size
    return [finding_from_pb(m, parse_evidence=parse[i]) for i, m in enumerate(items)]


# -- rank identities -----------------------------------------------------------------------------


def identity_to_pb(i: RankIdentity) -> pb.RankIdentity:
    return pb.RankIdentity(
        job_id=i.job_id, rank=i.rank, world_size=i.world_size, host=i.host, pid=i.pid,
        local_rank=-1 if i.local_rank is None else i.local_rank, gpu_uuid=i.gpu_uuid or "",
        gpu_index=-1 if i.gpu_index is None else i.gpu_index, found_by=i.found_by, verified=i.verified,
    )


def identity_from_pb(m: pb.RankIdentity) -> RankIdentity:
    check_name(m.job_id, "rank.job_id", MAX_JOB_ID_LEN)
    if not 0 < m.world_size <= MAX_WORLD_SIZE:
        raise WireError(f"rank identity: world_size {m.world_size} out of range")
    if m.rank >= m.world_size:
        raise WireError(f"rank identity: rank {m.rank} >= world_size {m.world_size}")
    return RankIdentity(
        job_id=m.job_id, rank=m.rank, world_size=m.world_size, host=m.host[:MAX_NAME_LEN], pid=m.pid,
        local_rank=None if m.local_rank < 0 else m.local_rank, gpu_uuid=m.gpu_uuid or None,
        gpu_index=None if m.gpu_index < 0 else m.gpu_index,
        found_by="discovered" if m.found_by == "discovered" else "hook",  # empty (older agents): the hook
        verified=m.verified,  # older agents never say: unverified
    )


# -- step batches (columnar) ----------------------------------------------------------------------

_NAN = float("nan")


def steps_to_pb(job_id: str, records: Iterable[StepRecord]) -> pb.StepBatch:
    """Records of ONE job, as columns. Missing compute/comm values travel as NaN."""
    recs = list(records)
    batch = pb.StepBatch(job_id=job_id)
    batch.rank.extend([r.rank for r in recs])
    batch.step.extend([r.step for r in recs])
    batch.start_time.extend([r.start_time for r in recs])
    batch.wall_s.extend([r.wall_s for r in recs])
    if any(r.compute_s is not None for r in recs):
        batch.compute_s.extend([_NAN if r.compute_s is None else r.compute_s for r in recs])
    if any(r.comm_wait_s is not None for r in recs):
        batch.comm_wait_s.extend([_NAN if r.comm_wait_s is None else r.comm_wait_s for r in recs])
    return batch


@dataclass(frozen=True, slots=True)
class StepColumns:
    """A validated batch: plain Python lists of equal length (compute/comm may be None)."""

    job_id: str
    rank: list[int]
    step: list[int]
    start_time: list[float]
    wall_s: list[float]
    compute_s: list[float] | None
    comm_wait_s: list[float] | None

    def __len__(self) -> int:
        return len(self.rank)

    def records(self) -> list[StepRecord]:
        n = len(self.rank)
        comp = self.compute_s or [_NAN] * n
        comm = self.comm_wait_s or [_NAN] * n
        return [
            StepRecord(self.job_id, r, s, t, w, None if c != c else c, None if q != q else q)
            for r, s, t, w, c, q in zip(self.rank, self.step, self.start_time, self.wall_s, comp, comm, strict=True)
        ]


def _check_durations(values: list[float], what: str, allow_nan: bool) -> None:
    # sum/min/max are C loops (cheap at a million values): NaN makes the sum NaN, inf makes it inf.
    if not values:
        return
    total, lo, hi = sum(values), min(values), max(values)
    if total == total and lo >= 0.0 and hi <= MAX_STEP_SECONDS and total != math.inf:
        return
    for v in values:
        if v != v:
            if allow_nan:
                continue
            raise WireError(f"steps.{what}: NaN is not allowed")
        if not 0.0 <= v <= MAX_STEP_SECONDS:
            raise WireError(f"steps.{what}: value {v!r} is not a duration in [0, {MAX_STEP_SECONDS:g}] s")


def steps_from_pb(m: pb.StepBatch, world_size: int | None = None) -> StepColumns:
    check_name(m.job_id, "steps.job_id", MAX_JOB_ID_LEN)
    rank = list(m.rank)
    n = len(rank)
    if n > MAX_BATCH_RECORDS:
        raise WireError(f"steps: {n} records in one batch, over {MAX_BATCH_RECORDS}")
    step, start, wall = list(m.step), list(m.start_time), list(m.wall_s)
    comp = list(m.compute_s) or None
    comm = list(m.comm_wait_s) or None
    for name, col in (("step", step), ("start_time", start), ("wall_s", wall), ("compute_s", comp),
                      ("comm_wait_s", comm)):
        if col is not None and len(col) != n:
            raise WireError(f"steps.{name}: {len(col)} values for {n} ranks (columns must have equal length)")
    if n:
        if world_size is not None and max(rank) >= world_size:
            raise WireError(f"steps.rank: rank {max(rank)} >= world_size {world_size}")
        if max(rank) >= MAX_WORLD_SIZE:
            raise WireError(f"steps.rank: rank {max(rank)} out of range")
        total = sum(start)
        if not (math.isfinite(total) and min(start) >= 0.0):
            raise WireError("steps.start_time: every value must be a finite time since the epoch")
        _check_durations(wall, "wall_s", allow_nan=False)
        if comp is not None:
            _check_durations(comp, "compute_s", allow_nan=True)
        if comm is not None:
            _check_durations(comm, "comm_wait_s", allow_nan=True)
    return StepColumns(m.job_id, rank, step, start, wall, comp, comm)


# -- a request's result with a large payload, serialised once -------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _len_field(number: int, size: int) -> bytes:
    return _varint(number << 3 | 2) + _varint(size)


def result_message_wire(result: pb.RequestResult, payload: bytes | bytearray) -> bytes:
    """``AgentMessage(result=result with payload)`` as it goes on the wire, built with ONE copy of
    ``payload`` (a dump of up to 32 MiB): building the messages (``payload=`` copies it, ``result=``
    copies the result again) and then serialising them made three. Protobuf takes a message's fields
    in any order, so the payload field is appended to the rest of the result."""
    head = result.SerializeToString()  # the result without its payload: small
    inner = len(head) + len(_len_field(_PAYLOAD_FIELD, len(payload))) + len(payload)
    return b"".join((_len_field(_RESULT_FIELD, inner), head, _len_field(_PAYLOAD_FIELD, len(payload)), payload))


_RESULT_FIELD = pb.AgentMessage.DESCRIPTOR.fields_by_name["result"].number
_PAYLOAD_FIELD = pb.RequestResult.DESCRIPTOR.fields_by_name["payload"].number
