"""The agent's link to the coordinator (an agent extension).

Up: rank identities and step records (from the ``RankHub`` listener) and findings snapshots (from
the agent's findings listener) go into the disk-backed ``Spool`` first, then over ONE gRPC stream;
a record leaves the spool only when the coordinator acknowledges its seq. Heartbeats carry node and
GPU health and which ranks are alive here. While the coordinator is unreachable records accumulate
(bounded) and the link reconnects with exponential backoff and jitter, then resends from the first
unacknowledged seq (the coordinator ignores the ones it already has).

Down: requests the link executes through the RankHub on worker threads — flight-recorder dumps
(the JSON files are read and sent up as they are), Python stacks (``py-spy dump --json`` on the
rank's PID when py-spy is installed and permitted, plus the hook's own stacks), and diagnostics
(``gpuhealth diag NAME --json`` in a child process: the agent never imports torch).

Everything runs on the link's own thread and event loop; ``start`` returns at once.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc

from gpuhealth import __version__
from gpuhealth.agent.ranks import DumpBudgetExceeded
from gpuhealth.agent.spool import Spool, SpoolError
from gpuhealth.model import EntityKind, Finding, MetricKind, RankIdentity, Sample, StepRecord, health_of
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import finding_to_pb, identity_to_pb, steps_to_pb
from gpuhealth.proto.options import API_VERSION, NODE_METADATA, SESSION_METADATA, UNARY_DEADLINE_S, client_options
from gpuhealth.runtime.tls import TlsFiles, channel_credentials, token_metadata

log = logging.getLogger("gpuhealth.agent.coordinator")

# Queues a result for the coordinator; may return an event set once it is on the wire.
Emit = Callable[[pb.RequestResult], object]

_DEVICE = re.compile(r"cpu|cuda(:\d+(,cuda:\d+)*)?")  # the only parameter passed to `gpuhealth diag`
MAX_DUMP_BYTES = 32 * 1024 * 1024  # as RankHub's cap; under the gRPC message limit with room for the envelope
CONNECT_METHOD = "/gpuhealth.v1.Coordinator/Connect"
REGISTER_METHOD = "/gpuhealth.v1.Coordinator/Register"


@dataclass(slots=True)
class LinkSettings:
    address: str
    spool_path: str
    token: str | None = None
    tls: TlsFiles | None = None
    batch_interval_s: float = 0.25  # step records are packed into one batch per job this often
    heartbeat_s: float | None = None  # None: what the coordinator asks for
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_inflight: int = 256
    pyspy: bool = True
    pyspy_path: str | None = None
    work_dir: str | None = None  # where requested FR dumps are written (default: a temp dir)
    wait_ready_s: float = 15.0  # wait this long for the agent's first sweep before registering


class CoordinatorLink:
    name = "coordinator_link"

    def __init__(self, settings: LinkSettings, *, rank_hub: Any = None) -> None:
        self.settings = settings
        self.hub = rank_hub
        self.agent: Any = None
        self.spool = Spool(settings.spool_path)
        self._steps: list[StepRecord] = []
        self._idents: list[RankIdentity] = []
        self._findings: list[Finding] | None = None
        self._buf_lock = threading.Lock()
        self._flush_lock = threading.Lock()  # held while buffered records move into the spool
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        # (result, set once it is written): a dump's sender waits for that, so dumps do not pile up here
        self._results: asyncio.Queue[tuple[pb.RequestResult, threading.Event]] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpuhealth-req")
        self.connected = threading.Event()
        self.stats: dict[str, int] = defaultdict(int)
        self._heartbeat_s = settings.heartbeat_s or 10.0

    # -- extension protocol ----------------------------------------------------------------------

    def start(self, agent: object) -> None:
        self.agent = agent
        if self.hub is None:
            self.hub = _find_rank_hub(agent)
        if self.hub is not None:
            self.hub.add_listener(on_identity=self.on_identity, on_steps=self.on_steps)
        add = getattr(agent, "add_findings_listener", None)
        if callable(add):
            add(self.on_findings)
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
        self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            self._flush()
        self.spool.close()

    # -- listeners (other threads): hand off, never block -----------------------------------------

    def on_identity(self, identity: RankIdentity) -> None:
        with self._buf_lock:
            self._idents.append(identity)

    def on_steps(self, identity: RankIdentity | None, records: Sequence[StepRecord]) -> None:
        with self._buf_lock:
            self._steps.extend(records)

    def on_findings(self, findings: list[Finding]) -> None:
        with self._buf_lock:
            self._findings = list(findings)
        self._poke()

    def buffered(self) -> int:
        """Records handed to the link but not yet in the spool (they get there within one batch interval)."""
        with self._flush_lock, self._buf_lock:
            return len(self._steps) + len(self._idents) + (self._findings is not None)

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
            steps, self._steps = self._steps, []
            idents, self._idents = self._idents, []
            findings, self._findings = self._findings, None
        now = time.time()
        n = 0
        if idents:
            msg = pb.RankIdentities(ranks=[identity_to_pb(i) for i in idents])
            self.spool.append("ranks", now, lambda seq: _record(seq, now, ranks=msg))
            n += 1
        by_job: dict[str, list[StepRecord]] = defaultdict(list)
        for r in steps:
            by_job[r.job_id].append(r)
        for job_id, recs in by_job.items():
            try:
                batch = steps_to_pb(job_id, recs)
            except (ValueError, TypeError) as exc:  # one job's bad batch must not lose the others'
                log.warning("dropping %d step records of job %r that cannot be encoded: %s", len(recs), job_id, exc)
                self.stats["steps_unencodable"] += len(recs)
                continue

            def build(seq: int, b: pb.StepBatch = batch) -> bytes:
                return _record(seq, now, steps=b)

            self.spool.append("steps", now, build)
            n += 1
        if findings is not None:
            snap = pb.FindingsSnapshot(at=now, findings=[finding_to_pb(f) for f in findings])
            self.spool.append("findings", now, lambda seq: _record(seq, now, findings=snap))
            n += 1
        return n

    # -- the link's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception:
            log.exception("coordinator link stopped on an error")
        finally:
            loop.close()

    async def _main(self) -> None:
        self._stop_event = asyncio.Event()
        self._wake = asyncio.Event()
        self._results = asyncio.Queue()
        if self.agent is not None and callable(getattr(self.agent, "current_findings", None)):
            self.on_findings(self.agent.current_findings())  # the listener only fires on changes
        flusher = asyncio.create_task(self._flush_loop())
        try:
            await self._connect_loop()
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher

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
        await self._wait_agent_ready()
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

    async def _wait_agent_ready(self) -> None:
        assert self._stop_event is not None
        deadline = time.monotonic() + self.settings.wait_ready_s
        while time.monotonic() < deadline and not self._stop_event.is_set():
            if self.agent is None or getattr(self.agent, "gpus", None):
                return
            await asyncio.sleep(0.2)

    def _channel(self) -> grpc.aio.Channel:
        if self.settings.tls is not None:
            return grpc.aio.secure_channel(self.settings.address, channel_credentials(self.settings.tls),
                                           options=client_options())
        return grpc.aio.insecure_channel(self.settings.address, options=client_options())

    def register_request(self) -> pb.RegisterRequest:
        return build_register_request(self.agent, self.spool.incarnation)

    async def _session(self) -> None:
        assert self._stop_event is not None and self._wake is not None and self._results is not None
        md = token_metadata(self.settings.token)
        async with self._channel() as channel:
            register = channel.unary_unary(REGISTER_METHOD, request_serializer=pb.RegisterRequest.SerializeToString,
                                           response_deserializer=pb.RegisterResponse.FromString)
            req = self.register_request()
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
                self._start_request(msg.request)

    async def _write(self, call: Any, window: int, reader: asyncio.Task[None]) -> None:
        assert self._stop_event is not None and self._wake is not None and self._results is not None
        sent_upto = self.spool.acked
        next_beat = 0.0
        while not self._stop_event.is_set() and not reader.done():
            while not self._results.empty():
                result, written = self._results.get_nowait()
                await call.write(pb.AgentMessage(result=result).SerializeToString())
                del result
                written.set()
            if time.monotonic() >= next_beat:
                await call.write(pb.AgentMessage(health=self.health_summary()).SerializeToString())
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

    # -- heartbeat -------------------------------------------------------------------------------

    def health_summary(self) -> pb.HealthSummary:
        st = self.spool.stats()
        msg = pb.HealthSummary(at=time.time(), spool_depth=st.depth, spool_dropped=st.dropped, health="unknown")
        agent = self.agent
        if agent is not None:
            try:
                findings = list(agent.current_findings())
                msg.health = str(health_of(findings))
                for g in agent.gpus:
                    fs = [f for f in findings if f.entity.kind is EntityKind.GPU and f.entity.id == g.uuid]
                    msg.gpus.append(pb.GpuHealth(index=g.index, uuid=g.uuid, health=str(health_of(fs))))
            except Exception:
                log.debug("cannot summarise agent health", exc_info=True)
        if self.hub is not None:
            live: dict[str, list[int]] = defaultdict(list)
            for ident in self.hub.ranks():
                live[ident.job_id].append(ident.rank)
            for job_id, ranks in sorted(live.items()):
                msg.live.append(pb.LiveRanks(job_id=job_id, ranks=sorted(ranks)))
        return msg

    # -- requests from the coordinator ----------------------------------------------------------

    def _start_request(self, req: pb.AgentRequest) -> None:
        loop = self._loop
        assert loop is not None
        self.stats["requests"] += 1

        def emit(result: pb.RequestResult) -> threading.Event:
            """Queue a result for the coordinator; the event is set once it is written to the stream."""
            assert self._results is not None and self._wake is not None
            written = threading.Event()
            loop.call_soon_threadsafe(self._results.put_nowait, (result, written))
            loop.call_soon_threadsafe(self._wake.set)
            return written

        self._pool.submit(self._execute, req, emit)

    def _execute(self, req: pb.AgentRequest, emit: Emit) -> None:
        rid = req.request_id
        try:
            if req.kind == pb.DUMP_FLIGHT_RECORDER:
                self._do_dump(req, emit)
            elif req.kind == pb.CAPTURE_STACKS:
                self._do_stacks(req, emit)
            elif req.kind == pb.RUN_DIAGNOSTIC:
                self._do_diag(req, emit)
            else:
                emit(pb.RequestResult(request_id=rid, rank=-1, ok=False, error=f"unknown request kind {req.kind}"))
        except Exception as exc:  # a request must always end with a final answer
            log.exception("request %d failed", rid)
            emit(pb.RequestResult(request_id=rid, rank=-1, ok=False, error=f"{type(exc).__name__}: {exc}"))
        emit(pb.RequestResult(request_id=rid, rank=-1, ok=True, final=True))

    def samples(self) -> list[Sample]:
        """For the agent's /metrics: is the coordinator reachable, and what waits in the spool."""
        sp = self.spool.stats()
        return [
            Sample("agent_coordinator_connected", 1.0 if self.connected.is_set() else 0.0,
                   "1 while the agent's stream to the coordinator is up"),
            Sample("agent_coordinator_spool_records", float(sp.depth),
                   "Records waiting in the agent's disk spool for the coordinator's acknowledgement"),
            Sample("agent_coordinator_spool_dropped_records", float(sp.dropped),
                   "Spooled records dropped because the spool was full (coordinator away too long)",
                   MetricKind.COUNTER),
            Sample("agent_coordinator_connects", float(self.stats["connects"]),
                   "Streams opened to the coordinator (reconnects included)", MetricKind.COUNTER),
        ]

    def _no_hub(self, req: pb.AgentRequest, emit: Emit) -> bool:
        if self.hub is None:
            emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, error="no rank hub on this agent"))
            return True
        return False

    def _do_dump(self, req: pb.AgentRequest, emit: Emit) -> None:
        if self._no_hub(req, emit):
            return
        # Ranks send their dump inline over the socket. The folder is only for hooks older than that,
        # which write a file there instead; ranks run as the job's user: they may create files here but
        # not list or remove others' (sticky).
        base = self.settings.work_dir or tempfile.gettempdir()
        out_dir = Path(base) / "gpuhealth-fr" / f"{_safe(req.job_id)}-{req.request_id}-{os.getpid()}"
        out_dir.mkdir(parents=True, exist_ok=True)
        out_dir.chmod(0o1733)
        timeout = req.timeout_s or 20.0
        deadline = time.monotonic() + timeout
        busy: list[int] = []  # ranks refused for the agent's dump memory budget: asked again, one at a time

        def ship(rank: int, res: bytes | str | Exception, *, may_retry: bool) -> None:
            if isinstance(res, DumpBudgetExceeded) and may_retry:
                busy.append(rank)
                return
            if isinstance(res, Exception):
                emit(pb.RequestResult(request_id=req.request_id, rank=rank, ok=False,
                                      error=f"{type(res).__name__}: {res}", format="fr_json"))
                return
            try:
                if isinstance(res, bytes):
                    data = _looks_like_json_object(res)
                else:
                    data = _read_json_file(Path(res), expected=out_dir / f"rank{rank}.json")
                written = emit(pb.RequestResult(request_id=req.request_id, rank=rank, ok=True, payload=data,
                                                format="fr_json"))
                del data
                # Wait until it is on the wire before taking the next: dumps do not pile up in the send queue
                # behind a slow link (past the deadline it stays queued and the next one is taken anyway).
                if isinstance(written, threading.Event):
                    written.wait(max(0.0, deadline - time.monotonic()))
            except (OSError, ValueError) as exc:
                emit(pb.RequestResult(request_id=req.request_id, rank=rank, ok=False, error=str(exc),
                                      format="fr_json"))

        # Each dump is shipped as soon as it arrives and dropped: the agent holds one, not the job's.
        for rank, res in self.hub.iter_dumps(req.job_id, None if req.rank < 0 else req.rank, str(out_dir),
                                             timeout_s=timeout):
            ship(rank, res, may_retry=True)
            del res
        for rank in busy:
            left = deadline - time.monotonic()
            if left <= 0:  # the coordinator stops listening at its deadline: say so instead of answering late
                ship(rank, TimeoutError(f"rank {rank}: refused for the agent's dump memory budget and no time "
                                        "was left to ask again"), may_retry=False)
                continue
            for r, res in self.hub.iter_dumps(req.job_id, rank, str(out_dir), timeout_s=left):
                ship(r, res, may_retry=False)
                del res
        shutil.rmtree(out_dir, ignore_errors=True)

    def _do_stacks(self, req: pb.AgentRequest, emit: Emit) -> None:
        if self._no_hub(req, emit):
            return
        rank = None if req.rank < 0 else req.rank
        timeout = req.timeout_s or 10.0
        hook = self.hub.request_stacks(req.job_id, rank, timeout_s=timeout)
        pids = {i.rank: i.pid for i in self.hub.ranks(req.job_id)}
        for r in sorted(set(hook) | set(pids if rank is None else {})):
            answer: dict[str, Any] = {}
            hook_res = hook.get(r)
            if isinstance(hook_res, dict):
                answer["hook"] = hook_res
            elif hook_res is not None:
                answer["hook_error"] = f"{type(hook_res).__name__}: {hook_res}"
            pid = pids.get(r)
            if pid and self.settings.pyspy:
                spy = pyspy_dump(pid, timeout_s=min(timeout, 15.0), exe=self.settings.pyspy_path)
                answer.update(spy)
            answer["source"] = "py-spy" if "py_spy" in answer else ("hook" if "hook" in answer else "none")
            ok = "hook" in answer or "py_spy" in answer
            emit(pb.RequestResult(request_id=req.request_id, rank=r, ok=ok, format="stacks_json",
                                  payload=json.dumps(answer, default=str).encode() if ok else b"",
                                  error="" if ok else str(answer.get("hook_error") or answer.get("py_spy_error"))))

    def _do_diag(self, req: pb.AgentRequest, emit: Emit) -> None:
        name = req.diagnostic
        if not name.isidentifier():
            emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, error=f"bad diagnostic {name!r}"))
            return
        cmd = [sys.executable, "-m", "gpuhealth.cli.main", "diag", name, "--json"]
        device = req.params.get("device")
        if device:
            if not _DEVICE.fullmatch(device):
                emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, error=f"bad device {device!r}"))
                return
            cmd += ["--device", device]
        timeout = req.timeout_s or 300.0
        # The CLI's own runner stops its child (in its own session, holding the per-GPU lock) before our
        # deadline; we kill the CLI's whole process group if even that overruns. Budgeted: automated.
        env = {**os.environ, "GPUHEALTH_DIAG_BUDGETED": "1", "GPUHEALTH_DIAG_TIMEOUT_S": str(max(1.0, timeout - 5.0))}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, error="diagnostic timed out"))
            return
        proc_stdout, proc_stderr = stdout, stderr
        try:
            json.loads(proc_stdout)
        except ValueError:
            emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=False, format="diag_json",
                                  error=f"exit {proc.returncode}: {proc_stderr.decode(errors='replace')[-2000:]}"))
            return
        emit(pb.RequestResult(request_id=req.request_id, rank=-1, ok=True, payload=proc_stdout, format="diag_json"))


