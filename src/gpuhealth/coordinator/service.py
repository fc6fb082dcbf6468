"""The coordinator's core: sessions with agents, record ingest with seq-based dedup, the periodic
detection tick (stragglers, hangs), requests down to agents, and the query documents.

``Coordinator`` holds the state and runs on one asyncio loop; ``CoordinatorServicer`` is the thin
gRPC edge (parse, authorise, call, reply). Everything an agent sends is validated
(``proto.convert``) before it touches the store; a bad message ends that stream with
``INVALID_ARGUMENT`` and the record's seq is marked rejected so a resend cannot loop forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import json
import logging
import math
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator import hangs
from gpuhealth.coordinator.fleet import (
    NodeView,
    SdcVote,
    culprit_line,
    fabric_findings,
    gpu_findings,
    sdc_votes,
    sdc_votes_from_findings,
    unhealthy_gpus,
    uuid_conflicts,
    version_drift,
)
from gpuhealth.coordinator.jobs import HangCheck, JobState, JobTable, OnlineStragglerDetector
from gpuhealth.coordinator.multinode import CutOff, comm_slow_verdict, cut_off_nodes, cut_off_verdict, localise
from gpuhealth.coordinator.requests import PendingRequest, sdc_digests_of
from gpuhealth.coordinator.screening import (
    LEVELS,
    RESULTS,
    KnownGpu,
    Offer,
    Rotation,
    Screen,
    ScreenBook,
    coverage,
    known_gpus,
    screens_from_pb,
)
from gpuhealth.coordinator.store import Store
from gpuhealth.coordinator.triage_wire import reply_to_dict
from gpuhealth.model import Finding, Severity
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import (
    WireError,
    check_name,
    findings_from_pb,
    identity_from_pb,
    steps_from_pb,
)
from gpuhealth.proto.options import API_VERSION, NODE_METADATA, SESSION_METADATA

log = logging.getLogger("gpuhealth.coordinator")

GROUP_COMMIT_S = 0.005  # records wait at most this long for their commit (and ack)
GROUP_COMMIT_RECORDS = 256  # or until this many records are in the group
ROTATION_PERIOD_S = 1.0  # screening turns are expired and granted this often (and when a node connects or reports)
LISTED_GPUS = 10  # the fleet view lists this many least recently screened GPUs


@dataclass(eq=False)
class Session:
    """One registered agent. The Connect stream attaches to it; a newer Register replaces it."""

    node: str
    incarnation: str
    session_id: str
    acked: int  # committed (and acknowledged once the writer sends it)
    received: int = 0  # written into the open group commit, not yet committed
    connected: bool = False
    ack_sent: int = -1
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    outbox: list[pb.AgentRequest] = field(default_factory=list)
    turn: pb.ScreenTurn | None = None  # the newest screening turn not yet sent (only the newest matters)
    closed: bool = False
    credential: str = "open"  # the credential it registered under (security.Caller.credential): its stream's too

    def push(self, request: pb.AgentRequest) -> None:
        self.outbox.append(request)
        self.wake.set()

    def offer(self, turn: pb.ScreenTurn) -> None:
        self.turn = turn
        self.wake.set()


@dataclass(slots=True)
class Counters:
    records: int = 0
    step_records: int = 0
    duplicates: int = 0
    rejected: int = 0
    refused_registrations: int = 0  # a second credential for a node whose stream is live
    hangs: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    triage: dict[tuple[str, str], int] = field(default_factory=dict)  # (verdict, headline root kind) -> count
    screens: dict[tuple[str, str], int] = field(default_factory=dict)  # (level, result) -> screens received
    foreign_screens: int = 0  # screens of GPUs the reporting node has not registered: dropped
    foreign_digests: int = 0  # SDC digests of GPUs the reporting node has not registered: dropped


class StreamRejected(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Coordinator:
    def __init__(
        self,
        store: Store,
        settings: CoordinatorConfig | None = None,
        *,
        detector_factory: Callable[[str], OnlineStragglerDetector] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.settings = settings or CoordinatorConfig()
        self.clock = clock
        self.mono = monotonic
        self.jobs = JobTable(detector_factory)
        self.nodes: dict[str, NodeView] = {}
        self.sessions: dict[str, Session] = {}  # session_id → session
        self.by_node: dict[str, Session] = {}
        self.counters = Counters()
        self.requests: dict[int, PendingRequest] = {}
        self._request_ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tick_task: asyncio.Task[None] | None = None
        self._last_prune = 0.0
        self.investigating: set[str] = set()
        # job → (the node whose agent reported it hung from NCCL RAS, since when (monotonic) that node's
        # current findings no longer say so; None while they do)
        self.reported_hangs: dict[str, tuple[str, float | None]] = {}
        self.reported_hang_grace_s = REPORTED_HANG_GRACE_S
        # node → job → rank → the straggler finding its agent's periodic dumps gave (zero-code jobs)
        self.reported_stragglers: dict[str, dict[str, dict[int, Finding]]] = {}
        # job → the nodes whose agents report it silently mismatched (a running job's ranks called different
        # collectives: periodic dumps or NCCL RAS); a ``mismatch`` verdict when the first node says so
        self.reported_mismatches: dict[str, set[str]] = {}
        self._pending: dict[Session, int] = {}
        self._pending_records = 0
        self._flush_handle: asyncio.TimerHandle | None = None
        self.book = ScreenBook()
        self.known: dict[str, list[KnownGpu]] = {}  # node -> its registered GPUs, as coverage counts them
        self.rotation = Rotation(self.settings.screen_turn_s, self.settings.screen_concurrency)
        self._rotation_planned = -float("inf")
        self._rotation_soon = False
        self._foreign_logged: dict[str, float] = {}  # node -> when its foreign screens were last logged
        self.heard_at: dict[str, float] = {}  # node -> when its agent last said anything (monotonic)
        self._load()

    # -- lifecycle -------------------------------------------------------------------------------

    def _load(self) -> None:
        """Rebuild memory from the store after a restart: nodes, findings, jobs and recent steps."""
        now, mono = self.clock(), self.mono()
        backends = self.store.node_backends()
        for row in self.store.nodes():
            simulated, backend = backends.get(row.name, (False, ""))
            self.nodes[row.name] = NodeView(row.name, row.versions, row.gpus, last_seen=row.last_seen,
                                            simulated=simulated, backend=backend)
        for view in self.nodes.values():
            self.known[view.name] = known_gpus(view.name, view.gpus)
        self.book.first_seen.update(self.store.gpus_first_seen())
        for screen in self.store.screens_last():
            self.book.add(screen)
        turns = self.store.turns()
        if self.settings.screen_rotation:
            self.rotation.restore([t for t in turns if t.until > now], {t.node: t.started_at for t in turns})
        for node, (at, findings) in self.store.node_findings().items():
            self.nodes.setdefault(node, NodeView(node)).findings = findings
            self.nodes[node].findings_at = at
        since = now - self.settings.warm_start_s
        # Only jobs heard from recently come back to life: an old one (kept for history) would otherwise
        # look stalled a minute after the restart and get a false hang investigation.
        for job_id, world, _first, last in self.store.jobs():
            if last >= since:
                self.jobs.get(job_id, mono).world_size = world
        for rank_row in self.store.ranks():
            if rank_row.identity.job_id not in self.jobs.jobs:
                continue
            job = self.jobs.get(rank_row.identity.job_id, mono)
            job.add_identity(rank_row.node, rank_row.identity, mono)
            job.live_ranks.clear()  # unknown until an agent says so
        for node, _seq, raw in self.store.step_batches(since=since):
            with contextlib.suppress(Exception):  # stored data was validated on the way in
                rec = pb.AgentMessage.FromString(raw).record
                cols = steps_from_pb(rec.steps)
                self.jobs.get(cols.job_id, mono).add_steps(cols, mono, node)
        # What each node said last about zero-code jobs holds until it says otherwise (findings are sent only
        # when they change): a hang it reported is the episode already investigated, not a new one, and the
        # stragglers its periodic dumps found stay the job's.
        for node, view in self.nodes.items():
            self._reported_stragglers(node, view.findings)
            self._reported_mismatches(node, view.findings, restoring=True)
            for f in view.findings:
                stuck_id = _stuck_job(f)
                stuck = self.jobs.jobs.get(stuck_id) if stuck_id is not None else None
                if stuck is not None:
                    stuck.hang_open = True
                    self.reported_hangs[stuck.job_id] = (node, None)

    async def start(self) -> None:
        # Retention runs once before anything is received, then hourly: a record that arrives after the
        # start is never pruned by a first tick that happened to run late.
        self._last_prune = self.clock()
        try:
            self.prune(self._last_prune)
        except Exception:  # as in the tick: retention failing must not keep the coordinator from serving
            log.exception("retention at start failed; tried again in an hour")
        self._tick_task = asyncio.create_task(self._tick_loop(), name="coordinator-tick")

    async def stop(self) -> None:
        self.flush_group()
        tasks = [t for t in (self._tick_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in list(self.sessions.values()):
            s.closed = True
            s.wake.set()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- registration ----------------------------------------------------------------------------

    def register(self, req: pb.RegisterRequest, credential: str = "open") -> pb.RegisterResponse:
        """A session for the node. A node whose stream is live under another credential keeps it: the
        newcomer is refused (``StreamRejected``) and logged — two credentials claiming one node is an
        impersonation or a misconfiguration, never a reconnect (those come under the same credential)."""
        node = check_name(req.node_name, "node_name")
        incarnation = check_name(req.incarnation, "incarnation", 128)
        live = self.by_node.get(node)
        if live is not None and live.connected and not live.closed and live.credential != credential:
            self.counters.refused_registrations += 1
            log.warning("node %s: refused a second registration under credential %s while its stream is live under "
                        "%s", node, credential, live.credential)
            raise StreamRejected(grpc.StatusCode.ALREADY_EXISTS,
                                 f"node {node!r} is connected under another credential; refused (logged)")
        now = self.clock()
        gpus = [{"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, "name": g.name, "vbios": g.vbios,
                 "serial": g.serial} for g in req.gpus]
        versions = dict(req.versions)
        known = known_gpus(node, gpus)
        with self.store.transaction():
            self.store.upsert_node(node, incarnation, now, req.agent_version, versions, gpus, req.topology_json)
            self.store.set_node_backend(node, req.simulated, req.backend[:200])
            self.store.note_gpus_seen(node, [g.uuid for g in known], now)
        view = self.nodes.setdefault(node, NodeView(node))
        view.versions, view.gpus, view.last_seen = versions, gpus, now
        view.simulated, view.backend = req.simulated, req.backend[:200]
        self.known[node] = known
        for g in known:
            self.book.seen(g, now)
        old = self.by_node.get(node)
        if old is not None:  # the agent reconnected: its old stream (if any) must go
            old.closed = True
            old.wake.set()
            self.sessions.pop(old.session_id, None)
        self.flush_group()  # the acked seq we return must be committed: the agent drops what it covers
        acked = self.store.acked_seq(node, incarnation)
        session = Session(node, incarnation, secrets.token_hex(16), acked, received=acked, credential=credential)
        self.sessions[session.session_id] = session
        self.by_node[node] = session
        log.info("node %s registered (incarnation %s, %d GPUs, acked seq %d)", node, incarnation, len(gpus),
                 session.acked)
        return pb.RegisterResponse(
            session_id=session.session_id, acked_seq=session.acked, api_version=API_VERSION,
            heartbeat_interval_s=self.settings.heartbeat_interval_s, max_inflight=self.settings.max_inflight)

    def session_for(self, metadata: Any) -> Session:
        md = {k: v for k, v in (metadata or ())}
        session = self.sessions.get(str(md.get(SESSION_METADATA, "")))
        if session is None or session.closed:
            raise StreamRejected(grpc.StatusCode.UNAUTHENTICATED, "unknown or expired session: call Register first")
        if md.get(NODE_METADATA) != session.node:
            raise StreamRejected(grpc.StatusCode.PERMISSION_DENIED,
                                 f"session belongs to node {session.node!r}, not {md.get(NODE_METADATA)!r}")
        return session

    # -- ingest ----------------------------------------------------------------------------------

    def handle_record(self, session: Session, raw: bytes, rec: pb.Record) -> None:
        """Write one record (idempotent by seq) into the open group commit; it is acknowledged when
        the group commits (``flush_group``: at most ``GROUP_COMMIT_S`` later)."""
        seq = rec.seq
        self.heard_at[session.node] = self.mono()
        if seq == 0:
            raise StreamRejected(grpc.StatusCode.INVALID_ARGUMENT, "record without a seq (seqs start at 1)")
        if seq <= session.received:
            self.counters.duplicates += 1
            session.wake.set()  # re-acknowledge
            return
        now, mono = self.clock(), self.mono()
        kind = rec.WhichOneof("payload")
        try:
            # Validate everything first (pure), then write; memory is updated only after the write.
            if kind == "steps":
                cols = steps_from_pb(rec.steps)
                self._begin_group()
                with self.store.transaction():
                    self.store.add_step_batch(session.node, seq, cols.job_id, len(cols), raw, now)
                    self.store.set_acked(session.node, session.incarnation, seq, now)
                self.jobs.get(cols.job_id, mono).add_steps(cols, mono, session.node)
                self.counters.step_records += len(cols)
            elif kind == "ranks":
                idents = [identity_from_pb(m) for m in rec.ranks.ranks]
                # An unverified claim to a verified rank's place is kept out of memory and the store alike.
                accepted = [i for i in idents if self.jobs.get(i.job_id, mono).accepts(session.node, i)]
                for ident in idents:
                    if ident not in accepted:
                        log.warning("node %s: an unverified claim to rank %d of job %s (pid %d) is ignored: the rank "
                                    "is placed on kernel evidence", session.node, ident.rank, ident.job_id, ident.pid)
                self._begin_group()
                with self.store.transaction():
                    self.store.upsert_ranks(session.node, accepted, now)
                    self.store.set_acked(session.node, session.incarnation, seq, now)
                for ident in idents:  # (counts the ignored ones: claims_ignored)
                    self.jobs.get(ident.job_id, mono).add_identity(session.node, ident, mono)
            elif kind == "findings":
                findings = findings_from_pb(rec.findings.findings)
                self._begin_group()
                with self.store.transaction():
                    self.store.set_node_findings(session.node, findings, now)
                    self.store.set_acked(session.node, session.incarnation, seq, now)
                view = self.nodes.setdefault(session.node, NodeView(session.node))
                view.findings, view.findings_at = findings, rec.findings.at or now
                self._reported_hangs(session.node, findings)
                self._reported_stragglers(session.node, findings)
                self._reported_mismatches(session.node, findings)
            elif kind == "screens":
                screens = self._own_screens(session.node, screens_from_pb(rec.screens, session.node, now), now)
                self._begin_group()
                with self.store.transaction():
                    self.store.add_screens(screens, self.settings.screen_history)
                    for sc in screens:  # their digests join the fleet-wide vote per golden key
                        for key, digest in sc.digests:
                            self.store.add_sdc_digest(session.node, sc.gpu_uuid, key, digest, sc.finished_at)
                    self.store.set_acked(session.node, session.incarnation, seq, now)
                for sc in screens:
                    self.book.add(sc)
                    self.counters.screens[(sc.level, sc.result)] = self.counters.screens.get((sc.level, sc.result),
                                                                                            0) + 1
                self._release_turn_if_screened(session.node, now)
                self._rotate_soon()  # the queue's order changed
            elif kind == "sdc":
                digests = list(rec.sdc.digests)
                if len(digests) > MAX_DIGESTS_PER_RECORD:
                    raise WireError(f"sdc: {len(digests)} digests in one record, more than {MAX_DIGESTS_PER_RECORD}")
                for d in digests:
                    check_name(d.gpu_uuid, "sdc.gpu_uuid")
                    check_name(d.key, "sdc.key", 1024)
                    check_name(d.digest, "sdc.digest", 256)
                # Only this node's GPUs: stored, another node's would grow the database (the vote ignores them).
                owned = [d for d in digests if self._owns(session.node, d.gpu_uuid)]
                if len(owned) < len(digests):
                    self.counters.foreign_digests += len(digests) - len(owned)
                    if now - self._foreign_logged.get("sdc:" + session.node, -math.inf) >= 60.0:
                        self._foreign_logged["sdc:" + session.node] = now
                        log.warning("node %s: dropped %d SDC digest(s) of GPUs it has not registered",
                                    session.node, len(digests) - len(owned))
                digests = owned
                self._begin_group()
                with self.store.transaction():
                    for d in digests:
                        self.store.add_sdc_digest(session.node, d.gpu_uuid, d.key, d.digest, d.at or now)
                    self.store.set_acked(session.node, session.incarnation, seq, now)
            else:
                raise WireError("record has no payload (or one this coordinator does not know)")
        except WireError as exc:
            # Mark the seq consumed so the agent drops it instead of resending it forever.
            self._begin_group()
            self.store.set_acked(session.node, session.incarnation, seq, now)
            self._note_pending(session, seq)
            self.flush_group()
            self.counters.rejected += 1
            raise StreamRejected(grpc.StatusCode.INVALID_ARGUMENT, f"record seq {seq}: {exc}") from exc
        self.counters.records += 1
        self._note_pending(session, seq)

    # -- group commit ----------------------------------------------------------------------------

    def _begin_group(self) -> None:
        if self.store.in_transaction:
            return
        self.store.begin()
        try:
            self._flush_handle = asyncio.get_running_loop().call_later(GROUP_COMMIT_S, self.flush_group)
        except RuntimeError:  # no loop (direct use in tests/tools): commit at the end of the record
            self._flush_handle = None

    def _note_pending(self, session: Session, seq: int) -> None:
        session.received = seq
        self._pending[session] = seq
        self._pending_records += 1
        if self._flush_handle is None or self._pending_records >= GROUP_COMMIT_RECORDS:
            self.flush_group()

    def flush_group(self) -> None:
        """Commit the open group and acknowledge every record in it."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self.store.in_transaction:
            return
        pending, self._pending = self._pending, {}
        self._pending_records = 0
        try:
            self.store.commit()
        except Exception:
            # Nothing of the group is acknowledged: the agents resend it. Their streams restart so
            # that ``received`` goes back to what is really committed.
            log.exception("cannot commit %d agents' records; their streams restart", len(pending))
            self.store.rollback()
            for session in pending:
                session.received = session.acked
                session.closed = True
                session.wake.set()
            return
        for session, seq in pending.items():
            if seq > session.acked:
                session.acked = seq
            session.wake.set()

    def handle_health(self, session: Session, msg: pb.HealthSummary) -> None:
        view = self.nodes.setdefault(session.node, NodeView(session.node))
        view.health = msg.health or "unknown"
        view.last_seen = self.clock()
        self.heard_at[session.node] = self.mono()
        live: dict[str, list[int]] = {}
        for lr in msg.live:
            live[lr.job_id] = list(lr.ranks)
        self.jobs.set_live(session.node, live)

    def handle_result(self, session: Session, msg: pb.RequestResult) -> None:
        pending = self.requests.get(msg.request_id)
        if pending is None:
            return  # late answer to a request whose deadline passed
        pending.add(session.node, msg)

    def stream_opened(self, session: Session) -> None:
        self.heard_at[session.node] = self.mono()
        session.connected = True
        session.ack_sent = -1
        self.nodes.setdefault(session.node, NodeView(session.node)).connected = True
        self.rotation.forget_sent(session.node)  # a new stream: the agent hears its turn again
        self._rotate_soon()
        session.wake.set()

    def stream_closed(self, session: Session) -> None:
        self.flush_group()
        session.connected = False
        if self.by_node.get(session.node) is session:
            self.nodes[session.node].connected = False
            self.jobs.node_gone(session.node)
        for pending in self.requests.values():
            pending.node_lost(session.node)

    async def outgoing(self, session: Session) -> AsyncIterator[pb.CoordinatorMessage]:
        """Acks (coalesced: only the newest) and requests for one session's stream."""
        while not session.closed:
            await session.wake.wait()
            session.wake.clear()
            if session.closed:
                return
            while session.outbox:
                yield pb.CoordinatorMessage(request=session.outbox.pop(0))
            if session.turn is not None:
                turn, session.turn = session.turn, None
                yield pb.CoordinatorMessage(screen_turn=turn)
            if session.acked != session.ack_sent:
                session.ack_sent = session.acked
                yield pb.CoordinatorMessage(ack=pb.Ack(up_to_seq=session.acked))

    # -- screening -------------------------------------------------------------------------------

    def _own_screens(self, node: str, screens: list[Screen], now: float) -> list[Screen]:
        """The screens of GPUs this node registered; the rest are counted, logged (once a minute per
        node) and dropped: kept, they would grow memory and the database without bound and their digests
        would outvote the fleet's real GPUs. A GPU registered without a uuid (known as ``index:N``) takes
        the screen of its index."""
        known = self.known.get(node, [])
        uuids = {g.uuid for g in known}
        by_index = {g.index: g.uuid for g in known if g.uuid == f"index:{g.index}"}
        own: list[Screen] = []
        for sc in screens:
            if sc.gpu_uuid in uuids:
                own.append(sc)
            elif sc.gpu_index is not None and sc.gpu_index in by_index:
                own.append(dataclasses.replace(sc, gpu_uuid=by_index[sc.gpu_index]))
        dropped = len(screens) - len(own)
        if dropped:
            self.counters.foreign_screens += dropped
            if now - self._foreign_logged.get(node, -math.inf) >= 60.0:
                self._foreign_logged[node] = now
                first = next(sc for sc in screens if sc.gpu_uuid not in uuids)
                log.warning("node %s: dropped %d screen(s) of GPUs it has not registered (first: %r; registered: "
                            "%d GPUs)", node, dropped, first.gpu_uuid[:80], len(known))
        return own

    def _release_turn_if_screened(self, node: str, now: float) -> None:
        turn = self.rotation.active.get(node)
        if turn is not None and self.book.all_reported_since(node, self.known.get(node, []), turn.started_at):
            self.rotation.release(node)
            self.store.end_turn(node, now)

    def _rotate_soon(self) -> None:
        """Plan the rotation on the loop's next turn (coalesced: many connects, one plan)."""
        if self._rotation_soon:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # direct use (tests, tools): the next tick plans
        self._rotation_soon = True
        loop.call_soon(self._rotate_logged)

    def _rotate_logged(self) -> None:
        try:
            self.rotate()
        except Exception:  # the rotation must not take the loop down; the next tick tries again
            log.exception("screening rotation failed")

    def rotate(self) -> dict[str, Offer]:
        """Expire and grant screening turns; queue each connected node's turn on its stream. Returns
        the offers made (empty with ``screen_rotation`` off: agents then keep their own schedules)."""
        now = self.clock()
        self._rotation_planned = now
        self._rotation_soon = False
        if not self.settings.screen_rotation:
            return {}
        connected = {n: self.book.node_screened_at(n, self.known.get(n, []))
                     for n, s in self.by_node.items() if s.connected and not s.closed}
        before = dict(self.rotation.active)
        offers = self.rotation.plan(now, connected)
        granted = [t for n, t in self.rotation.active.items() if before.get(n) is not t]
        if granted:
            with self.store.transaction():
                for t in granted:
                    self.store.set_turn(t)
            for t in granted:
                log.info("node %s: screening turn for %.0f s", t.node, t.until - t.started_at)
        for node, offer in offers.items():
            self.by_node[node].offer(pb.ScreenTurn(not_before=offer.not_before, valid_for_s=offer.valid_for_s))
        return offers

    def _counted_gpus(self, now: float) -> list[KnownGpu]:
        """The GPUs coverage is owed for: those of every node heard from within the retention window
        (a node gone longer than that was decommissioned, not left unscreened)."""
        horizon = now - self.settings.retention_days * 86_400.0
        return [g for name in sorted(self.known) if (v := self.nodes.get(name)) is not None and v.last_seen >= horizon
                for g in self.known[name]]

    def screening_doc(self) -> dict[str, Any]:
        """Coverage, the least recently screened GPUs, failing screens and who holds a turn."""
        now = self.clock()
        gpus = self._counted_gpus(now)
        cov = coverage(gpus, self.book, now, self.settings.screen_window_s)

        def when(g: KnownGpu) -> float:
            done = self.book.last_completed(g.node, g.uuid)
            return done.screened_at if done is not None else self.book.first_seen.get((g.node, g.uuid), now)

        def row(g: KnownGpu) -> dict[str, Any]:
            done = self.book.last_completed(g.node, g.uuid)
            last = self.book.last.get((g.node, g.uuid))
            return {"node": g.node, "gpu": g.index, "uuid": g.uuid,
                    "screened_at": done.screened_at if done is not None else None,
                    "age_s": max(0.0, now - when(g)), "level": done.level if done is not None else None,
                    "result": done.result if done is not None else None,
                    "last_attempt": {"result": last.result, "reason": last.reason, "finished_at": last.finished_at,
                                     "trigger": last.trigger} if last is not None else None}

        oldest = heapq.nsmallest(LISTED_GPUS, gpus, key=lambda g: (when(g), self.book.last_completed(g.node, g.uuid)
                                                                    is not None))
        failed = []
        for g in gpus:
            done = self.book.last_completed(g.node, g.uuid)
            if done is not None and done.result == "fail" and done.screened_at >= now - cov.window_s:
                failed.append({"node": g.node, "gpu": g.index, "uuid": g.uuid, "level": done.level,
                               "reason": done.reason, "finished_at": done.finished_at, "trigger": done.trigger})
        connected = sum(1 for s in self.by_node.values() if s.connected)
        return {
            "window_s": cov.window_s, "gpus": cov.gpus, "screened": cov.screened, "unscreened": cov.unscreened,
            "coverage_ratio": cov.ratio, "oldest_age_s": cov.oldest_age_s,
            "oldest": row(cov.oldest) if cov.oldest is not None else None,
            "least_recently_screened": [row(g) for g in oldest],
            "failed": failed,
            "rotation": {
                "enabled": self.settings.screen_rotation, "turn_s": self.settings.screen_turn_s,
                "slots": self.rotation.slots(connected) if connected else 0,
                "turns": [{"node": t.node, "since": t.started_at, "until": t.until,
                           "remaining_s": max(0.0, t.until - now)}
                          for t in sorted(self.rotation.active.values(), key=lambda t: (t.until, t.node))],
                "next": [{"node": n, "estimated_start": at} for n, at in
                         sorted(self.rotation.estimates.items(), key=lambda kv: (kv[1], kv[0]))[:LISTED_GPUS]],
            },
        }

    # -- requests to agents ----------------------------------------------------------------------

    def send_request(self, job_id: str, kind: Any, timeout_s: float, nodes: set[str],
                     rank: int = -1, rank_nodes: dict[int, str] | None = None) -> PendingRequest:
        rid = next(self._request_ids)
        targets = {n for n in nodes if (s := self.by_node.get(n)) is not None and s.connected}
        pending = PendingRequest(rid, kind, job_id, targets, rank_nodes=dict(rank_nodes or {}))
        self.requests[rid] = pending
        for n in targets:
            self.by_node[n].push(pb.AgentRequest(request_id=rid, kind=kind, job_id=job_id, rank=rank,
                                                 timeout_s=timeout_s))
        return pending

    def forget_request(self, rid: int) -> None:
        self.requests.pop(rid, None)

    def job_nodes(self, job: JobState) -> set[str]:
        nodes = {p.node for p in job.placements.values()} | {n for n, r in job.live_ranks.items() if r}
        return nodes or {n for n, s in self.by_node.items() if s.connected}

    # -- detection tick --------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                self.tick()
                if self.clock() - self._last_prune > 3600:
                    self._last_prune = self.clock()
                    self.prune(self._last_prune)
            except Exception:  # the tick must survive anything a job's data does to it
                log.exception("detection tick failed")

    def prune(self, now: float) -> int:
        """Retention: old rows, and evidence folders (dumps, stacks) older than ``retention_days``.
        Returns evidence folders removed."""
        self.flush_group()
        self.store.prune(now, keep_days=self.settings.retention_days,
                         keep_steps_hours=self.settings.step_retention_hours)
        self.store.prune_screens(now - self.settings.retention_days * 86_400.0,
                                 {(g.node, g.uuid) for gpus in self.known.values() for g in gpus})
        cutoff = now - self.settings.retention_days * 86_400.0
        for name, view in list(self.nodes.items()):
            if view.last_seen < cutoff:
                self.rotation.forget(name)
        removed = 0
        root = Path(self.settings.resolved_evidence_dir())
        for folder in root.glob("*/*") if root.is_dir() else ():
            with contextlib.suppress(OSError):
                if folder.is_dir() and not folder.is_symlink() and folder.stat().st_mtime < cutoff:
                    shutil.rmtree(folder)
                    removed += 1
        return removed

    def tick(self) -> None:
        if self.clock() - self._rotation_planned >= ROTATION_PERIOD_S:
            self._rotate_logged()  # its own failure must not cost the jobs their detection
        mono = self.mono()
        self._end_reported_hangs(mono)
        for job in list(self.jobs.jobs.values()):
            quiet_s = mono - max(job.last_record_at, job.progress_at)
            if quiet_s > self.settings.forget_job_after_s and (job.finished or not job.placements) \
                    and job.job_id not in self.investigating:
                del self.jobs.jobs[job.job_id]  # memory stays bounded; the store keeps its history
                continue
            if job.detector is not None or job.discovered_only:
                self._update_stragglers(job)
            self._judge_comm(job)
            self._judge_cut_off(job, mono)
            check = job.hang_check(mono, self.settings.hang_k, self.settings.hang_floor_s)
            if check is not None and self._cut_off(job, mono, self.settings.heartbeat_interval_s + 2.0):
                check = None  # a node missed its heartbeat as the job stopped: wait for the cut-off judgement
            if check is not None and job.job_id not in self.investigating:
                job.hang_open = True
                job.hangs += 1
                self.counters.hangs += 1
                self.investigating.add(job.job_id)
                log.warning("job %s: no rank progressed for %.1f s (threshold %.1f s): collecting evidence",
                            job.job_id, check.stalled_s, check.threshold_s)
                self._spawn(self._investigate_hang(job, check), f"hang-{job.job_id}")

    # -- multi-node judgement (coordinator/multinode.py) --------------------------------------------

    @property
    def silent_after_s(self) -> float:
        """A node's agent silent this long (2.5 heartbeats and a margin) while its job waits: cut off."""
        return 2.5 * self.settings.heartbeat_interval_s + 2.0

    def _job_ranks_by_node(self, job: JobState) -> dict[str, list[int]]:
        by_node: dict[str, list[int]] = {}
        for rank, p in job.placements.items():
            by_node.setdefault(p.node, []).append(rank)
        return by_node

    def _cut_off(self, job: JobState, mono: float, silent_after_s: float) -> list[CutOff]:
        return cut_off_nodes(self._job_ranks_by_node(job), self.heard_at, job.progress_at, mono, silent_after_s,
                             job.typical_step_s(), self.settings.heartbeat_interval_s)

    def _judge_comm(self, job: JobState) -> None:
        """``job.comm_slow``: communication grew against the job's own baseline while compute held; a verdict
        naming the node(s) the evidence explains it by, or the candidates and a probe to run."""
        episode, opened = job.comm.judge()
        if episode is None:
            if job.comm_verdict is not None:
                log.info("job %s: communication back to its pace", job.job_id)
            job.comm_verdict = None
            return
        if not opened and job.comm_verdict is not None:
            job.comm_verdict.update(ratio=round(episode.ratio, 3), comm_s=round(episode.comm_s, 6),
                                    at_step=episode.at_step)
            return
        nodes = sorted(self._job_ranks_by_node(job))
        if len(nodes) < 2:
            return  # one node: no network between its ranks that this judges (job.slowdown and stragglers do)
        where = localise(nodes, {n: v.findings for n in nodes if (v := self.nodes.get(n)) is not None}, episode,
                         job.comm.settings)
        doc = comm_slow_verdict(job.job_id, episode, where, self.clock())
        job.comm_verdict = doc
        self.record_verdict(job.job_id, "comm_slow", doc)
        log.warning("job %s: %s", job.job_id, doc["summary"])

    def _judge_cut_off(self, job: JobState, mono: float) -> None:
        """``node.cut_off``: a node whose agent and ranks went silent together while the job's other ranks wait.
        The hang this causes is explained by it: no evidence is asked of a node nobody can reach."""
        if job.finished or not job.progress_at:
            return
        cuts = self._cut_off(job, mono, self.silent_after_s)
        names = [c.node for c in cuts]
        if not cuts:
            if job.cut_off:
                log.info("job %s: node(s) %s heard again", job.job_id, ", ".join(job.cut_off))
            job.cut_off = []
            return
        if set(names) <= set(job.cut_off):
            return  # the same episode
        job.cut_off = sorted(set(job.cut_off) | set(names))
        job.hang_open = True  # the stall is explained; a new step ends it like any hang
        waiting = [n for n in self._job_ranks_by_node(job) if n not in job.cut_off]
        doc = cut_off_verdict(job.job_id, cuts, waiting, self.clock(), max(job.last_step.values(), default=None))
        self.record_verdict(job.job_id, "cut_off", doc)
        log.warning("job %s: %s", job.job_id, doc["summary"])

    def _reported_hangs(self, node: str, findings: list[Finding]) -> None:
        """Hangs an agent judged itself: its zero-code watcher names a rank of its own that NCCL RAS shows
        behind (``rank.stuck``, critical). Such jobs send no steps, so the step check never fires for them;
        the coordinator collects every rank's dumps and stacks, on every node, as for a hang it saw itself.
        The episode ends when that node has stopped reporting it for a while (``_end_reported_hangs``)."""
        reported: dict[str, Finding] = {}
        for f in findings:
            job_id = _stuck_job(f)
            if job_id is not None:
                reported.setdefault(job_id, f)
        mono = self.mono()
        for job_id, (reporter, missing_since) in list(self.reported_hangs.items()):
            if reporter != node:
                continue
            if job_id in reported:
                self.reported_hangs[job_id] = (reporter, None)  # still reported: the same episode
            elif missing_since is None:
                self.reported_hangs[job_id] = (reporter, mono)
        for job_id, f in reported.items():
            if job_id in self.reported_hangs:
                continue
            job = self.jobs.jobs.get(job_id)
            if job is None or job.hang_open or job_id in self.investigating:
                continue  # unknown here (no identity yet: the next report tries again), or already handled
            if not any(p.node == node for p in job.placements.values()):
                continue  # critical only where the stuck rank runs: a node without ranks of the job cannot open it
            stalled = _number(f.evidence.get("stalled_s"))
            threshold = _number(f.evidence.get("threshold_s")) or stalled
            raw_rank = f.evidence.get("rank")
            rank = raw_rank if isinstance(raw_rank, int) and not isinstance(raw_rank, bool) and raw_rank >= 0 else None
            check = HangCheck(stalled, threshold, None, max(job.last_step.values(), default=-1))
            job.hang_open = True
            job.hangs += 1
            self.counters.hangs += 1
            self.investigating.add(job_id)
            self.reported_hangs[job_id] = (node, None)
            origin: dict[str, Any] = {"node": node, "source": str(f.evidence.get("source") or f.source)[:200],
                                      "message": f.message[:1000], "rank": rank}
            log.warning("job %s: node %s reports it hung (%s): collecting evidence", job_id, node, f.message[:300])
            self._spawn(self._investigate_hang(job, check, reported_by=origin, suspects=[] if rank is None else [rank]),
                        f"hang-{job_id}")

    def _reported_stragglers(self, node: str, findings: list[Finding]) -> None:
        """Stragglers an agent found in a discovered job's periodic flight-recorder dumps (``rank.straggler``
        tagged with the job): that node's current word on the job, kept until its findings change."""
        found: dict[str, dict[int, Finding]] = {}
        for f in findings:
            job_id, rank = f.evidence.get("job_id"), f.evidence.get("rank")
            if (f.code.startswith("rank.straggler") and isinstance(job_id, str) and job_id
                    and isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < MAX_REPORTED_RANK):
                found.setdefault(job_id, {})[rank] = f
        if found:
            self.reported_stragglers[node] = found
        else:
            self.reported_stragglers.pop(node, None)

    def _reported_mismatches(self, node: str, findings: list[Finding], *, restoring: bool = False) -> None:
        """A node's agent proves a running job silently mismatched (critical ``collective.*_mismatch`` tagged with
        the job: two ranks' periodic dumps recorded different collectives at one sequence number and both completed
        it; or NCCL RAS showed one collective type a fixed count apart while every rank launched on). The first node
        to say so opens the episode and its ``mismatch`` verdict; it ends when no node says so any more. After a
        restart the stored findings reopen the episodes without a second verdict."""
        now_reported: dict[str, Finding] = {}
        for f in findings:
            job_id = f.evidence.get("job_id")
            if (f.code in MISMATCH_CODES and f.severity is Severity.CRITICAL and isinstance(job_id, str) and job_id
                    and len(job_id) <= 256):
                now_reported.setdefault(job_id, f)
        for job_id, nodes in list(self.reported_mismatches.items()):
            if job_id not in now_reported:
                nodes.discard(node)
                if not nodes:
                    del self.reported_mismatches[job_id]
        for job_id, f in now_reported.items():
            nodes = self.reported_mismatches.setdefault(job_id, set())
            opened = not nodes
            nodes.add(node)
            if opened and not restoring:
                doc = self.mismatch_verdict(job_id, node, f)
                self.record_verdict(job_id, "mismatch", doc)
                log.warning("job %s: %s", job_id, doc["summary"])

    def mismatch_verdict(self, job_id: str, node: str, finding: Finding) -> dict[str, Any]:
        """The verdict of a reported silent mismatch: the group (or communicator), the sequence number where the
        flight recorder saw it, each side (op, sizes, dtypes, ranks), and who said so."""
        ev = finding.evidence
        sides = [v for v in ev.get("variants") or [] if isinstance(v, dict)][:16]
        culprits = sorted({int(r) for v in sides for r in v.get("ranks") or []
                           if isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_REPORTED_RANK})
        job = self.jobs.jobs.get(job_id)
        return {
            "verdict": "mismatch", "job_id": job_id, "culprits": culprits,
            "culprit_details": [self.culprit(job, r) for r in culprits] if job is not None else [],
            "group": ev.get("group") if ev.get("group") is not None else ev.get("communicator"),
            "seq": ev.get("seq"), "sides": sides or ev.get("ranks"), "collective": ev.get("collective"),
            "summary": f"mismatch: {finding.message[:1000]}",
            "reported_by": {"node": node, "source": str(ev.get("source") or finding.source)[:200]},
            "findings": [finding.to_dict()], "created_at": self.clock(),
        }

    def _end_reported_hangs(self, mono: float) -> None:
        """A reported hang ends once its node's findings have gone without it for ``reported_hang_grace_s``:
        one update without it (a poll that missed the process while it was dumped) is not the rank moving on."""
        for job_id, (_node, missing_since) in list(self.reported_hangs.items()):
            if missing_since is not None and mono - missing_since > self.reported_hang_grace_s \
                    and job_id not in self.investigating:
                del self.reported_hangs[job_id]
                job = self.jobs.jobs.get(job_id)
                if job is not None:
                    job.hang_open = False

    def _update_stragglers(self, job: JobState) -> None:
        """Stragglers from the job's steps (the detector), or, for a job found only by discovery, from what
        its agents' periodic dumps said (``_reported_stragglers``); a verdict per new straggler either way."""
        if job.episodes_stored is None:
            # First look at this job since (re)start: episodes it had open were announced already, so
            # they continue (same onset, no second verdict) until the detector sees clear recovery.
            restored = self.store.straggler_episodes(job.job_id)
            if job.detector is not None:
                job.detector.resume(restored.values())
            job.stragglers = {**restored, **job.stragglers}
            job.episodes_stored = set(restored)
        if job.discovered_only:
            current = {rank: f for by_job in self.reported_stragglers.values()
                       for rank, f in by_job.get(job.job_id, {}).items()}
        else:
            assert job.detector is not None
            current = {int(f.evidence.get("rank", f.entity.id)): f for f in job.detector.evaluate()}
        for rank, finding in current.items():
            if rank not in job.stragglers:
                doc = self.straggler_verdict(job, rank, finding)
                self.record_verdict(job.job_id, "straggler", doc)
                log.warning("job %s: %s", job.job_id, doc["summary"])
        if set(current) != job.episodes_stored:
            with self.store.transaction():
                self.store.set_straggler_episodes(job.job_id, current, self.clock())
            job.episodes_stored = set(current)
        job.stragglers = current
        slowdown = job.detector.slowdown() if job.detector is not None and not job.discovered_only else None
        if slowdown is not None and job.slowdown is None:
            log.warning("job %s: %s", job.job_id, slowdown.message)
        job.slowdown = slowdown

    def culprit(self, job: JobState, rank: int) -> dict[str, Any]:
        """Rank → node/GPU and that GPU's current findings."""
        placement = job.placements.get(rank)
        out: dict[str, Any] = {"rank": rank}
        if placement is None:
            out.update(node=None, line=f"rank {rank}: placement unknown (no identity received)", gpu_findings=[])
            return out
        ident = placement.identity
        view = self.nodes.get(placement.node) or NodeView(placement.node)
        gpu_index = ident.gpu_index
        inferred = False
        if ident.gpu_uuid is None and gpu_index is None and ident.local_rank is not None:
            gpu_index, inferred = ident.local_rank, True  # the launcher convention: cuda:local_rank
        gpu = view.gpu(uuid=ident.gpu_uuid) if ident.gpu_uuid else view.gpu(index=gpu_index)
        if inferred and gpu is None:  # the node has no such GPU (a CPU job): name none rather than a wrong one
            gpu_index, inferred = None, False
        uuid = ident.gpu_uuid or (gpu or {}).get("uuid")
        if gpu is not None and gpu_index is None:
            gpu_index = gpu.get("index")
        findings = gpu_findings(view, uuid)
        out.update(
            node=placement.node, host=ident.host, pid=ident.pid, local_rank=ident.local_rank, gpu_index=gpu_index,
            gpu_uuid=uuid, gpu_inferred_from_local_rank=inferred,
            gpu_findings=[f.to_dict() for f in findings], line=culprit_line(rank, placement.node, gpu_index, findings))
        return out

    def straggler_verdict(self, job: JobState, rank: int, finding: Finding) -> dict[str, Any]:
        culprit = self.culprit(job, rank)
        return {
            "verdict": "straggler", "job_id": job.job_id, "culprits": [rank], "culprit_details": [culprit],
            "summary": f"straggler: {culprit['line']} ({finding.message})",
            "findings": [finding.to_dict()], "created_at": self.clock(),
            "at_step": max(job.last_step.values(), default=None),
        }

    def record_verdict(self, job_id: str, kind: str, doc: dict[str, Any]) -> int:
        self.counters.verdicts[kind] = self.counters.verdicts.get(kind, 0) + 1
        return self.store.add_verdict(job_id, kind, doc, self.clock())

    @property
    def evidence_dir(self) -> str:
        return self.settings.resolved_evidence_dir()

    async def _investigate_hang(self, job: JobState, check: Any, *, reported_by: dict[str, Any] | None = None,
                                suspects: list[int] | None = None) -> None:
        try:
            reply = await hangs.investigate(self, job, reason="hang", hang=check,
                                            timeout_s=self.settings.evidence_timeout_s, suspects=suspects or ())
            self._count_triage(reply)
            doc = reply_to_dict(reply)
            if reported_by is not None:
                doc["reported_by"] = reported_by  # the agent's own judgement that opened this investigation
            self.record_verdict(job.job_id, "hang", doc)
            log.warning("job %s: %s", job.job_id, doc["summary"])
        except Exception:
            log.exception("job %s: hang investigation failed", job.job_id)
        finally:
            self.investigating.discard(job.job_id)

    async def live_triage(self, job_id: str, timeout_s: float) -> pb.TriageReply:
        job = self.jobs.jobs.get(job_id)
        if job is None:
            raise KeyError(job_id)
        reply = await hangs.investigate(self, job, reason="on_demand", timeout_s=timeout_s)
        self._count_triage(reply)
        return reply

    def _count_triage(self, reply: pb.TriageReply) -> None:
        verdict = pb.Verdict.Name(reply.report.verdict).removeprefix("VERDICT_").lower()
        roots = [r for r in reply.report.roots if r.kind != pb.ROOT_BEHIND]
        root = pb.RootKind.Name(roots[0].kind).removeprefix("ROOT_").lower() if roots else "none"
        key = (verdict, root)
        self.counters.triage[key] = self.counters.triage.get(key, 0) + 1

    async def run_diagnostic(self, nodes: list[str], name: str, params: dict[str, str],
                             timeout_s: float) -> dict[str, Any]:
        """Run ``gpuhealth diag NAME`` on agents; SDC digests in the results are stored as votes. A name
        or parameter outside the known set is refused here (``WireError``), before any agent hears it."""
        check_diagnostic(name, params)
        wanted = set(nodes) or {n for n, s in self.by_node.items() if s.connected}
        rid = next(self._request_ids)
        targets = {n for n in wanted if (s := self.by_node.get(n)) is not None and s.connected}
        pending = PendingRequest(rid, pb.RUN_DIAGNOSTIC, "", set(targets))
        self.requests[rid] = pending
        for n in targets:
            self.by_node[n].push(pb.AgentRequest(request_id=rid, kind=pb.RUN_DIAGNOSTIC, diagnostic=name,
                                                 params=params, timeout_s=max(1.0, timeout_s - 2.0), rank=-1))
        try:
            await pending.wait(timeout_s)
        finally:
            self.forget_request(rid)
        now = self.clock()
        stored = 0
        with self.store.transaction():
            for node, ans in pending.node_answers.items():
                for uuid, key, digest in sdc_digests_of(ans.payload):
                    self.store.add_sdc_digest(node, uuid, key, digest, now)
                    stored += 1
        return {
            "diagnostic": name,
            "results": {n: a.payload for n, a in sorted(pending.node_answers.items())},
            "errors": {**pending.node_errors, **{n: "not connected" for n in sorted(wanted - targets)},
                       **{n: "no answer before the deadline" for n in sorted(pending.waiting)}},
            "sdc_digests_stored": stored,
            "fleet": self.fleet_doc(),
        }

    # -- query documents -------------------------------------------------------------------------

    def jobs_doc(self, job_id: str = "", include_finished: bool = True) -> dict[str, Any]:
        mono = self.mono()
        jobs = []
        for job in self.jobs.jobs.values():
            if job_id and job.job_id != job_id:
                continue
            if not include_finished and job.finished:
                continue
            summary = job.summary(mono)
            summary["step_time_quantiles"] = {str(q): v for q, v in job.step_quantiles().items()}
            summary["straggler_culprits"] = [self.culprit(job, r) for r in sorted(job.stragglers)]
            summary["verdicts"] = self.store.verdicts(job.job_id, limit=5)
            # ranks on nodes whose agent replays a recording: their GPU health is not a real GPU's
            summary["simulated_nodes"] = [n for n in summary["nodes"]
                                          if (view := self.nodes.get(n)) is not None and view.simulated]
            jobs.append(summary)
        return {"jobs": jobs, "generated_at": self.clock()}

    def _owns(self, node: str, gpu_uuid: str) -> bool:
        if not gpu_uuid.startswith(("GPU-", "MIG-")):
            return True  # a node-local pseudo device (a CPU run of the check): names no real GPU
        view = self.nodes.get(node)
        return view is not None and view.gpu(uuid=gpu_uuid) is not None

    def fleet_doc(self) -> dict[str, Any]:
        nodes = list(self.nodes.values())
        votes = [SdcVote(gpu, node, key, digest) for node, gpu, key, digest, _ in self.store.sdc_digests()]
        for n in nodes:
            votes += sdc_votes_from_findings(n)
        # A node votes only for GPUs it registered, under UUIDs no other node claims: otherwise one node
        # could outvote (and get drained) healthy GPUs elsewhere by reporting digests under their UUIDs.
        # One vote per node, GPU and key; sdc_votes then gives each node one vote across nodes.
        conflicts = uuid_conflicts({n.name: [str(g.get("uuid", "")) for g in n.gpus if g.get("uuid")]
                                    for n in nodes})
        disputed = {f.entity.id for f in conflicts}
        unique = {(v.node, v.gpu_uuid, v.key): v for v in votes
                  if self._owns(v.node, v.gpu_uuid) and v.gpu_uuid not in disputed}
        return {
            "nodes": [{
                "name": n.name, "connected": n.connected, "health": n.health, "last_seen": n.last_seen,
                "versions": n.versions, "gpus": len(n.gpus), "findings": len(n.findings),
                "simulated": n.simulated, "backend": n.backend,
            } for n in sorted(nodes, key=lambda n: n.name)],
            "simulated_nodes": sum(1 for n in nodes if n.simulated),
            "version_drift": [f.to_dict() for f in version_drift(nodes)],
            "sdc": [f.to_dict() for f in sdc_votes(unique.values())],
            "identity": [f.to_dict() for f in conflicts],
            "sdc_digests": {"votes": len(unique), "keys": len({v.key for v in unique.values()})},
            "unhealthy_gpus": unhealthy_gpus(nodes),
            "fabric": fabric_findings(nodes),
            "screening": self.screening_doc(),
            "generated_at": self.clock(),
        }

    def metrics_snapshot(self) -> dict[str, Any]:
        """Plain data for the /metrics thread (never iterates live structures from another thread)."""
        mono = self.mono()
        jobs = []
        for job in list(self.jobs.jobs.values()):
            scores = job.detector.scores() if job.detector is not None else {}
            top = sorted(scores.items(), key=lambda kv: -kv[1])[:16]  # bounded cardinality
            jobs.append({
                "job_id": job.job_id, "quantiles": job.step_quantiles(), "scores": top,
                "step_count": len(job.step_samples), "step_sum": sum(job.step_samples),
                "stragglers": len(job.stragglers), "hangs": job.hangs, "records": job.records,
                "slowdown_ratio": float(job.slowdown.evidence.get("ratio_to_history") or 1.0)
                if job.slowdown is not None else 1.0,
                "comm_slow_ratio": float(job.comm_verdict.get("ratio") or 1.0) if job.comm_verdict is not None
                else 1.0,
                "nodes_cut_off": len(job.cut_off),
                "stalled_s": mono - job.progress_at if job.progress_at else 0.0,
            })
        c = self.counters
        now = self.clock()
        cov = coverage(self._counted_gpus(now), self.book, now, self.settings.screen_window_s)
        return {
            "screen_coverage_ratio": cov.ratio, "screen_oldest_age_s": cov.oldest_age_s,
            "gpus_unscreened": cov.unscreened, "gpus_known": cov.gpus, "screen_turns": len(self.rotation.active),
            "screens": {(level, result): c.screens.get((level, result), 0) for level in LEVELS for result in RESULTS},
            "foreign_screens": c.foreign_screens, "foreign_digests": c.foreign_digests,
            "jobs": jobs, "connected": sum(1 for s in self.by_node.values() if s.connected),
            "nodes": len(self.nodes), "records": c.records, "step_records": c.step_records,
            "duplicates": c.duplicates, "rejected": c.rejected, "hangs": c.hangs, "verdicts": dict(c.verdicts),
            "triage": dict(c.triage),
        }


