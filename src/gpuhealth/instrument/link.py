"""The hook's one background thread: ships step records and answers the agent's requests.

The training thread only calls ``submit`` (a non-blocking put into a bounded queue; a full queue
drops the record and counts it). The thread

- connects to the agent's unix socket (and retries every ``reconnect_s`` while none listens),
  says hello, sends queued records in batches every ``flush_interval_s``;
- when no agent listens and a JSONL path is set, appends the records there instead (one
  ``StepRecord`` dict per line; ``{rank}`` in the path becomes the rank); with neither, records
  wait in the queue for an agent to appear (and the oldest overflow is dropped, counted);
- answers ``dump_fr`` and ``stacks`` requests arriving on the same connection.

Nothing here raises into the training loop: every failure is caught, counted and retried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord

DEFAULT_SOCKET = "/run/gpuhealth/agent.sock"
SOCKET_ENV = "GPUHEALTH_SOCKET"
JSONL_ENV = "GPUHEALTH_STEPS_JSONL"

RequestHandler = Callable[[Mapping[str, Any], RankIdentity], "Sequence[dict[str, Any]]"]


@dataclass(slots=True)
class LinkStats:
    submitted: int = 0
    sent: int = 0  # records delivered to the agent
    written: int = 0  # records appended to the JSONL file
    dropped: int = 0  # queue full, or could not be delivered anywhere
    connects: int = 0
    requests: int = 0
    errors: int = 0
    malformed: int = 0  # lines from the agent we could not parse
    last_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class AgentLink:
    def __init__(
        self,
        identity: RankIdentity,
        *,
        socket_path: str | None,
        jsonl_path: str | None,
        handler: RequestHandler | None,
        flush_interval_s: float = 1.0,
        max_queue: int = 10_000,
        batch_size: int = 512,
        reconnect_s: float = 2.0,
        send_timeout_s: float = 5.0,
        on_tick: Callable[[], None] | None = None,
        tick_interval_s: float = 0.1,
    ) -> None:
        """``on_tick`` runs on the link's thread every ``tick_interval_s`` (the Tracker resolves
        finished CUDA steps there: off the training thread, and while that thread is stuck)."""
        self.identity = identity
        self.socket_path = socket_path
        self.jsonl_path = jsonl_path.replace("{rank}", str(identity.rank)) if jsonl_path else None
        self._handler = handler
        self._on_tick = on_tick
        self._tick_interval = tick_interval_s
        self._last_tick = 0.0
        self._flush_interval = flush_interval_s
        self._batch_size = batch_size
        self._reconnect_s = reconnect_s
        self._send_timeout = send_timeout_s
        # A deque, not queue.Queue: append/popleft are atomic under the GIL and cost a fraction of
        # Queue's lock round trips, on the training thread's path.
        self._queue: deque[StepRecord] = deque()
        self._max_queue = max_queue
        self.stats = LinkStats()
        self._sock: socket.socket | None = None
        self._buffer = protocol.LineBuffer()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_connect = 0.0
        self._last_flush = 0.0

    # -- training-thread side ---------------------------------------------------------------------

    def submit(self, record: StepRecord) -> bool:
        stats = self.stats
        stats.submitted += 1
        if len(self._queue) >= self._max_queue:
            stats.dropped += 1
            return False
        self._queue.append(record)
        if stats.submitted % self._batch_size == 0:
            self.wake()  # a full batch is waiting: send it now rather than at the next interval
        return True

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuhealth-instrument", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued (agent or JSONL), then stop the thread."""
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        else:
            self._flush(final=True)
        self._disconnect()
        for s in (self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # -- background thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as exc:  # never let the thread die: count, back off, continue
                self._error(exc)
                self._disconnect()
                self._stop.wait(0.5)
        try:
            self._flush(final=True)
        except Exception as exc:
            self._error(exc)

    def _error(self, exc: BaseException) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"

    def _step(self) -> None:
        now = time.monotonic()
        if self._sock is None and self.socket_path and now >= self._next_connect:
            self._connect()
        next_flush = self._last_flush + self._flush_interval
        next_tick = self._last_tick + self._tick_interval if self._on_tick is not None else next_flush
        timeout = max(0.0, min(next_flush, next_tick) - time.monotonic())
        for key, _ in self._sel.select(timeout):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif key.fileobj is self._sock:
                self._read()
        now = time.monotonic()
        if self._on_tick is not None and now >= next_tick:
            self._last_tick = now
            try:
                self._on_tick()
            except Exception as exc:
                self._error(exc)
        if now >= next_flush or len(self._queue) >= self._batch_size:
            self._flush()

    def _connect(self) -> None:
        assert self.socket_path is not None
        self._next_connect = time.monotonic() + self._reconnect_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._send_timeout)
        try:
            sock.connect(self.socket_path)
            sock.sendall(protocol.encode(protocol.hello(self.identity)))
        except OSError:
            sock.close()  # no agent listening: normal, try again later
            return
        self._sock = sock
        self._buffer = protocol.LineBuffer()
        self._sel.register(sock, selectors.EVENT_READ)
        self.stats.connects += 1

    def _disconnect(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            sock.close()
            self._next_connect = time.monotonic() + self._reconnect_s

    def _send(self, message: Mapping[str, Any]) -> bool:
        """Raises ProtocolError when the message cannot be encoded (the link stays up)."""
        return self._send_line(protocol.encode(message))

    def _send_line(self, line: bytes) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendall(line)
            return True
        except OSError as exc:  # agent went away or stopped reading: reconnect later
            self._error(exc)
            self._disconnect()
            return False

    def _read(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(65536)
        except OSError as exc:
            self._error(exc)
            self._disconnect()
            return
        if not data:
            self._disconnect()
            return
        before = self._buffer.malformed
        messages = list(self._buffer.feed(data))
        self.stats.malformed += self._buffer.malformed - before
        for message in messages:
            self._on_message(message)

    def _on_message(self, message: Mapping[str, Any]) -> None:
        if self._handler is None:
            return
        replies = self._handler(message, self.identity)
        if not replies:
            return
        self.stats.requests += 1
        for reply in replies:
            try:
                if not self._send(reply):
                    return  # the agent went away: it will ask again
            except protocol.ProtocolError as exc:  # e.g. stacks over the line limit
                self._error(exc)
                self._send(protocol.reply_error(str(reply.get("id")), str(exc)))
                return

    def _drain(self, limit: int) -> list[StepRecord]:
        out: list[StepRecord] = []
        while len(out) < limit:
            try:
                out.append(self._queue.popleft())
            except IndexError:
                break
        return out

    def _flush(self, final: bool = False) -> None:
        self._last_flush = time.monotonic()
        if final and self._sock is None and self.socket_path:
            self._connect()  # one last try, so a late agent still gets the tail
        while True:
            if self._sock is None and self.jsonl_path is None:
                if final:
                    self.stats.dropped += len(self._queue)
                return  # keep records queued until an agent appears
            batch = self._drain(self._batch_size)
            if not batch:
                return
            line = b""
            if self._sock is not None:
                try:
                    line = protocol.encode(protocol.steps(batch, self.stats.dropped))
                except protocol.ProtocolError as exc:  # a record that is not JSON: drop the batch, keep the link
                    self._error(exc)
                    self.stats.dropped += len(batch)
                    continue
            if self._sock is not None and self._send_line(line):
                self.stats.sent += len(batch)
            elif self.jsonl_path is not None:
                self._append_jsonl(batch)
            else:
                self.stats.dropped += len(batch)
                return

    def _append_jsonl(self, batch: list[StepRecord]) -> None:
        assert self.jsonl_path is not None
        data = "".join(json.dumps(r.to_dict(), separators=(",", ":")) + "\n" for r in batch).encode()
        try:
            Path(self.jsonl_path).parent.mkdir(parents=True, exist_ok=True)
            # One O_APPEND write per batch: ranks sharing one file never interleave within a line.
            fd = os.open(self.jsonl_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            self.stats.written += len(batch)
        except OSError as exc:
            self._error(exc)
            self.stats.dropped += len(batch)


def default_socket_path(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get(SOCKET_ENV) or DEFAULT_SOCKET