# -- helpers --------------------------------------------------------------------------------------


def _record(seq: int, now: float, **payload: Any) -> bytes:
    return pb.AgentMessage(record=pb.Record(seq=seq, created_at=now, **payload)).SerializeToString()


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:80] or "_"


def _read_json_file(path: Path, *, expected: Path) -> bytes:
    """The dump a rank says it wrote — only if it is the file we asked for: any local process can speak
    on the rank socket, and must not make the agent read (and ship) some other file it can reach."""
    if os.path.realpath(path) != os.path.realpath(expected):
        raise ValueError(f"the rank answered with {path}, not the dump file {expected} it was asked for")
    fd = os.open(expected, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{expected}: not a regular file")
        if st.st_size > MAX_DUMP_BYTES:
            raise ValueError(f"{expected}: {st.st_size} bytes is over the {MAX_DUMP_BYTES} limit")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_DUMP_BYTES + 1)
    finally:
        os.close(fd)
    return _looks_like_json_object(data)


def _looks_like_json_object(data: bytes) -> bytes:
    """Only JSON travels: a pickle or garbage is refused here already. A cheap check (the coordinator
    parses it with its safe loader): parsing a 30 MB dump here would cost the agent ~10× that in
    memory, and deeply nested input would not even parse (RecursionError)."""
    head = data[:64].lstrip()
    if not head.startswith(b"{") or not data[-64:].rstrip().endswith(b"}"):
        raise ValueError("the rank's dump is not a JSON object")
    decoder = codecs.getincrementaldecoder("utf-8")()  # slice by slice: no full copy of the dump
    view = memoryview(data)
    try:
        for off in range(0, len(data), 1 << 20):
            decoder.decode(view[off:off + (1 << 20)], final=off + (1 << 20) >= len(data))
    except UnicodeDecodeError as exc:
        raise ValueError(f"the rank's dump is not UTF-8 JSON: {exc}") from exc
    return data


