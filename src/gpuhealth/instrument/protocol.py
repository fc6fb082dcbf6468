"""The instrument wire protocol: newline-delimited JSON over a unix stream socket.

Pure (no I/O, no torch): the training-side hook and the agent's ``RankHub`` both use it.

Every line is one JSON object with a ``type``. Version 1 messages:

rank → agent
    ``{"v": 1, "type": "hello", "identity": RankIdentity}``  (first line on a connection)
    ``{"type": "steps", "records": [StepRecord, ...], "dropped": N}``
    ``{"type": "dump_chunk", "id": ID, "index": K, "data": BASE64}``     (an inline dump, in order)
    ``{"type": "reply", "id": ID, "ok": true, "inline": true, "bytes": N, "chunks": K, "sha256": HEX}``
                                                                          (answer to an inline dump_fr)
    ``{"type": "reply", "id": ID, "ok": true, "path": "..."}``            (answer to dump_fr with a dir)
    ``{"type": "reply", "id": ID, "ok": true, "stacks": {...}}``          (answer to stacks)
    ``{"type": "reply", "id": ID, "ok": false, "error": "..."}``
agent → rank
    ``{"type": "dump_fr", "id": ID, "inline": true[, "dir": "/folder"]}``
    ``{"type": "stacks", "id": ID}``

A dump travels inline, over this socket: the rank may run as another user than the agent, and a
file it writes (0600, its own) is one the agent could not read. ``dir`` is still sent for hooks
older than ``inline``, which write ``<dir>/rank<N>.json`` and answer with its path.

Either side ignores message types it does not know (forward compatibility) and lines that are
not valid JSON objects (counted, never fatal). A line longer than ``MAX_LINE_BYTES`` is discarded
whole, up to its newline.

What the agent decodes is judged first (the hello's size, a steps line's shape, a reply's request id):
a hello is at most ``MAX_HELLO_BYTES``, and a steps line is read record by record
(:func:`iter_steps_line`: each record a flat object of at most ``MAX_RECORD_BYTES``), never as one
document — the hook writes both exactly so (compact JSON, ``type`` first, ``records`` next).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gpuhealth.model import MAX_RANKS, RankIdentity, StepRecord

PROTOCOL_VERSION = 1
# Large enough for a batch of step records or all-thread stacks of a busy process; small enough
# that one bad peer cannot make the other side buffer without bound.
MAX_LINE_BYTES = 8 * 1024 * 1024
# Before a hello, nothing longer is read (a hello is ~300 bytes; its job id at most 256 characters).
MAX_HELLO_BYTES = 16 * 1024
# One step record as the hook writes it is ~170 bytes; a steps line holds at most this many.
MAX_RECORD_BYTES = 4096
MAX_RECORDS_PER_LINE = 65536
STEPS_HEAD = b'{"type":"steps","records":['

HELLO = "hello"
STEPS = "steps"
REPLY = "reply"
DUMP_FR = "dump_fr"
DUMP_CHUNK = "dump_chunk"
STACKS = "stacks"
# Raw bytes per dump chunk: 2.7 MiB as base64, well under MAX_LINE_BYTES.
DUMP_CHUNK_BYTES = 2 * 1024 * 1024


class ProtocolError(ValueError):
    """A line that is not a valid message (bad JSON, not an object, missing fields, too long)."""


def encode(message: Mapping[str, Any]) -> bytes:
    """One message as one line (with the trailing newline). ProtocolError when too long or not JSON."""
    try:
        line = json.dumps(message, separators=(",", ":"), allow_nan=False, default=str).encode() + b"\n"
    except ValueError as exc:  # NaN/inf: not JSON, and the other side could not parse it
        raise ProtocolError(f"message of type {message.get('type')!r} cannot be encoded: {exc}") from exc
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"message of type {message.get('type')!r} is {len(line)} bytes, over {MAX_LINE_BYTES}")
    return line


def decode(line: bytes | str) -> dict[str, Any]:
    """Parse one line into a message dict with a string ``type``; ProtocolError otherwise."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"line of {len(line)} bytes is over {MAX_LINE_BYTES}")
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"expected a JSON object, got {type(obj).__name__}")
    if not isinstance(obj.get("type"), str):
        raise ProtocolError("message has no string 'type'")
    return obj


# -- builders -------------------------------------------------------------------------------------


