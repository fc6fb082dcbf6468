"""The one channel between the agent's root part and its unprivileged rank process (``tenant_proc``).

A unix socketpair carrying frames: ``!II`` (header length, payload length), a JSON object (the header),
then raw bytes (a flight-recorder dump; empty otherwise). Every frame is checked against a schema
before anyone acts on it: its ``op`` must be one the receiving side takes, each field of the type the
op names, nothing else, and both lengths under their caps. The root part treats every frame from the
rank process as untrusted (that process parses what tenants send); a frame that breaks the schema
closes the channel (``ChannelError``) and the rank process is restarted.

Ops (the only things the root part needs of the rank socket):

- root → rank process: ``ranks`` (who is connected), ``stats``, ``dump`` / ``stacks`` (ask ranks),
  ``next`` / ``stop`` (take the next dump of a request, or forget the rest: one dump at a time in memory),
  ``verified`` (the answer to ``verify``).
- rank process → root: ``ready``, ``identity`` / ``steps`` / ``disconnect`` (what ranks sent),
  ``value`` (the answer to ``ranks``/``stats``), ``answer`` (one rank's dump, stacks or error),
  ``end`` (a request is over) and ``verify`` (does a connected process name its job? only root can read
  another user's environment).

Pure plumbing: sockets, struct and json only (the rank process imports this).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any

_HEAD = struct.Struct("!II")
MAX_HEADER_BYTES = 4 * 1024 * 1024  # a steps batch (STEPS_PER_FRAME records of ≤ 4 KiB), stacks of many threads
MAX_PAYLOAD_BYTES = 32 * 1024 * 1024  # one rank's dump, as RankHub's max_dump_bytes
STEPS_PER_FRAME = 512
MAX_RANKS_PER_VALUE = 65536
MAX_STRING = 4096  # job ids, errors, paths

# (type, may it be None) per field, per op; "int" excludes bool.
_Field = tuple[str, bool]
TO_RANK_PROCESS: dict[str, dict[str, _Field]] = {
    "ranks": {"rid": ("int", False), "job_id": ("str", True)},
    "stats": {"rid": ("int", False)},
    "dump": {"rid": ("int", False), "job_id": ("str", False), "rank": ("int", True), "out_dir": ("str", True),
             "timeout_s": ("float", False)},
    "stacks": {"rid": ("int", False), "job_id": ("str", False), "rank": ("int", True), "timeout_s": ("float", False)},
    "next": {"rid": ("int", False)},
    "stop": {"rid": ("int", False)},
    "verified": {"rid": ("int", False), "names_job": ("bool", False)},
}
TO_ROOT: dict[str, dict[str, _Field]] = {
    "ready": {"pid": ("int", False), "uid": ("int", False)},
    "identity": {"identity": ("dict", False)},
    "steps": {"identity": ("dict", False), "records": ("list", False)},
    "disconnect": {"identity": ("dict", False)},
    "value": {"rid": ("int", False), "ranks": ("list", True), "stats": ("dict", True)},
    # kind: "dump" (the payload), "path" (an old hook's file), "stacks", "error" (error_type names the class)
    "answer": {"rid": ("int", False), "rank": ("int", False), "kind": ("str", False), "path": ("str", True),
               "stacks": ("dict", True), "error_type": ("str", True), "error": ("str", True)},
    "end": {"rid": ("int", False)},
    # Does process ``pid`` name ``job_id`` in its environment or Slurm cgroup? Only root reads another user's
    # /proc/<pid>/environ: the rank process asks (one question at a time: its hub thread waits for the answer).
    "verify": {"rid": ("int", False), "pid": ("int", False), "job_id": ("str", False)},
}
# Only these carry a payload.
_PAYLOAD_OPS = frozenset({"answer"})
ANSWER_KINDS = frozenset({"dump", "path", "stacks", "error"})


class ChannelError(Exception):
    """The channel is closed, or the other side broke the protocol (it is then closed)."""


def _type_ok(value: Any, kind: str, nullable: bool) -> bool:
    if value is None:
        return nullable
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool) and -(1 << 62) < value < (1 << 62)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e7
    if kind == "str":
        return isinstance(value, str) and len(value) <= MAX_STRING
    if kind == "dict":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list) and len(value) <= MAX_RANKS_PER_VALUE
    return False


def check(message: Mapping[str, Any], schema: Mapping[str, Mapping[str, _Field]], payload: bytes) -> str:
    """The message's op when it fits ``schema`` exactly; ChannelError otherwise."""
    op = message.get("op")
    fields = schema.get(op) if isinstance(op, str) else None
    if fields is None:
        raise ChannelError(f"unexpected op {str(op)[:40]!r}")
    extra = set(message) - {"op"} - set(fields)
    if extra:
        raise ChannelError(f"{op}: unexpected fields {sorted(extra)[:5]}")
    for name, (kind, nullable) in fields.items():
        if not _type_ok(message.get(name), kind, nullable):
            raise ChannelError(f"{op}: field {name!r} is not a {kind}")
    if payload and op not in _PAYLOAD_OPS:
        raise ChannelError(f"{op}: carries bytes it may not")
    return str(op)


class Channel:
    """One end of the socketpair: ``send`` from any thread, ``receive`` from one."""

    def __init__(self, sock: socket.socket, accepts: Mapping[str, Mapping[str, _Field]]) -> None:
        self.sock = sock
        self._accepts = accepts
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, message: Mapping[str, Any], payload: bytes | bytearray = b"") -> None:
        header = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
        if len(header) > MAX_HEADER_BYTES or len(payload) > MAX_PAYLOAD_BYTES:
            raise ChannelError(f"{message.get('op')}: frame over the channel's limits")
        with self._send_lock:
            if self.closed:
                raise ChannelError("the channel is closed")
            try:
                self.sock.sendall(_HEAD.pack(len(header), len(payload)) + header)
                if payload:
                    self.sock.sendall(payload)
            except OSError as exc:
                raise ChannelError(f"cannot send: {exc}") from exc

    def receive(self) -> tuple[str, dict[str, Any], bytes]:
        """The next frame, checked: (op, message, payload). ChannelError at EOF or on any breach."""
        head = self._exactly(_HEAD.size)
        n_header, n_payload = _HEAD.unpack(head)
        if not 2 <= n_header <= MAX_HEADER_BYTES or n_payload > MAX_PAYLOAD_BYTES:
            raise ChannelError(f"a frame of {n_header}+{n_payload} bytes is over the channel's limits")
        try:
            message = json.loads(self._exactly(n_header))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ChannelError(f"a frame's header is not JSON: {exc}") from exc
        if not isinstance(message, dict):
            raise ChannelError("a frame's header is not an object")
        payload = self._exactly(n_payload) if n_payload else b""
        op = check(message, self._accepts, payload)
        return op, message, payload

    def _exactly(self, n: int) -> bytes:
        # MSG_WAITALL: one buffer of the frame's size, no copy of a 32 MiB dump (parts only if a signal cuts it)
        parts: list[bytes] = []
        got = 0
        while got < n:
            try:
                part = self.sock.recv(n - got, socket.MSG_WAITALL)
            except OSError as exc:
                raise ChannelError(f"cannot receive: {exc}") from exc
            if not part:
                raise ChannelError("the other side closed the channel")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


__all__ = [
    "ANSWER_KINDS",
    "MAX_PAYLOAD_BYTES",
    "STEPS_PER_FRAME",
    "TO_RANK_PROCESS",
    "TO_ROOT",
    "Channel",
    "ChannelError",
    "check",
]
