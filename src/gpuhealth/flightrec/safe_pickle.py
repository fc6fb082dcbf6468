"""A pickle reader that can only build plain containers, within bounds.

Flight-recorder pickles hold dicts, lists, tuples, strings, numbers, booleans and None — nothing
that needs a global. An unpickler executes code only through ``find_class`` (GLOBAL,
STACK_GLOBAL, and through them REDUCE/BUILD/NEWOBJ/INST/OBJ) and persistent ids, so refusing every
global and every persistent id makes loading a hostile file raise instead of run anything.

Memory and time are bounded too, which the C unpickler cannot promise:

- **what it builds is counted as it builds it**: every opcode is charged the bytes its result takes
  in this process (an empty set is 1 byte of pickle and 232 bytes of memory; a string its size), and
  reading stops with :class:`PickleBudgetError` once the charge passes the budget
  (:data:`MEMORY_BUDGET`, 384 MiB by default) — whatever the file's size. A payload (a string, a
  frame) is checked against the budget before it is decoded. Charges are never given back (a POP
  does not refund): the charge is an upper bound of what the unpickler holds, measured per opcode in
  ``tests/unit/flightrec/test_pickle_budget.py``; a real NCCL dump is charged ~1.5-1.7× what it takes.
- its memo is an array indexed by the file's own numbers in the C unpickler: a 12-byte pickle
  saying ``LONG_BINPUT 1e8`` takes 1.5 GB. The pure-Python unpickler used here keeps it in a dict.
- the memo lets a tiny pickle reuse one list in many places: a DAG that is exponential as a tree
  (walked, hashed as a key, or printed). torch reuses strings and the dicts of identical stack
  frames, each a handful of items. Every container fetched again from the memo is measured as a
  tree: over :data:`MAX_REUSED_TREE` items, or more than ~4 items per byte of the file over all
  reuses, and the pickle is refused. The whole document is then at most a few times its file as a tree.
- MARK nests at most :data:`MAX_MARK_DEPTH` deep (each level is a Python list).

A MemoryError inside (a budget larger than the process may take) drops everything the unpickler
built before it is reported, so the caller can still say so in one line.
"""

from __future__ import annotations

import io
import itertools
import pickle
import sys
from collections.abc import Callable
from typing import Any, ClassVar

MAX_MARK_DEPTH = 1000  # torch nests MARKs a few deep
MAX_REUSED_TREE = 256  # items (as a tree) of one container fetched again from the memo
MEMORY_BUDGET = 384 << 20  # bytes of objects one pickle may build (charged per opcode, see below)
_BIG_READ = 1 << 16  # reads past this are checked against the budget before they are decoded
_DECODE_FACTOR = 5  # a payload of n bytes: the bytes read, and a str of up to 4n (UCS-4)

_CONTAINERS = (list, tuple, dict, set, frozenset)


class UnsafePickleError(ValueError):
    """The pickle asked for something other than plain containers (a class, a function, …)."""


class SharedReferenceError(ValueError):
    """The pickle reuses containers more than a flight-recorder dump does (or nests MARKs absurdly)."""


class PickleBudgetError(ValueError):
    """What the pickle builds would take more memory than its budget."""


# ------------------------------------------------------------------------------------ the charges
# Bytes each opcode's result takes in CPython 3.11 on 64 bits, rounded up: the object (with its GC
# header, as pymalloc rounds it) and its slot on the stack (8 bytes, 9 with the list's overallocation).
# Opcodes not listed cost nothing themselves: they pop (POP, STOP), only say how to read (PROTO, FRAME:
# its bytes are checked as a read), or are refused (the globals and persistent ids).
_SLOT = 9
_FIXED: dict[bytes, int] = {
    pickle.NONE: _SLOT, pickle.NEWTRUE: _SLOT, pickle.NEWFALSE: _SLOT, pickle.EMPTY_TUPLE: _SLOT,
    pickle.BININT1: _SLOT, pickle.DUP: _SLOT, pickle.GET: _SLOT, pickle.BINGET: _SLOT, pickle.LONG_BINGET: _SLOT,
    pickle.BININT2: 48, pickle.BININT: 48, pickle.BINFLOAT: 40, pickle.FLOAT: 40,
    pickle.EMPTY_LIST: 80, pickle.EMPTY_DICT: 80, pickle.EMPTY_SET: 240, pickle.MARK: 80,
    pickle.TUPLE1: 64, pickle.TUPLE2: 72, pickle.TUPLE3: 80, pickle.TUPLE: 64, pickle.LIST: 80, pickle.DICT: 80,
    pickle.FROZENSET: 240,
    pickle.APPEND: _SLOT, pickle.SETITEM: 72,
    pickle.MEMOIZE: 96, pickle.PUT: 96, pickle.BINPUT: 96, pickle.LONG_BINPUT: 96,
}
# Opcodes that take every item since the MARK: bytes per item (a set's table is up to ~7 slots of 16
# bytes per item right after it grows; a dict's ~36 bytes per key or value).
_PER_ITEM: dict[bytes, int] = {
    pickle.TUPLE: 8, pickle.LIST: _SLOT, pickle.APPENDS: _SLOT, pickle.DICT: 36, pickle.SETITEMS: 36,
    pickle.FROZENSET: 112, pickle.ADDITEMS: 112,
}
# Opcodes whose result is as large as its payload: charged its measured size after it is built.
_SIZED = (pickle.INT, pickle.LONG, pickle.LONG1, pickle.LONG4, pickle.STRING, pickle.BINSTRING,
          pickle.SHORT_BINSTRING, pickle.UNICODE, pickle.BINUNICODE, pickle.SHORT_BINUNICODE, pickle.BINUNICODE8,
          pickle.BINBYTES, pickle.SHORT_BINBYTES, pickle.BINBYTES8, pickle.BYTEARRAY8)
