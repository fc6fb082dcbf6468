"""Read a JSON dump from its end: the small top-level blocks plus only the newest entries.

Triaging 16,384 ranks must not mean parsing 16,384 × 2,000 entries. torch writes compact JSON with
sorted keys, so ``entries`` comes before ``pg_config``/``pg_status``/``version``: the reader takes
the blocks after the entries array from the file's end, then decodes entries backwards until it
has ``want`` of them and each group's last completed collective is covered, growing the window
×4 when it must. Each entry is decoded from its own bounded slice and normalized at once (the raw
dict is dropped). A layout it does not recognise gives None: the caller then reads the whole file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from gpuhealth.flightrec.jsonstream import (
    MAX_ENTRIES,
    MAX_ENTRY_BYTES,
    Budget,
    DumpReader,
    JsonBoundsError,
    decode_object,
)
from gpuhealth.flightrec.normalize import Normalized, Repairs, entry, int_status
from gpuhealth.flightrec.records import Entry, PgStatus

# An entry object starts with one of the entry keys (whatever order the writer used).
_ENTRY_KEY_AT = re.compile(
    rb'\{"(?:collective_seq_id|record_id|frames|pg_id|process_group|profiling_name|duration_ms|input_dtypes)"'
)
_SMALL_BLOCKS = 1 << 20
_ENTRIES_KEY = re.compile(rb'"entries"\s*:\s*\[')
_TOP_KEY_AFTER_ENTRIES = re.compile(
    rb'\],"(?:nccl_comm_state|pg_config|pg_status|version|comm_lib_version|nccl_version|rank|host|gpuhealth|'
    rb'dump_time_ns)":'
)


def read_tail(path: Path, size: int, want: int, keep: Collection[str], hint: dict[str, int] | None = None
              ) -> tuple[dict[str, Any], Normalized] | None:
    """(the top-level blocks named in ``keep``, the newest entries) of the JSON dump at ``path``,
    or None when the layout is not the one torch writes. ``hint``: carried between the dumps of
    one job (they share a layout) to find the blocks after the entries in one read."""
    with path.open("rb") as fh:
        head = fh.read(min(size, 4096))
        m = _ENTRIES_KEY.search(head)
        if m is None:
            return None
        prefix = _blocks(head[: m.start()].rstrip().rstrip(b",") + b"}", keep)
        if prefix is None:
            return None
        entries_start = m.end()
        # Start from the previous file's suffix size so a large pg_config (the world's rank list)
        # is read in one go.
        chunk = max(64 * 1024, (hint or {}).get("suffix", 0) + 16 * 1024) + want * 1024
        suffix: dict[str, Any] | None = None
        suffix_len = 0
        while True:
            start = max(entries_start, size - chunk)
            fh.seek(start)
            buf = fh.read(size - start)
            if suffix is None:
                found = _split_suffix(buf, keep, (hint or {}).get("suffix"))
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
            repairs = Repairs()
            status = int_status(top.get("pg_status"), repairs)
            entries: list[Entry] = []
            bad = 0
            covered: dict[int, int] = {}
            budget = Budget(len(body))
            done = False
            pos = 0
            for n, pos in enumerate(_entry_starts_backwards(body, at_array_start=start == entries_start)):
                if n >= MAX_ENTRIES:
                    raise JsonBoundsError(f"more than {MAX_ENTRIES:,} entries: more than any flight-recorder "
                                          "buffer holds")
                try:
                    obj, _ = decode_object(body, pos, min(len(body), pos + MAX_ENTRY_BYTES), budget, "an entry")
                except ValueError:
                    return None
                e = entry(obj, repairs)
                if e is None:
                    bad += 1
                    continue
                entries.append(e)
                covered[e.pg_id] = min(covered.get(e.pg_id, e.seq), e.seq)
                if len(entries) >= want and _frontier_covered(status, covered):
                    done = True
                    break
            entries.reverse()
            if start == entries_start:
                return top, Normalized(entries, bad, repairs, done and _entry_starts_exist_before(body, pos))
            if done:
                return top, Normalized(entries, bad, repairs, True)
            chunk *= 4


def _blocks(data: bytes, keep: Collection[str]) -> dict[str, Any] | None:
    """The kept top-level blocks of a JSON object (the part before or after the entries), or None
    when it is not one. Up to 1 MiB (the usual case, even at 16k ranks) one json.loads is both
    fastest and bounded (~30× of 1 MiB at worst); larger ones are walked block by block."""
    if len(data) <= _SMALL_BLOCKS:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return None
        return {k: v for k, v in obj.items() if k in keep} if isinstance(obj, dict) else None
    reader = DumpReader(data, keep)
    try:
        for _ in reader.entries():
            pass
    except ValueError:
        return None
    return reader.blocks


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


def _split_suffix(buf: bytes, keep: Collection[str], hint: int | None = None) -> tuple[dict[str, Any], int] | None:
    """(the top-level blocks after the entries array, offset of the array's closing "]") or None.
    ``hint``: the suffix length of a sibling dump, to look there first instead of scanning back
    through a large pg_config. Only a "]," followed by a known top-level key is tried."""
    if hint:
        lo, hi = max(0, len(buf) - hint - 512), len(buf) - hint + 512
        m = _TOP_KEY_AFTER_ENTRIES.search(buf, lo, hi)
        if m is not None:
            parsed = _try_suffix(buf, m.start(), keep)
            if parsed is not None:
                return parsed, m.start()
    close = buf.rfind(b'],"')
    tries = 0
    while close != -1 and tries < 64:
        if _TOP_KEY_AFTER_ENTRIES.match(buf, close):
            parsed = _try_suffix(buf, close, keep)
            if parsed is not None:
                return parsed, close
        close = buf.rfind(b'],"', 0, close)
        tries += 1
    return None


def _try_suffix(buf: bytes, close: int, keep: Collection[str]) -> dict[str, Any] | None:
    blocks = _blocks(b"{" + buf[close + 2:], keep)
    if blocks is not None and ("pg_status" in blocks or "version" in blocks or "pg_config" in blocks):
        return blocks
    return None


def _frontier_covered(status: Mapping[int, PgStatus], covered: Mapping[int, int]) -> bool:
    for pid, st in status.items():
        target = st.completed if st.completed is not None else st.enqueued
        if target is None or target <= 0:
            continue
        if pid not in covered or covered[pid] > max(1, target):
            return False
    return True

