"""One verdict per job from flight-recorder dumps (and optional step records).

``triage(source)`` → :class:`TriageReport` with ``verdict`` in hang | mismatch | straggler |
healthy | incomplete, findings that name culprit ranks (``evidence.rank`` on every rank-level
finding), the collective (group, seq id, op, sizes, dtypes), why, and the call-site stack when a
pickle provided frames. Only faults become findings: there is no "no errors found" line per entry.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuhealth.flightrec.checks import Mismatch, find_mismatch
from gpuhealth.flightrec.findings import root_findings
from gpuhealth.flightrec.groups import GroupView, build_groups
from gpuhealth.flightrec.lag import find_laggards, idle_seconds
from gpuhealth.flightrec.load import LoadResult, RankDump, load_dumps, paused_gc, rank_from_filename
from gpuhealth.flightrec.p2p import P2PMismatch, P2PPair, find_p2p_mismatches, pending_pairs
from gpuhealth.flightrec.report import EVIDENCE_GAP_KINDS, HANG_KINDS, RootCause, RootKind, TriageReport, Verdict
from gpuhealth.flightrec.roots import assemble, with_stacks
from gpuhealth.flightrec.running import still_running
from gpuhealth.flightrec.stacks import main_threads
from gpuhealth.flightrec.text import format_ranks
from gpuhealth.flightrec.unrecorded import name_unrecorded_peers
from gpuhealth.flightrec.waits import build_graph, find_hang_roots, unmatched_behind
from gpuhealth.model import MAX_RANKS, Action, Finding, Severity, StepRecord
from gpuhealth.stragglers import StragglerConfig, detect_from_durations, detect_stragglers

__all__ = ["VERDICTS", "RootCause", "RootKind", "TriageReport", "Verdict", "triage"]

VERDICTS = tuple(v.value for v in Verdict)
# Above this many bytes of dumps, read each JSON dump's tail instead of the whole file.
AUTO_TAIL_BYTES = 512 * 2**20
DEFAULT_TAIL_ENTRIES = 4

Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | LoadResult | Mapping[int, RankDump]


def triage(
    source: Source,
    *,
    steps: Sequence[StepRecord] | None = None,
    job: Mapping[str, Any] | None = None,
    tail_entries: int | None = None,
    straggler_config: StragglerConfig | None = None,
    stacks: Mapping[Any, Any] | None = None,
) -> TriageReport:
    """Triage a job. ``source``: a folder, a file, a list of paths, a LoadResult, or {rank: RankDump}.
    ``job``: optional {"job_id", "world_size", "groups": {name: [ranks]}} (Gloo dumps do not record
    group membership). ``tail_entries``: read only the newest entries of each dump (None: decide by
    total size — whole files up to 512 MiB of dumps, tails above). ``stacks``: live stack captures per
    rank (what the coordinator stores in ``stacks.json``), used as evidence next to the dumps."""
    with paused_gc():
        return _triage(source, steps=steps, job=job, tail_entries=tail_entries, straggler_config=straggler_config,
                       stacks=stacks)


def _triage(
    source: Source,
    *,
    steps: Sequence[StepRecord] | None,
    job: Mapping[str, Any] | None,
    tail_entries: int | None,
    straggler_config: StragglerConfig | None,
    stacks: Mapping[Any, Any] | None = None,
) -> TriageReport:
    job = dict(job or {})
    mains = main_threads(stacks)
    loaded, tail_used = _load(source, tail_entries)
    dumps = loaded.dumps
    unreadable = _unreadable_ranks(loaded)
    groups, world = build_groups(dumps, job, known_ranks=unreadable)
    analysis = analyse(groups, dumps, unreadable, world)
    roots = analysis.roots
    running = still_running(dumps)
    if running is not None:  # a moment's wait in a running job is not a hang (flightrec/running.py)
        roots = [r for r in roots if r.kind not in HANG_KINDS]
    untimed = [r for r in roots if _untimed_stall(r)]
    if untimed:  # every rank posted it and nothing says when: a running job shows the same
        roots = [r for r in roots if r not in untimed]
        # ... but a send/recv queued behind it that no peer matches will block for good
        behind = {(b.group, b.seq, b.ranks): b for r in untimed
                  if (b := unmatched_behind(groups, analysis.pairs, r, dumps)) is not None}
        roots += list(behind.values())
    with_stacks(roots, mains, groups)
    findings: list[Finding] = []
    for root in roots:
        findings += root_findings(root, groups, dumps, job, analysis.mismatches, analysis.p2p_mismatches, mains)
    straggler_findings: list[Finding] = []
    if steps:
        straggler_findings += detect_stragglers(steps, straggler_config, job_slowdown=True)
    # From the tails of a large job there are too few collectives per rank to call persistence.
    durations = {} if any(d.tail_only for d in dumps.values()) else _durations(dumps)
    if durations:
        have = {int(f.evidence["rank"]) for f in straggler_findings if f.code == "rank.straggler"}
        straggler_findings += [f for f in detect_from_durations(durations, straggler_config)
                               if int(f.evidence["rank"]) not in have]
    if any(r.kind is RootKind.MISMATCH or r.kind in HANG_KINDS for r in roots):
        # A hung or mismatched job: that fault is the story, and the last steps before a hang time badly.
        # A slower rank is worth knowing, not worth blaming.
        straggler_findings = [_as_context(f) for f in straggler_findings]
    findings += straggler_findings
    # What an operator reads first is the most severe finding: keep the root order within a severity.
    findings.sort(key=lambda f: -int(f.severity))

    # The world: what the dumps and the job say, and what the ranks' own step records say (the hook writes it).
    world = max(world, max((s.world_size or 0 for s in steps or ()), default=0),
                max((s.rank for s in steps or ()), default=-1) + 1)
    # Without dumps, the ranks are those that sent step records.
    seen = sorted(dumps) if dumps else sorted({s.rank for s in steps or ()})
    missing = sorted(set(range(world)) - set(seen) - set(unreadable)) if (seen or unreadable) else []
    verdict = _verdict(roots, findings, dumps, missing, unreadable, bool(steps))
    blank = bool(dumps) and not steps and _nothing_recorded(dumps, groups)
    if blank and verdict is Verdict.HEALTHY:
        verdict = Verdict.INCOMPLETE  # no entry, no progress: nothing says the job is healthy
    # One rank is not a job: a straggler needs peers and a hang the group's members. Unless something
    # names the world (a pg_config's members, --world-size, the step records' world_size), one rank's
    # evidence cannot tell a one-rank job from one rank of many (Gloo dumps record no membership).
    lone = len(set(seen) | set(unreadable)) == 1 and not _world_named(dumps, job, steps)
    if lone and verdict is Verdict.HEALTHY:
        verdict = Verdict.INCOMPLETE
    report = TriageReport(
        verdict=verdict, summary="", findings=findings, ranks_seen=seen, ranks_missing=missing,
        groups=[g.to_dict() for g in groups.values()], roots=roots, problems=list(loaded.problems),
        identity=loaded.identity_sources, notes=_notes(groups), ranks_unreadable=unreadable,
    )
    if blank:
        report.notes.append(NOTHING_RECORDED)
    if lone:
        report.notes.append(LONE_RANK.format(rank=format_ranks([*seen, *unreadable])))
    if dumps and steps and (short := sorted(set(range(world)) - {s.rank for s in steps})):
        report.notes.append(f"step records of rank(s) {format_ranks(short)} were not given: a straggler among them "
                            "would not show")
    if running is not None:
        report.notes.append(running.note())
    report.notes += [UNTIMED_STALL.format(what=r.what or f"collective #{r.seq} of group {r.group}",
                                          ranks=format_ranks(r.waiting_ranks or r.ranks)) for r in untimed]
    if any(d.tail_only for d in dumps.values()):
        report.notes.append(f"large job: read the newest entries of each dump only (≥{tail_used} per rank, "
                            "more where a group's frontier needed it); older history was not compared")
    report.summary = _summary(report, steps_only=not dumps and bool(steps))
    return report


UNTIMED_STALL = ("rank(s) {ranks} all posted {what} and it had not completed when they dumped, but the dumps carry no "
                 "time for it (time_created_ns 0): a running job dumped at that moment looks the same, so no hang is "
                 "claimed; dump again later — if the same op is still pending, it is stuck")


def _untimed_stall(root: RootCause) -> bool:
    """A stall (every participant posted the op, it does not complete) whose op carries no creation time on
    any rank: nothing shows that the wait lasted (PyTorch's analyser tests write such dumps: every event
    ``scheduled``, ``time_created_ns`` 0). Real dumps always time their entries."""
    return root.kind is RootKind.GPU_STALL and not root.created_ns


def _as_context(f: Finding) -> Finding:
    if f.severity <= Severity.INFO:
        return f
    return dataclasses.replace(f, severity=Severity.INFO, action=Action.MONITOR,
                               message=f"before the job stopped: {f.message}",
                               evidence={**f.evidence, "demoted": "the job is hung or mismatched: that is the fault"})


@dataclass(slots=True)
class Analysis:
    roots: list[RootCause]
    mismatches: list[Mismatch]
    p2p_mismatches: list[P2PMismatch]
    pairs: list[P2PPair]


def analyse(groups: Mapping[str, GroupView], dumps: Mapping[int, RankDump], unreadable: Sequence[int] = (),
            world: int = 0) -> Analysis:
    """Root causes of the job's state, in reading order (see :mod:`gpuhealth.flightrec.roots`)."""
    mismatches = [m for g in groups.values() if (m := find_mismatch(g)) is not None]
    pairs = [p for g in groups.values() for p in pending_pairs(g)]
    p2p_mismatches = [m for g in groups.values() for m in find_p2p_mismatches(g, [p for p in pairs
                                                                                  if p.group == g.name])]
    graph = build_graph(groups, pairs, dumps, unreadable, world)
    hang_roots = find_hang_roots(groups, graph)
    name_unrecorded_peers(hang_roots, groups, dumps)  # Gloo: a stuck rank may wait in an unrecorded recv
    idle = idle_seconds(dumps)
    laggards = [lg for g in groups.values() for lg in find_laggards(g, idle)]
    waiting = {r: True for r in graph.heads}
    return Analysis(assemble(groups, hang_roots, mismatches, p2p_mismatches, laggards, waiting), mismatches,
                    p2p_mismatches, pairs)


