"""Read per-rank flight-recorder dumps into plain, normalized records.

JSON first (``_dump_nccl_trace_json`` / ``_dump_fr_trace_json``); pickles (``_dump_nccl_trace`` and
the dump-on-timeout files) only through :mod:`gpuhealth.flightrec.safe_pickle`. Everything that can
be wrong with a dump — garbage bytes, a file cut short, an unknown version, a missing field, a
duplicate rank, a file too large — becomes a :class:`Problem` naming the file; the other files
still load. Nothing here raises for bad input.

Format tolerance (FLIGHT_RECORDER.md): versions 2.x; ``nccl_version`` (old) or ``comm_lib_version``;
``pg_status`` values as strings (JSON) or ints (pickle); unset timestamps as 0 (JSON) or None
(pickle); ``process_group`` as a list or a tuple; ``frames`` present (pickle) or not (JSON);
``entries`` absent when empty; NCCL (``nccl:``) and Gloo (``gloo:``) profiling names.

Rank identity comes from the contents when the file says it (a top-level ``rank``, or a
``gpuhealth`` block written by our instrument hook) and otherwise from the file name
(``rank3.json``, ``node7-rank3.json``, ``nccl_trace_rank_3``, ``fr_dump3``); :attr:`RankDump.rank_source`
says which.

Large jobs: with ``tail_entries`` set, a JSON dump is read from its end — the small top-level
blocks plus only the newest entries, extended until each group's last completed collective is
covered — so triaging 16,384 ranks does not mean parsing 16,384 × 2,000 entries. Pickles and
JSON whose layout the tail reader does not recognise are parsed whole (up to ``max_file_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.flightrec.safe_pickle import UnsafePickleError, loads_plain

DEFAULT_MAX_FILE_BYTES = 1 << 30  # a whole-file parse above this is refused (tail reading still works)
SUPPORTED_MAJOR = 2
_SKIP_SUFFIXES = {".jsonl", ".txt", ".log", ".tmp", ".md", ".csv", ".tar", ".gz", ".tgz", ".zip"}


@dataclass(frozen=True, slots=True)
class Frame:
    name: str
    filename: str
    line: int

    def __str__(self) -> str:
        return f"{self.name} at {self.filename}:{self.line}"


@dataclass(slots=True)
class Entry:
    """One flight-recorder entry, normalized. Times are ns since the epoch or None (never 0)."""

    record_id: int
    pg_id: int  # the process-local ProcessGroup uid (NOT the same on every rank)
    group: str  # the process-group name: the same on every rank, the key to match on
    group_desc: str
    seq: int  # collective_seq_id
    p2p_seq: int
    op_id: int
    op: str  # "all_reduce", "_all_gather_base", "send", …
    backend: str  # "nccl", "gloo", "" (from the profiling name)
    in_sizes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[str, ...]
    out_sizes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[str, ...]
    state: str  # scheduled | started | completed (Gloo: always scheduled)
    retired: bool
    is_p2p: bool
    created_ns: int | None = None
    started_ns: int | None = None
    completed_ns: int | None = None
    duration_ms: float | None = None
    timeout_ms: int | None = None
    frames: tuple[Frame, ...] = ()
    p2p_src: int | None = None  # group-local ranks of a send/recv ("send 1->2", "recv 2<-1")
    p2p_dst: int | None = None

    @property
    def profiling_name(self) -> str:
        return f"{self.backend}:{self.op}" if self.backend else self.op


@dataclass(frozen=True, slots=True)
class PgStatus:
    enqueued: int | None
    started: int | None
    completed: int | None


@dataclass(frozen=True, slots=True)
class GroupConfig:
    name: str
    desc: str
    ranks: tuple[int, ...] | None  # None when the dump does not say (Gloo records "[]")


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
        try:
            dumps.append(_load_file(path, tail_entries=tail_entries, max_file_bytes=max_file_bytes, problems=problems,
                                    hint=hint))
        except (UnsafePickleError, DumpError, OSError) as exc:
            problems.append(Problem(str(path), str(exc)))
    return dumps, problems


def rank_from_filename(name: str) -> tuple[int, str | None] | None:
    """(rank, host or None) from a dump's file name, or None when the name carries no rank."""
    stem = name
    for suffix in (".json", ".pkl", ".pickle", ".bin"):
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