def hello(identity: RankIdentity) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": HELLO, "identity": identity.to_dict()}


def steps(records: Sequence[StepRecord], dropped: int = 0) -> dict[str, Any]:
    return {"type": STEPS, "records": [r.to_dict() for r in records], "dropped": dropped}


def dump_fr_request(request_id: str, out_dir: str | None = None) -> dict[str, Any]:
    """Ask for the flight recorder inline; ``out_dir`` only for hooks that predate inline dumps."""
    msg: dict[str, Any] = {"type": DUMP_FR, "id": request_id, "inline": True}
    if out_dir:
        msg["dir"] = out_dir
    return msg


def dump_chunks(request_id: str, data: bytes, chunk_bytes: int = DUMP_CHUNK_BYTES) -> list[dict[str, Any]]:
    """``data`` as ordered ``dump_chunk`` messages (none for an empty dump)."""
    return [{"type": DUMP_CHUNK, "id": request_id, "index": i,
             "data": base64.b64encode(data[off:off + chunk_bytes]).decode("ascii")}
            for i, off in enumerate(range(0, len(data), chunk_bytes))]


def inline_dump_reply(request_id: str, data: bytes, n_chunks: int, **extra: Any) -> dict[str, Any]:
    return reply_ok(request_id, inline=True, bytes=len(data), chunks=n_chunks,
                    sha256=hashlib.sha256(data).hexdigest(), **extra)


def stacks_request(request_id: str) -> dict[str, Any]:
    return {"type": STACKS, "id": request_id}


def reply_ok(request_id: str, **payload: Any) -> dict[str, Any]:
    return {"type": REPLY, "id": request_id, "ok": True, **payload}


def reply_error(request_id: str, error: str) -> dict[str, Any]:
    return {"type": REPLY, "id": request_id, "ok": False, "error": error}


# -- readers (validate the payload of a decoded message) ----------------------------------------


def read_identity(message: Mapping[str, Any]) -> RankIdentity:
    """The identity of a hello; ProtocolError when it is missing or malformed."""
    ident = message.get("identity")
    if not isinstance(ident, Mapping):
        raise ProtocolError("hello without an 'identity' object")
    try:
        identity = RankIdentity.from_dict(ident)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad identity: {exc!r}") from exc
    if not (0 < len(identity.job_id) <= _MAX_JOB_ID_LEN and all(ord(c) >= 0x20 for c in identity.job_id)):
        raise ProtocolError(f"bad identity: job id {identity.job_id[:40]!r}")
    if not (0 <= identity.rank < identity.world_size <= _MAX_RANK):
        raise ProtocolError(f"bad identity: rank {identity.rank} of world size {identity.world_size}")
    return identity


def read_steps(message: Mapping[str, Any]) -> tuple[list[StepRecord], int]:
    """(valid records, number of malformed records skipped) of a steps message."""
    raw = message.get("records")
    if not isinstance(raw, list):
        raise ProtocolError("steps without a 'records' list")
    records: list[StepRecord] = []
    bad = 0
    for item in raw:
        try:
            if not isinstance(item, Mapping):
                raise TypeError("record is not an object")
            rec = StepRecord.from_dict(item)
        except (KeyError, TypeError, ValueError):
            bad += 1
            continue
        if record_is_sane(rec):
            records.append(rec)
        else:
            bad += 1
    return records, bad


# The coordinator's wire limits (proto/convert.py), checked here already: one bad record from one rank
# must not make the agent's whole batch — every job's — fail to encode or be refused upstream.
_MAX_JOB_ID_LEN = 256
_MAX_RANK = MAX_RANKS
_MAX_STEP = 1 << 62
_MAX_STEP_SECONDS = 7 * 86_400.0


def _duration_ok(value: float | None, optional: bool) -> bool:
    if value is None:
        return optional
    return math.isfinite(value) and 0.0 <= value <= _MAX_STEP_SECONDS


def record_is_sane(rec: StepRecord) -> bool:
    """A record the coordinator will accept: a printable job id, rank/step in range, finite times."""
    return (0 < len(rec.job_id) <= _MAX_JOB_ID_LEN and all(ord(c) >= 0x20 for c in rec.job_id)
            and 0 <= rec.rank < _MAX_RANK and 0 <= rec.step < _MAX_STEP
            and math.isfinite(rec.start_time) and rec.start_time >= 0.0
            and _duration_ok(rec.wall_s, optional=False)
            and _duration_ok(rec.compute_s, optional=True) and _duration_ok(rec.comm_wait_s, optional=True))


