"""A pickle reader that can only build plain containers.

Flight-recorder pickles hold dicts, lists, tuples, strings, numbers, booleans and None — nothing
that needs a global. ``pickle.Unpickler`` executes code only through ``find_class`` (GLOBAL,
STACK_GLOBAL, and through them REDUCE/BUILD/NEWOBJ/INST/OBJ) and persistent ids, so refusing every
global and every persistent id makes loading a hostile file raise instead of run anything.
"""

from __future__ import annotations

import io
import pickle
from typing import Any


class UnsafePickleError(ValueError):
    """The pickle asked for something other than plain containers (a class, a function, …)."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(
            f"refused: the pickle asks for the global {module}.{name}; a flight-recorder dump holds only "
            "plain data, so this file was not written by PyTorch (or was tampered with)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refused: the pickle uses a persistent id (not a flight-recorder dump)")


def loads_plain(data: bytes) -> Any:
    """Unpickle ``data`` allowing only plain containers; UnsafePickleError for anything else,
    ValueError for a corrupt stream."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, IndexError, KeyError, TypeError, AttributeError,
            UnicodeDecodeError, OverflowError, MemoryError, RecursionError) as exc:
        raise ValueError(f"corrupt pickle: {type(exc).__name__}: {exc}") from exc
