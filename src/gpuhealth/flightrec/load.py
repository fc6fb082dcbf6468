"""Read per-rank flight-recorder dumps into plain, normalized records — bounded, whatever the input.

JSON first (``_dump_nccl_trace_json`` / ``_dump_fr_trace_json``); pickles (``_dump_nccl_trace`` and
the dump-on-timeout files) only through :mod:`gpuhealth.flightrec.safe_pickle`; either of them
gzip/bzip2/xz-compressed or in a zip or tar archive (:mod:`gpuhealth.flightrec.archive`). Everything
that can be wrong with a dump — garbage bytes, a file cut short, an unknown version, a missing
field, a duplicate rank, a file too large, a hostile file — becomes a :class:`Problem` naming the
file (and the rank its name carries, so triage knows whose dump is missing); the other files still
load. Nothing here raises for bad input.

Bounds (whatever a file holds, memory stays a fixed multiple of its size and time linear in it):
a JSON dump is walked entry by entry (:mod:`gpuhealth.flightrec.jsonstream`), each entry decoded
from its own slice and normalized at once, at most ``MAX_ENTRIES`` of them; a pickle is read by a
pure-Python unpickler that refuses globals and reused lists (:mod:`gpuhealth.flightrec.safe_pickle`)
and normalized within a work budget proportional to its size; values are capped
(:mod:`gpuhealth.flightrec.normalize`: ``MAX_TENSORS``, ``MAX_DIMS``, ``MAX_FRAMES``, …) and counted
in one warning line; ranks must be below :data:`MAX_RANKS`.

Format tolerance (docs/reference/FLIGHT_RECORDER.md): versions 2.x; ``nccl_version`` (old) or ``comm_lib_version``;
``pg_status`` values as strings (JSON) or ints (pickle); unset timestamps as 0 (JSON) or None
(pickle); ``process_group`` as a list or a tuple; ``frames`` present (pickle) or not (JSON);
``entries`` absent when empty; NCCL (``nccl:``) and Gloo (``gloo:``) profiling names; any-source
p2p (``recv 1<-?``).

Rank identity comes from the contents when the file says it (a top-level ``rank``, or a
``gpuhealth`` block written by our instrument hook) and otherwise from the file name
(``rank3.json``, ``node7-rank3.json``, ``nccl_trace_rank_3``, ``fr_dump3``, ``rank3.json.gz``);
:attr:`RankDump.rank_source` says which.

Large jobs: with ``tail_entries`` set, a JSON dump is read from its end (:mod:`gpuhealth.flightrec.jsontail`)
— the small top-level blocks plus only the newest entries, extended until each group's last completed
collective is covered — so triaging 16,384 ranks does not mean parsing 16,384 × 2,000 entries.
Pickles, compressed dumps and JSON whose layout the tail reader does not recognise are read whole
(up to ``max_file_bytes``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.flightrec import archive
from gpuhealth.flightrec.jsonstream import MAX_ENTRIES, NOT_AN_OBJECT, DumpReader, JsonBoundsError, JsonSyntaxError
from gpuhealth.flightrec.jsontail import read_tail
from gpuhealth.flightrec.normalize import (
    MAX_RANKS,
    Normalized,
    Repairs,
    WalkBudgetError,
    entry,
    entry_fast,
    entry_slow,
    int_status,
    pg_config,
    text,
)
from gpuhealth.flightrec.records import Entry, Frame, GroupConfig, PgStatus
from gpuhealth.flightrec.safe_pickle import UnsafePickleError, loads_plain

__all__ = [
    "DEFAULT_MAX_FILE_BYTES", "MAX_RANKS", "DumpError", "Entry", "Frame", "GroupConfig", "LoadResult", "PgStatus",
    "Problem", "RankDump", "load_dumps", "paused_gc", "rank_from_filename",
]

# Set from measured growth (BENCHMARKS.md, "Hardening, round two") so that the worst file of each format
# costs `gpuhealth triage` under 1 GiB: a JSON dump takes up to ~13× its size as normalized records, a pickle
# at most safe_pickle.MEMORY_BUDGET of objects whatever its size.
DEFAULT_MAX_FILE_BYTES = 64 << 20  # a whole-file parse above this is refused (tail reading still works)
MAX_PICKLE_BYTES = 64 << 20  # a pickle is unpickled whole, within safe_pickle's memory budget
SUPPORTED_MAJOR = 2
_SKIP_SUFFIXES = {".jsonl", ".txt", ".log", ".tmp", ".md", ".csv"}
# The top-level blocks the loader reads; any other (nccl_comm_state, …) is skipped unread.
_TOP_KEYS = frozenset({"version", "comm_lib_version", "nccl_version", "pg_config", "pg_status", "rank", "host",
                       "gpuhealth", "dump_time_ns"})
_I64 = 1 << 63


@dataclass(slots=True)
class RankDump:
    rank: int
    rank_source: str  # "contents" | "filename"
    path: str
    format: str  # "json" | "pickle"
    version: str
    backend: str  # "nccl" | "gloo" | "unknown"
    comm_lib_version: str = ""
    host: str | None = None
    pg_config: dict[str, GroupConfig] = field(default_factory=dict)
    pg_status: dict[int, PgStatus] = field(default_factory=dict)  # by local pg_id
    entries: list[Entry] = field(default_factory=list)
    dump_time_ns: int | None = None
    dump_time_source: str = ""  # "contents" | "mtime" | ""
    tail_only: bool = False  # only the newest entries were read (older ones exist in the file)
    frames_from: str | None = None  # the pickle that gave call-site stacks to a JSON dump

    def group_status(self) -> dict[str, PgStatus]:
        """pg_status keyed by group name (mapped through this rank's entries: pg ids are local)."""
        by_id = {e.pg_id: e.group for e in self.entries}
        return {by_id[pid]: st for pid, st in self.pg_status.items() if pid in by_id}


@dataclass(frozen=True, slots=True)
class Problem:
    path: str
    message: str
    rank: int | None = None
    severity: str = "error"  # "error": the file gave nothing; "warning": it loaded with a caveat

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "message": self.message, "rank": self.rank, "severity": self.severity}