def request_id_of(message: Mapping[str, Any]) -> str:
    rid = message.get("id")
    if not isinstance(rid, str | int) or isinstance(rid, bool):
        raise ProtocolError(f"{message.get('type')} without a string 'id'")
    return str(rid)


class LineBuffer:
    """Splits a byte stream into lines and decodes them, never holding more than one line's limit.

    ``feed(data)`` yields each decoded message; malformed and over-long lines are counted in
    ``malformed`` and skipped."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_line
        self._discarding = False  # inside an over-long line: drop bytes up to the next newline
        self.malformed = 0

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        self._buf += data
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self._max:
                    if not self._discarding:
                        self.malformed += 1
                    self._discarding = True
                    self._buf.clear()
                return
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if self._discarding:
                self._discarding = False
                continue
            if not line.strip():
                continue
            if len(line) > self._max:
                self.malformed += 1
                continue
            try:
                yield decode(line)
            except ProtocolError:
                self.malformed += 1


def read_dump_chunk(message: Mapping[str, Any]) -> tuple[str, int, bytes]:
    """(request id, chunk index, bytes) of a ``dump_chunk``; ProtocolError when malformed."""
    rid = request_id_of(message)
    index, data = message.get("index"), message.get("data")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0 or not isinstance(data, str):
        raise ProtocolError("dump_chunk needs an 'index' >= 0 and base64 'data'")
    try:
        return rid, index, base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"dump_chunk data is not base64: {exc}") from exc


# -- judged before decoded (the agent's side) -----------------------------------------------------

# A JSON object with no object or array inside: what one step record is. Possessive (no backtracking).
_FLAT_OBJECT = re.compile(rb'\{(?:[^{}\[\]"]++|"(?:[^"\\]++|\\.)*+")*+\}')
_REQUEST_HEAD = re.compile(rb'\{"type":"(reply|dump_chunk)","id":"([^"\\]{1,128})"')
_MAX_STEPS_TAIL = 256


def iter_steps_line(line: bytes) -> Iterator[StepRecord | None]:
    """The records of a steps line as :func:`steps` and :func:`encode` write it, one at a time: each
    record's text (a flat object of at most ``MAX_RECORD_BYTES``) is decoded alone, so however long the
    line, only one record is ever a Python object before it is judged. None stands for a record that
    is not a valid one (counted by the caller). ProtocolError where the line stops being a steps line
    (the records before it were yielded already)."""
    if not line.startswith(STEPS_HEAD):
        raise ProtocolError("not a steps line as the hook writes it")
    pos, end = len(STEPS_HEAD), len(line)
    if line[pos:pos + 1] != b"]":
        for n in range(MAX_RECORDS_PER_LINE + 1):
            if n == MAX_RECORDS_PER_LINE:
                raise ProtocolError(f"more than {MAX_RECORDS_PER_LINE} records on one line")
            m = _FLAT_OBJECT.match(line, pos, min(end, pos + MAX_RECORD_BYTES))
            if m is None:
                raise ProtocolError(f"a record is not a flat JSON object of at most {MAX_RECORD_BYTES} bytes")
            yield _record(m.group())
            pos = m.end()
            sep = line[pos:pos + 1]
            if sep == b"]":
                break
            if sep != b",":
                raise ProtocolError("records not separated by commas")
            pos += 1
    tail = line[pos + 1:].rstrip()
    if not (tail == b"}" or (tail[:1] == b"," and tail[-1:] == b"}" and len(tail) <= _MAX_STEPS_TAIL)):
        raise ProtocolError("a steps line that does not end as one")


def _record(text: bytes) -> StepRecord | None:
    try:
        item = json.loads(text)
        rec = StepRecord.from_dict(item)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return rec if record_is_sane(rec) else None


def request_head(line: bytes) -> tuple[str, str] | None:
    """(type, request id) of a ``reply`` or ``dump_chunk`` line as the hook writes it, read from its
    first bytes without decoding the line; None for anything else."""
    m = _REQUEST_HEAD.match(line, 0, 200)
    return (m.group(1).decode(), m.group(2).decode()) if m else None
