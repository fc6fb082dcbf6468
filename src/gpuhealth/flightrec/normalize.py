"""Raw entries and top-level blocks (from JSON or a pickle) into records, whatever they hold.

A raw value is never trusted: it may be of the wrong type, absurd (negative sizes, 10^6 tensors,
NaN durations, timestamps as strings, ranks in the billions) or, from a pickle, a container reached
many times. Nothing here calls ``str()`` on a container (the repr of a shared-reference DAG is
exponential), every list is cut at a cap, and whatever was cut or dropped is counted in a
:class:`Repairs` so the loader reports it in one line. :func:`entry_fast` takes entries exactly
as torch writes them (and never repairs); anything else goes to :func:`entry_slow`.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Any

from gpuhealth.flightrec.records import Entry, Frame, GroupConfig, PgStatus
from gpuhealth.model import MAX_RANKS

MAX_TENSORS = 1 << 16  # tensors kept per entry (an all_to_all lists one per peer)
MAX_DIMS = 64  # dimensions kept per tensor shape
MAX_FRAMES = 256  # stack frames kept per entry
MAX_GROUPS = 1 << 16  # process groups kept per dump
MAX_TEXT = 1024  # characters kept of a name (group, op, frame, dtype, host)
MAX_RANK_STRING = 16 << 20  # a pg_config rank list ("[0, 1, …]") longer than this is not parsed

_I64 = 1 << 63  # torch writes int64: a larger number is no id, size or time of a real dump
_MAX_DURATION_MS = 1e9  # 11.6 days
_INTERN_MAX = 128  # longer strings are not interned (interned strings outlive the dump)
_SHARED_MAX = 65536


class WalkBudgetError(ValueError):
    """The data reaches more items than its file could hold without shared references."""


class Repairs:
    """What normalizing one dump cut or dropped, and the work it may still do.

    ``budget``: items a pickle's normalization may visit (proportional to the file's size: a dict
    reused many times would otherwise be walked many times). ``shared``: the raw objects stay
    alive during normalization (a pickle), so frame dicts torch shares can map to one Frame each."""

    __slots__ = ("_current", "blocks", "budget", "entries", "fields", "frames", "shared")

    def __init__(self, budget: int | None = None, *, shared: bool = False) -> None:
        self.fields: Counter[str] = Counter()  # field -> entries where it was capped or ignored
        self.entries = 0
        self.blocks: Counter[str] = Counter()  # top-level note -> count
        self.budget = sys.maxsize if budget is None else budget
        self.shared = shared
        self.frames: dict[int, Frame] = {}
        self._current: set[str] = set()

    def note(self, field: str) -> None:
        self._current.add(field)

    def end_entry(self) -> None:
        if self._current:
            self.entries += 1
            self.fields.update(self._current)
            self._current.clear()

    def charge(self, items: int) -> None:
        self.budget -= items
        if self.budget < 0:
            raise WalkBudgetError("refused: the pickle's references reach more items than the file holds (a "
                                  "flight-recorder dump reuses nothing but strings and stack frames)")

    def messages(self) -> list[str]:
        out = [f"{what} ({n}×)" if n > 1 else what for what, n in sorted(self.blocks.items())]
        if self.entries:
            fields = ", ".join(f"{f} ({n})" for f, n in sorted(self.fields.items()))
            out.append(f"{self.entries} entr{'y' if self.entries == 1 else 'ies'} had values torch never writes, "
                       f"capped or ignored: {fields}")
        return out


class Normalized:
    """A dump's normalized entries and what normalizing them dropped (``bad``: not entries at all)
    or capped (``repairs``). ``tail_only``: only the newest were read (older ones exist)."""

    __slots__ = ("bad", "entries", "repairs", "tail_only")

    def __init__(self, entries: list[Entry], bad: int, repairs: Repairs, tail_only: bool = False) -> None:
        self.entries, self.bad, self.repairs, self.tail_only = entries, bad, repairs, tail_only


# ------------------------------------------------------------------------------------ scalars


def int64(v: Any) -> int | None:
    """An int that fits int64, from an int, an integral float or a numeric string; else None."""
    if type(v) is int:
        return v if -_I64 <= v < _I64 else None
    if type(v) is str and len(v) <= 32:  # pg_status values are strings in JSON
        try:
            n = int(v)
        except ValueError:
            try:
                f = float(v)
            except ValueError:
                return None
            if not f.is_integer():
                return None
            n = int(f)
        return n if -_I64 <= n < _I64 else None
    if isinstance(v, float):
        return int(v) if v.is_integer() and -_I64 <= v < _I64 else None
    if isinstance(v, int) and not isinstance(v, bool):
        return int64(int(v))
    return None


def text(v: Any, repairs: Repairs | None = None, field: str = "", limit: int = MAX_TEXT) -> str:
    """A scalar as text (None: ""). Containers are never rendered: they give "" and a repair."""
    if type(v) is str:
        if len(v) <= limit:
            return v
        if repairs is not None:
            repairs.note(field)
        return v[:limit]
    if v is None:
        return ""
    if isinstance(v, int) and (isinstance(v, bool) or -_I64 <= v < _I64):
        return str(v)
    if isinstance(v, float):
        return str(v)
    if isinstance(v, str):  # a str subclass (never from json or our unpickler; be plain anyway)
        return text(str.__str__(v)[:limit], repairs, field, limit)
    if repairs is not None:
        repairs.note(field)
    return ""


def _intern(s: str) -> str:
    return sys.intern(s) if len(s) <= _INTERN_MAX else s


def _time(v: Any, fix: Repairs, field: str) -> int | None:
    if type(v) is int and 0 <= v < _I64:
        return v or None  # JSON writes 0 for "unset", pickle None
    if v is None:
        return None
    t = int64(v)
    fix.note(field)
    return t if t is not None and t > 0 else None


def _count(v: Any, fix: Repairs, field: str) -> int | None:
    """A non-negative int64 (ids, timeouts); None and a repair for anything else present."""
    if type(v) is int and 0 <= v < _I64:
        return v
    if v is None:
        return None
    n = int64(v)
    if n is None or n < 0 or type(v) is not int:
        fix.note(field)
    return n if n is not None and n >= 0 else None


# ------------------------------------------------------------------------------------ lists

_SIZES: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = {}
_STRS: dict[tuple[str, ...], tuple[str, ...]] = {}


def _sizes_fast(v: Any) -> tuple[tuple[int, ...], ...] | None:
    """Shapes as torch writes them (lists of non-negative ints, within the caps), shared between
    entries: millions of entries repeat a handful of shapes. None for anything else."""
    if (type(v) is not list and type(v) is not tuple) or len(v) > MAX_TENSORS:
        return None
    try:
        t = tuple([tuple(shape) for shape in v])
        got = _SIZES.get(t)  # cached shapes were checked when they were added
    except TypeError:
        return None
    if got is not None:
        return got
    if not all(len(s) <= MAX_DIMS and all(type(x) is int and 0 <= x < _I64 for x in s) for s in t):
        return None
    if len(_SIZES) < _SHARED_MAX and len(t) <= 64:
        _SIZES[t] = t
    return t


def _sizes_slow(v: Any, fix: Repairs, field: str) -> tuple[tuple[int, ...], ...]:
    """Any shapes, capped; the work is charged first (a pickle may reuse one long list everywhere)."""
    if v is None:
        return ()
    if not isinstance(v, list | tuple):
        fix.note(field)
        return ()
    if len(v) > MAX_TENSORS:
        fix.note(field)
        v = v[:MAX_TENSORS]
    fix.charge(len(v))
    out = []
    dims_seen = 0
    for shape in v:
        if isinstance(shape, list | tuple):
            if len(shape) > MAX_DIMS:
                fix.note(field)
                shape = shape[:MAX_DIMS]
            dims = tuple(x if type(x) is int and 0 <= x < _I64 else -1 for x in shape)
            dims_seen += len(dims)
            if -1 in dims:
                fix.note(field)  # negative, absurd or not a number: unknown
            out.append(dims)
        elif type(shape) is int and 0 <= shape < _I64:
            out.append((shape,))
        else:
            fix.note(field)
    fix.charge(dims_seen)
    t = tuple(out)
    return _SIZES.get(t, t)


def _strs_fast(v: Any) -> tuple[str, ...] | None:
    if (type(v) is not list and type(v) is not tuple) or len(v) > MAX_TENSORS:
        return None
    try:
        t = tuple(v)
        got = _STRS.get(t)
    except TypeError:
        return None
    if got is not None:
        return got
    if not all(type(x) is str and len(x) <= _INTERN_MAX for x in t):
        return None
    t = tuple([sys.intern(x) for x in t])
    if len(_STRS) < _SHARED_MAX and len(t) <= 64:
        _STRS[t] = t
    return t


def _strs_slow(v: Any, fix: Repairs, field: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):  # one dtype for every tensor, as PyTorch's analyser tests write it ("" = none)
        return (_intern(text(v, fix, field)),) if v else ()
    if not isinstance(v, list | tuple):
        fix.note(field)
        return ()
    if len(v) > MAX_TENSORS:
        fix.note(field)
        v = v[:MAX_TENSORS]
    fix.charge(len(v))
    fast = _strs_fast(v)
    if fast is not None:
        return fast
    return tuple(_intern(text(x, fix, field)) for x in v)


# ------------------------------------------------------------------------------------ entries

_STATES = {s: s for s in ("scheduled", "started", "completed")}
_P2P_META = re.compile(r"^(\d+|\?)\s*(->|<-)\s*(\d+|\?)$")
_Names = tuple[str, str, int | None, int | None, str, str]  # backend, op, p2p_src, p2p_dst, group, desc
# (profiling_name, group name, group desc) -> names: parsed once per distinct triple
_NAMES: dict[tuple[str, str, str], _Names] = {}
_NAME_KEY_MAX = 256


def _peer(s: str, fix: Repairs) -> int | None:
    if s == "?":
        return None  # any-source recv (irecv without a source): the peer is not known
    if len(s) <= 7 and int(s) < MAX_RANKS:
        return int(s)
    fix.note("profiling_name")
    return None


def _names(pname: str, g0: Any, g1: Any, fix: Repairs) -> _Names:
    # "<backend>:<op>[ <peers>]": the op is after the last colon of the first word, so a library name with a
    # colon in it ("weird:backend:all_reduce") keeps the op.
    head, _, meta = pname.partition(" ")
    backend, _, op = head.rpartition(":")
    src = dst = None
    if meta:
        m = _P2P_META.match(meta.strip())
        if m:  # "send 0->1" (src->dst), "recv 1<-0" (dst<-src)
            a, b = _peer(m.group(1), fix), _peer(m.group(3), fix)
            src, dst = (a, b) if m.group(2) == "->" else (b, a)
    return (_intern(backend), _intern(op), src, dst, _intern(text(g0, fix, "process_group")),
            _intern(text(g1, fix, "process_group")))


def entry_fast(item: dict[str, Any]) -> Entry | None:
    """An entry exactly as torch writes it, without per-field fallbacks. Returns None (or
    raises KeyError/TypeError/…) on anything unusual; :func:`entry_slow` then handles it."""
    seq, rid, pg_id = item["collective_seq_id"], item["record_id"], item["pg_id"]
    if not (type(seq) is int and type(rid) is int and type(pg_id) is int
            and 0 <= seq < _I64 and 0 <= rid < _I64 and 0 <= pg_id < _I64):
        return None
    pg = item["process_group"]
    if type(pg) is not list and type(pg) is not tuple:
        return None
    key = (item["profiling_name"], pg[0], pg[1])
    names = _NAMES.get(key)
    if names is None:
        if not all(type(k) is str and len(k) <= _NAME_KEY_MAX for k in key):
            return None
        fix = Repairs()
        names = _names(key[0], key[1], key[2], fix)
        fix.end_entry()
        if fix.entries:
            return None  # the slow path notes what was repaired
        if len(_NAMES) < _SHARED_MAX:
            _NAMES[key] = names
    backend, op, p2p_src, p2p_dst, group, desc = names
    state = _STATES.get(item["state"])
    created, started, completed = (item["time_created_ns"], item["time_discovered_started_ns"],
                                   item["time_discovered_completed_ns"])
    dur = item.get("duration_ms")
    timeout = item.get("timeout_ms")
    p2p_seq = item.get("p2p_seq_id", 0)
    op_id = item.get("op_id", 0)
    if not (state is not None and type(created) is int and 0 <= created < _I64
            and (started is None or (type(started) is int and 0 <= started < _I64))
            and (completed is None or (type(completed) is int and 0 <= completed < _I64))
            and (dur is None or ((type(dur) is float or type(dur) is int) and 0 <= dur < _MAX_DURATION_MS))
            and (timeout is None or (type(timeout) is int and 0 <= timeout < _I64))
            and type(p2p_seq) is int and 0 <= p2p_seq < _I64 and type(op_id) is int and 0 <= op_id < _I64
            and "frames" not in item):
        return None
    in_sizes, out_sizes = _sizes_fast(item["input_sizes"]), _sizes_fast(item["output_sizes"])
    in_dtypes, out_dtypes = _strs_fast(item["input_dtypes"]), _strs_fast(item["output_dtypes"])
    if in_sizes is None or out_sizes is None or in_dtypes is None or out_dtypes is None:
        return None
    return Entry(
        record_id=rid, pg_id=pg_id, group=group, group_desc=desc, seq=seq, p2p_seq=p2p_seq, op_id=op_id, op=op,
        backend=backend, in_sizes=in_sizes, in_dtypes=in_dtypes, out_sizes=out_sizes, out_dtypes=out_dtypes,
        state=state, retired=bool(item.get("retired", False)), is_p2p=bool(item.get("is_p2p", False)),
        created_ns=created or None, started_ns=started or None, completed_ns=completed or None,
        duration_ms=None if dur is None else float(dur), timeout_ms=timeout, frames=(), p2p_src=p2p_src,
        p2p_dst=p2p_dst,
    )


def entry_slow(item: Any, repairs: Repairs | None = None) -> Entry | None:
    """Any raw entry, field by field, capped; None when it is not an entry at all (no integer
    collective_seq_id / record_id). What was capped or ignored is noted in ``repairs``."""
    if not isinstance(item, dict):
        return None
    fix = repairs if repairs is not None else Repairs()
    seq = int64(item.get("collective_seq_id"))
    record_id = int64(item.get("record_id"))
    if seq is None or record_id is None:
        return None
    if type(item.get("collective_seq_id")) is not int or type(item.get("record_id")) is not int:
        fix.note("collective_seq_id/record_id")
    pg_raw = item.get("pg_id")
    pg_id = int64(pg_raw)
    if pg_raw is not None and (pg_id is None or type(pg_raw) is not int):
        fix.note("pg_id")
    pg_id = -1 if pg_id is None else pg_id
    pg = item.get("process_group")
    if isinstance(pg, list | tuple) and pg:
        g0, g1 = pg[0], pg[1] if len(pg) > 1 else ""
    elif isinstance(pg, dict):
        g0, g1 = pg.get("name", pg_id), pg.get("desc", "")
    else:
        if pg is not None:
            fix.note("process_group")
        g0, g1 = pg_id, ""
    backend, op, p2p_src, p2p_dst, group, desc = _names(text(item.get("profiling_name"), fix, "profiling_name"),
                                                        g0, g1, fix)
    return Entry(
        record_id=record_id, pg_id=pg_id, group=group, group_desc=desc, seq=seq,
        p2p_seq=_count(item.get("p2p_seq_id"), fix, "p2p_seq_id") or 0,
        op_id=_count(item.get("op_id"), fix, "op_id") or 0, op=op, backend=backend,
        in_sizes=_sizes_slow(item.get("input_sizes"), fix, "input_sizes"),
        in_dtypes=_strs_slow(item.get("input_dtypes"), fix, "input_dtypes"),
        out_sizes=_sizes_slow(item.get("output_sizes"), fix, "output_sizes"),
        out_dtypes=_strs_slow(item.get("output_dtypes"), fix, "output_dtypes"),
        state=_intern(text(item.get("state"), fix, "state") or "scheduled"),
        retired=bool(item.get("retired", False)), is_p2p=bool(item.get("is_p2p", False)),
        created_ns=_time(item.get("time_created_ns"), fix, "time_created_ns"),
        started_ns=_time(item.get("time_discovered_started_ns"), fix, "time_discovered_started_ns"),
        completed_ns=_time(item.get("time_discovered_completed_ns"), fix, "time_discovered_completed_ns"),
        duration_ms=_duration(item.get("duration_ms"), fix), timeout_ms=_count(item.get("timeout_ms"), fix,
                                                                                "timeout_ms"),
        frames=_frames(item.get("frames"), fix), p2p_src=p2p_src, p2p_dst=p2p_dst,
    )


def entry(item: Any, repairs: Repairs) -> Entry | None:
    """Normalize one raw entry (fast path first, except for a pickle's entries: their lists may be
    reused, and only the slow path charges its work); None when it is not an entry at all."""
    if type(item) is dict and not repairs.shared:
        try:
            fast = entry_fast(item)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            fast = None
        if fast is not None:
            return fast
    e = entry_slow(item, repairs)
    repairs.end_entry()
    return e


def _duration(v: Any, fix: Repairs) -> float | None:
    if v is None:
        return None
    if (type(v) is float or type(v) is int) and 0 <= v < _MAX_DURATION_MS:
        return float(v)
    fix.note("duration_ms")
    if isinstance(v, str) and len(v) <= 32:
        try:
            d = float(v)
        except ValueError:
            return None
        return d if 0 <= d < _MAX_DURATION_MS else None
    return None


def _frames(v: Any, fix: Repairs) -> tuple[Frame, ...]:
    if v is None:
        return ()
    if not isinstance(v, list | tuple):
        fix.note("frames")
        return ()
    if len(v) > MAX_FRAMES:
        fix.note("frames")
        v = v[:MAX_FRAMES]
    fix.charge(len(v))
    out = []
    for f in v:
        if not isinstance(f, dict):
            fix.note("frames")
            continue
        frame = fix.frames.get(id(f)) if fix.shared else None
        if frame is None:
            frame = Frame(text(f.get("name"), fix, "frames") or "?", text(f.get("filename"), fix, "frames") or "?",
                          int64(f.get("line")) or 0)
            if fix.shared:
                fix.frames[id(f)] = frame
        out.append(frame)
    return tuple(out)


# ------------------------------------------------------------------------------------ blocks


def int_status(v: Any, fix: Repairs) -> dict[int, PgStatus]:
    """pg_status {pg_id: {last_enqueued_collective, …}} (strings in JSON, ints in pickles)."""
    out: dict[int, PgStatus] = {}
    if not isinstance(v, dict):
        return out
    for i, (key, st) in enumerate(v.items()):
        if i >= MAX_GROUPS:
            fix.blocks[f"pg_status: over {MAX_GROUPS:,} process groups; the rest ignored"] += 1
            break
        fix.charge(1)
        pid = int64(key)
        if pid is None or not isinstance(st, dict):
            continue
        out[pid] = PgStatus(enqueued=int64(st.get("last_enqueued_collective")),
                            started=int64(st.get("last_started_collective")),
                            completed=int64(st.get("last_completed_collective")))
    return out


def pg_config(v: Any, fix: Repairs) -> dict[str, GroupConfig]:
    out: dict[str, GroupConfig] = {}
    if not isinstance(v, dict):
        return out
    for i, (key, cfg) in enumerate(v.items()):
        if i >= MAX_GROUPS:
            fix.blocks[f"pg_config: over {MAX_GROUPS:,} process groups; the rest ignored"] += 1
            break
        fix.charge(1)
        if not isinstance(cfg, dict):
            continue
        ranks = parse_ranks(cfg.get("ranks"), fix)
        name = text(cfg.get("name", key)) or text(key)
        out[text(key)] = GroupConfig(name=name, desc=text(cfg.get("desc", "")), ranks=ranks or None)
    return out


_RANK_NUMBER = re.compile(r"\d+")
# Every rank's dump repeats the world group's list (16,384 numbers at 16k ranks): parse each
# distinct string once and hand out one shared tuple (the matcher merges each tuple once).
_RANK_STRINGS: dict[str, tuple[tuple[int, ...], int]] = {}
_RANK_STRINGS_CHARS = [0]
_RANK_STRINGS_MAX_CHARS = 32 << 20


def parse_ranks(v: Any, fix: Repairs) -> tuple[int, ...]:
    """Group members from a rank list — a string like "[0, 1]" as real dumps write it (never
    eval'd), or a list. Ranks at or above :data:`MAX_RANKS` are dropped and counted."""
    if isinstance(v, str):
        if len(v) > MAX_RANK_STRING:
            fix.blocks[f"pg_config: a rank list over {MAX_RANK_STRING >> 20} MiB; ignored"] += 1
            return ()
        ranks, dropped = _parse_rank_string(v)
    elif isinstance(v, list | tuple):
        fix.charge(len(v))
        kept = [r for r in (int64(x) for x in v[: MAX_RANKS + 1]) if r is not None and 0 <= r < MAX_RANKS]
        dropped = len(v) - len(kept)
        ranks = tuple(kept[:MAX_RANKS])
    else:
        return ()
    if dropped:
        fix.blocks[f"pg_config: rank numbers that are not ranks 0…{MAX_RANKS - 1:,} ignored"] += 1
    return ranks


def _parse_rank_string(v: str) -> tuple[tuple[int, ...], int]:
    got = _RANK_STRINGS.get(v)
    if got is not None:
        return got
    out: list[int] = []
    dropped = 0
    for m in _RANK_NUMBER.finditer(v):
        s = m.group()
        r = int(s) if len(s) <= 7 else MAX_RANKS
        if r >= MAX_RANKS or len(out) >= MAX_RANKS:
            dropped += 1
            if dropped > MAX_RANKS:
                break
            continue
        out.append(r)
    parsed = (tuple(out), dropped)
    if _RANK_STRINGS_CHARS[0] + len(v) > _RANK_STRINGS_MAX_CHARS:
        _RANK_STRINGS.clear()
        _RANK_STRINGS_CHARS[0] = 0
    _RANK_STRINGS[v] = parsed
    _RANK_STRINGS_CHARS[0] += len(v)
    return parsed