@dataclass(slots=True)
class LoadResult:
    dumps: dict[int, RankDump] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    @property
    def identity_sources(self) -> dict[int, str]:
        return {r: d.rank_source for r, d in sorted(self.dumps.items())}

    @property
    def ranks(self) -> list[int]:
        return sorted(self.dumps)


class DumpError(ValueError):
    """One file could not be read as a dump (becomes a Problem; never escapes load_dumps)."""


# ------------------------------------------------------------------------------------ public API


def load_dumps(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    tail_entries: int | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    workers: int | None = None,
) -> LoadResult:
    """Load every dump under ``paths`` (a folder, a file, or a list of either).

    ``tail_entries``: read at least this many of the newest entries per JSON dump (more when a
    group's frontier needs it) instead of the whole file. None reads everything.
    ``workers``: processes to read with (None: one per CPU for thousands of files read by their
    tails, else 1). Workers are spawned, not forked, so a caller with threads is safe."""
    result = LoadResult()
    files = [str(p) for p in _expand(paths, result)]
    if workers is None:
        workers = min(os.cpu_count() or 1, 8) if (tail_entries is not None and len(files) >= PARALLEL_MIN_FILES) else 1
    if workers > 1 and len(files) > 1:
        chunks = [files[i::workers] for i in range(workers)]
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        try:
            with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                parts = list(pool.map(_load_many, chunks, [tail_entries] * workers, [max_file_bytes] * workers))
        except (OSError, RuntimeError, concurrent.futures.process.BrokenProcessPool):
            parts = [_load_many(files, tail_entries, max_file_bytes)]  # no processes here: read inline
        loaded = sorted((item for dumps, _ in parts for item in dumps), key=lambda d: d.path)
        for _, problems in parts:
            result.problems += problems
    else:
        loaded, problems = _load_many(files, tail_entries, max_file_bytes)
        result.problems += problems
    for dump in loaded:
        _merge(result, dump)
    result.problems.sort(key=lambda p: p.path)
    return result


