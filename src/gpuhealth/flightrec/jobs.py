"""Several jobs' dumps in one folder: tell them apart, so that each gets its own verdict.

A folder handed to ``gpuhealth triage`` may hold more than one job: a folder of runs (one sub-folder
each), or two jobs' files side by side (``jobA-rank0.json``, ``jobB-rank0.json``). Read as one job, one
rank 0 hid the other and a hung job could be called healthy. What tells jobs apart is in the dumps:

- **the same rank twice**: two dumps that both say rank 0 (other than a JSON + pickle pair of one dump)
  are not one picture of one job;
- **the world**: NCCL dumps name their default group's members (``pg_config``): 2 ranks is not 4;
- **time**: ranks of one job record their collectives together; dumps whose newest collectives lie
  further apart than the job's own collective timeout (plus a minute) did not run together.

Files are first grouped the way people and tools name one job's dumps: by folder and by file-name
prefix (``node7-rank3.json``: "node7"; ``rank3.json``: none). Groups that can be one job — no rank in
common, the same world, times that fit — are joined, nearest folders first (the nodes of one job, a
folder or a prefix each). A group that could join more than one job is kept as a job of its own: its
verdict then says which ranks it lacks, rather than mixing two jobs.

Finding the jobs reads as little as it can: nothing when the names alone show one group whose ranks
are all different; otherwise each JSON dump's top-level blocks and newest entry (``tail_entries=1``:
files over 64 KiB are read from their end), each pickle whose JSON twin is not there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuhealth.flightrec.load import LoadResult, Problem, RankDump, load_dumps, rank_from_filename
from gpuhealth.flightrec.load import _expand as dump_files  # the loader's own walk: same files, same skips
from gpuhealth.flightrec.report import TriageReport, Verdict
from gpuhealth.model import StepRecord

__all__ = ["Job", "assign_steps", "find_jobs", "no_clean_bill_on_evidence_set_aside"]

IGNORED_MARK = "this file is ignored"  # the loader's word for a second dump of a rank it set aside
DEFAULT_TIMEOUT_MS = 600_000  # torch's default collective timeout, for dumps that do not say theirs
SLACK_NS = 60 * 10**9


@dataclass(slots=True)
class _Unit:
    """The files of one folder that share a name prefix."""

    folder: Path
    prefix: str | None
    files: list[Path]
    ranks: set[int] = field(default_factory=set)
    world: int | None = None
    newest_ns: tuple[int, int] | None = None  # (earliest, latest) of the ranks' newest collectives
    timeout_ns: int = DEFAULT_TIMEOUT_MS * 10**6
    readable: bool = True  # at least one dump loaded (a group of unreadable files has nothing to match)
    problems: list[Problem] = field(default_factory=list)
    readable_timeouts: bool = False  # timeout_ns is the dumps' own (else torch's default)


@dataclass(slots=True)
class Job:
    """One job's files, and how to call it: its folder relative to what was given, and name prefixes."""

    name: str
    files: list[str]
    folders: list[Path]
    ranks: list[int]
    newest_ns: tuple[int, int] | None = None
    timeout_ns: int = DEFAULT_TIMEOUT_MS * 10**6


def find_jobs(path: str | os.PathLike[str]) -> tuple[list[Job], list[Problem]]:
    """The jobs whose dumps are under ``path``, and the problems of files that belong to none (a folder
    walk that failed). One job when nothing says there are more."""
    found = LoadResult()
    files = list(dump_files([path], found))
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    units = _units(files)
    if len(units) <= 1 and _names_distinct(files):
        return [_job(root, units)] if units else [], found.problems
    _read_signatures(units)
    jobs: list[list[_Unit]] = []
    for unit in sorted((u for u in units if u.readable), key=lambda u: (str(u.folder), u.prefix or "")):
        best = _best_job(unit, jobs)
        if best is None:
            jobs.append([unit])
        else:
            best.append(unit)
    for unit in (u for u in units if not u.readable):
        # No dump read from these files (notes, unreadable dumps): they go with the nearest job, whose
        # report then names them — or, nearest to none in particular, they are the folder's problems.
        nearest = _nearest(unit, jobs)
        if nearest is not None:
            nearest.append(unit)
        else:
            found.problems += unit.problems
    return [_job(root, units_of_job) for units_of_job in jobs], found.problems


def _units(files: Iterable[Path]) -> list[_Unit]:
    by_key: dict[tuple[Path, str | None], _Unit] = {}
    for f in files:
        named = rank_from_filename(f.name)
        prefix = named[1] if named is not None else None
        key = (f.parent, prefix)
        by_key.setdefault(key, _Unit(f.parent, prefix, [])).files.append(f)
    return list(by_key.values())


