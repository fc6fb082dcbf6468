"""Fuzz targets (issue 30): every parser of untrusted bytes, under generated inputs of any shape, answers
with its documented ValueError kind only (never another exception, never a hang) and stays within its
memory budget (tracemalloc peak). Property-based (hypothesis), bounded so the whole file runs in well
under 60 s on 2 cores; raise ``GPUHEALTH_FUZZ_EXAMPLES`` for a longer run.

- ``safe_pickle.loads_plain``: UnsafePickleError (a ValueError) only; peak within a small multiple of
  the budget it is given, whatever the opcodes;
- the JSON dump loader (``load._read_json``): DumpError only;
- the archive reader (``archive.unpack``): members or ArchiveError, and nothing unpacked past one file's
  limit;
- the rank socket's lines (``protocol.decode``, ``iter_steps_line``, ``read_identity``/``read_steps``/
  ``read_dump_chunk``, ``LineBuffer``): ProtocolError only (or a record judged invalid);
- the gRPC messages' validation (``proto.convert``): WireError only, for any message the wire can carry.
"""

from __future__ import annotations

import io
import os
import pickle
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from gpuhealth.flightrec import archive
from gpuhealth.flightrec.load import DumpError, _read_json
from gpuhealth.flightrec.safe_pickle import PickleBudgetError, SharedReferenceError, UnsafePickleError, loads_plain
from gpuhealth.instrument import protocol
from gpuhealth.proto import convert
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

EXAMPLES = int(os.environ.get("GPUHEALTH_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextmanager
def peak_bytes() -> Iterator[list[int]]:
    """The tracemalloc peak of the block, in out[0]."""
    out = [0]
    tracemalloc.start()
    try:
        yield out
    finally:
        out[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def _only(kinds: tuple[type[BaseException], ...], call: Callable[[], Any]) -> Any:
    try:
        return call()
    except kinds:
        return None


# ----------------------------------------------------------------------------------------- pickles
# Opcodes a hostile pickle would use: containers that inflate, memo tricks, frames, strings, numbers.
_OPS = [b"}", b"]", b")", b"\x8f", b"(", b"e", b"l", b"t", b"s", b"u", b"a", b"\x85", b"\x86", b"\x87", b"2",
        b"0", b"\x94", b"h\x00", b"j\x00\x00\x00\x00", b"K\x07", b"J\xff\xff\xff\x7f", b"\x8a\x01\x05",
        b"N", b"\x88", b"\x89", b"X\x03\x00\x00\x00abc", b"C\x02hi", b"\x8c\x01k", b"G@\x09!\xfb\x85\xebQ\xb8",
        b"\x90", b"\x91", b"\x95\x08\x00\x00\x00\x00\x00\x00\x00", b"c", b"\x93", b"R", b"b", b"."]
_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    | st.tuples(inner, inner),
    max_leaves=30)
BUDGET = 256 << 10


def _pickle_errors_only(data: bytes) -> None:
    """loads_plain's documented answers: a value, UnsafePickleError (and its kinds), or a ValueError saying
    the pickle is corrupt."""
    try:
        loads_plain(data, budget=BUDGET)
    except (UnsafePickleError, SharedReferenceError, PickleBudgetError):
        pass
    except ValueError as exc:
        assert str(exc).startswith("corrupt pickle"), exc


@FUZZ
@given(st.lists(st.sampled_from(_OPS), max_size=4000), st.integers(2, 5))
def test_loads_plain_keeps_its_budget_for_any_opcodes(ops: list[bytes], proto: int) -> None:
    data = bytes([0x80, proto]) + b"".join(ops) + b"."
    with peak_bytes() as peak:
        _pickle_errors_only(data)
    assert peak[0] < 3 * BUDGET + 64 * len(data), peak[0]


@FUZZ
@given(_PLAIN, st.integers(3, 5))  # (protocol 2 pickles bytes through a global, which is refused)
def test_loads_plain_reads_plain_data_back(value: Any, proto: int) -> None:
    assert loads_plain(pickle.dumps(value, protocol=proto)) == value


@FUZZ
@given(st.binary(max_size=2048))
def test_loads_plain_refuses_garbage_in_one_kind(data: bytes) -> None:
    _pickle_errors_only(data)


# -------------------------------------------------------------------------------------------- JSON
_JSON_BITS = [b"{", b"}", b"[", b"]", b",", b":", b'"entries"', b'"version"', b'"2.10"', b'"pg_status"', b"1",
              b"-1e308", b"null", b"true", b'"\\ud800"', b'"x"', b" ", b'"state"', b'"scheduled"', b'"sizes"',
              b"[[1,2]]", b'"record_id"', b'"collective_seq_id"', b'"frames"', b"1e999", b"\xff"]


@FUZZ
@given(st.lists(st.sampled_from(_JSON_BITS), max_size=600) | st.binary(max_size=1024).map(lambda b: [b]))
def test_the_json_dump_loader_answers_dump_errors_only(bits: list[bytes]) -> None:
    data = b"".join(bits)
    with peak_bytes() as peak:
        _only((DumpError,), lambda: _read_json(data))
    assert peak[0] < 4 << 20, peak[0]


# ---------------------------------------------------------------------------------------- archives
@pytest.mark.filterwarnings("ignore:Duplicate name")
@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["rank0.json", "rank1.json", "x/rank2.json", "rank3.json.gz", ".hidden"]),
                          st.binary(max_size=64) | st.integers(0, 700).map(lambda n: b"{" * n),
                          st.integers(0, 9)), max_size=6),
       st.just(0) | st.integers(0, 64), st.just(b"") | st.binary(max_size=64))