PARALLEL_MIN_FILES = 2048


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building millions of acyclic records (it would
    rescan them all again and again: ~25 % of the load time at 16k ranks); restore it after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _load_many(files: Sequence[str], tail_entries: int | None, max_file_bytes: int
               ) -> tuple[list[RankDump], list[Problem]]:
    with paused_gc():
        return _load_many_inner(files, tail_entries, max_file_bytes)


def _load_many_inner(files: Sequence[str], tail_entries: int | None, max_file_bytes: int
                     ) -> tuple[list[RankDump], list[Problem]]:
    dumps: list[RankDump] = []
    problems: list[Problem] = []
    hint: dict[str, int] = {}
    for name in files:
        path = Path(name)
        with _as_problem(problems, str(path), path.name):
            kind, st = _sniff_file(path)
            if archive.is_packed(kind):
                for member in archive.unpack(path, kind, max_file_bytes, _wanted):
                    if member.data is None:
                        problems.append(_unreadable(member.display, member.name, member.error or "not read"))
                        continue
                    with _as_problem(problems, member.display, member.name):
                        dumps.append(_load_data(member.display, member.name, member.data, member.mtime_ns,
                                                problems))
            else:
                dumps.append(_load_file(path, kind, st, tail_entries=tail_entries, max_file_bytes=max_file_bytes,
                                        problems=problems, hint=hint))
    return dumps, problems


@contextlib.contextmanager
def _as_problem(problems: list[Problem], display: str, name: str) -> Iterator[None]:
    """Whatever goes wrong reading one file (or archive member) becomes one Problem line."""
    try:
        yield
    except (DumpError, UnsafePickleError, archive.ArchiveError) as exc:
        problems.append(_unreadable(display, name, str(exc)))
    except OSError as exc:
        problems.append(_unreadable(display, name, f"cannot be read: {exc.strerror or exc}"))
    except MemoryError as exc:
        exc.__traceback__ = None  # its frames hold what filled memory: let it go before saying so
        problems.append(_unreadable(display, name, "ran out of memory reading it"))
    except Exception as exc:  # a bug of ours: still one line, never a traceback
        problems.append(_unreadable(display, name, f"could not be read: {type(exc).__name__}: {exc} "
                                                   "(a bug in gpuhealth: please report it)"))


def _unreadable(display: str, name: str, message: str) -> Problem:
    """An error Problem carrying the rank the file's name gives (triage then knows whose dump is
    unreadable); None when the name has none, or an impossible one."""
    by_name = rank_from_filename(name)
    rank = by_name[0] if by_name is not None and by_name[0] < MAX_RANKS else None
    return Problem(display, message, rank)


def rank_from_filename(name: str) -> tuple[int, str | None] | None:
    """(rank, host or None) from a dump's file name, or None when the name carries no rank. The
    rank may be absurd (``rank9999999999999.json``): the loader refuses ranks ≥ MAX_RANKS."""
    stem = name
    for suffixes in ((".gz", ".bz2", ".xz", ".zst", ".lz4"), (".json", ".pkl", ".pickle", ".bin")):
        for suffix in suffixes:
            if stem.lower().endswith(suffix):
                stem = stem[: -len(suffix)]
                break
    m = _RANK_WORD.search(stem)
    if m is None:
        m = _TRAILING_DIGITS.search(stem)
        if m is None:
            return None
    host = m.group("host").strip("._-") if m.group("host") else None
    if host and host.lower().strip("._-") in _NOT_HOSTS:
        host = None
    return int(m.group("rank")), host or None


# ----------------------------------------------------------------------------------- file discovery

_RANK_WORD = re.compile(r"^(?P<host>.*?)[._-]*rank[._-]?(?P<rank>\d{1,30})$", re.IGNORECASE)
_TRAILING_DIGITS = re.compile(r"^(?P<host>.*?)[._-]?(?P<rank>\d{1,30})$")
_NOT_HOSTS = {"", "nccl_trace", "nccl_trace_", "fr_trace", "trace", "dump", "fr", "fr_dump", "nccl", "gloo",
              "flight_recorder", "nccl_trace_rank", "host"}