def _names_distinct(files: Sequence[Path]) -> bool:
    """Every file names its rank, and no rank is named twice (a JSON + pickle pair of one dump aside)."""
    seen: dict[int, str] = {}
    for f in files:
        named = rank_from_filename(f.name)
        if named is None:
            return False
        stem = _stem(f)
        if seen.setdefault(named[0], stem) != stem:
            return False
    return True


def _stem(f: Path) -> str:
    name = f.name
    for suffix in (".gz", ".bz2", ".xz", ".zst", ".lz4", ".json", ".pkl", ".pickle", ".bin"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return str(f.parent / name)


def _read_signatures(units: Sequence[_Unit]) -> None:
    """Ranks, world and the time of the newest collectives of each group of files, from as little of each
    file as will say: a JSON dump's top-level blocks and newest entry, a pickle only without its JSON twin.
    All files are read in one loader call (in parallel for thousands); the loader keeps one dump per rank,
    so the files it set aside as a rank read already are read in the next round, until none is left."""
    owner: dict[str, _Unit] = {}
    for unit in units:
        json_stems = {_stem(f) for f in unit.files if ".json" in f.name.lower()}
        for f in unit.files:
            if ".json" in f.name.lower() or _stem(f) not in json_stems:
                owner[str(f)] = unit
        unit.readable = False
    # Round k reads the k-th file named for each rank: no round reads two files of one rank by name.
    by_rank: dict[object, list[str]] = {}
    for name in sorted(owner):
        named = rank_from_filename(Path(name).name)
        by_rank.setdefault(named[0] if named is not None else name, []).append(name)
    rounds = [[files[k] for files in by_rank.values() if k < len(files)]
              for k in range(max((len(v) for v in by_rank.values()), default=0))]
    pending: list[str] = []
    while rounds or pending:
        batch = (rounds.pop(0) if rounds else []) + pending
        loaded = load_dumps(batch, tail_entries=1)
        pending = []
        for dump in loaded.dumps.values():
            _note(_owner_of(dump.path, owner), dump)
        for problem in loaded.problems:
            holder = _owner_of(problem.path, owner)
            if problem.severity == "warning" and IGNORED_MARK in problem.message and problem.path in owner:
                pending.append(problem.path)  # another job's rank, most likely: its own round
            elif holder is not None:
                holder.problems.append(problem)
                if problem.severity == "error" and problem.rank is not None:
                    holder.ranks.add(problem.rank)


def _owner_of(path: str, owner: dict[str, _Unit]) -> _Unit | None:
    """The group a file belongs to (an archive member's path starts with its archive's)."""
    found = owner.get(path)
    return found if found is not None else next((u for f, u in owner.items() if path.startswith(f)), None)


def _note(unit: _Unit | None, dump: RankDump) -> None:
    if unit is None:
        return
    unit.readable = True
    unit.ranks.add(dump.rank)
    for group in dump.pg_config.values():
        if group.desc == "default_pg" and group.ranks:
            unit.world = len(group.ranks)
    times = [e.created_ns for e in dump.entries if e.created_ns]
    if times:
        newest = max(times)
        unit.newest_ns = (min(newest, unit.newest_ns[0]), max(newest, unit.newest_ns[1])) if unit.newest_ns \
            else (newest, newest)
    timeouts = [e.timeout_ms for e in dump.entries if e.timeout_ms]
    if timeouts:
        unit.timeout_ns = max(unit.timeout_ns, max(timeouts) * 10**6) if unit.readable_timeouts \
            else max(timeouts) * 10**6
        unit.readable_timeouts = True


def _fits(unit: _Unit, job: Sequence[_Unit]) -> bool:
    ranks = set().union(*(u.ranks for u in job))
    if not unit.readable or unit.ranks & ranks:
        return False
    worlds = {u.world for u in job if u.world is not None}
    if unit.world is not None and (worlds - {unit.world} or (ranks and max(ranks) >= unit.world)):
        return False
    if any(unit.ranks and max(unit.ranks) >= w for w in worlds):
        return False
    spans = [u.newest_ns for u in job if u.newest_ns is not None]
    if unit.newest_ns is not None and spans:
        slack = max(unit.timeout_ns, *(u.timeout_ns for u in job)) + SLACK_NS
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        if unit.newest_ns[0] > hi + slack or unit.newest_ns[1] < lo - slack:
            return False
    return True


def _best_job(unit: _Unit, jobs: Sequence[list[_Unit]]) -> list[_Unit] | None:
    """The job this group of files joins: the one with the nearest folder among those it fits; none when
    it fits none, or two equally near (which job it belongs to is then a guess)."""
    scored = [(max(_common_depth(unit.folder, u.folder) for u in job), i) for i, job in enumerate(jobs)
              if _fits(unit, job)]
    if not scored:
        return None
    top = max(s for s, _ in scored)
    best = [i for s, i in scored if s == top]
    return jobs[best[0]] if len(best) == 1 else None


def _nearest(unit: _Unit, jobs: Sequence[list[_Unit]]) -> list[_Unit] | None:
    if not jobs:
        return None
    depth = [max(_common_depth(unit.folder, u.folder) for u in job) for job in jobs]
    top = max(depth)
    return jobs[depth.index(top)] if depth.count(top) == 1 else None


def _common_depth(a: Path, b: Path) -> int:
    n = 0
    for x, y in zip(a.parts, b.parts, strict=False):
        if x != y:
            break
        n += 1
    return n


def _job(root: Path, units: Sequence[_Unit]) -> Job:
    folders = sorted({u.folder for u in units})
    common = Path(os.path.commonpath([str(f) for f in folders])) if folders else root
    try:
        where = str(common.relative_to(root)) if common != root else "."
    except ValueError:
        where = str(common)
    prefixes = sorted({u.prefix for u in units if u.prefix})
    named = ", ".join(p + "-*" for p in prefixes)
    name = (named if where == "." else f"{where} ({named})") if prefixes else where
    spans = [u.newest_ns for u in units if u.newest_ns is not None]
    return Job(name=name, files=sorted(str(f) for u in units for f in u.files), folders=folders,
               ranks=sorted(set().union(*(u.ranks for u in units))),
               newest_ns=(min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None,
               timeout_ns=max(u.timeout_ns for u in units) if units else DEFAULT_TIMEOUT_MS * 10**6)


def assign_steps(step_files: Sequence[tuple[str, Sequence[StepRecord]]], jobs: Sequence[Job]
                 ) -> tuple[list[list[StepRecord]], list[str]]:
    """Each job's step records, and a line for each set that fits no job or more than one (set aside).

    A steps file belongs to the jobs whose dumps are in its folder or below (``steps_rank0.jsonl`` beside
    ``dumps/``); where that leaves several, each of its jobs' records (by ``job_id``) goes to the one job
    whose newest collectives are within that job's timeout of the records' last step."""
    out: list[list[StepRecord]] = [[] for _ in jobs]
    set_aside: list[str] = []
    if len(jobs) == 1:
        out[0] = [r for _, records in step_files for r in records]
        return out, set_aside
    for path, records in step_files:
        folder = Path(path).resolve().parent
        near = [i for i, job in enumerate(jobs) if any(folder in (f.resolve(), *f.resolve().parents)
                                                          for f in job.folders)]
        candidates = near or list(range(len(jobs)))
        by_id: dict[str, list[StepRecord]] = {}
        for r in records:
            by_id.setdefault(r.job_id, []).append(r)
        for job_id, recs in by_id.items():
            fit = candidates if len(candidates) == 1 else [i for i in candidates if _steps_fit(recs, jobs[i])]
            if len(fit) == 1:
                out[fit[0]] += recs
            else:
                why = "fit no job's dumps in time" if not fit else \
                    f"fit {len(fit)} jobs ({', '.join(jobs[i].name for i in fit)})"
                set_aside.append(f"{path}: step records of job {job_id!r} {why}; not used")
    return out, set_aside


def _steps_fit(records: Sequence[StepRecord], job: Job) -> bool:
    if job.newest_ns is None:
        return False
    last_ns = int(max(r.start_time + r.wall_s for r in records) * 1e9)
    slack = job.timeout_ns + SLACK_NS
    return job.newest_ns[0] - slack <= last_ns <= job.newest_ns[1] + slack


def no_clean_bill_on_evidence_set_aside(report: TriageReport, set_aside: Sequence[str] = ()) -> TriageReport:
    """A job whose dumps say healthy is not called healthy when something that might have said otherwise was
    not read: a second dump of a rank (the loader keeps the first), step records that fit no one job."""
    ignored = [p for p in report.problems if p.severity == "warning" and IGNORED_MARK in p.message]
    if report.verdict is not Verdict.HEALTHY or not (ignored or set_aside):
        return report
    what = []
    if ignored:
        what.append(f"{len(ignored)} dump file(s) of ranks already read ({', '.join(p.path for p in ignored[:3])}"
                    + (", …" if len(ignored) > 3 else "") + ")")
    if set_aside:
        what.append(f"{len(set_aside)} set(s) of step records that fit no one job")
    report.verdict = Verdict.INCOMPLETE
    report.summary = (f"INCOMPLETE: no fault in the {len(report.ranks_seen)} rank(s) read, but {' and '.join(what)} "
                      "were set aside; triage them on their own")
    return report
