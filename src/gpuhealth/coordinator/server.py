"""The gRPC edge and the process around it: the servicer (parse, authorise, call, reply), gRPC
health checking and reflection, the ``/metrics`` HTTP port, and ``CoordinatorServer`` which starts
and stops all of it on the current event loop.

Handlers receive raw bytes (no deserializer registered) so that a message that is not valid
protobuf is answered with ``INVALID_ARGUMENT`` naming what was wrong, instead of a bare
``INTERNAL``.

A caller's cost is bounded before the coordinator knows who it is: every unary method is served as
a client-streaming one (the wire is the same), so the caller is authenticated from its metadata
BEFORE gRPC reads the request body. An unauthenticated caller's body is never read (HTTP/2 flow
control holds it at the sender); an authenticated one's is refused above the method's own limit
(``UNARY_LIMITS``), and at most ``MAX_UNARY_BODIES`` bodies are read at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpuhealth.config import split_address
from gpuhealth.coordinator.metrics import CoordinatorCollector, make_registry, start_metrics_server
from gpuhealth.coordinator.security import AuthPolicy, Caller, is_loopback_address, peer_names
from gpuhealth.coordinator.service import Coordinator, StreamRejected, json_reply
from gpuhealth.coordinator.token_review import TokenReviewError
from gpuhealth.coordinator.triage_wire import reply_to_dict
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import WireError
from gpuhealth.proto.options import server_options
from gpuhealth.runtime.tls import TlsFiles, server_credentials
from gpuhealth.runtime.webconfig import WebGuard

log = logging.getLogger("gpuhealth.coordinator")
FLEET_METRICS_INTERVAL_S = 5.0  # the fleet findings on /metrics are at most this old
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
M = TypeVar("M", bound=Message)

# The largest body each unary method needs (a Register carries the node's GPUs and versions; the
# queries a job id or a list of node names). The stream (Connect) keeps the channel's limit: dumps.
UNARY_LIMITS = {
    "Register": 1 << 20, "ListJobs": 64 << 10, "GetFleet": 64 << 10, "LiveTriage": 64 << 10,
    "Triage": 64 << 10, "RunDiagnostic": 1 << 20,
}
MAX_UNARY_BODIES = 16  # unary request bodies read at once (each within its method's limit)
_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("gpuhealth_caller", default=None)


async def _parse(raw: bytes, cls: type[M], context: grpc.aio.ServicerContext) -> M:
    try:
        return cls.FromString(raw)
    except (DecodeError, RuntimeError, ValueError) as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a valid {cls.__name__}: {exc}")
        raise  # unreachable: abort raises


class CoordinatorServicer:
    def __init__(self, coord: Coordinator, policy: AuthPolicy) -> None:
        self.coord = coord
        self.policy = policy

    async def _authorise(self, context: grpc.aio.ServicerContext) -> Caller:
        known = _CALLER.get()  # authenticated already, before the body was read (``_body_after_auth``)
        if known is not None:
            return known
        try:
            caller = await self.policy.authenticate(context.invocation_metadata(), context.auth_context(),
                                                    context.peer())
        except TokenReviewError as exc:
            log.warning("cannot check a ServiceAccount token: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the coordinator cannot check this token now (the "
                                "Kubernetes API server did not answer); try again")
            raise
        if caller is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            raise AssertionError("unreachable: abort raises")
        return caller

    async def _authorise_operator(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        caller = await self._authorise(context)
        if not caller.operator:
            how = ("present the operator token, or a client certificate named in operator_names"
                   if self.policy.operators_configured else
                   "none is configured: start the coordinator with --operator-token or --operator-names")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{rpc} acts on nodes and needs operator credentials ({how}); "
                                "agent credentials only report and read")

    async def _check_node(self, context: grpc.aio.ServicerContext, caller: Caller, node: str, rpc: str) -> None:
        """Aborts (and logs) unless ``caller``'s credential may report as ``node``."""
        names = sorted(peer_names(context.auth_context()))
        if not self.policy.node_allowed(context.auth_context(), node):
            log.warning("refused %s for node %r from a certificate for %s", rpc, node, names)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"certificate names {names}, not node {node!r}")
        if not caller.may_be(node):
            what = "operator credentials do not report as a node" if not caller.reports else \
                f"this {caller.kind.replace('_', ' ')} is node {caller.node!r}'s, not node {node!r}'s"
            log.warning("refused %s for node %r: %s (credential %s, peer %s)", rpc, node, what, caller.credential,
                        context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, what)

    async def register(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        caller = await self._authorise(context)
        req = await _parse(raw, pb.RegisterRequest, context)
        await self._check_node(context, caller, req.node_name, "Register")
        try:
            return self.coord.register(req, credential=caller.credential)
        except StreamRejected as exc:
            await context.abort(exc.code, exc.details)
            raise
        except WireError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise

    async def connect(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        caller = await self._authorise(context)
        try:
            session = self.coord.session_for(context.invocation_metadata())
        except StreamRejected as exc:
            await context.abort(exc.code, exc.details)
            return
        await self._check_node(context, caller, session.node, "Connect")
        if caller.credential != session.credential:  # a session id used under another credential
            log.warning("node %s: refused a stream under credential %s on a session registered under %s (peer %s)",
                        session.node, caller.credential, session.credential, context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this session was registered under another "
                                "credential")
        if session.connected:  # one stream per session: two would split its requests and acks
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "this session already has a stream: register again")
        self.coord.stream_opened(session)
        written_ack = -1

        async def writer() -> None:
            nonlocal written_ack
            async for out in self.coord.outgoing(session):
                await context.write(out)
                if out.HasField("ack"):
                    written_ack = out.ack.up_to_seq

        replaced_marker = StreamRejected(grpc.StatusCode.ABORTED, "this stream's session ended (a newer Register "
                                         "of the node, or the coordinator is stopping): register again")

        async def reader() -> StreamRejected | None:
            async for raw in requests:
                if session.closed:
                    return replaced_marker
                try:
                    msg = pb.AgentMessage.FromString(raw)
                except (DecodeError, RuntimeError, ValueError) as exc:
                    return StreamRejected(grpc.StatusCode.INVALID_ARGUMENT, f"not a valid AgentMessage: {exc}")
                body = msg.WhichOneof("body")
                try:
                    if body == "record":
                        self.coord.handle_record(session, raw, msg.record)
                    elif body == "health":
                        self.coord.handle_health(session, msg.health)
                    elif body == "result":
                        self.coord.handle_result(session, msg.result)
                    else:
                        return StreamRejected(grpc.StatusCode.INVALID_ARGUMENT, "empty AgentMessage")
                except StreamRejected as exc:
                    return exc
                except WireError as exc:
                    return StreamRejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return None  # the agent half-closed

        read_task = asyncio.create_task(reader())
        write_task = asyncio.create_task(writer())
        rejected: StreamRejected | None = None
        replaced = False
        try:
            await asyncio.wait({read_task, write_task}, return_when=asyncio.FIRST_COMPLETED)
            if read_task.done():
                rejected = read_task.result()
                # Flush the last ack (also that of a rejected seq) before the call ends.
                session.wake.set()
                for _ in range(100):
                    if written_ack >= session.acked or write_task.done():
                        break
                    await asyncio.sleep(0.01)
            else:
                replaced = not read_task.done()  # the session was replaced or the coordinator stops
        finally:
            self.coord.stream_closed(session)
            for task in (read_task, write_task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if rejected is not None:
            log.warning("node %s: stream rejected: %s", session.node, rejected.details)
            await context.abort(rejected.code, rejected.details)
        elif replaced:
            await context.abort(grpc.StatusCode.ABORTED, "this stream's session ended (a newer Register of the "
                                "node, or the coordinator is stopping): register again")

    async def list_jobs(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.JsonReply:
        await self._authorise(context)
        req = await _parse(raw, pb.ListJobsRequest, context)
        return json_reply(self.coord.jobs_doc(req.job_id, req.include_finished or not req.job_id))

    async def get_fleet(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.JsonReply:
        await self._authorise(context)
        await _parse(raw, pb.FleetRequest, context)
        return json_reply(self.coord.fleet_doc())

    async def live_triage(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.JsonReply:
        """The JSON form of :meth:`triage` (kept for older clients)."""
        return json_reply(reply_to_dict(await self._triage(raw, context, "LiveTriage")))

    async def triage(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.TriageReply:
        return await self._triage(raw, context, "Triage")

    async def _triage(self, raw: bytes, context: grpc.aio.ServicerContext, method: str) -> pb.TriageReply:
        await self._authorise_operator(context, method)
        req = await _parse(raw, pb.LiveTriageRequest, context)
        remaining = context.time_remaining()
        budget = req.timeout_s or 30.0
        if remaining is not None:
            budget = min(budget, max(0.5, remaining - 1.0))  # answer before the caller's deadline
        try:
            return await self.coord.live_triage(req.job_id, budget)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {req.job_id!r} is known to this coordinator")
            raise

    async def run_diagnostic(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.JsonReply:
        await self._authorise_operator(context, "RunDiagnostic")
        req = await _parse(raw, pb.RunDiagnosticRequest, context)
        remaining = context.time_remaining()
        budget = req.timeout_s or 300.0
        if remaining is not None:
            budget = min(budget, max(0.5, remaining - 1.0))
        try:
            doc = await self.coord.run_diagnostic(list(req.nodes), req.diagnostic, dict(req.params), budget)
        except WireError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        return json_reply(doc)

    def _body_after_auth(self, method: str, handler: Callable[[bytes, grpc.aio.ServicerContext], Any]
                         ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Any]:
        """A unary method served as client-streaming: authenticate from the metadata, and only then read
        the one request message, within the method's limit."""
        limit = UNARY_LIMITS[method]

        async def serve(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            token = _CALLER.set(await self._authorise(context))
            try:
                async with self._bodies:
                    raw = None
                    async for message in requests:
                        raw = message
                        break
                if raw is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: no request message")
                    raise AssertionError("unreachable: abort raises")
                if len(raw) > limit:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"{method}: a request of {len(raw)} bytes is over this method's {limit}")
                return await handler(raw, context)
            finally:
                _CALLER.reset(token)

        return serve

    def generic_handler(self) -> grpc.GenericRpcHandler:
        ser: Callable[[Any], bytes] = lambda m: m.SerializeToString()  # noqa: E731
        self._bodies = asyncio.Semaphore(MAX_UNARY_BODIES)
        unary = {"Register": self.register, "ListJobs": self.list_jobs, "GetFleet": self.get_fleet,
                 "LiveTriage": self.live_triage, "Triage": self.triage, "RunDiagnostic": self.run_diagnostic}
        handlers = {name: grpc.stream_unary_rpc_method_handler(self._body_after_auth(name, fn), response_serializer=ser)
                    for name, fn in unary.items()}
        handlers["Connect"] = grpc.stream_stream_rpc_method_handler(self.connect, response_serializer=ser)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


@dataclass(slots=True)
class Endpoints:
    grpc_port: int
    metrics_port: int | None


class CoordinatorServer:
    """gRPC server + health + reflection + metrics around one ``Coordinator``."""

    def __init__(self, coord: Coordinator, *, listen: str, metrics_listen: str | None,
                 policy: AuthPolicy, tls: TlsFiles | None = None, metrics_interval_s: float = 1.0,
                 metrics_web: WebGuard | None = None) -> None:
        self.coord = coord
        self.metrics_web = metrics_web  # TLS / basic auth of /metrics (web config)
        self.listen = listen
        self.metrics_listen = metrics_listen
        self.policy = policy
        self.tls = tls
        self.metrics_interval_s = metrics_interval_s
        self.collector = CoordinatorCollector()
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self._metrics_http: Any = None
        self._metrics_task: asyncio.Task[None] | None = None
        self.endpoints: Endpoints | None = None

    async def start(self) -> Endpoints:
        server = grpc.aio.server(options=server_options())
        server.add_generic_rpc_handlers((CoordinatorServicer(self.coord, self.policy).generic_handler(),))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        if self.tls is not None:
            port = server.add_secure_port(self.listen, server_credentials(self.tls))
        else:
            port = server.add_insecure_port(self.listen)
        if port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        await self.coord.start()  # its startup retention runs before the first record is served
        await server.start()
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        metrics_port = None
        if self.metrics_listen:
            host, mport = split_address(self.metrics_listen) or ("", 0)
            self.collector.update(self.coord.metrics_snapshot())
            self._metrics_http, _thread = start_metrics_server(mport, addr=host or "0.0.0.0",
                                                               registry=make_registry(self.collector),
                                                               guard=self.metrics_web)
            metrics_port = int(self._metrics_http.server_port)
            self._metrics_task = asyncio.create_task(self._refresh_metrics())
        self.endpoints = Endpoints(port, metrics_port)
        if self.policy.open and is_loopback_address(self.listen):
            log.warning("coordinator is running WITHOUT authentication on %s: only this host can reach it", self.listen)
        elif self.policy.open:
            log.warning("coordinator is running WITHOUT authentication on %s (coordinator.allow_unauthenticated): "
                        "anyone who can reach it can report as any node; only callers on this host may act on nodes",
                        self.listen)
        if self.policy.token:
            log.warning("agents share one token (coordinator.shared_token): any holder can report as any node; give "
                        "each node its own token (coordinator.node_secret_file and `gpuhealth token`)")
        if self.policy.operator_names and not self.policy.mtls:
            log.warning("--operator-names has no effect without mutual TLS (names come from client certificates)")
        if not self.policy.open and not self.policy.operators_configured:
            log.warning("no operator credentials configured (--operator-token / --operator-names): live triage "
                        "and remote diagnostics are refused; automatic hang investigations still run")
        log.info("coordinator serving gRPC on port %d, %s", port,
                 f"metrics on port {metrics_port}" if metrics_port is not None else "metrics off")
        return self.endpoints

    async def _refresh_metrics(self) -> None:
        fleet: list[dict[str, Any]] = []
        fabric: dict[tuple[str, str], int] = {}
        fleet_at = -FLEET_METRICS_INTERVAL_S
        while True:
            with contextlib.suppress(Exception):
                snapshot = self.coord.metrics_snapshot()
                # The fleet's cross-node judgement (the SDC vote, version drift) costs a store read: less often.
                if time.monotonic() - fleet_at >= FLEET_METRICS_INTERVAL_S:
                    where = {str(g.get("uuid")): (n.name, g.get("index"))
                             for n in list(self.coord.nodes.values()) for g in n.gpus if g.get("uuid")}
                    doc = self.coord.fleet_doc()
                    fleet, fleet_at = fleet_findings(doc, where), time.monotonic()
                    fabric = fabric_counts(doc)
                snapshot["fleet_findings"] = fleet
                snapshot["fabric_findings"] = fabric
                self.collector.update(snapshot)
            await asyncio.sleep(self.metrics_interval_s)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._health is not None:
            with contextlib.suppress(Exception):
                await self._health.enter_graceful_shutdown()
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        await self.coord.stop()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def fleet_findings(doc: dict[str, Any], gpus: dict[str, tuple[str, Any]]) -> list[dict[str, Any]]:
    """The findings of the fleet view (``sdc``: the cross-node vote; ``version_drift``) as the rows of
    ``gpuhealth_fleet_findings``: code, severity, action, entity, and the node and GPU (index, UUID) it
    is about (``gpus``: UUID → (node, index), from the registrations)."""
    rows = []
    for f in [*doc.get("sdc", []), *doc.get("version_drift", [])]:
        entity = f.get("entity") or {}
        kind, ident = str(entity.get("kind", "")), str(entity.get("id", ""))
        uuid = ident if kind == "gpu" else ""
        node, index = gpus.get(uuid, ("", entity.get("gpu_index")))
        node = (f.get("evidence") or {}).get("node") or node or (ident if kind == "node" else "")
        rows.append({"code": f.get("code", ""), "severity": f.get("severity", ""), "action": f.get("action", ""),
                     "node": str(node), "gpu": "" if index is None else str(index), "uuid": uuid,
                     "entity": f"{kind}:{ident}"})
    return rows


def fabric_counts(doc: dict[str, Any]) -> dict[tuple[str, str], int]:
    """(node, code) → how many ``netprobe.*`` findings the node's agent reports (``gpuhealth_fleet_netprobe_findings``:
    one series per node and code, however many links a probe named)."""
    counts: dict[tuple[str, str], int] = {}
    for row in doc.get("fabric", []):
        key = (str(row.get("node", "")), str(row.get("code", "")))
        counts[key] = counts.get(key, 0) + 1
    return counts


def write_ready_file(path: str, endpoints: Endpoints) -> None:
    """For supervisors and tests that start the coordinator on port 0."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps({"grpc_port": endpoints.grpc_port, "metrics_port": endpoints.metrics_port}))
    tmp.replace(path)