def _wanted(name: str) -> bool:
    """Whether a file (or archive member) may be a dump: not hidden, not a log, steps file or note."""
    parts = name.replace("\\", "/").split("/")
    base = parts[-1]
    return bool(base) and not base.startswith(".") and "__MACOSX" not in parts \
        and Path(base).suffix.lower() not in _SKIP_SUFFIXES


def _expand(paths: Any, result: LoadResult) -> Iterator[Path]:
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    for item in items:
        p = Path(item)
        if p.is_dir():
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if _wanted(name):
                        yield Path(root) / name
        elif p.exists():
            yield p
        else:
            result.problems.append(Problem(str(p), "no such file or folder"))


def _merge(result: LoadResult, dump: RankDump) -> None:
    have = result.dumps.get(dump.rank)
    if have is None:
        result.dumps[dump.rank] = dump
        return
    # The same rank twice: a JSON + pickle pair from one dump is normal (JSON wins, the pickle
    # lends its stacks); anything else is a naming problem worth saying.
    if have.format != dump.format:
        json_dump, pkl_dump = (have, dump) if have.format == "json" else (dump, have)
        result.dumps[dump.rank] = json_dump
        if not json_dump.frames_from:
            json_dump.frames_from = pkl_dump.path
            _copy_frames(json_dump, pkl_dump)
        return
    result.problems.append(Problem(dump.path, f"rank {dump.rank} already loaded from {have.path}; this file is ignored",
                                   rank=dump.rank, severity="warning"))


def _copy_frames(target: RankDump, source: RankDump) -> None:
    frames = {e.record_id: e.frames for e in source.entries if e.frames}
    for e in target.entries:
        if not e.frames and e.record_id in frames:
            e.frames = frames[e.record_id]


# ---------------------------------------------------------------------------------- one file


def _sniff_file(path: Path) -> tuple[str, os.stat_result]:
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise DumpError("not a regular file")
    if st.st_size == 0:
        raise DumpError("empty file")
    with path.open("rb") as fh:
        head = fh.read(512)
    return _format(head), st


def _format(head: bytes) -> str:
    """"json", "pickle", or a packed kind (archive.sniff); DumpError for anything else."""
    if head.lstrip()[:1] == b"{":
        return "json"
    if head[:1] == b"\x80":
        return "pickle"
    kind = archive.sniff(head)
    if kind:
        return kind
    raise DumpError(f"not a flight-recorder dump (starts with {head[:8]!r}; expected JSON, a pickle or a "
                    "gzip/bzip2/xz/zip/tar of them)")


def _load_file(path: Path, fmt: str, st: os.stat_result, *, tail_entries: int | None, max_file_bytes: int,
               problems: list[Problem], hint: dict[str, int] | None = None) -> RankDump:
    size = st.st_size
    # A tail window that covers the whole file anyway (~200 bytes an entry at least) is read whole.
    if fmt == "json" and tail_entries is not None and size > 64 * 1024 and tail_entries * 200 < size:
        try:
            tail = read_tail(path, size, tail_entries, _TOP_KEYS, hint)
        except JsonBoundsError as exc:
            raise DumpError(str(exc)) from exc
        if tail is not None:
            return _build(str(path), path.name, fmt, tail[0], "array", tail[1], st.st_mtime_ns, problems)
    if size > max_file_bytes:
        raise DumpError(f"file is {size / 2**20:.0f} MiB, over the {max_file_bytes / 2**20:.0f} MiB limit for a "
                        "whole-file parse (a JSON dump can be read by its tail: use the tail window)")
    return _load_data(str(path), path.name, path.read_bytes(), st.st_mtime_ns, problems)