def pyspy_dump(pid: int, *, timeout_s: float = 10.0, exe: str | None = None) -> dict[str, Any]:
    """``py-spy dump --json`` of one process: ``{"py_spy": [...threads]}`` or ``{"py_spy_error": ...}``.
    Needs ptrace permission on the process (same user with ptrace_scope 0/1 as parent, or
    CAP_SYS_PTRACE, which the DaemonSet/systemd unit grants)."""
    exe = exe or shutil.which("py-spy") or _venv_pyspy()
    if exe is None:
        return {"py_spy_error": "py-spy is not installed"}
    try:
        proc = subprocess.run([exe, "dump", "--pid", str(pid), "--json"], capture_output=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"py_spy_error": f"py-spy did not finish within {timeout_s:g} s"}
    except OSError as exc:
        return {"py_spy_error": f"cannot run py-spy: {exc}"}
    if proc.returncode != 0:
        return {"py_spy_error": proc.stderr.decode(errors="replace").strip()[-500:] or f"exit {proc.returncode}"}
    try:
        return {"py_spy": json.loads(proc.stdout)}
    except ValueError as exc:
        return {"py_spy_error": f"py-spy output is not JSON: {exc}"}


def _venv_pyspy() -> str | None:
    candidate = Path(sys.executable).parent / "py-spy"
    return str(candidate) if candidate.exists() else None