def _unreadable_ranks(loaded: LoadResult) -> list[int]:
    """Ranks whose dump exists but could not be read (a file named for the rank that gave nothing)."""
    out = set()
    for p in loaded.problems:
        if p.severity != "error":
            continue
        rank = p.rank
        if rank is None:
            named = rank_from_filename(Path(p.path).name)
            rank = named[0] if named is not None else None
        if rank is not None and rank not in loaded.dumps and 0 <= rank < MAX_RANKS:
            out.add(rank)
    return sorted(out)


NOTHING_RECORDED = ("the dumps record no collectives: the flight recorder's buffer was off (TORCH_FR_BUFFER_SIZE, "
                    "older torch TORCH_NCCL_TRACE_BUFFER_SIZE, unset or 0) or the job had run none; set it at "
                    "launch (gpuhealth env prints it) and dump again")


LONE_RANK = ("only rank {rank}'s evidence, and nothing in it says how many ranks the job has (Gloo dumps and step "
             "records of older hooks do not): a straggler needs its peers and a hang the group's members, so neither "
             "was judged; give every rank's dumps or step records, or --world-size N (1 if the job has one rank)")


def _world_named(dumps: Mapping[int, RankDump], job: Mapping[str, Any], steps: Sequence[StepRecord] | None) -> bool:
    """Whether anything beyond the ranks held says how many ranks the job has: the job's description, a
    pg_config that lists members (NCCL; Gloo's is empty), or the step records' own ``world_size``."""
    return (bool(job.get("world_size"))
            or any(cfg.ranks for d in dumps.values() for cfg in d.pg_config.values())
            or any(s.world_size for s in steps or ()))