_OP_COST = [0] * 256
for _op, _cost in _FIXED.items():
    _OP_COST[_op[0]] = _cost
_OP_PER_ITEM = {op[0]: n for op, n in _PER_ITEM.items()}
_OP_SIZED = frozenset(op[0] for op in _SIZED)
_MARK_FREED = 64  # the list a MARK started (56 bytes, as pymalloc rounds it) once an opcode takes its items
del _op, _cost


def _tree_size(obj: Any, cap: int) -> int:
    """Items in ``obj`` counted as a tree (a reused child once per use), or cap + 1 when more."""
    n = 0
    todo = [obj]
    while todo:
        o = todo.pop()
        n += 1
        if n > cap:
            return n
        kind = type(o)
        if kind is dict:
            n += len(o)  # its keys
            todo.extend(itertools.islice(o.values(), cap))
        elif kind in _CONTAINERS:
            todo.extend(itertools.islice(o, cap))
    return n


def _checked(load: Callable[[Any], None]) -> Callable[[Any], None]:
    def fetch(self: Any) -> None:
        load(self)
        obj = self.stack[-1]
        if type(obj) in _CONTAINERS:
            size = _tree_size(obj, MAX_REUSED_TREE)
            self.reuse_left -= size
            if size > MAX_REUSED_TREE or self.reuse_left < 0:
                how = (f"of over {MAX_REUSED_TREE} items" if size > MAX_REUSED_TREE
                       else "more often than its size allows")
                raise SharedReferenceError(
                    f"refused: the pickle reuses a {type(obj).__name__} {how} (a flight-recorder dump reuses only "
                    "strings and small stack-frame dicts; reused references can describe data exponentially larger "
                    "than the file)"
                )
    return fetch


# Keys (and set members) are hashed as they are inserted. Python's hash of an int is the int modulo
# 2**61 - 1, so ints a multiple of that apart collide — and n colliding keys make one dict cost O(n**2):
# a 1.3 MB pickle took 79 s. Tuples and frozensets hash their members' hashes, which an input that
# controls those members can make collide too. A flight-recorder dump's keys are strings and small
# numbers, so only str, bytes, bool, None, floats and ints below the modulus may be keys or members.
_HASH_MODULUS = (1 << 61) - 1
_SAFE_KEY_TYPES = (str, bytes, bool, float, type(None))


def _check_keys(keys: Any) -> None:
    for k in keys:
        kind = type(k)
        if kind is int:
            if -_HASH_MODULUS < k < _HASH_MODULUS:
                continue
        elif kind in _SAFE_KEY_TYPES:
            continue
        what = "an integer this large" if kind is int else f"a {kind.__name__}"
        raise SharedReferenceError(
            f"refused: the pickle uses {what} as a dict key or set member (a flight-recorder dump keys by strings "
            "and small numbers; such keys can be made to collide and cost time quadratic in their number)")


def _keys_checked(load: Callable[[Any], None], where: str) -> Callable[[Any], None]:
    """``load`` after checking the keys it is about to insert: ``setitem`` (the one below the top of the
    stack), ``pairs`` (every other item since the MARK) or ``all`` (every item since the MARK)."""
    def checked(self: Any) -> None:
        stack = self.stack
        if where == "setitem":
            _check_keys(stack[-2:-1])
        elif where == "pairs":
            _check_keys(stack[0::2])
        else:
            _check_keys(stack)
        load(self)
    return checked


def _load_mark(self: Any) -> None:
    if len(self.metastack) >= MAX_MARK_DEPTH:
        raise SharedReferenceError(f"refused: MARKs nested over {MAX_MARK_DEPTH} deep (not a flight-recorder dump)")
    self.metastack.append(self.stack)
    self.stack = []
    self.append = self.stack.append