def _find_rank_hub(agent: object) -> Any:
    hub = getattr(agent, "rank_hub", None)
    if hub is not None:
        return hub
    for ext in getattr(agent, "extensions", ()) or ():
        if getattr(ext, "name", "") in ("rank_hub", "ranks") or type(ext).__name__ == "RankHub":
            return ext
    return None


def _dist_version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return ""


def build_register_request(agent: Any, incarnation: str) -> pb.RegisterRequest:
    """Node identity, GPU inventory and software versions (torch/NCCL from package metadata: the
    agent never imports torch)."""
    node = str(getattr(agent, "node_name", "") or os.uname().nodename)
    req = pb.RegisterRequest(node_name=node, incarnation=incarnation, agent_version=__version__,
                             api_version=API_VERSION)
    versions = {"torch": _dist_version("torch"),
                "nccl": _dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"),
                "kernel": os.uname().release, "gpuhealth": __version__}
    backend = getattr(agent, "backend", None)
    if agent is not None:
        try:
            node_info = agent.node_report().get("node", {})
            versions["driver"] = str(node_info.get("driver_version") or "")
            versions["cuda_driver"] = str(node_info.get("cuda_driver_version") or "")
        except Exception:
            log.debug("no node report for registration", exc_info=True)
        for g in getattr(agent, "gpus", []) or []:
            vbios = ""
            if backend is not None:
                with contextlib.suppress(Exception):
                    vbios = str(backend.query(g.index, "VbiosVersion"))
            req.gpus.append(pb.GpuInfo(index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, name=g.name,
                                       vbios=vbios))
    for k, v in versions.items():
        if v:
            req.versions[k] = v
    return req