def _load_data(display: str, name: str, data: bytes, mtime_ns: int | None, problems: list[Problem]) -> RankDump:
    """One dump from its bytes (a file read whole, or an archive member)."""
    fmt = _format(data[:512])
    if fmt == "json":
        blocks, kind, got = _read_json(data)
    elif fmt == "pickle":
        if len(data) > MAX_PICKLE_BYTES:
            raise DumpError(f"pickle is {len(data) / 2**20:.0f} MiB, over the {MAX_PICKLE_BYTES >> 20} MiB limit "
                            "for pickles (read whole into memory); use the JSON dump")
        blocks, kind, got = _read_pickle(data)
    else:
        raise DumpError(f"a {fmt} inside a packed file is not unpacked: unpack it first")
    return _build(display, name, fmt, blocks, kind, got, mtime_ns, problems)


def _read_json(data: bytes) -> tuple[dict[str, Any], str, Normalized]:
    reader = DumpReader(data, _TOP_KEYS)
    repairs = Repairs()
    entries: list[Entry] = []
    append = entries.append
    bad = 0
    try:
        for item in reader.entries():  # each raw entry is dropped as soon as it is normalized
            e: Entry | None = None
            if type(item) is dict:
                try:
                    e = entry_fast(item)
                except (KeyError, TypeError, ValueError, AttributeError, IndexError):
                    e = None
                if e is None:
                    e = entry_slow(item, repairs)
                    repairs.end_entry()
            elif item is not NOT_AN_OBJECT:  # pragma: no cover - the reader yields objects or the marker
                e = None
            if e is None:
                bad += 1
            else:
                append(e)
    except JsonSyntaxError as exc:
        raise DumpError(f"broken JSON (file cut short or corrupted?): {exc}") from exc
    except JsonBoundsError as exc:
        raise DumpError(str(exc)) from exc
    if reader.entries_kind == "absent" and not any(k in reader.blocks for k in ("version", "pg_status", "pg_config")):
        keys = ", ".join(reader.keys[:6])
        raise DumpError(f"not a flight-recorder dump (no version, entries, pg_status or pg_config; keys: {keys})")
    return reader.blocks, reader.entries_kind, Normalized(entries, bad, repairs)


def _read_pickle(data: bytes) -> tuple[dict[str, Any], str, Normalized]:
    try:
        obj = loads_plain(data)
    except UnsafePickleError:
        raise
    except ValueError as exc:
        raise DumpError(str(exc)) from exc
    if not isinstance(obj, dict):
        raise DumpError(f"pickle holds a {type(obj).__name__}, not a dump dict")
    if not any(k in obj for k in ("entries", "version", "pg_status", "pg_config")):
        keys = ", ".join(k if isinstance(k, str) else type(k).__name__ for k, _ in zip(obj, range(6), strict=False))
        raise DumpError(f"not a flight-recorder dump (no version, entries, pg_status or pg_config; keys: {keys})")
    blocks = {k: obj[k] for k in _TOP_KEYS if k in obj}
    raw: Any = obj.get("entries")
    kind = "absent" if raw is None else "array" if isinstance(raw, list | tuple) else type(raw).__name__
    # The walk may visit about as many items as the file has bytes: shared dicts (allowed: torch
    # shares stack frames) cannot make it walk more.
    repairs = Repairs(budget=2 * len(data) + 65536, shared=True)
    entries: list[Entry] = []
    bad = 0
    if kind == "array":
        if len(raw) > MAX_ENTRIES:
            raise DumpError(f"{len(raw):,} entries: more than any flight-recorder buffer holds ({MAX_ENTRIES:,})")
        seen: set[int] = set()
        try:
            for item in raw:
                if type(item) is dict:
                    if id(item) in seen:
                        raise DumpError("refused: the pickle lists one entry several times (a flight-recorder dump "
                                        "never does; reused references can describe far more than the file holds)")
                    seen.add(id(item))
                repairs.charge(1)
                e = entry(item, repairs)
                if e is None:
                    bad += 1
                else:
                    entries.append(e)
        except WalkBudgetError as exc:
            raise DumpError(str(exc)) from exc
    return blocks, kind, Normalized(entries, bad, repairs)


