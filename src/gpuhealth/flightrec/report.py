"""The triage verdict as types: what the analyser decides, what the coordinator stores and sends, and what
the CLI and ``/metrics`` show. One shape end to end (``to_dict`` for JSON, ``gpuhealth.proto.triage`` for
the wire).

A report has one :class:`Verdict`, the root causes in the order an operator should read them (the first
is the *headline*: it names the rank(s) at fault), and the findings made from them. Every other stuck
group, waiting rank and stall is nested under the root it follows from, as a consequence — never a
headline of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpuhealth.flightrec.load import Problem
from gpuhealth.model import Finding, Health, Severity

__all__ = ["Blocked", "RootCause", "RootKind", "TriageReport", "Verdict"]


class Verdict(StrEnum):
    HANG = "hang"
    MISMATCH = "mismatch"
    STRAGGLER = "straggler"
    HEALTHY = "healthy"
    INCOMPLETE = "incomplete"

    @property
    def health(self) -> Health:
        return _HEALTH[self]


_HEALTH = {Verdict.HEALTHY: Health.HEALTHY, Verdict.STRAGGLER: Health.DEGRADED, Verdict.HANG: Health.UNHEALTHY,
           Verdict.MISMATCH: Health.UNHEALTHY, Verdict.INCOMPLETE: Health.UNKNOWN}


class RootKind(StrEnum):
    """What kind of fault a root cause is (the finding code is derived from it)."""

    HOST_STUCK = "host_stuck"  # never posted an op others wait in, and waits for nothing itself
    SKIPPED = "skipped"  # went on past an op others wait in (a code path that differs on this rank)
    TIMED_OUT = "timed_out"  # never posted it; the others waited until the process-group timeout
    BEHIND = "behind"  # behind in a group where nobody waits: dump timing (information)
    P2P_UNMATCHED = "p2p_unmatched"  # never posted the send/recv a peer waits in
    GPU_STALL = "gpu_stall"  # every participant posted it; it does not complete
    MISMATCH = "mismatch"  # participants disagree on op, sizes or dtypes (collective, coalesced, p2p, all_to_all)
    CIRCULAR = "circular"  # ranks wait for each other with no single rank to blame
    DUMP_MISSING = "dump_missing"  # the rank others wait for left no dump
    DUMP_UNREADABLE = "dump_unreadable"  # the rank others wait for left a dump that cannot be read
    STRAGGLER = "straggler"  # persistently slower than the other ranks


HANG_KINDS = frozenset({RootKind.HOST_STUCK, RootKind.SKIPPED, RootKind.TIMED_OUT, RootKind.P2P_UNMATCHED,
                        RootKind.GPU_STALL, RootKind.CIRCULAR})
EVIDENCE_GAP_KINDS = frozenset({RootKind.DUMP_MISSING, RootKind.DUMP_UNREADABLE})


@dataclass(frozen=True, slots=True)
class Blocked:
    """One op a root's culprit holds up directly, and who waits in it."""

    what: str
    group: str
    seq: int | None
    waiting_ranks: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "group": self.group, "seq": self.seq, "waiting_ranks": list(self.waiting_ranks)}


@dataclass(slots=True)
class RootCause:
    """One fault, the ranks to blame, the op it is about, and what follows from it."""

    kind: RootKind
    ranks: tuple[int, ...]  # the culprits (for an undecided mismatch: both sides)
    why: str
    group: str | None = None
    seq: int | None = None  # collective sequence id (p2p: the op's p2p sequence id)
    op: str | None = None
    mismatch: str | None = None  # "type" | "size" | "dtype" (MISMATCH only)
    waiting_ranks: tuple[int, ...] = ()  # ranks waiting directly on the culprit(s) in this op
    affected_ranks: tuple[int, ...] = ()  # every rank held up by this root, directly or not
    consequences: tuple[str, ...] = ()  # other process groups stuck because of this root
    followed_by: list[RootCause] = field(default_factory=list)  # later faults nested under this one
    decided_by: str | None = None  # how the culprit was chosen (majority, history, …, undecided)
    completed: bool | None = None  # MISMATCH: the op went through anyway (silently wrong results)
    created_ns: int | None = None  # when the op at fault was created (orders independent roots)
    what: str = ""  # the op at fault, in words
    blocks: tuple[Blocked, ...] = ()  # every op the culprit holds up directly (HOST_STUCK, SKIPPED, P2P_UNMATCHED)
    idle_s: float | None = None  # TIMED_OUT / BEHIND: how long the ranks ahead were idle before their dump
    timeout_s: float | None = None  # TIMED_OUT / BEHIND: the collective's process-group timeout

    @property
    def decided(self) -> bool:
        return self.decided_by != "undecided"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value, "ranks": list(self.ranks), "why": self.why}
        for key in ("group", "seq", "op", "mismatch", "decided_by", "completed", "idle_s", "timeout_s"):
            value = getattr(self, key)
            if value is not None:
                d[key] = value
        d["waiting_ranks"] = list(self.waiting_ranks)
        d["affected_ranks"] = list(self.affected_ranks)
        d["consequences"] = list(self.consequences)
        if self.followed_by:
            d["followed_by"] = [r.to_dict() for r in self.followed_by]
        if self.what:
            d["what"] = self.what
        if self.blocks:
            d["blocks"] = [b.to_dict() for b in self.blocks]
        return d


@dataclass(slots=True)
class TriageReport:
    verdict: Verdict
    summary: str
    findings: list[Finding]
    ranks_seen: list[int]
    ranks_missing: list[int]
    groups: list[dict[str, Any]]
    roots: list[RootCause] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    identity: dict[int, str] = field(default_factory=dict)  # rank -> "contents" | "filename"
    notes: list[str] = field(default_factory=list)
    ranks_unreadable: list[int] = field(default_factory=list)

    @property
    def health(self) -> Health:
        return self.verdict.health

    @property
    def headline(self) -> Finding | None:
        """What an operator reads first: the first finding of the highest severity."""
        if not self.findings:
            return None
        top = max(f.severity for f in self.findings)
        return next(f for f in self.findings if f.severity == top)

    @property
    def culprits(self) -> list[int]:
        return sorted({int(f.evidence["rank"]) for f in self.findings
                       if "rank" in f.evidence and f.severity >= Severity.WARNING
                       and f.evidence.get("active", True) is not False})

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "summary": self.summary,
            "culprits": self.culprits,
            "roots": [r.to_dict() for r in self.roots],
            "findings": [f.to_dict() for f in self.findings],
            "ranks_seen": self.ranks_seen,
            "ranks_missing": self.ranks_missing,
            "ranks_unreadable": self.ranks_unreadable,
            "groups": self.groups,
            "problems": [p.to_dict() for p in self.problems],
            "rank_identity": {str(r): s for r, s in self.identity.items()},
            "notes": self.notes,
        }