def link_from_config(config: Any, *, rank_hub: Any = None) -> CoordinatorLink | None:
    """The link an agent config asks for (``agent.coordinator`` set), else None. The spool lives in
    ``agent.state_dir``; mTLS uses ``coordinator.client_tls_cert/key`` with ``coordinator.tls_ca``."""
    address = config.agent.coordinator
    if not address:
        return None
    c = config.coordinator
    if c.operator_token:
        log.warning("coordinator.operator_token is set in this agent's config: anyone who can read it on this "
                    "node can make every other node's ranks dump and run GPU work; keep it off the nodes")
    tls = None
    if c.client_tls_cert or c.client_tls_key:
        from gpuhealth.runtime.tls import tls_files

        tls = tls_files(c.client_tls_cert, c.client_tls_key, c.tls_ca)
    settings = LinkSettings(address=address, spool_path=str(Path(config.agent.state_dir) / "coordinator-spool.db"),
                            token=c.token, tls=tls,
                            # beside the rank socket: the one folder ranks (other containers, other users) share
                            work_dir=str(Path(config.agent.socket_path).parent / "fr"),
                            batch_interval_s=c.link_batch_interval_s)
    try:
        link = CoordinatorLink(settings, rank_hub=rank_hub)
    except SpoolError as exc:  # the agent keeps monitoring the node without its coordinator link
        log.error("coordinator link not started: %s (set agent.state_dir to a writable folder)", exc)
        return None
    link.spool.max_records = c.spool_max_records
    return link