def _nothing_recorded(dumps: Mapping[int, RankDump], groups: Mapping[str, GroupView]) -> bool:
    """No rank's dump holds an entry and no group shows progress in its status."""
    return (not any(d.entries for d in dumps.values())
            and not any(v for g in groups.values() for v in (*g.enqueued.values(), *g.completed.values())))


def _notes(groups: Mapping[str, GroupView]) -> list[str]:
    notes = [f"group {g.name}: only rank(s) {list(g.members)} have entries; membership may be incomplete "
             "(Gloo dumps do not record it)" for g in groups.values()
             if g.membership_source == "entries" and len(g.members) < 2]
    for g in groups.values():
        for rank, last in sorted(g.stale.items()):
            notes.append(f"group {g.name}: rank {rank}'s dump ends at collective #{last}, before #{g.joined}, which "
                         f"completed with every member: it was taken earlier, while the job ran, and shows nothing "
                         f"of what came after; dump again if the job still looks stuck")
    return notes


# ---------------------------------------------------------------------------------------- loading


def _load(source: Source, tail_entries: int | None) -> tuple[LoadResult, int | None]:
    if isinstance(source, LoadResult):
        return source, None
    if isinstance(source, Mapping):
        return LoadResult(dumps=dict(source)), None
    if tail_entries is None and _total_bytes(source) > AUTO_TAIL_BYTES:
        tail_entries = DEFAULT_TAIL_ENTRIES
    return load_dumps(source, tail_entries=tail_entries), tail_entries