def _build(display: str, name: str, fmt: str, top: Mapping[str, Any], entries_kind: str, got: Normalized,
           mtime_ns: int | None, problems: list[Problem]) -> RankDump:
    """The RankDump from the top-level blocks and the normalized entries; warnings into problems."""
    ident: Mapping[str, Any] = top["gpuhealth"] if isinstance(top.get("gpuhealth"), dict) else {}
    rank_val = top.get("rank", ident.get("rank"))
    by_name = rank_from_filename(name)
    host: str | None = None
    if type(rank_val) is int and rank_val >= 0:
        if rank_val >= MAX_RANKS:
            raise DumpError(f"the dump says it is rank {_big(rank_val)}: ranks above {MAX_RANKS - 1:,} are refused "
                            f"(MAX_RANKS; no job is that large)")
        rank, source = rank_val, "contents"
        host = text(top.get("host", ident.get("host")), limit=255) or (by_name[1] if by_name else None)
        if by_name is not None and by_name[0] != rank:
            problems.append(Problem(display, f"file name says rank {_big(by_name[0])} but the contents say rank "
                                             f"{rank}; using the contents", rank=rank, severity="warning"))
    elif by_name is not None:
        if by_name[0] >= MAX_RANKS:
            raise DumpError(f"the file name says rank {_big(by_name[0])}: ranks above {MAX_RANKS - 1:,} are refused "
                            "(MAX_RANKS; no job is that large)")
        rank, host = by_name
        source = "filename"
    else:
        raise DumpError("cannot tell which rank this dump is from: no 'rank' in the contents and no rank number "
                        "in the file name (name files like rank3.json or node7-rank3.json)")

    version = text(top.get("version", ""), limit=64)
    if not version:
        problems.append(Problem(display, "no format version in the dump; reading it as 2.x", rank, "warning"))
    else:
        head = version.split(".")[0]
        major = int(head) if head.isdigit() and len(head) < 6 else -1
        if major != SUPPORTED_MAJOR:
            problems.append(Problem(display, f"format version {version!r} is not 2.x; read on a best-effort basis",
                                    rank, "warning"))
    if entries_kind not in ("array", "absent"):
        problems.append(Problem(display, f"'entries' is a {entries_kind}, not a list; ignored", rank, "warning"))
    entries = got.entries
    if got.bad:
        what = f"{got.bad} malformed entr{'y' if got.bad == 1 else 'ies'} skipped"
        problems.append(Problem(display, what, rank, "warning"))
    repairs = got.repairs
    try:
        groups = pg_config(top.get("pg_config"), repairs)
        status = int_status(top.get("pg_status"), repairs)
    except WalkBudgetError as exc:
        raise DumpError(str(exc)) from exc
    for message in repairs.messages():
        problems.append(Problem(display, message, rank, "warning"))
    entries.sort(key=lambda e: e.record_id)
    backends = {e.backend for e in entries if e.backend}
    comm = text(top.get("comm_lib_version") or top.get("nccl_version"), limit=64)
    if len(backends) == 1:
        backend = next(iter(backends))
    elif backends:
        backend = "mixed"
    else:
        backend = "nccl" if comm else "unknown"
    dump = RankDump(
        rank=rank, rank_source=source, path=display, format=fmt, version=version, backend=backend,
        comm_lib_version=comm, host=host, pg_config=groups, pg_status=status, entries=entries,
        tail_only=got.tail_only,
    )
    dump_time = top.get("dump_time_ns", ident.get("dump_time_ns"))
    if type(dump_time) is int and 0 < dump_time < _I64:
        dump.dump_time_ns, dump.dump_time_source = dump_time, "contents"
    elif mtime_ns is not None:
        dump.dump_time_ns, dump.dump_time_source = mtime_ns, "mtime"
    return dump


def _big(n: int) -> str:
    """A number for a message; a huge one (no str() past 4,300 digits) as its size."""
    return f"{n:,}" if n.bit_length() <= 64 else f"≈2^{n.bit_length() - 1}"