_RANK_WORD = re.compile(r"^(?P<host>.*?)[._-]*rank[._-]?(?P<rank>\d+)$", re.IGNORECASE)
_TRAILING_DIGITS = re.compile(r"^(?P<host>.*?)[._-]?(?P<rank>\d+)$")
_NOT_HOSTS = {"", "nccl_trace", "nccl_trace_", "fr_trace", "trace", "dump", "fr", "fr_dump", "nccl", "gloo",
              "flight_recorder", "nccl_trace_rank", "host"}


def _expand(paths: Any, result: LoadResult) -> Iterator[Path]:
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    for item in items:
        p = Path(item)
        if p.is_dir():
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if name.startswith(".") or Path(name).suffix.lower() in _SKIP_SUFFIXES:
                        continue
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


def _load_file(path: Path, *, tail_entries: int | None, max_file_bytes: int, problems: list[Problem],
               hint: dict[str, int] | None = None) -> RankDump:
    size = path.stat().st_size
    if size == 0:
        raise DumpError("empty file")
    with path.open("rb") as fh:
        head = fh.read(16)
    first = head.lstrip()[:1]
    if first == b"{":
        fmt = "json"
    elif head[:1] == b"\x80":
        fmt = "pickle"
    else:
        raise DumpError(f"not a flight-recorder dump (starts with {head[:8]!r}; expected JSON or a pickle)")
    raw: dict[str, Any] | None = None
    tail_info: tuple[dict[str, Any], list[Any], bool] | None = None
    # A tail window that covers the whole file anyway (~200 bytes an entry at least) is read whole:
    # one json.loads is faster than decoding entry by entry from the end.
    if fmt == "json" and tail_entries is not None and size > 64 * 1024 and tail_entries * 200 < size:
        tail_info = _read_json_tail(path, size, tail_entries, hint)
    if tail_info is None:
        if size > max_file_bytes:
            raise DumpError(f"file is {size / 2**20:.0f} MiB, over the {max_file_bytes / 2**20:.0f} MiB limit for a "
                            "whole-file parse (a JSON dump can be read by its tail: use the tail window)")
        data = path.read_bytes()
        raw = _parse_json(data) if fmt == "json" else _parse_pickle(data)
        tail_only = False
        raw_entries = raw.get("entries") or []
    else:
        raw, raw_entries, tail_only = tail_info
    return _normalize(path, fmt, raw, raw_entries, tail_only, problems)