# The diagnostics an agent can run (``diag/ondemand.DIAGNOSTICS``: the coordinator may not import
# ``diag``; a test keeps the two equal) and the one parameter a request passes on, in the form the
# agent accepts (``cpu``, ``cuda``, ``cuda:N[,cuda:M]``).
KNOWN_DIAGNOSTICS = ("sdc", "busbw", "bandwidth")
REPORTED_HANG_GRACE_S = 60.0  # a node's hang report ends this long after its findings stopped saying so
# What an agent reports of a running job's silent mismatch (agent/zerocode/watcher.py): periodic dumps, NCCL RAS.
MISMATCH_CODES = frozenset({"collective.type_mismatch", "collective.size_mismatch", "collective.dtype_mismatch",
                            "collective.launch_mismatch"})
MAX_REPORTED_RANK = 1 << 20  # a straggler rank an agent reports beyond this is not a rank
MAX_DIGESTS_PER_RECORD = 4096  # a node's GPUs × golden keys; a record over it is refused in one line
_DEVICE = re.compile(r"cpu|cuda(:\d{1,4}(,cuda:\d{1,4}){0,63})?")


def check_diagnostic(name: str, params: dict[str, str]) -> None:
    """``WireError`` unless ``name`` is a known diagnostic and ``params`` only a valid ``device``."""
    if name not in KNOWN_DIAGNOSTICS:
        raise WireError(f"diagnostic: unknown {name[:64]!r} (known: {', '.join(KNOWN_DIAGNOSTICS)})")
    unknown = sorted(set(params) - {"device"})
    if unknown:
        raise WireError(f"diagnostic {name}: unknown parameter(s) {[k[:40] for k in unknown[:5]]} (known: device)")
    device = params.get("device")
    if device is not None and not _DEVICE.fullmatch(device):
        raise WireError(f"diagnostic {name}: bad device {device[:64]!r} (cpu, cuda or cuda:N[,cuda:M])")


def json_reply(doc: dict[str, Any]) -> pb.JsonReply:
    return pb.JsonReply(json=json.dumps(doc, default=str, sort_keys=True))


def evidence_root(settings: CoordinatorConfig) -> Path:
    return Path(settings.resolved_evidence_dir())


def _stuck_job(f: Finding) -> str | None:
    """The job of an agent's own hang report: a critical ``rank.stuck`` (the stuck rank runs on that node)."""
    job_id = f.evidence.get("job_id")
    if f.code == "rank.stuck" and f.severity is Severity.CRITICAL and isinstance(job_id, str) and job_id:
        return job_id
    return None


def _number(value: Any) -> float:
    """A finite, non-negative number an agent sent in a finding's evidence; 0 for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)
