"""The instrument wire protocol: round trips, limits, and tolerance of garbage."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord

IDENT = RankIdentity("job7", 3, 8, "node-a", 4242, local_rank=3, gpu_uuid="GPU-abc", gpu_index=3)
REC = StepRecord("job7", 3, 11, 1_700_000_000.5, 0.25, 0.2, 0.05)


def _one(line: bytes) -> dict:
    buf = protocol.LineBuffer()
    msgs = list(buf.feed(line))
    assert buf.malformed == 0
    assert len(msgs) == 1
    return msgs[0]


def test_hello_round_trip_is_versioned() -> None:
    line = protocol.encode(protocol.hello(IDENT))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    msg = _one(line)
    assert msg["v"] == protocol.PROTOCOL_VERSION == 1
    assert msg["type"] == "hello"
    assert protocol.read_identity(msg) == IDENT


def test_steps_round_trip_and_bad_records_are_counted_not_fatal() -> None:
    msg = _one(protocol.encode(protocol.steps([REC, REC], dropped=4)))
    assert msg["dropped"] == 4
    records, bad = protocol.read_steps(msg)
    assert records == [REC, REC] and bad == 0
    msg["records"].append({"job_id": "x"})  # no rank/step
    msg["records"].append("not a dict")
    records, bad = protocol.read_steps(msg)
    assert records == [REC, REC] and bad == 2


def test_requests_and_replies() -> None:
    assert _one(protocol.encode(protocol.dump_fr_request("r1", "/d"))) == {"type": "dump_fr", "id": "r1",
                                                                             "inline": True, "dir": "/d"}
    assert _one(protocol.encode(protocol.dump_fr_request("r1"))) == {"type": "dump_fr", "id": "r1", "inline": True}
    assert _one(protocol.encode(protocol.stacks_request("r2"))) == {"type": "stacks", "id": "r2"}
    ok = _one(protocol.encode(protocol.reply_ok("r1", path="/d/rank3.json")))
    assert ok == {"type": "reply", "id": "r1", "ok": True, "path": "/d/rank3.json"}
    err = _one(protocol.encode(protocol.reply_error("r2", "boom")))
    assert err["ok"] is False and err["error"] == "boom"
    assert protocol.request_id_of(ok) == "r1"
    with pytest.raises(protocol.ProtocolError):
        protocol.request_id_of({"type": "stacks"})
    with pytest.raises(protocol.ProtocolError):
        protocol.request_id_of({"type": "stacks", "id": True})


@pytest.mark.parametrize(
    "line",
    [b"not json", b"[1, 2]", b'"text"', b'{"no_type": 1}', b'{"type": 5}', b"\xff\xfe", b"{"],
)
def test_decode_rejects_garbage(line: bytes) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(line)


def test_read_identity_rejects_bad_identity() -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.read_identity({"type": "hello"})
    with pytest.raises(protocol.ProtocolError):
        protocol.read_identity({"type": "hello", "identity": {"job_id": "j", "rank": "three", "world_size": 2}})
    with pytest.raises(protocol.ProtocolError):
        protocol.read_steps({"type": "steps", "records": "nope"})


def test_line_buffer_reassembles_split_lines_and_skips_garbage() -> None:
    data = (protocol.encode(protocol.stacks_request("a")) + b"garbage\n\n" + b'{"type":"future_thing","x":1}\n'
            + protocol.encode(protocol.stacks_request("b")))
    buf = protocol.LineBuffer()
    out = []
    for i in range(0, len(data), 7):  # arrives in small pieces
        out.extend(buf.feed(data[i : i + 7]))
    assert [m["type"] for m in out] == ["stacks", "future_thing", "stacks"]  # unknown types pass through
    assert [m.get("id") for m in out] == ["a", None, "b"]
    assert buf.malformed == 1


def test_over_long_line_is_dropped_whole_and_the_stream_recovers() -> None:
    buf = protocol.LineBuffer(max_line=100)
    assert list(buf.feed(b"x" * 150)) == []  # no newline yet: buffer must not grow past the limit
    assert list(buf.feed(b"y" * 150)) == []
    out = list(buf.feed(b"tail\n" + protocol.encode({"type": "ok"})))
    assert out == [{"type": "ok"}]
    assert buf.malformed == 1
    out = list(buf.feed(b'{"type":"' + b"z" * 120 + b'"}\n{"type":"ok2"}\n'))
    assert out == [{"type": "ok2"}] and buf.malformed == 2


def test_encode_refuses_messages_over_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_LINE_BYTES", 64)
    with pytest.raises(protocol.ProtocolError, match="over 64"):
        protocol.encode({"type": "reply", "blob": "x" * 100})


def test_encode_uses_no_nan() -> None:
    with pytest.raises(ValueError):
        protocol.encode({"type": "steps", "x": float("nan")})


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=1, max_value=50))
def test_line_buffer_never_raises_on_arbitrary_bytes(data: bytes, chunk: int) -> None:
    buf = protocol.LineBuffer(max_line=128)
    for i in range(0, len(data), chunk):
        for msg in buf.feed(data[i : i + chunk]):
            assert isinstance(msg["type"], str)
    # And a valid line after any garbage still comes through once a newline ends the garbage.
    tail = list(buf.feed(b"\n" + json.dumps({"type": "after"}).encode() + b"\n"))
    assert tail[-1] == {"type": "after"}


def test_records_the_coordinator_would_refuse_are_dropped_at_the_socket() -> None:
    from gpuhealth.instrument.protocol import read_identity, read_steps

    good = {"job_id": "j", "rank": 1, "step": 3, "start_time": 1.0, "wall_s": 0.1, "compute_s": 0.05}
    bad = [dict(good, rank=-1), dict(good, step=-1), dict(good, job_id=""), dict(good, wall_s=float("nan")),
           dict(good, wall_s=float("inf")), dict(good, compute_s=-0.5), dict(good, start_time=float("nan")),
           dict(good, job_id="x" * 300), dict(good, job_id="a\nb")]
    records, dropped = read_steps({"records": [good, *bad]})
    assert [r.step for r in records] == [3] and dropped == len(bad)
    ident = {"job_id": "j", "rank": 0, "world_size": 2, "host": "h", "pid": 1}
    assert read_identity({"identity": ident}).rank == 0
    for broken in (dict(ident, rank=2), dict(ident, rank=-1), dict(ident, job_id=""), dict(ident, world_size=0)):
        with pytest.raises(protocol.ProtocolError):
            read_identity({"identity": broken})


def test_dump_chunks_round_trip_and_stay_under_the_line_limit() -> None:
    data = bytes(range(256)) * 20_000  # 5 MB: three chunks
    msgs = protocol.dump_chunks("r9", data)
    assert [m["index"] for m in msgs] == [0, 1, 2]
    lines = [protocol.encode(m) for m in msgs]
    assert max(len(x) for x in lines) < protocol.MAX_LINE_BYTES
    parts = [protocol.read_dump_chunk(_one(x)) for x in lines]
    assert {rid for rid, _, _ in parts} == {"r9"} and b"".join(p for _, _, p in parts) == data
    assert protocol.dump_chunks("r9", b"") == []
    reply = protocol.inline_dump_reply("r9", data, 3)
    assert reply["bytes"] == len(data) and reply["chunks"] == 3 and len(reply["sha256"]) == 64


@pytest.mark.parametrize("bad", [
    {"type": "dump_chunk", "id": "r", "index": 0, "data": "not base64!"},
    {"type": "dump_chunk", "id": "r", "index": -1, "data": ""},
    {"type": "dump_chunk", "id": "r", "index": True, "data": ""},
    {"type": "dump_chunk", "id": "r", "data": ""},
    {"type": "dump_chunk", "index": 0, "data": ""},
])
def test_malformed_dump_chunks_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.read_dump_chunk(bad)
