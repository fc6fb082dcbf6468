"""One verdict per job from flight-recorder dumps (and optional step records).

``triage(source)`` → :class:`TriageReport` with ``verdict`` in hang | mismatch | straggler |
healthy | incomplete, findings that name culprit ranks (``evidence.rank`` on every rank-level
finding), the collective (group, seq id, op, sizes, dtypes), why, and the call-site stack when a
pickle provided frames. Only faults become findings: there is no "no errors found" line per entry.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.flightrec.load import Entry, LoadResult, Problem, RankDump, load_dumps, paused_gc
from gpuhealth.flightrec.match import GroupView, MatchResult, Mismatch, Root, Signature, find_roots, format_ranks, match
from gpuhealth.model import Action, Entity, EntityKind, Finding, Health, Severity, StepRecord
from gpuhealth.stragglers import StragglerConfig, detect_from_durations, detect_stragglers

SOURCE = "flightrec"
VERDICTS = ("hang", "mismatch", "straggler", "healthy", "incomplete")
# Above this many bytes of dumps, read each JSON dump's tail instead of the whole file.
AUTO_TAIL_BYTES = 512 * 2**20
DEFAULT_TAIL_ENTRIES = 4
MAX_STACK_FRAMES = 8

Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | LoadResult | Mapping[int, RankDump]


@dataclass(slots=True)
class TriageReport:
    verdict: str
    summary: str
    findings: list[Finding]
    ranks_seen: list[int]
    ranks_missing: list[int]
    groups: list[dict[str, Any]]
    problems: list[Problem] = field(default_factory=list)
    identity: dict[int, str] = field(default_factory=dict)  # rank -> "contents" | "filename"
    notes: list[str] = field(default_factory=list)

    @property
    def health(self) -> Health:
        return {"healthy": Health.HEALTHY, "straggler": Health.DEGRADED, "hang": Health.UNHEALTHY,
                "mismatch": Health.UNHEALTHY, "incomplete": Health.UNKNOWN}[self.verdict]

    @property
    def culprits(self) -> list[int]:
        return sorted({int(f.evidence["rank"]) for f in self.findings
                       if "rank" in f.evidence and f.severity >= Severity.WARNING
                       and f.evidence.get("active", True) is not False})

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "summary": self.summary,
            "culprits": self.culprits,
            "findings": [f.to_dict() for f in self.findings],
            "ranks_seen": self.ranks_seen,
            "ranks_missing": self.ranks_missing,
            "groups": self.groups,
            "problems": [p.to_dict() for p in self.problems],
            "rank_identity": {str(r): s for r, s in self.identity.items()},
            "notes": self.notes,
        }


def triage(
    source: Source,
    *,
    steps: Sequence[StepRecord] | None = None,
    job: Mapping[str, Any] | None = None,
    tail_entries: int | None = None,
    straggler_config: StragglerConfig | None = None,
) -> TriageReport:
    """Triage a job. ``source``: a folder, a file, a list of paths, a LoadResult, or {rank: RankDump}.
    ``job``: optional {"job_id", "world_size", "groups": {name: [ranks]}} (Gloo dumps do not record
    group membership). ``tail_entries``: read only the newest entries of each dump (None: decide by
    total size — whole files up to 512 MiB of dumps, tails above)."""
    with paused_gc():
        return _triage(source, steps=steps, job=job, tail_entries=tail_entries, straggler_config=straggler_config)


def _triage(
    source: Source,
    *,
    steps: Sequence[StepRecord] | None,
    job: Mapping[str, Any] | None,
    tail_entries: int | None,
    straggler_config: StragglerConfig | None,
) -> TriageReport:
    job = dict(job or {})
    loaded, tail_used = _load(source, tail_entries)
    dumps = loaded.dumps
    result = match(dumps, job)
    roots = find_roots(result)
    findings: list[Finding] = []
    for root in roots:
        findings += _root_findings(root, result, dumps, job)
    findings += _silent_mismatch_findings(result, dumps, roots, job)
    straggler_findings: list[Finding] = []
    if steps:
        straggler_findings += detect_stragglers(steps, straggler_config)
    # From the tails of a large job there are too few collectives per rank to call persistence.
    durations = {} if any(d.tail_only for d in dumps.values()) else _durations(dumps)
    if durations:
        have = {int(f.evidence["rank"]) for f in straggler_findings}
        straggler_findings += [f for f in detect_from_durations(durations, straggler_config)
                               if int(f.evidence["rank"]) not in have]
    findings += straggler_findings

    world = result.world_size or (max((s.rank for s in steps or ()), default=-1) + 1)
    # Without dumps, the ranks are those that sent step records.
    seen = sorted(dumps) if dumps else sorted({s.rank for s in steps or ()})
    missing = sorted(set(range(world)) - set(seen)) if seen else []
    verdict = _verdict(findings, dumps, missing, bool(steps))
    report = TriageReport(
        verdict=verdict, summary="", findings=findings, ranks_seen=seen, ranks_missing=missing,
        groups=[g.to_dict() for g in result.groups.values()], problems=list(loaded.problems),
        identity=loaded.identity_sources, notes=list(result.notes),
    )
    if any(d.tail_only for d in dumps.values()):
        report.notes.append(f"large job: read the newest entries of each dump only (≥{tail_used} per rank, "
                            "more where a group's frontier needed it); older history was not compared")
    report.summary = _summary(report)
    return report


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


# --------------------------------------------------------------------------------------- findings


def _job_entity(job: Mapping[str, Any]) -> Entity:
    return Entity(EntityKind.JOB, str(job.get("job_id") or "job"))


def _stack(e: Entry | None) -> list[str]:
    if e is None or not e.frames:
        return []
    # Skip torch.distributed's own frames: the user's call site is what helps.
    frames = [f for f in e.frames if "/torch/distributed/" not in f.filename] or list(e.frames)
    return [str(f) for f in frames[:MAX_STACK_FRAMES]]


def _collective(view: GroupView, seq: int, ranks: Sequence[int]) -> tuple[dict[str, Any], Entry | None]:
    """Describe collective ``seq`` of a group from the entries of ``ranks`` (majority signature)."""
    entries = [e for r in ranks if (e := view.entry(r, seq)) is not None]
    if not entries:
        return {"group": view.name, "group_desc": view.desc, "seq": seq}, None
    counts: dict[Signature, list[Entry]] = defaultdict(list)
    for e in entries:
        counts[Signature.of(e)].append(e)
    _sig, group_entries = max(counts.items(), key=lambda kv: len(kv[1]))
    e = group_entries[0]
    with_frames = next((x for x in group_entries if x.frames), e)
    info = {"group": view.name, "group_desc": view.desc, "seq": seq, "op": e.profiling_name,
            "input_sizes": [list(s) for s in e.in_sizes], "input_dtypes": list(e.in_dtypes),
            "output_sizes": [list(s) for s in e.out_sizes], "output_dtypes": list(e.out_dtypes)}
    return info, with_frames


def _describe(info: Mapping[str, Any]) -> str:
    op = info.get("op", "collective")
    sizes = info.get("input_sizes")
    dtypes = info.get("input_dtypes")
    desc = f" ({info['group_desc']})" if info.get("group_desc") and info["group_desc"] != "undefined" else ""
    s = f"{op} #{info['seq']} in group {info['group']}{desc}"
    if sizes is not None:
        s += f", sizes {sizes}"
    if dtypes:
        s += f", dtypes {dtypes}"
    return s


def _last_seen(dump: RankDump | None) -> dict[str, Any] | None:
    if dump is None or not dump.entries:
        return None
    e = dump.entries[-1]
    return {"group": e.group, "seq": e.seq, "op": e.profiling_name, "state": e.state,
            "completed": e.retired or e.state == "completed", "stack": _stack(e)}


def _root_findings(root: Root, result: MatchResult, dumps: Mapping[int, RankDump],
                   job: Mapping[str, Any]) -> list[Finding]:
    view = result.groups[root.group]
    out: list[Finding] = []
    if root.kind == "mismatch":
        mm = next(m for m in result.mismatches if m.group == root.group and m.seq == root.seq)
        return _mismatch_findings(mm, view, dumps)
    waiting = [b.waiting for b in result.blockers if b.group == root.group and b.seq == root.seq]
    waiting += [lg.ahead for lg in result.laggards if lg.group == root.group and lg.seq == root.seq]
    waiters = waiting[0] if waiting else ()
    info, call_site = _collective(view, root.seq, waiters or view.dumped)
    base = {**info, "why": root.why, "waiting_ranks": list(waiters), "consequences": list(root.consequences)}
    stack = _stack(call_site)
    if stack:
        base["stack"] = stack
    if root.kind in ("host_stuck", "skipped"):
        for rank in root.ranks:
            d = dumps.get(rank)
            ev = {**base, "rank": rank, "kind": root.kind, "host": d.host if d else None,
                  "last_seen": _last_seen(d)}
            also = f" (also blocks group(s) {', '.join(root.consequences)})" if root.consequences else ""
            verb = "skipped" if root.kind == "skipped" else "never reached"
            msg = (f"rank {rank} {verb} {_describe(info)}; rank(s) {format_ranks(waiters)} wait in it{also}")
            out.append(Finding("collective.missing_rank", Severity.CRITICAL, Entity.rank(rank), msg,
                               Action.CHECK_JOB, ev, SOURCE))
    elif root.kind in ("timed_out", "behind"):
        lg = next(x for x in result.laggards if x.group == root.group and x.seq == root.seq and x.rank in root.ranks)
        d = dumps.get(lg.rank)
        ev = {**base, "rank": lg.rank, "kind": root.kind, "ahead_ranks": list(lg.ahead), "host": d.host if d else None,
              "last_seen": _last_seen(d), "idle_s": None if lg.idle_s is None else round(lg.idle_s, 1),
              "timeout_s": lg.timeout_s}
        ev.pop("waiting_ranks", None)
        if root.kind == "timed_out":
            msg = (f"rank {lg.rank} never reached {_describe(info)}; rank(s) {format_ranks(lg.ahead)} timed out "
                   f"waiting for it (process-group timeout {lg.timeout_s:g} s)")
            out.append(Finding("collective.missing_rank", Severity.CRITICAL, Entity.rank(lg.rank), msg,
                               Action.CHECK_JOB, ev, SOURCE))
        else:
            msg = (f"rank {lg.rank} is behind in group {lg.group}: it has not enqueued {_describe(info)} that "
                   f"rank(s) {format_ranks(lg.ahead)} ran; nobody waits, so this is likely dump timing")
            out.append(Finding("collective.rank_behind", Severity.INFO, Entity.rank(lg.rank), msg,
                               Action.MONITOR, ev, SOURCE))
    elif root.kind == "dump_missing":
        for rank in root.ranks:
            ev = {**base, "rank": rank}
            msg = (f"rank {rank} left no dump and rank(s) {format_ranks(waiters)} wait for it in {_describe(info)}: "
                   "it is the prime suspect (crashed, killed, or stuck before dumping)")
            out.append(Finding("flightrec.dump_missing", Severity.CRITICAL, Entity.rank(rank), msg,
                               Action.CHECK_JOB, ev, SOURCE))
    elif root.kind == "stall":
        st = next(s for s in result.stalls if s.group == root.group and s.seq == root.seq)
        info, call_site = _collective(view, root.seq, st.not_done)
        stack = _stack(call_site)
        if st.suspects:
            for rank in st.suspects:
                ev = {**info, "rank": rank, "why": root.why, "not_completed": list(st.not_done),
                      "host": dumps[rank].host if rank in dumps else None}
                if stack:
                    ev["stack"] = stack
                msg = f"rank {rank} never started {_describe(info)} that every rank enqueued: its GPU is stuck"
                out.append(Finding("collective.gpu_stall", Severity.CRITICAL, Entity.rank(rank), msg,
                                   Action.CHECK_JOB, ev, SOURCE))
        else:
            ev = {**info, "ranks": list(st.not_done), "why": root.why}
            if stack:
                ev["stack"] = stack
            msg = (f"{_describe(info)} was enqueued by every rank and completed by none of "
                   f"{format_ranks(st.not_done)}: GPU or network stall (check the GPUs and links of these ranks)")
            out.append(Finding("collective.gpu_stall", Severity.CRITICAL, _job_entity(job), msg,
                               Action.CHECK_JOB, ev, SOURCE))
    elif root.kind == "circular":
        ev = {**base, "ranks": list(root.ranks)}
        msg = f"circular wait between rank(s) {format_ranks(root.ranks)}: {root.why}"
        out.append(Finding("job.hang", Severity.CRITICAL, _job_entity(job), msg, Action.CHECK_JOB, ev, SOURCE))
    elif root.kind == "p2p":
        p = next(x for x in result.p2p if x.group == root.group and x.rank == root.ranks[0])
        e = p.entry
        ev = {"rank": p.rank, "peer": p.peer, "group": p.group, "p2p_seq": e.p2p_seq, "op": e.profiling_name,
              "input_sizes": [list(s) for s in e.in_sizes], "input_dtypes": list(e.in_dtypes), "why": root.why}
        if _stack(e):
            ev["stack"] = _stack(e)
        msg = (f"rank {p.peer} waits in {e.profiling_name} (p2p #{e.p2p_seq}, group {p.group}) for rank {p.rank}, "
               f"which never posted the matching {'recv' if p.op == 'send' else 'send'}")
        out.append(Finding("collective.p2p_unmatched", Severity.CRITICAL, Entity.rank(p.rank), msg,
                           Action.CHECK_JOB, ev, SOURCE))
    return out


_MISMATCH_CODES = {"type": "collective.type_mismatch", "size": "collective.size_mismatch",
                   "dtype": "collective.dtype_mismatch"}


def _mismatch_findings(mm: Mismatch, view: GroupView, dumps: Mapping[int, RankDump]) -> list[Finding]:
    by_sig: dict[Signature, list[int]] = defaultdict(list)
    for r, s in sorted(mm.by_rank.items()):
        by_sig[s].append(r)
    variants = [{**s.to_dict(), "ranks": rs} for s, rs in sorted(by_sig.items(), key=lambda kv: -len(kv[1]))]
    out = []
    exp = mm.expected
    for rank in mm.culprits:
        got = mm.by_rank[rank]
        e = view.entry(rank, mm.seq)
        what = {"type": f"calls {got.op} where the others call {exp.op}",
                "dtype": f"uses dtypes {list(got.in_dtypes)} where the others use {list(exp.in_dtypes)}",
                "size": f"passes sizes {[list(s) for s in got.in_sizes]}→{[list(s) for s in got.out_sizes]} "
                        f"where the others pass {[list(s) for s in exp.in_sizes]}→"
                        f"{[list(s) for s in exp.out_sizes]}"}[mm.kind]
        how = {"majority": "the other ranks agree", "history": "the others repeat what this group ran before",
               "undecided": "a tie: cannot tell which side is wrong"}[mm.decided_by]
        state = ("the collective completed anyway: results are silently wrong" if mm.completed
                 else "the collective cannot complete: the job hangs here")
        msg = (f"rank {rank} {what} at collective #{mm.seq} of group {view.name} ({how}); {state}")
        ev: dict[str, Any] = {
            "rank": rank, "group": view.name, "group_desc": view.desc, "seq": mm.seq, "kind": mm.kind,
            "actual": got.to_dict(), "expected": exp.to_dict(), "variants": variants, "decided_by": mm.decided_by,
            "completed": mm.completed, "host": dumps[rank].host if rank in dumps else None,
        }
        if mm.later_suppressed:
            ev["later_mismatches_not_compared"] = mm.later_suppressed
        if _stack(e):
            ev["stack"] = _stack(e)
        sev = Severity.CRITICAL if mm.decided_by != "undecided" else Severity.WARNING
        out.append(Finding(_MISMATCH_CODES[mm.kind], sev, Entity.rank(rank), msg, Action.CHECK_JOB, ev, SOURCE))
    return out


def _silent_mismatch_findings(result: MatchResult, dumps: Mapping[int, RankDump], roots: Sequence[Root],
                              job: Mapping[str, Any]) -> list[Finding]:
    # Mismatches that completed anyway (a broadcast leaf, same-bytes dtypes on Gloo) are not roots
    # of a hang but still corrupt results.
    done = {(r.group, r.seq) for r in roots if r.kind == "mismatch"}
    out = []
    for mm in result.mismatches:
        if (mm.group, mm.seq) not in done:
            out += _mismatch_findings(mm, result.groups[mm.group], dumps)
    return out


def _durations(dumps: Mapping[int, RankDump]) -> dict[int, list[tuple[str, int, float]]]:
    out: dict[int, list[tuple[str, int, float]]] = {}
    for rank, d in dumps.items():
        items = [(e.group, e.seq, e.duration_ms) for e in d.entries
                 if e.duration_ms is not None and not e.is_p2p and e.seq > 0]
        if items:
            out[rank] = [(g, s, float(ms)) for g, s, ms in items if ms is not None]
    return out


# ---------------------------------------------------------------------------------------- verdict


def _verdict(findings: Sequence[Finding], dumps: Mapping[int, RankDump], missing: Sequence[int],
             have_steps: bool) -> str:
    codes = {f.code for f in findings if f.severity >= Severity.WARNING}
    if any(c.endswith("_mismatch") for c in codes):
        return "mismatch"
    if codes & {"collective.missing_rank", "collective.gpu_stall", "collective.p2p_unmatched", "job.hang"}:
        return "hang"
    if "flightrec.dump_missing" in codes:
        return "incomplete"
    if "rank.straggler" in codes:
        return "straggler"
    if not dumps and not have_steps:
        return "incomplete"
    if missing:
        return "incomplete"
    return "healthy"


def _summary(report: TriageReport) -> str:
    v = report.verdict
    culprits = report.culprits
    if v in ("hang", "mismatch", "straggler") and report.findings:
        main = next((f for f in report.findings if f.severity is Severity.CRITICAL), report.findings[0])
        who = f"culprit rank(s) {format_ranks(culprits)}" if culprits else "no single culprit rank"
        return f"{v.upper()}: {who} — {main.message}"
    if v == "incomplete":
        if report.findings:
            return f"INCOMPLETE: {report.findings[0].message}"
        if not report.ranks_seen:
            return "INCOMPLETE: no readable dump" + (f" ({len(report.problems)} file problem(s))"
                                                     if report.problems else "")
        return (f"INCOMPLETE: no fault in the {len(report.ranks_seen)} rank(s) that dumped; "
                f"rank(s) {format_ranks(report.ranks_missing)} left no dump")
    return f"HEALTHY: {len(report.ranks_seen)} rank(s), no stuck, mismatched or straggling rank"