def _total_bytes(source: Any) -> int:
    items = [source] if isinstance(source, str | os.PathLike) else list(source)
    total = 0
    for item in items:
        p = Path(item)
        try:
            if p.is_dir():
                for root, _, names in os.walk(p):
                    for n in names:
                        total += (Path(root) / n).stat().st_size
                        if total > AUTO_TAIL_BYTES:
                            return total
            elif p.exists():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def _durations(dumps: Mapping[int, RankDump]) -> dict[int, list[tuple[str, int, float, int | None]]]:
    """Per rank, its collectives' (group, seq, duration_ms, created_ns) in the order it ran them: the creation
    time places each wait inside its step (see ``stragglers.detect_from_durations``)."""
    out: dict[int, list[tuple[str, int, float, int | None]]] = {}
    for rank, d in dumps.items():
        items = [(e.group, e.seq, float(e.duration_ms), e.created_ns) for e in d.entries
                 if e.duration_ms is not None and not e.is_p2p and e.seq > 0]
        if items:
            out[rank] = items
    return out


# ---------------------------------------------------------------------------------------- verdict


def _verdict(roots: Sequence[RootCause], findings: Sequence[Finding], dumps: Mapping[int, RankDump],
             missing: Sequence[int], unreadable: Sequence[int], have_steps: bool) -> Verdict:
    real = [r for r in roots if r.kind is not RootKind.BEHIND]
    if any(r.kind is RootKind.MISMATCH for r in real):
        return Verdict.MISMATCH
    if any(r.kind in HANG_KINDS for r in real):
        return Verdict.HANG
    if any(r.kind in EVIDENCE_GAP_KINDS for r in real):
        return Verdict.INCOMPLETE
    if any(f.code == "rank.straggler" and f.severity >= Severity.WARNING for f in findings):
        return Verdict.STRAGGLER
    if (not dumps and not have_steps) or missing or unreadable:
        return Verdict.INCOMPLETE
    return Verdict.HEALTHY


def _summary(report: TriageReport, *, steps_only: bool = False) -> str:
    v = report.verdict
    head = report.headline
    first = next((r for r in report.roots if r.kind is not RootKind.BEHIND), None)
    # One rank: its finding says it best; several: the root's own sentence names them all.
    text = head.message if head is not None else ""
    if first is not None and len(first.ranks) > 1 and first.kind is not RootKind.MISMATCH:
        text = first.why
    if v in (Verdict.HANG, Verdict.MISMATCH, Verdict.STRAGGLER) and head is not None:
        ranks = _headline_ranks(report)
        who = f"culprit rank(s) {format_ranks(ranks)}" if ranks else "no single culprit rank"
        return f"{v.value.upper()}: {who} — {text}"
    if v is Verdict.INCOMPLETE:
        if head is not None and head.severity >= Severity.WARNING:
            return f"INCOMPLETE: {text}"
        if not report.ranks_seen:
            return "INCOMPLETE: no readable dump" + (f" ({len(report.problems)} file problem(s))"
                                                     if report.problems else "")
        gaps = []
        if report.ranks_unreadable:
            gaps.append(f"rank(s) {format_ranks(report.ranks_unreadable)} left a dump that could not be read")
        if report.ranks_missing:
            gaps.append(f"rank(s) {format_ranks(report.ranks_missing)} left no "
                        + ("step records" if steps_only else "dump"))
        if NOTHING_RECORDED in report.notes:
            gaps.append("their dumps record no collectives (the flight recorder's buffer was off?)")
        if any(n.startswith(LONE_RANK[:LONE_RANK.index("{")]) for n in report.notes):
            gaps.append("nothing says how many ranks the job has: one rank alone cannot show a straggler or a "
                        "hang (see the note)")
        read = "whose step records were read" if steps_only else "that dumped"
        return f"INCOMPLETE: no fault in the {len(report.ranks_seen)} rank(s) {read}; " + "; ".join(gaps)
    return f"HEALTHY: {len(report.ranks_seen)} rank(s), no stuck, mismatched or straggling rank"


def _headline_ranks(report: TriageReport) -> list[int]:
    """The ranks the headline root names (the first root; stragglers when there is no root)."""
    real = [r for r in report.roots if r.kind is not RootKind.BEHIND]
    if real:
        return list(real[0].ranks)
    return report.culprits
