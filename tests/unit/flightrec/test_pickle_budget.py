"""The unpickler counts what it builds: each opcode's charge is at least what its result takes (measured
with tracemalloc, opcode by opcode), a real NCCL dump is not charged absurdly more than it takes, and a
pickle stops at its budget whatever its size — before a large payload is decoded, not after."""

from __future__ import annotations

import pickle
import tracemalloc
from pathlib import Path

import pytest

from gpuhealth.flightrec.safe_pickle import MEMORY_BUDGET, PickleBudgetError, charged_bytes, loads_plain

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
N = 1 << 17  # opcodes per flood: enough for the per-object costs to dominate, fast in pure Python
HDR = b"\x80\x04"


def _int4(i: int) -> bytes:
    return b"J" + i.to_bytes(4, "little")


# Pickles of one construct repeated: each grows the unpickler by a different amount per byte.
FLOODS: dict[str, bytes] = {
    "NONE": HDR + b"N" * N + b".",
    "DUP": HDR + b"N" + b"2" * N + b".",
    "EMPTY_LIST": HDR + b"]" * N + b".",
    "EMPTY_DICT": HDR + b"}" * N + b".",
    "EMPTY_SET": HDR + b"\x8f" * N + b".",
    "MARK+FROZENSET": HDR + b"(\x91" * (N // 2) + b".",
    "EMPTY_LIST+MEMOIZE": HDR + b"]\x94" * (N // 2) + b".",
    "NONE+MEMOIZE": HDR + b"N\x94" * (N // 2) + b".",
    "BININT2": HDR + b"M\x01\x02" * (N // 3) + b".",
    "BININT": HDR + b"".join(_int4(i) for i in range(N // 5)) + b".",
    "BINFLOAT": HDR + b"G\x3f\xf0\x00\x00\x00\x00\x00\x00" * (N // 9) + b".",
    "LONG1": HDR + (b"\x8a\x08" + b"\xff" * 7 + b"\x7f") * (N // 10) + b".",
    "SHORT_BINUNICODE": HDR + b"\x8c\x02ab" * (N // 4) + b".",
    "SHORT_BINUNICODE astral": HDR + (b"\x8c\x05" + "a\U0001F600".encode()) * (N // 7) + b".",
    "TUPLE1": HDR + b"N\x85" * (N // 2) + b".",
    "TUPLE3": HDR + b"NNN\x87" * (N // 4) + b".",
    "MARK..TUPLE": HDR + b"(" + b"N" * N + b"t.",
    "APPEND": HDR + b"]" + b"]a" * (N // 2) + b".",
    "APPENDS": HDR + b"](" + b"]" * N + b"e.",
    "SETITEM": HDR + b"}" + b"".join(_int4(i) + b"Ns" for i in range(N // 7)) + b".",
    "SETITEMS": HDR + b"}(" + b"".join(_int4(i) + b"N" for i in range(N // 6)) + b"u.",
    "FROZENSET of ints": HDR + b"(" + b"".join(_int4(i) for i in range(N // 5)) + b"\x91.",
    "ADDITEMS": HDR + b"\x8f(" + b"".join(_int4(i) for i in range(N // 5)) + b"\x90.",
}


def _traced_peak(data: bytes) -> int:
    tracemalloc.start()
    try:
        obj = loads_plain(data, budget=1 << 40)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del obj
    return peak


@pytest.mark.parametrize("name", sorted(FLOODS))
def test_each_opcode_is_charged_at_least_what_it_builds(name: str) -> None:
    data = FLOODS[name]
    peak, charged = _traced_peak(data), charged_bytes(data)
    # tracemalloc counts this process's Python allocations while loading (the input's copy included: ~N bytes)
    assert peak <= charged + len(data) + 64 * 1024, (name, peak, charged)


def _real_pickles() -> list[Path]:
    return sorted(FIXTURES.rglob("*.pkl"))


def test_real_dumps_load_and_are_charged_near_what_they_take() -> None:
    paths = _real_pickles()
    assert len(paths) > 50
    for path in paths[:: max(1, len(paths) // 12)]:  # a dozen across the recordings (each ~0.3 s)
        data = path.read_bytes()
        assert loads_plain(data) == pickle.loads(data), path
        peak, charged = _traced_peak(data), charged_bytes(data)
        assert charged < 2.5 * peak + 65536, (path, peak, charged)  # pessimistic, not absurd: real dumps fit
        assert charged < MEMORY_BUDGET / 32, path


def test_a_pickle_stops_at_its_budget_whatever_its_size() -> None:
    budget = 8 << 20
    data = HDR + b"\x8f" * (4 << 20) + b"."  # 4 MiB of empty sets: ~1 GB if built
    tracemalloc.start()
    try:
        with pytest.raises(PickleBudgetError, match=r"builds more than its 8 MiB memory budget"):
            loads_plain(data, budget=budget)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < budget + len(data) + (1 << 20)


def test_a_large_payload_is_weighed_before_it_is_decoded() -> None:
    text = ("a" * ((4 << 20) - 1) + "\U0001F600").encode()  # 4 MiB of UTF-8 that decodes to 16 MiB (UCS-4)
    data = HDR + b"X" + len(text).to_bytes(4, "little") + text + b"."
    tracemalloc.start()
    try:
        with pytest.raises(PickleBudgetError, match="holds a 4,096 KiB value"):
            loads_plain(data, budget=12 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(data) + (1 << 20)  # the input and the payload read: never the 16 MiB string
    assert loads_plain(data, budget=32 << 20) == text.decode()
