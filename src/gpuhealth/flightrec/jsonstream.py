"""Bounded reading of a flight-recorder JSON dump: one entry at a time, never the whole document.

``json.loads`` of a whole dump first builds every entry as a dict: 26× the file for a file of ``{}``
entries, an out-of-memory for 600 MB. Here the ``entries`` array is walked element by element and
each element is decoded from its own slice of the file, so one element can build only what its
slice holds (at most :data:`MAX_ENTRY_BYTES`), is handed to the caller, and is dropped. The top-level
blocks the caller asks for (version, pg_config, pg_status, …) are decoded the same way, after their
extent is known and within :data:`MAX_BLOCK_BYTES`; other blocks (``nccl_comm_state``) are skipped
without being built.

An element normally ends at the first ``}`` after it (torch writes entries without nested objects),
which costs one ``find``; anything else is measured by :func:`container_end`, a structural scan
charged against a per-document :class:`Budget`, so time as well as memory stays bounded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Generator, Iterator
from typing import Any

MAX_ENTRIES = 1 << 20  # more elements than any flight-recorder ring buffer holds (TORCH_FR_BUFFER_SIZE: 2,000)
MAX_ENTRY_BYTES = 32 << 20  # one entry: 10^6 tensors with their dtypes fit; a decoded slice is ≤ ~20× this
MAX_BLOCK_BYTES = 64 << 20  # one top-level block (pg_config lists the world: ~8 MB at 2^20 ranks)
MAX_KEY_BYTES = 256  # a longer top-level key is no key the loader knows: its value is skipped
BASE_SCAN_TOKENS = 4_000_000  # structural tokens scanned outside the fast path, plus one per 16 bytes

NOT_AN_OBJECT: Any = object()  # an "entries" element that is not a JSON object (skipped undecoded)

_DECODER = json.JSONDecoder()
_STRUCTURAL = re.compile(rb'[\[\]{}"]')
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # after the opening quote
_SCALAR = re.compile(rb"-?(?:[0-9][0-9.eE+-]*|Infinity)|true|false|null|NaN")
_WS = re.compile(rb"[ \t\r\n]*")
_WS_BYTES = frozenset(b" \t\r\n")
_KINDS = {0x7B: "object", 0x5B: "array", 0x22: "string", 0x74: "boolean", 0x66: "boolean", 0x6E: "null"}


class JsonSyntaxError(ValueError):
    """Not JSON (or cut short): the message says where."""


class JsonBoundsError(ValueError):
    """Well-formed perhaps, but larger or more nested than any flight-recorder dump: refused."""


class Budget:
    """Structural tokens a document may still cost outside the fast path."""

    __slots__ = ("tokens",)

    def __init__(self, size: int) -> None:
        self.tokens = BASE_SCAN_TOKENS + size // 16


def container_end(data: bytes, pos: int, limit: int, budget: Budget, what: str) -> int:
    """Offset just past the array or object that starts at ``data[pos]``, found without decoding it.
    JsonBoundsError when it runs past ``limit`` or the budget; brackets of the wrong kind are left
    for the decoder to reject."""
    depth = 0
    i = pos
    search = _STRUCTURAL.search
    while True:
        m = search(data, i, limit)
        if m is None:
            break
        k = m.start()
        c = data[k]
        if c == 0x22:
            s = _STRING_REST.match(data, k + 1, limit)
            if s is None:
                break
            i = s.end()
        else:
            i = k + 1
            if c == 0x5B or c == 0x7B:
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return i
        budget.tokens -= 1
        if budget.tokens < 0:
            raise JsonBoundsError(f"{what} nests more structure than a flight-recorder dump has: gave up")
    if limit < len(data):
        raise JsonBoundsError(f"{what} is over {_mib(limit - pos)}: no flight-recorder dump has one that large")
    raise JsonSyntaxError(f"{what} is not closed before the end of the file (file cut short?)")


def value_end(data: bytes, pos: int, limit: int, budget: Budget, what: str) -> int:
    """Offset just past the JSON value (any kind) that starts at ``data[pos]``."""
    if pos >= len(data):
        raise JsonSyntaxError(f"the file ends where {what} should start (file cut short?)")
    c = data[pos]
    if c == 0x7B or c == 0x5B:
        close = data.find(b"}" if c == 0x7B else b"]", pos, limit)
        # Flat (no nested container, no string): the first closing bracket ends it.
        if close != -1 and not any(data.find(x, pos + 1, close) != -1 for x in (b"{", b"[", b'"')):
            return close + 1
        return container_end(data, pos, limit, budget, what)
    if c == 0x22:
        s = _STRING_REST.match(data, pos + 1, limit)
        if s is None:
            if limit < len(data):
                raise JsonBoundsError(f"{what} is a string over {_mib(limit - pos)}")
            raise JsonSyntaxError(f"{what}: a string is not closed before the end of the file (file cut short?)")
        return s.end()
    m = _SCALAR.match(data, pos, limit)
    if m is None:
        raise JsonSyntaxError(f"{what}: unexpected {data[pos:pos + 12]!r} at byte {pos}")
    return m.end()


def decode_slice(data: bytes, start: int, end: int, what: str) -> Any:
    """The one JSON value that is exactly ``data[start:end]``."""
    try:
        text = data[start:end].decode("utf-8")
        obj, stop = _DECODER.raw_decode(text)
    except UnicodeDecodeError as exc:
        raise JsonSyntaxError(f"{what} is not UTF-8 at byte {start + exc.start}") from exc
    except RecursionError as exc:
        raise JsonBoundsError(f"{what} is nested too deeply") from exc
    except ValueError as exc:
        raise JsonSyntaxError(f"{what}: {exc} (from byte {start})") from exc
    if stop != len(text):
        raise JsonSyntaxError(f"{what}: unexpected data at byte {start + stop}")
    return obj


def decode_object(data: bytes, pos: int, limit: int, budget: Budget, what: str) -> tuple[Any, int]:
    """(value, end) of the object at ``data[pos]`` (``{``), decoded from its own slice."""
    close = data.find(b"}", pos, limit)
    if close != -1:
        try:  # the common case: no nested object, so the first "}" closes it
            text = data[pos : close + 1].decode("utf-8")
            obj, stop = _DECODER.raw_decode(text)
            if stop == len(text):
                return obj, close + 1
        except (ValueError, RecursionError):
            pass
    end = container_end(data, pos, limit, budget, what)
    return decode_slice(data, pos, end, what), end


def skip_ws(data: bytes, pos: int) -> int:
    if pos < len(data) and data[pos] in _WS_BYTES:
        m = _WS.match(data, pos)
        return m.end() if m else pos
    return pos


class DumpReader:
    """Walk one JSON dump. Iterating :meth:`entries` yields every element of the top-level
    ``entries`` array (a decoded object, or :data:`NOT_AN_OBJECT`) and, by the time it is
    exhausted, has filled :attr:`blocks` with the top-level keys named in ``keep`` and
    :attr:`entries_kind` with "array", "absent", or the JSON kind of a non-array ``entries``."""

    def __init__(self, data: bytes, keep: Collection[str], *, max_entries: int = MAX_ENTRIES) -> None:
        self.data = data
        self.keep = keep
        self.max_entries = max_entries
        self.blocks: dict[str, Any] = {}
        self.entries_kind = "absent"
        self.count = 0
        self.keys: list[str] = []  # the first top-level keys met (for "not a dump" messages)
        self.budget = Budget(len(data))

    def entries(self) -> Iterator[Any]:
        data = self.data
        pos = skip_ws(data, 0)
        if pos >= len(data) or data[pos] != 0x7B:
            raise JsonSyntaxError("the top level is not a JSON object")
        pos = skip_ws(data, pos + 1)
        if pos < len(data) and data[pos] == 0x7D:
            pos += 1
        else:
            while True:
                key, pos = self._key(pos)
                if key == "entries" and pos < len(data) and data[pos] == 0x5B:
                    if self.entries_kind != "absent":
                        raise JsonSyntaxError("'entries' appears twice at the top level")
                    self.entries_kind = "array"
                    pos = yield from self._array(pos)
                else:
                    pos = self._block(key, pos)
                pos = skip_ws(data, pos)
                if pos >= len(data):
                    raise JsonSyntaxError("the file ends inside the top-level object (file cut short?)")
                if data[pos] == 0x2C:
                    pos = skip_ws(data, pos + 1)
                    continue
                if data[pos] == 0x7D:
                    pos += 1
                    break
                raise JsonSyntaxError(f"expected ',' or '}}' at byte {pos}, found {data[pos:pos + 12]!r}")
        if skip_ws(data, pos) != len(data):
            raise JsonSyntaxError(f"extra data after the top-level object at byte {pos}")

    def _key(self, pos: int) -> tuple[str | None, int]:
        data = self.data
        if pos >= len(data) or data[pos] != 0x22:
            raise JsonSyntaxError(f"expected a key at byte {pos}")
        end = value_end(data, pos, len(data), self.budget, "a top-level key")
        key = decode_slice(data, pos, end, "a top-level key") if end - pos <= MAX_KEY_BYTES else None
        if len(self.keys) < 16:
            self.keys.append(key if isinstance(key, str) else "…")
        pos = skip_ws(data, end)
        if pos >= len(data) or data[pos] != 0x3A:
            raise JsonSyntaxError(f"expected ':' at byte {pos}")
        return key, skip_ws(data, pos + 1)

    def _block(self, key: str | None, pos: int) -> int:
        data = self.data
        what = f"the top-level '{key}'" if key is not None else "a top-level block"
        end = value_end(data, pos, min(len(data), pos + MAX_BLOCK_BYTES), self.budget, what)
        if key == "entries":
            if self.entries_kind != "absent":
                raise JsonSyntaxError("'entries' appears twice at the top level")
            self.entries_kind = _KINDS.get(data[pos], "number")
        elif key is not None and key in self.keep:
            self.blocks[key] = decode_slice(data, pos, end, what)
        return end

    def _array(self, pos: int) -> Generator[Any, None, int]:
        data = self.data
        size = len(data)
        pos = skip_ws(data, pos + 1)
        if pos < size and data[pos] == 0x5D:
            return pos + 1
        budget = self.budget
        while True:
            if self.count >= self.max_entries:
                raise JsonBoundsError(f"more than {self.max_entries:,} entries: more than any flight-recorder "
                                      "buffer holds")
            self.count += 1
            limit = min(size, pos + MAX_ENTRY_BYTES)
            if pos < size and data[pos] == 0x7B:
                obj, pos = decode_object(data, pos, limit, budget, f"entry #{self.count}")
                yield obj
            else:
                pos = value_end(data, pos, limit, budget, f"entry #{self.count}")
                yield NOT_AN_OBJECT
            if pos < size and data[pos] == 0x2C and pos + 1 < size and data[pos + 1] not in _WS_BYTES:
                pos += 1  # compact JSON as torch writes it
                continue
            pos = skip_ws(data, pos)
            if pos >= size:
                raise JsonSyntaxError("the file ends inside 'entries' (file cut short?)")
            if data[pos] == 0x5D:
                return pos + 1
            if data[pos] != 0x2C:
                raise JsonSyntaxError(f"expected ',' or ']' after entry #{self.count} at byte {pos}, "
                                      f"found {data[pos:pos + 12]!r}")
            pos = skip_ws(data, pos + 1)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n:,} bytes"
