"""The agent's one gRPC stream to the coordinator, with the disk spool behind it.

Up: rank identities, step records, findings snapshots and screen results are handed in (``on_identity``,
``on_steps``, ``on_findings``, ``on_screens``: quick, from any thread), packed into records every
``batch_interval_s`` and written to the ``Spool`` first; then they go over ONE ``Connect`` stream,
and a record leaves the spool only when the coordinator acknowledges its seq. Step records reach
the disk sooner: the ``StepJournal`` group-commits them every ``spool_commit_s`` (50 ms), so an
agent killed with SIGKILL loses at most that much of them, and packing moves them into the spool
exactly once (``step_journal``). Heartbeats and the
answers to requests (``emit``) go up the same stream. While the coordinator is unreachable records
accumulate (bounded) and the stream reconnects with exponential backoff and jitter, then resends
from the first unacknowledged seq (the coordinator ignores the ones it already has).

Down: acknowledgements, requests, handed to ``on_request`` (the executors) untouched, and the node's
screening turn (ScreenTurn), handed to ``on_screen_turn(not_before, valid_for_s)``.

Everything runs on the stream's own thread and event loop; ``start`` returns at once. What to
register with and what a heartbeat says are the owner's (``coordinator_link``): passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gpuhealth.agent.coordinator_requests import Emit
from gpuhealth.agent.spool import Spool, SpoolStats
from gpuhealth.agent.step_journal import JournalError, StepJournal, Taken, journal_path_for
from gpuhealth.diag.screen import ScreenResult
from gpuhealth.model import Finding, RankIdentity, StepRecord
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import finding_to_pb, identity_to_pb, steps_to_pb
from gpuhealth.proto.options import NODE_METADATA, SESSION_METADATA, UNARY_DEADLINE_S, client_options
from gpuhealth.runtime.credentials import node_token, read_secret, read_token
from gpuhealth.runtime.tls import TlsFiles, channel_credentials, token_metadata

log = logging.getLogger("gpuhealth.agent.coordinator")

CONNECT_METHOD = "/gpuhealth.v1.Coordinator/Connect"
REGISTER_METHOD = "/gpuhealth.v1.Coordinator/Register"


@dataclass(slots=True)
class StreamSettings:
    address: str
    # The bearer token: read from ``token_file`` at every connect (projected ServiceAccount tokens
    # rotate), else derived from the cluster secret in ``node_secret_file`` for this node, else ``token``.
    token: str | None = None
    token_file: str | None = None
    node_secret_file: str | None = None
    tls: TlsFiles | None = None
    batch_interval_s: float = 0.25  # step records are packed into one batch per job this often
    spool_commit_s: float = 0.05  # ... and are on disk within this long of their arrival
    heartbeat_s: float | None = None  # None: what the coordinator asks for
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_inflight: int = 256


class CoordinatorStream:
    """``register(incarnation)`` builds the Register request; ``heartbeat(spool_stats)`` the
    ``HealthSummary`` sent every heartbeat; ``on_request(request, emit)`` takes each request (it must
    not block: run it elsewhere); ``ready()`` says whether the agent has something to register with
    (its first sweep), waited for up to ``wait_ready_s`` before the first connect."""

    def __init__(
        self,
        settings: StreamSettings,
        spool: Spool,
        *,
        register: Callable[[str], pb.RegisterRequest],
        heartbeat: Callable[[SpoolStats], pb.HealthSummary],
        on_request: Callable[[pb.AgentRequest, Emit], None],
        ready: Callable[[], bool] = lambda: True,
        wait_ready_s: float = 15.0,
        on_screen_turn: Callable[[float, float], None] | None = None,
    ) -> None:
        self.settings = settings
        self.spool = spool
        self.journal = StepJournal(journal_path_for(spool.path))
        st = spool.stats()
        self.stats: dict[str, int] = defaultdict(int)
        self.stats["steps_recovered"] = self.journal.recover(st.next_seq, spool.incarnation)
        self._register = register
        self._heartbeat = heartbeat
        self._on_request = on_request
        self._ready = ready
        self._wait_ready_s = wait_ready_s
        self._on_screen_turn = on_screen_turn
        self._idents: list[RankIdentity] = []
        self._findings: list[Finding] | None = None
        self._screens: list[ScreenResult] = []
        self._buf_lock = threading.Lock()
        self._flush_lock = threading.Lock()  # held while buffered records move into the spool
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        # (result, set once it is written): a dump's sender waits for that, so dumps do not pile up here
        self._results: asyncio.Queue[tuple[pb.RequestResult | bytes, threading.Event]] | None = None
        self.connected = threading.Event()
        self._heartbeat_s = settings.heartbeat_s or 10.0

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuhealth-coordinator-link", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        loop, stop, wake = self._loop, self._stop_event, self._wake
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
                if wake is not None:
                    loop.call_soon_threadsafe(wake.set)  # the writer sleeps on it until the next heartbeat
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self._flush()
        self.journal.close()
        self.spool.close()

    # -- hand-offs (other threads): never block ---------------------------------------------------

    def on_identity(self, identity: RankIdentity) -> None:
        with self._buf_lock:
            self._idents.append(identity)

    def on_steps(self, identity: RankIdentity | None, records: Sequence[StepRecord]) -> None:
        self.journal.add(records)

    def on_findings(self, findings: list[Finding]) -> None:
        with self._buf_lock:
            self._findings = list(findings)
        self._poke()

    def on_screens(self, results: Sequence[ScreenResult]) -> None:
        """One screen's results (one per GPU it screened): one ``screens`` record."""
        with self._buf_lock:
            self._screens.extend(results)
        self._poke()

    def emit(self, result: pb.RequestResult | bytes) -> threading.Event:
        """Queue a result for the coordinator (a message, or an ``AgentMessage`` already on its wire form:
        ``convert.result_message_wire``, one copy of a large dump); the event is set once it is written."""
        written = threading.Event()
        loop, results, wake = self._loop, self._results, self._wake
        if loop is None or results is None or wake is None:
            return written  # not running: nothing will carry it
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(results.put_nowait, (result, written))
            loop.call_soon_threadsafe(wake.set)
        return written

    def buffered(self) -> int:
        """Records handed in but not yet in the spool (they get there within one batch interval)."""
        with self._flush_lock, self._buf_lock:
            return self.journal.pending() + len(self._idents) + (self._findings is not None) + bool(self._screens)

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

    # -- spooling --------------------------------------------------------------------------------

    def _flush(self) -> int:
        """Move buffered identities/steps/findings into the spool. Returns records spooled."""
        with self._flush_lock:
            return self._flush_locked()

    def _flush_locked(self) -> int:
        with self._buf_lock:
            idents, self._idents = self._idents, []
            findings, self._findings = self._findings, None
            screens, self._screens = self._screens, []
        now = time.time()
        n = 0
        if idents:
            msg = pb.RankIdentities(ranks=[identity_to_pb(i) for i in idents])
            self.spool.append("ranks", now, lambda seq: _record(seq, now, ranks=msg))
            n += 1
        self.journal.commit()  # what arrived since the last group commit
        for job_id in self.journal.jobs():
            while (taken := self.journal.take(job_id)) is not None:
                n += self._spool_steps(taken, now)
        if findings is not None:
            snap = pb.FindingsSnapshot(at=now, findings=[finding_to_pb(f) for f in findings])
            self.spool.append("findings", now, lambda seq: _record(seq, now, findings=snap))
            n += 1
        if screens:
            batch = pb.ScreenResults(screens=[screen_to_pb(r) for r in screens])
            self.spool.append("screens", now, lambda seq: _record(seq, now, screens=batch))
            n += 1
        return n

    def _spool_steps(self, taken: Taken, now: float) -> int:
        """One job's journalled records → one spool record, exactly once (``step_journal``)."""
        try:
            batch = steps_to_pb(taken.job_id, taken.records)
        except (ValueError, TypeError) as exc:  # one job's bad batch must not lose the others'
            log.warning("dropping %d step records of job %r that cannot be encoded: %s", len(taken.records),
                        taken.job_id, exc)
            self.stats["steps_unencodable"] += len(taken.records)
            self.journal.end_move(taken)
            return 0

        def build(seq: int) -> bytes:
            return _record(seq, now, steps=batch)

        self.journal.begin_move(taken, self.spool.stats().next_seq, self.spool.incarnation)
        self.spool.append("steps", now, build)
        self.journal.end_move(taken)
        return 1

    def _commit_steps(self) -> None:
        try:
            self.journal.commit()
        except JournalError:
            log.exception("cannot write step records to the journal (they stay in memory)")

    # -- the stream's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        except Exception:
            log.exception("coordinator link stopped on an error")
        finally:
            loop.close()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stop_event = asyncio.Event()
        self._wake = asyncio.Event()
        self._results = asyncio.Queue()
        self._loop = loop  # last: emit() and _poke() use the loop only once its queue and events exist
        flusher = asyncio.create_task(self._flush_loop())
        committer = asyncio.create_task(self._commit_loop())
        try:
            await self._connect_loop()
        finally:
            for task in (flusher, committer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.spool_commit_s)
            self._commit_steps()

    async def _flush_loop(self) -> None:
        assert self._wake is not None
        while True:
            await asyncio.sleep(self.settings.batch_interval_s)
            try:
                if self._flush():
                    self._wake.set()
            except Exception:
                log.exception("cannot spool records for the coordinator")

    async def _connect_loop(self) -> None:
        assert self._stop_event is not None
        await self._wait_ready()
        backoff = self.settings.backoff_initial_s
        while not self._stop_event.is_set():
            started = time.monotonic()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                self.stats["disconnects"] += 1
                log.warning("coordinator %s: %s: %s", self.settings.address, exc.code().name, exc.details())
            except Exception as exc:
                self.stats["disconnects"] += 1
                log.warning("coordinator %s: %s", self.settings.address, exc)
            finally:
                self.connected.clear()
            if self._stop_event.is_set():
                return
            if time.monotonic() - started > 30:
                backoff = self.settings.backoff_initial_s  # the last session was healthy
            delay = backoff * random.uniform(0.5, 1.5)  # jitter: agents of a restarted coordinator spread out
            backoff = min(backoff * 2, self.settings.backoff_max_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), delay)

    async def _wait_ready(self) -> None:
        assert self._stop_event is not None
        deadline = time.monotonic() + self._wait_ready_s
        while time.monotonic() < deadline and not self._stop_event.is_set():
            if self._ready():
                return
            await asyncio.sleep(0.2)

    def bearer_token(self, node: str) -> str | None:
        """What this node presents (``StreamSettings``); ``CredentialError`` when its file is unusable
        (the session fails with that line and is retried with backoff)."""
        s = self.settings
        if s.token_file:
            return read_token(s.token_file)
        if s.node_secret_file:
            return node_token(read_secret(s.node_secret_file), node)
        return s.token

    def _channel(self) -> grpc.aio.Channel:
        if self.settings.tls is not None:
            return grpc.aio.secure_channel(self.settings.address, channel_credentials(self.settings.tls),
                                           options=client_options())
        return grpc.aio.insecure_channel(self.settings.address, options=client_options())

    async def _session(self) -> None:
        assert self._stop_event is not None and self._wake is not None and self._results is not None
        req = self._register(self.spool.incarnation)
        md = token_metadata(self.bearer_token(req.node_name))
        async with self._channel() as channel:
            register = channel.unary_unary(REGISTER_METHOD, request_serializer=pb.RegisterRequest.SerializeToString,
                                           response_deserializer=pb.RegisterResponse.FromString)
            resp: pb.RegisterResponse = await register(req, timeout=UNARY_DEADLINE_S, metadata=md)
            self.spool.ack(resp.acked_seq)
            if self.settings.heartbeat_s is None and resp.heartbeat_interval_s > 0:
                self._heartbeat_s = resp.heartbeat_interval_s
            window = max(1, min(self.settings.max_inflight, resp.max_inflight or self.settings.max_inflight))
            connect = channel.stream_stream(CONNECT_METHOD, request_serializer=None,
                                            response_deserializer=pb.CoordinatorMessage.FromString)
            call = connect(metadata=(*md, (SESSION_METADATA, resp.session_id), (NODE_METADATA, req.node_name)))
            self.connected.set()
            self.stats["connects"] += 1
            log.info("connected to coordinator %s as %s (resuming after seq %d)", self.settings.address,
                     req.node_name, resp.acked_seq)
            reader = asyncio.create_task(self._read(call))
            try:
                await self._write(call, window, reader)
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
                call.cancel()
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]

    async def _read(self, call: Any) -> None:
        assert self._wake is not None
        async for msg in call:
            body = msg.WhichOneof("body")
            if body == "ack":
                self.spool.ack(msg.ack.up_to_seq)
                self.stats["acks"] += 1
                self._wake.set()
            elif body == "request":
                self.stats["requests"] += 1
                self._on_request(msg.request, self.emit)
            elif body == "screen_turn":
                self.stats["screen_turns"] += 1
                if self._on_screen_turn is not None:
                    try:
                        self._on_screen_turn(msg.screen_turn.not_before, msg.screen_turn.valid_for_s)
                    except Exception:  # a turn that cannot be taken must not end the stream
                        log.exception("screen turn not applied")

    async def _write(self, call: Any, window: int, reader: asyncio.Task[None]) -> None:
        assert self._stop_event is not None and self._wake is not None and self._results is not None
        sent_upto = self.spool.acked
        next_beat = 0.0
        while not self._stop_event.is_set() and not reader.done():
            while not self._results.empty():
                result, written = self._results.get_nowait()
                wire = result if isinstance(result, bytes) else pb.AgentMessage(result=result).SerializeToString()
                del result
                await call.write(wire)
                del wire
                written.set()
            if time.monotonic() >= next_beat:
                await call.write(pb.AgentMessage(health=self._heartbeat(self.spool.stats())).SerializeToString())
                next_beat = time.monotonic() + self._heartbeat_s
            sent_upto = max(sent_upto, self.spool.acked)
            room = window - (sent_upto - self.spool.acked)
            if room > 0:
                for seq, payload in self.spool.pending(sent_upto, room):
                    await call.write(payload)
                    sent_upto = seq
                    self.stats["sent"] += 1
            self._wake.clear()
            timeout = max(0.05, next_beat - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
        if reader.done():
            return
        with contextlib.suppress(Exception):
            await call.done_writing()


def screen_to_pb(r: ScreenResult) -> pb.ScreenResult:
    return pb.ScreenResult(gpu_uuid=r.gpu_uuid, gpu_index=r.gpu_index, started_at=r.started_at,
                           finished_at=r.finished_at, level=r.level, result=r.result, reason=r.reason,
                           trigger=r.trigger,
                           digests=[pb.SdcDigest(gpu_uuid=r.gpu_uuid, key=k, digest=d, at=r.finished_at)
                                    for k, d in r.digests])


def _record(seq: int, now: float, **payload: Any) -> bytes:
    return pb.AgentMessage(record=pb.Record(seq=seq, created_at=now, **payload)).SerializeToString()


__all__ = ["CoordinatorStream", "StreamSettings"]
