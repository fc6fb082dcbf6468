"""A pickle reader that can only build plain containers, within bounds.

Flight-recorder pickles hold dicts, lists, tuples, strings, numbers, booleans and None — nothing
that needs a global. An unpickler executes code only through ``find_class`` (GLOBAL,
STACK_GLOBAL, and through them REDUCE/BUILD/NEWOBJ/INST/OBJ) and persistent ids, so refusing every
global and every persistent id makes loading a hostile file raise instead of run anything.

Memory and time are bounded too, which the C unpickler cannot promise:

- its memo is an array indexed by the file's own numbers: a 12-byte pickle saying ``LONG_BINPUT
  1e8`` takes 1.5 GB. The pure-Python unpickler used here keeps the memo in a dict.
- the memo lets a tiny pickle reuse one list in many places: a DAG that is exponential as a tree
  (walked, hashed as a key, or printed). torch reuses strings and the dicts of identical stack
  frames, each a handful of items. Every container fetched again from the memo is measured as a
  tree: over :data:`MAX_REUSED_TREE` items, or more than ~4 items per byte of the file over all
  reuses, and the pickle is refused. The whole document is then at most a few times its file as a tree.
- MARK nests at most :data:`MAX_MARK_DEPTH` deep (each level is a Python list).
"""

from __future__ import annotations

import io
import itertools
import pickle
from collections.abc import Callable
from typing import Any, ClassVar

MAX_MARK_DEPTH = 1000  # torch nests MARKs a few deep
MAX_REUSED_TREE = 256  # items (as a tree) of one container fetched again from the memo

_CONTAINERS = (list, tuple, dict, set, frozenset)


class UnsafePickleError(ValueError):
    """The pickle asked for something other than plain containers (a class, a function, …)."""


class SharedReferenceError(ValueError):
    """The pickle reuses containers more than a flight-recorder dump does (or nests MARKs absurdly)."""


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
    del _op

    def __init__(self, data: bytes | bytearray) -> None:
        super().__init__(io.BytesIO(data))
        self.reuse_left = 4 * len(data) + 65536  # tree items all memo fetches together may add

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(
            f"refused: the pickle asks for the global {module}.{name}; a flight-recorder dump holds only "
            "plain data, so this file was not written by PyTorch (or was tampered with)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refused: the pickle uses a persistent id (not a flight-recorder dump)")


def loads_plain(data: bytes | bytearray) -> Any:
    """Unpickle ``data`` allowing only plain containers; UnsafePickleError for anything else,
    ValueError (SharedReferenceError among them) for a corrupt or inflating stream."""
    try:
        return _PlainUnpickler(data).load()
    except (UnsafePickleError, SharedReferenceError):
        raise
    except Exception as exc:  # the pure-Python unpickler fails in many ways (MemoryError and RecursionError too)
        raise ValueError(f"corrupt pickle: {type(exc).__name__}: {exc}") from exc