def _parse_json(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except UnicodeDecodeError as exc:
        raise DumpError(f"not UTF-8 JSON: {exc}") from exc
    except ValueError as exc:
        raise DumpError(f"broken JSON (file cut short or corrupted?): {exc}") from exc
    except RecursionError as exc:
        raise DumpError("JSON nested too deeply") from exc
    if not isinstance(obj, dict):
        raise DumpError(f"JSON top level is a {type(obj).__name__}, not an object")
    _require_dump_keys(obj)
    return obj


def _parse_pickle(data: bytes) -> dict[str, Any]:
    try:
        obj = loads_plain(data)
    except UnsafePickleError:
        raise
    except ValueError as exc:
        raise DumpError(str(exc)) from exc
    if not isinstance(obj, dict):
        raise DumpError(f"pickle holds a {type(obj).__name__}, not a dump dict")
    _require_dump_keys(obj)
    return obj


def _require_dump_keys(obj: Mapping[str, Any]) -> None:
    if not any(k in obj for k in ("entries", "version", "pg_status", "pg_config")):
        keys = ", ".join(sorted(map(str, obj))[:6])
        raise DumpError(f"not a flight-recorder dump (no version, entries, pg_status or pg_config; keys: {keys})")


# An entry object starts with one of the entry keys (whatever order the writer used).
_ENTRY_KEY_AT = re.compile(
    rb'\{"(?:collective_seq_id|record_id|frames|pg_id|process_group|profiling_name|duration_ms|input_dtypes)"'
)
_ENTRIES_KEY = re.compile(rb'"entries"\s*:\s*\[')


def _read_json_tail(path: Path, size: int, want: int, hint: dict[str, int] | None = None
                    ) -> tuple[dict[str, Any], list[Any], bool] | None:
    """(top-level blocks, newest entries, tail_only) read from the end of a JSON dump, or None when
    the layout is not the one torch writes (sorted keys: "entries" before "pg_status")."""
    with path.open("rb") as fh:
        head = fh.read(min(size, 4096))
        m = _ENTRIES_KEY.search(head)
        if m is None:
            return None
        try:
            prefix = json.loads(head[: m.start()].rstrip().rstrip(b",") + b"}")
        except ValueError:
            return None
        if not isinstance(prefix, dict):
            return None
        entries_start = m.end()
        # Dumps of one job have the same layout: start from the previous file's suffix size so a
        # large pg_config (the world's rank list) is read in one go.
        chunk = max(64 * 1024, (hint or {}).get("suffix", 0) + 16 * 1024) + want * 1024
        suffix: dict[str, Any] | None = None
        suffix_len = 0
        while True:
            start = max(entries_start, size - chunk)
            fh.seek(start)
            buf = fh.read(size - start)
            if suffix is None:
                found = _split_suffix(buf, (hint or {}).get("suffix"))
                if found is None:
                    if start == entries_start:
                        return None
                    chunk *= 4  # a large pg_config (the world's rank list) did not fit yet
                    continue
                suffix, cut = found
                suffix_len = len(buf) - cut
                if hint is not None:
                    hint["suffix"] = suffix_len
            body = buf[: len(buf) - suffix_len]
            top = {**prefix, **suffix}
            status = _int_status(top.get("pg_status"))
            entries: list[Any] = []
            covered: dict[int, int] = {}
            done = False
            pos = 0
            for pos in _entry_starts_backwards(body, at_array_start=start == entries_start):
                try:
                    obj = _decode_at(body, pos)
                except ValueError:
                    return None
                entries.append(obj)
                if isinstance(obj, dict):
                    pid = _as_int(obj.get("pg_id"), -1)
                    seq = _as_int(obj.get("collective_seq_id"), -1)
                    if pid is not None and seq is not None:
                        covered[pid] = min(covered.get(pid, seq), seq)
                if len(entries) >= want and _frontier_covered(status, covered):
                    done = True
                    break
            entries.reverse()
            if start == entries_start:
                return top, entries, done and _entry_starts_exist_before(body, pos)
            if done:
                return top, entries, True
            chunk *= 4


def _entry_starts_backwards(body: bytes, *, at_array_start: bool) -> Iterator[int]:
    """Offsets of the entry objects in ``body`` (a slice of the entries array), newest first. An
    entry starts with '{"' + an entry key, after "," or (first entry) "["."""
    pos = len(body)
    while True:
        i = body.rfind(b'{"', 0, pos)
        if i < 0:
            return
        j = i - 1
        while j >= 0 and body[j] in b" \t\r\n":
            j -= 1
        before = body[j : j + 1] if j >= 0 else (b"[" if at_array_start else b"")
        if before in (b",", b"[") and _ENTRY_KEY_AT.match(body, i):
            yield i
        pos = i


def _entry_starts_exist_before(body: bytes, pos: int) -> bool:
    return any(True for _ in _entry_starts_backwards(body[:pos], at_array_start=True))


def _decode_at(buf: bytes, pos: int) -> Any:
    """Decode the one entry object that starts at byte offset ``pos``. Entries nest only lists (and
    small frame dicts in re-serialized pickles), so the object ends at one of the next "}"."""
    end = buf.find(b"}", pos)
    tries = 0
    while end != -1 and tries < 256:
        try:
            return json.loads(buf[pos : end + 1])
        except ValueError:
            end = buf.find(b"}", end + 1)
            tries += 1
    raise ValueError("unterminated entry")


def _split_suffix(buf: bytes, hint: int | None = None) -> tuple[dict[str, Any], int] | None:
    """(the top-level keys after the entries array, offset of the array's closing "]") or None.
    ``hint``: the suffix length of a sibling dump, to look there first instead of scanning back
    through a large pg_config. Only a "]," followed by a known top-level key is tried."""
    if hint:
        lo, hi = max(0, len(buf) - hint - 512), len(buf) - hint + 512
        m = _TOP_KEY_AFTER_ENTRIES.search(buf, lo, hi)
        if m is not None:
            parsed = _try_suffix(buf, m.start())
            if parsed is not None:
                return parsed, m.start()
    close = buf.rfind(b'],"')
    tries = 0
    while close != -1 and tries < 64:
        if _TOP_KEY_AFTER_ENTRIES.match(buf, close):
            parsed = _try_suffix(buf, close)
            if parsed is not None:
                return parsed, close
        close = buf.rfind(b'],"', 0, close)
        tries += 1
    return None


def _try_suffix(buf: bytes, close: int) -> dict[str, Any] | None:
    try:
        suffix = json.loads(b"{" + buf[close + 2:])
    except ValueError:
        return None
    if isinstance(suffix, dict) and ("pg_status" in suffix or "version" in suffix or "pg_config" in suffix):
        return suffix
    return None


_TOP_KEY_AFTER_ENTRIES = re.compile(
    rb'\],"(?:nccl_comm_state|pg_config|pg_status|version|comm_lib_version|nccl_version|rank|host|gpuhealth|'
    rb'dump_time_ns)":'
)


def _frontier_covered(status: Mapping[int, PgStatus], covered: Mapping[int, int]) -> bool:
    for pid, st in status.items():
        target = st.completed if st.completed is not None else st.enqueued
        if target is None or target <= 0:
            continue
        if pid not in covered or covered[pid] > max(1, target):
            return False
    return True


# ------------------------------------------------------------------------------------ normalizing


def _normalize(path: Path, fmt: str, raw: Mapping[str, Any], raw_entries: Any, tail_only: bool,
               problems: list[Problem]) -> RankDump:
    ident = raw.get("gpuhealth") if isinstance(raw.get("gpuhealth"), dict) else {}
    rank_val = raw.get("rank", ident.get("rank") if isinstance(ident, dict) else None)
    by_name = rank_from_filename(path.name)
    host: str | None = None
    if isinstance(rank_val, int) and not isinstance(rank_val, bool) and rank_val >= 0:
        rank, source = rank_val, "contents"
        host_val = raw.get("host", ident.get("host") if isinstance(ident, dict) else None)
        host = str(host_val) if host_val else (by_name[1] if by_name else None)
        if by_name is not None and by_name[0] != rank:
            problems.append(Problem(str(path), f"file name says rank {by_name[0]} but the contents say rank {rank}; "
                                               "using the contents", rank=rank, severity="warning"))
    elif by_name is not None:
        rank, host = by_name
        source = "filename"
    else:
        raise DumpError("cannot tell which rank this dump is from: no 'rank' in the contents and no rank number "
                        "in the file name (name files like rank3.json or node7-rank3.json)")

    version = str(raw.get("version", ""))
    if not version:
        problems.append(Problem(str(path), "no format version in the dump; reading it as 2.x", rank, "warning"))
    else:
        try:
            major = int(version.split(".")[0])
        except ValueError:
            major = -1
        if major != SUPPORTED_MAJOR:
            problems.append(Problem(str(path), f"format version {version!r} is not 2.x; read on a best-effort basis",
                                    rank, "warning"))
    if raw_entries is None:
        raw_entries = []
    if not isinstance(raw_entries, list | tuple):
        problems.append(Problem(str(path), f"'entries' is a {type(raw_entries).__name__}, not a list; ignored",
                                rank, "warning"))
        raw_entries = []
    entries: list[Entry] = []
    bad = 0
    for item in raw_entries:
        e = _entry(item)
        if e is None:
            bad += 1
        else:
            entries.append(e)
    if bad:
        what = f"{bad} malformed entr{'y' if bad == 1 else 'ies'} skipped"
        problems.append(Problem(str(path), what, rank, "warning"))
    entries.sort(key=lambda e: e.record_id)
    backends = {e.backend for e in entries if e.backend}
    comm = str(raw.get("comm_lib_version") or raw.get("nccl_version") or "")
    if len(backends) == 1:
        backend = next(iter(backends))
    elif backends:
        backend = "mixed"
    else:
        backend = "nccl" if comm else "unknown"
    dump_time = ident.get("dump_time_ns") if isinstance(ident, dict) else None
    dump_time = raw.get("dump_time_ns", dump_time)
    dump = RankDump(
        rank=rank, rank_source=source, path=str(path), format=fmt, version=version, backend=backend,
        comm_lib_version=comm, host=host, pg_config=_pg_config(raw.get("pg_config")),
        pg_status=_int_status(raw.get("pg_status")), entries=entries, tail_only=tail_only,
    )
    if isinstance(dump_time, int) and dump_time > 0:
        dump.dump_time_ns, dump.dump_time_source = dump_time, "contents"
    else:
        try:
            dump.dump_time_ns, dump.dump_time_source = path.stat().st_mtime_ns, "mtime"
        except OSError:
            pass
    return dump


def _as_int(v: Any, default: int | None = None) -> int | None:
    if type(v) is int:
        return v
    if v is None or isinstance(v, bool):
        return default
    if isinstance(v, int):
        return int(v)
    try:
        return int(str(v).strip())
    except ValueError:
        try:
            return int(float(str(v)))
        except (ValueError, OverflowError):
            return default


def _time(v: Any) -> int | None:
    t = _as_int(v)
    return t if t else None  # JSON writes 0 for "unset", pickle None


def _sizes(v: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, list | tuple):
        return ()
    try:  # the common case: a list of lists of ints
        fast = tuple(tuple(shape) for shape in v)
        if all(type(x) is int for shape in fast for x in shape):
            return _shared(fast)
    except TypeError:
        pass
    out = []
    for shape in v:
        if isinstance(shape, list | tuple):
            out.append(tuple(int(x) if isinstance(x, int) and not isinstance(x, bool) else -1 for x in shape))
        elif isinstance(shape, int):
            out.append((shape,))
    return tuple(out)


def _strs(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list | tuple):
        return ()
    return _shared(tuple(sys.intern(str(x)) for x in v))


# Millions of entries repeat a handful of shapes, dtypes and names: share one object for each
# (a third of the memory of a whole-history load). Bounded so hostile input cannot grow it.
_SHARED: dict[Any, Any] = {}
_SHARED_MAX = 65536


def _shared(value: Any) -> Any:
    got = _SHARED.get(value)
    if got is not None:
        return got
    if len(_SHARED) < _SHARED_MAX:
        _SHARED[value] = value
    return value


def _name(v: Any) -> str:
    return sys.intern(str(v)) if v is not None else ""


def _entry(item: Any) -> Entry | None:
    """Normalize one raw entry; None when it is not an entry at all."""
    if type(item) is dict:
        try:
            fast = _entry_fast(item)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            fast = None
        if fast is not None:
            return fast
    return _entry_slow(item)


# (profiling_name, group name, group desc) -> (backend, op, p2p_src, p2p_dst, group, desc)
_NAMES: dict[tuple[str, str, str], tuple[str, str, int | None, int | None, str, str]] = {}


def _entry_fast(item: dict[str, Any]) -> Entry | None:
    """The common case — an entry exactly as torch writes it — without per-field fallbacks.
    Returns None (or raises) on anything unusual; :func:`_entry_slow` then handles it."""
    seq, rid, pg_id = item["collective_seq_id"], item["record_id"], item["pg_id"]
    if type(seq) is not int or type(rid) is not int or type(pg_id) is not int:
        return None
    pg = item["process_group"]
    key = (item["profiling_name"], pg[0], pg[1])
    names = _NAMES.get(key)
    if names is None:
        if not all(type(k) is str for k in key):
            return None
        slow = _entry_slow(item)
        if slow is None:
            return None
        names = (slow.backend, slow.op, slow.p2p_src, slow.p2p_dst, slow.group, slow.group_desc)
        if len(_NAMES) < _SHARED_MAX:
            _NAMES[key] = names
    backend, op, p2p_src, p2p_dst, group, desc = names
    state = item["state"]
    created, started, completed = (item["time_created_ns"], item["time_discovered_started_ns"],
                                   item["time_discovered_completed_ns"])
    dur = item.get("duration_ms")
    if not (type(state) is str and type(created) is int and (started is None or type(started) is int)
            and (completed is None or type(completed) is int) and (dur is None or type(dur) in (int, float))
            and "frames" not in item):
        return None
    timeout = item.get("timeout_ms")
    return Entry(
        record_id=rid, pg_id=pg_id, group=group, group_desc=desc, seq=seq,
        p2p_seq=_as_int(item.get("p2p_seq_id"), 0) or 0, op_id=_as_int(item.get("op_id"), 0) or 0, op=op,
        backend=backend, in_sizes=_sizes(item["input_sizes"]), in_dtypes=_strs(item["input_dtypes"]),
        out_sizes=_sizes(item["output_sizes"]), out_dtypes=_strs(item["output_dtypes"]),
        state=sys.intern(state or "scheduled"), retired=bool(item.get("retired", False)),
        is_p2p=bool(item.get("is_p2p", False)), created_ns=created or None, started_ns=started or None,
        completed_ns=completed or None, duration_ms=None if dur is None else float(dur),
        timeout_ms=timeout if type(timeout) is int else _as_int(timeout), frames=(), p2p_src=p2p_src,
        p2p_dst=p2p_dst,
    )


def _entry_slow(item: Any) -> Entry | None:
    if not isinstance(item, dict):
        return None
    pname = str(item.get("profiling_name") or "")
    backend, _, op = pname.partition(":")
    backend = sys.intern(backend)
    if not op:
        backend, op = "", pname
    p2p_src = p2p_dst = None
    op, _, meta = op.partition(" ")
    if meta:
        m = _P2P_META.match(meta.strip())
        if m:
            if m.group(2) == "->":
                p2p_src, p2p_dst = int(m.group(1)), int(m.group(3))
            else:
                p2p_dst, p2p_src = int(m.group(1)), int(m.group(3))
    pg = item.get("process_group")
    pg_id = _as_int(item.get("pg_id"), -1)
    if isinstance(pg, list | tuple) and pg:
        group, desc = _name(pg[0]), _name(pg[1]) if len(pg) > 1 else ""
    elif isinstance(pg, dict):
        group, desc = str(pg.get("name", pg_id)), str(pg.get("desc", ""))
    else:
        group, desc = str(pg_id), ""
    seq = _as_int(item.get("collective_seq_id"))
    record_id = _as_int(item.get("record_id"))
    if seq is None or record_id is None:
        return None
    dur = item.get("duration_ms")
    try:
        duration = float(dur) if dur is not None and not isinstance(dur, bool) else None
    except (TypeError, ValueError):
        duration = None
    frames_raw = item.get("frames")
    frames: tuple[Frame, ...] = ()
    if isinstance(frames_raw, list | tuple):
        frames = tuple(
            Frame(str(f.get("name", "?")), str(f.get("filename", "?")), _as_int(f.get("line"), 0) or 0)
            for f in frames_raw if isinstance(f, dict)
        )
    return Entry(
        record_id=record_id, pg_id=pg_id if pg_id is not None else -1, group=group, group_desc=desc, seq=seq,
        p2p_seq=_as_int(item.get("p2p_seq_id"), 0) or 0, op_id=_as_int(item.get("op_id"), 0) or 0,
        op=sys.intern(op),
        backend=backend, in_sizes=_sizes(item.get("input_sizes")), in_dtypes=_strs(item.get("input_dtypes")),
        out_sizes=_sizes(item.get("output_sizes")), out_dtypes=_strs(item.get("output_dtypes")),
        state=sys.intern(str(item.get("state") or "scheduled")), retired=bool(item.get("retired", False)),
        is_p2p=bool(item.get("is_p2p", False)), created_ns=_time(item.get("time_created_ns")),
        started_ns=_time(item.get("time_discovered_started_ns")),
        completed_ns=_time(item.get("time_discovered_completed_ns")), duration_ms=duration,
        timeout_ms=_as_int(item.get("timeout_ms")), frames=frames, p2p_src=p2p_src, p2p_dst=p2p_dst,
    )


_P2P_META = re.compile(r"^(\d+)\s*(->|<-)\s*(\d+)$")


def _int_status(v: Any) -> dict[int, PgStatus]:
    out: dict[int, PgStatus] = {}
    if not isinstance(v, dict):
        return out
    for key, st in v.items():
        pid = _as_int(key)
        if pid is None or not isinstance(st, dict):
            continue
        out[pid] = PgStatus(
            enqueued=_as_int(st.get("last_enqueued_collective")),
            started=_as_int(st.get("last_started_collective")),
            completed=_as_int(st.get("last_completed_collective")),
        )
    return out


def _pg_config(v: Any) -> dict[str, GroupConfig]:
    out: dict[str, GroupConfig] = {}
    if not isinstance(v, dict):
        return out
    for key, cfg in v.items():
        if not isinstance(cfg, dict):
            continue
        ranks = _parse_ranks(cfg.get("ranks"))
        name = str(cfg.get("name", key) or key)
        out[str(key)] = GroupConfig(name=name, desc=str(cfg.get("desc", "")), ranks=ranks or None)
    return out


@functools.lru_cache(maxsize=64)
def _parse_rank_string(v: str) -> tuple[int, ...]:
    # Every rank's dump repeats the world group's list (16,384 numbers at 16k ranks): parse it once.
    return tuple(int(x) for x in re.findall(r"\d+", v))


def _parse_ranks(v: Any) -> tuple[int, ...]:
    # Real dumps write the list as a string ("[0, 1]"); never eval it.
    if isinstance(v, str):
        return _parse_rank_string(v)
    if isinstance(v, list | tuple):
        items: Iterable[Any] = v
    else:
        return ()
    out = []
    for x in items:
        i = _as_int(x)
        if i is not None and i >= 0:
            out.append(i)
    return tuple(out)