class _PlainUnpickler(pickle._Unpickler):
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    for _op in (pickle.GET, pickle.BINGET, pickle.LONG_BINGET, pickle.DUP):
        dispatch[_op[0]] = _checked(dispatch[_op[0]])
    dispatch[pickle.MARK[0]] = _load_mark
    for _op, _where in ((pickle.SETITEM, "setitem"), (pickle.SETITEMS, "pairs"), (pickle.DICT, "pairs"),
                        (pickle.ADDITEMS, "all"), (pickle.FROZENSET, "all")):
        dispatch[_op[0]] = _keys_checked(dispatch[_op[0]], _where)
    del _op, _where

    def __init__(self, data: bytes | bytearray, budget: int) -> None:
        super().__init__(io.BytesIO(data))
        self.reuse_left = 4 * len(data) + 65536  # tree items all memo fetches together may add
        self.budget = budget
        self.charged = 0  # bytes charged so far (kept current before each opcode runs)
        self.peak = 0  # the most charged at any point (before a MARK's list was given back)

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(
            f"refused: the pickle asks for the global {module}.{name}; a flight-recorder dump holds only "
            "plain data, so this file was not written by PyTorch (or was tampered with)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refused: the pickle uses a persistent id (not a flight-recorder dump)")

    def _over(self, what: str) -> PickleBudgetError:
        return PickleBudgetError(
            f"refused: the pickle {what} more than its {self.budget >> 20} MiB memory budget (a flight-recorder "
            "dump of 2,000 entries builds ~6 MiB; this is not one, or is far larger than any ring buffer holds)")

    def _read(self, n: int) -> bytes:
        data: bytes = self._unframer.read(n)
        if len(data) > _BIG_READ and self.charged + _DECODE_FACTOR * len(data) > self.budget:
            raise self._over(f"holds a {len(data) >> 10:,} KiB value: decoding it would take")
        return data

    def _readline(self) -> bytes:
        line: bytes = self._unframer.readline()
        if len(line) > _BIG_READ and self.charged + _DECODE_FACTOR * len(line) > self.budget:
            raise self._over(f"holds a {len(line) >> 10:,} KiB text value: decoding it would take")
        return line

    def load(self) -> Any:
        """pickle._Unpickler.load, charging each opcode's result to the budget (same setup, same loop)."""
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._read
        self.readinto = self._unframer.readinto
        self.readline = self._readline
        self.metastack: list[list[Any]] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read = self._unframer.read  # the opcode itself: one byte
        dispatch, cost, per_item, sized = self.dispatch, _OP_COST, _OP_PER_ITEM, _OP_SIZED
        budget = self.budget
        charged = 0
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                op = key[0]
                charged += cost[op]
                items = -1
                if op in per_item:
                    items = len(self.stack)
                    charged += per_item[op] * items
                if charged > budget:
                    raise self._over("builds")
                self.charged = charged
                dispatch[op](self)
                if op in sized:
                    charged += sys.getsizeof(self.stack[-1]) + _SLOT
                elif items >= 0:  # the MARK's list and its slots are gone now that its items moved
                    self.peak = max(self.peak, charged)
                    charged -= _MARK_FREED + 8 * items
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            self.charged = charged
            self.peak = max(self.peak, charged)
            return stop.value

    def release(self) -> None:
        """Drop everything built so far (after a MemoryError the traceback still holds this object). Clears
        in place: with memory exhausted, even a new empty list may not be had."""
        for level in getattr(self, "metastack", ()):
            level.clear()
        for attr in ("stack", "metastack", "memo"):
            held = getattr(self, attr, None)
            if held is not None:
                held.clear()


def loads_plain(data: bytes | bytearray, *, budget: int = MEMORY_BUDGET) -> Any:
    """Unpickle ``data`` allowing only plain containers, building at most ``budget`` bytes of objects;
    UnsafePickleError for anything but plain data, ValueError (SharedReferenceError and
    PickleBudgetError among them) for a corrupt, inflating or oversized stream."""
    unpickler = _PlainUnpickler(data, budget)
    try:
        return unpickler.load()
    except (UnsafePickleError, SharedReferenceError, PickleBudgetError):
        raise
    except MemoryError:
        unpickler.release()
        raise PickleBudgetError(f"ran out of memory unpickling it (after {unpickler.charged >> 20} MiB of objects; "
                                "this process may take less than the pickle budget)") from None
    except Exception as exc:  # the pure-Python unpickler fails in many ways (RecursionError too)
        raise ValueError(f"corrupt pickle: {type(exc).__name__}: {exc}") from exc
    finally:
        unpickler.release()


def charged_bytes(data: bytes | bytearray) -> int:
    """The most that loading ``data`` charges to the budget at any point (for measurements: the budget is
    not enforced)."""
    unpickler = _PlainUnpickler(data, sys.maxsize)
    try:
        unpickler.load()
        return unpickler.peak
    finally:
        unpickler.release()