def test_the_archive_reader_answers_members_or_one_error(tmp_path_factory: pytest.TempPathFactory,
                                                         members: list[tuple[str, bytes, int]], cut: int,
                                                         junk: bytes) -> None:
    target(float(sum(len(d) for _, d, _ in members)))  # steer towards archives bigger than one file's limit
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data, level in members:
            z.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED if level else zipfile.ZIP_STORED)
    raw = buf.getvalue()
    raw = raw[:len(raw) - cut] + junk if cut or junk else raw  # cut short, or with garbage after it
    path = tmp_path_factory.mktemp("zip") / "dumps.zip"
    path.write_bytes(raw)
    limit = 1024  # one file's limit here: the members together stay within it (an archive is one file)
    got = _only((archive.ArchiveError,), lambda: list(archive.unpack(path, "zip", limit, lambda n: True)))
    for m in got or []:
        assert (m.data is None) != (m.error is None)
    assert sum(len(m.data or b"") for m in got or []) <= limit


# ------------------------------------------------------------------------------ rank-socket lines
_LINE_BITS = [b'{"type":"hello","identity":{"job_id":"j","rank":0,"world_size":2,"host":"h","pid":1}}',
              protocol.STEPS_HEAD, b'{"job_id":"j","rank":0,"step":1,"start_time":1.0,"wall_s":0.1}', b",", b"]",
              b"}", b'"dropped":0', b'{"type":"dump_chunk","id":"1","index":0,"data":"QUJD"}', b'{"type":1}',
              b'"', b"\\", b"\xff", b"\n", b"[", b"{", b"1e999", b"NaN", b"-0", b'"rank":-1', b'"world_size":0']


@FUZZ
@given(st.lists(st.sampled_from(_LINE_BITS), max_size=80) | st.binary(max_size=512).map(lambda b: [b]))
def test_rank_socket_lines_answer_protocol_errors_only(bits: list[bytes]) -> None:
    line = b"".join(bits)
    if line.startswith(protocol.STEPS_HEAD):
        records = _only((protocol.ProtocolError,), lambda: list(protocol.iter_steps_line(line)))
        for r in records or []:
            assert r is None or (r.rank >= 0 and r.step >= 0)
    msg = _only((protocol.ProtocolError,), lambda: protocol.decode(line))
    if msg is not None:
        for read in (protocol.read_identity, protocol.read_steps, protocol.read_dump_chunk):
            _only((protocol.ProtocolError,), lambda read=read: read(msg))  # type: ignore[misc]
    buf = protocol.LineBuffer(max_line=256)
    for piece in (line[:7], line[7:], b"\n"):
        list(buf.feed(piece))


# -------------------------------------------------------------------------------------- gRPC wire
def _message(cls: type[Any]) -> st.SearchStrategy[Any]:
    return st.binary(max_size=256).map(lambda b: _only((Exception,), lambda: cls.FromString(b))).filter(
        lambda m: m is not None)


@FUZZ
@given(_message(pb.RankIdentity), _message(pb.StepBatch), st.lists(_message(pb.Finding), max_size=4),
       st.integers(0, 4096))
def test_grpc_messages_are_validated_into_wire_errors_only(ident: Any, steps: Any, findings: list[Any],
                                                          world: int) -> None:
    _only((convert.WireError,), lambda: convert.identity_from_pb(ident))
    _only((convert.WireError,), lambda: convert.steps_from_pb(steps, world or None))
    _only((convert.WireError,), lambda: convert.findings_from_pb(findings))


def test_the_fuzz_file_is_bounded() -> None:
    """The examples count is what CI runs; a longer run sets GPUHEALTH_FUZZ_EXAMPLES."""
    assert EXAMPLES <= 150 or os.environ.get("GPUHEALTH_FUZZ_EXAMPLES")
    assert Path(__file__).name.startswith("test_fuzz")
