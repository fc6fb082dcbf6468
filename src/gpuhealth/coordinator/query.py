"""Client side of the coordinator's query API (the CLI's ``jobs``, ``fleet`` and
``triage --job``). Every call carries a deadline; errors become ``CoordinatorQueryError`` with a
message a person can act on."""

from __future__ import annotations

import json
from typing import Any

import grpc

from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.options import UNARY_DEADLINE_S, client_options
from gpuhealth.runtime.tls import TlsFiles, channel_credentials, token_metadata

SERVICE = "/gpuhealth.v1.Coordinator/"


class CoordinatorQueryError(RuntimeError):
    """The coordinator could not be reached or refused the query."""


def _rpc(address: str, method: str, request: Any, reply_type: Any, *, token: str | None, tls: TlsFiles | None,
         timeout_s: float) -> Any:
    creds = channel_credentials(tls) if tls is not None else None
    channel = (grpc.secure_channel(address, creds, options=client_options()) if creds is not None
               else grpc.insecure_channel(address, options=client_options()))
    try:
        stub = channel.unary_unary(SERVICE + method, request_serializer=type(request).SerializeToString,
                                   response_deserializer=reply_type.FromString)
        return stub(request, timeout=timeout_s, metadata=token_metadata(token))
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        raise CoordinatorQueryError(f"coordinator {address}: {code}: {details}") from exc
    finally:
        channel.close()


def _call(address: str, method: str, request: Any, *, token: str | None, tls: TlsFiles | None,
          timeout_s: float) -> dict[str, Any]:
    reply = _rpc(address, method, request, pb.JsonReply, token=token, tls=tls, timeout_s=timeout_s)
    try:
        doc = json.loads(reply.json)
    except ValueError as exc:
        raise CoordinatorQueryError(f"coordinator {address}: reply is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise CoordinatorQueryError(f"coordinator {address}: reply is not a JSON object")
    return doc


def list_jobs(address: str, job_id: str = "", *, token: str | None = None, tls: TlsFiles | None = None,
              timeout_s: float = UNARY_DEADLINE_S) -> dict[str, Any]:
    return _call(address, "ListJobs", pb.ListJobsRequest(job_id=job_id, include_finished=True), token=token,
                 tls=tls, timeout_s=timeout_s)


def fleet(address: str, *, token: str | None = None, tls: TlsFiles | None = None,
          timeout_s: float = UNARY_DEADLINE_S) -> dict[str, Any]:
    return _call(address, "GetFleet", pb.FleetRequest(), token=token, tls=tls, timeout_s=timeout_s)


def live_triage(address: str, job_id: str, token: str | None = None, *, tls: TlsFiles | None = None,
                timeout_s: float = 60.0) -> pb.TriageReply:
    """Collect flight-recorder dumps and stacks from every rank of a running job now, and triage them:
    the analyser's typed report plus ``culprit_details`` (rank → node/GPU and that GPU's findings),
    stacks and the evidence folder (``triage_wire.reply_to_dict`` gives the ``triage --json`` shape)."""
    # The coordinator gets a little less than our deadline so its partial answer arrives in time.
    request = pb.LiveTriageRequest(job_id=job_id, timeout_s=max(1.0, timeout_s - 5.0))
    reply: pb.TriageReply = _rpc(address, "Triage", request, pb.TriageReply, token=token, tls=tls,
                                 timeout_s=timeout_s)
    return reply


def run_diagnostic(address: str, diagnostic: str, *, nodes: tuple[str, ...] = (), device: str | None = None,
                   token: str | None = None, tls: TlsFiles | None = None, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run ``gpuhealth diag DIAGNOSTIC --json`` on agents (all connected ones by default) through the
    coordinator; SDC digests are stored and voted. Returns per-node results and the fleet view."""
    params = {"device": device} if device else {}
    request = pb.RunDiagnosticRequest(nodes=list(nodes), diagnostic=diagnostic, params=params,
                                      timeout_s=max(1.0, timeout_s - 5.0))
    return _call(address, "RunDiagnostic", request, token=token, tls=tls, timeout_s=timeout_s)
