"""The agent reads a steps line record by record (``protocol.iter_steps_line``): whatever the hook writes
comes out as ``read_steps`` would give it, and a line that is not what the hook writes stops at the first
record that is not a small flat object — none of it decoded as one document."""

from __future__ import annotations

import json

import pytest

from gpuhealth.instrument import protocol
from gpuhealth.model import StepRecord


def _line(records: list[StepRecord], dropped: int = 0) -> bytes:
    return protocol.encode(protocol.steps(records, dropped)).rstrip(b"\n")


def test_what_the_hook_writes_reads_back_record_by_record() -> None:
    records = [StepRecord("job-ü \"q\" }{", r, s, 1.7e9 + s, 0.25, 0.2 if s % 2 else None, 0.05,
                          section="fwd" if s == 3 else None) for r in range(2) for s in range(5)]
    for batch in (records, records[:1], []):
        line = _line(batch, dropped=7)
        assert list(protocol.iter_steps_line(line)) == batch
        assert protocol.read_steps(protocol.decode(line)) == (batch, 0)


def test_bad_records_are_none_and_the_rest_still_read() -> None:
    good = StepRecord("j", 0, 1, 1.7e9, 0.1, None, None)
    line = (b'{"type":"steps","records":[{},' + json.dumps(good.to_dict(), separators=(",", ":")).encode()
            + b',{"job_id":"j","rank":-1,"step":0,"start_time":1.0,"wall_s":0.1}]}')
    assert list(protocol.iter_steps_line(line)) == [None, good, None]


@pytest.mark.parametrize("line", [
    b'{"type":"steps","records":[{"a":[1,2]}]}',  # nested: no record holds a list
    b'{"type":"steps","records":[{"a":{"b":1}}]}',
    b'{"type":"steps","records":[{"a":"' + b"x" * 5000 + b'"}]}',  # one record over 4 KiB
    b'{"type":"steps","records":[{} {}]}',
    b'{"type":"steps","records":[{}]',  # no closing brace
    b'{"type":"steps","records":[{}],"dropped":0,"x":"' + b"y" * 300 + b'"}',
    b'{"type": "steps", "records": [{}]}',  # not the hook's layout: the caller decides (short lines only)
])
def test_a_line_that_is_not_the_hooks_stops_at_the_first_odd_record(line: bytes) -> None:
    with pytest.raises(protocol.ProtocolError):
        list(protocol.iter_steps_line(line))


def test_at_most_a_lines_worth_of_records() -> None:
    line = b'{"type":"steps","records":[' + b",".join([b"{}"] * (protocol.MAX_RECORDS_PER_LINE + 1)) + b"]}"
    got = []
    with pytest.raises(protocol.ProtocolError, match="more than 65536 records"):
        for rec in protocol.iter_steps_line(line):
            got.append(rec)
    assert len(got) == protocol.MAX_RECORDS_PER_LINE


def test_a_reply_is_named_by_its_head_without_decoding_it() -> None:
    big = protocol.encode(protocol.reply_ok("123-4", stacks={"x": "y" * 100_000}))
    assert protocol.request_head(big) == ("reply", "123-4")
    assert protocol.request_head(protocol.encode(protocol.dump_chunks("9-9", b"abc")[0])) == ("dump_chunk", "9-9")
    assert protocol.request_head(protocol.encode(protocol.steps([]))) is None
    assert protocol.request_head(b'{"id":"1","type":"reply"}') is None
