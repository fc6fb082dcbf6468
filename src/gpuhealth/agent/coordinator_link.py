"""The agent's link to the coordinator (an agent extension): the stream plus the request executors.

- ``coordinator_stream.CoordinatorStream``: the spool and the one gRPC stream (records up, acks and
  requests down, heartbeats, reconnects).
- ``coordinator_requests.RequestExecutor``: what the coordinator's requests do here (flight-recorder
  dumps and stacks through the rank hub, diagnostics through ``DiagRunner``).

This module only wires them to the agent (``view.AgentView``) and the rank hub it is handed — the
rank identities and step records the hub hears go up the stream, the agent's findings too — and
says what a registration and a heartbeat contain. ``start`` returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpuhealth import __version__
from gpuhealth.agent.coordinator_requests import ExecutorSettings, RankSource, RequestExecutor
from gpuhealth.agent.coordinator_stream import CoordinatorStream, StreamSettings
from gpuhealth.agent.spool import Spool, SpoolError, SpoolStats
from gpuhealth.agent.view import AgentView
from gpuhealth.model import EntityKind, MetricKind, RankIdentity, Sample, StepRecord, health_of
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.options import API_VERSION
from gpuhealth.runtime.credentials import CredentialError, read_token
from gpuhealth.runtime.tls import TlsFiles

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuhealth.config import Config
    from gpuhealth.diag.screen import ScreenResult

log = logging.getLogger("gpuhealth.agent.coordinator")


class RankHubLike(RankSource, Protocol):
    """The rank hub as the link uses it: requests (``RankSource``) and what ranks send."""

    def add_listener(self, on_identity: Callable[[RankIdentity], None] | None = None,
                     on_steps: Callable[[RankIdentity | None, Sequence[StepRecord]], None] | None = None,
                     ) -> None: ...


@dataclass(slots=True)
class LinkSettings:
    address: str
    spool_path: str
    # The bearer token: from ``token_file`` at every connect, else derived from ``node_secret_file``, else ``token``.
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
    pyspy: bool = True
    pyspy_path: str | None = None
    work_dir: str | None = None  # where requested FR dumps are written (default: a temp dir)
    wait_ready_s: float = 15.0  # wait this long for the agent's first sweep before registering


class CoordinatorLink:
    """``rank_hub``: where dumps and stacks come from and step records arrive (None: this agent has
    no rank socket; such requests are answered with that reason)."""

    name = "coordinator_link"

    def __init__(self, settings: LinkSettings, *, rank_hub: RankHubLike | None = None) -> None:
        self.settings = settings
        self.hub = rank_hub
        self.agent: AgentView | None = None
        self.spool = Spool(settings.spool_path)
        self.requests = RequestExecutor(
            ExecutorSettings(work_dir=settings.work_dir, pyspy=settings.pyspy, pyspy_path=settings.pyspy_path),
            ranks=rank_hub, config=lambda: self.agent.config if self.agent is not None else None)
        self.stream = CoordinatorStream(
            StreamSettings(address=settings.address, token=settings.token, token_file=settings.token_file,
                           node_secret_file=settings.node_secret_file, tls=settings.tls,
                           batch_interval_s=settings.batch_interval_s, spool_commit_s=settings.spool_commit_s,
                           heartbeat_s=settings.heartbeat_s,
                           backoff_initial_s=settings.backoff_initial_s, backoff_max_s=settings.backoff_max_s,
                           max_inflight=settings.max_inflight),
            self.spool, register=self.register_request, heartbeat=self.health_summary,
            on_request=self.requests.submit, ready=self._agent_ready, wait_ready_s=settings.wait_ready_s,
            on_screen_turn=self._on_screen_turn)
        self._turn_listeners: list[Callable[[float, float], None]] = []

    # -- extension protocol ----------------------------------------------------------------------

    def start(self, agent: AgentView | None) -> None:
        """``agent`` None: a link without an agent (tests, tools) — records only from the hub."""
        self.agent = agent
        if self.hub is not None:
            self.hub.add_listener(on_identity=self.stream.on_identity, on_steps=self.stream.on_steps)
        if agent is not None:
            agent.add_findings_listener(self.stream.on_findings)
            self.stream.on_findings(agent.current_findings())  # the listener only fires on changes
        self.stream.start()

    def stop(self) -> None:
        self.stream.stop()
        self.requests.close()

    # -- what the coordinator hears from this node -----------------------------------------------

    @property
    def connected(self) -> threading.Event:
        return self.stream.connected

    @property
    def stats(self) -> dict[str, int]:
        return self.stream.stats

    def on_steps(self, identity: RankIdentity | None, records: Sequence[StepRecord]) -> None:
        self.stream.on_steps(identity, records)

    def buffered(self) -> int:
        return self.stream.buffered()

    def on_screens(self, results: Sequence[ScreenResult]) -> None:
        """Screen results (one per GPU screened) go up as one ``screens`` record."""
        self.stream.on_screens(results)

    def add_turn_listener(self, callback: Callable[[float, float], None]) -> None:
        """``callback(not_before, valid_for_s)`` for every ScreenTurn the coordinator sends (screening)."""
        self._turn_listeners.append(callback)

    def _on_screen_turn(self, not_before: float, valid_for_s: float) -> None:
        for cb in list(self._turn_listeners):
            cb(not_before, valid_for_s)

    def register_request(self, incarnation: str | None = None) -> pb.RegisterRequest:
        return build_register_request(self.agent, incarnation if incarnation is not None else self.spool.incarnation)

    def health_summary(self, spool: SpoolStats | None = None) -> pb.HealthSummary:
        """The heartbeat: node and GPU health, spool depth, and which ranks are alive here."""
        st = spool or self.spool.stats()
        msg = pb.HealthSummary(at=time.time(), spool_depth=st.depth, spool_dropped=st.dropped, health="unknown")
        agent = self.agent
        if agent is not None:
            try:
                findings = list(agent.current_findings())
                msg.health = str(health_of(findings))
                for g in agent.gpus:
                    # the GPU's own findings and its links' (a PCIe link at x8 is that GPU's problem)
                    fs = [f for f in findings if (f.entity.kind is EntityKind.GPU and f.entity.id == g.uuid)
                          or (f.entity.kind is EntityKind.LINK and f.entity.id.startswith(g.uuid + "/"))]
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

    def samples(self) -> list[Sample]:
        """For the agent's /metrics: is the coordinator reachable, and what waits in the spool."""
        sp = self.spool.stats()
        return [
            Sample("agent_coordinator_connected", 1.0 if self.stream.connected.is_set() else 0.0,
                   "1 while the agent's stream to the coordinator is up"),
            Sample("agent_coordinator_spool_records", float(sp.depth),
                   "Records waiting in the agent's disk spool for the coordinator's acknowledgement"),
            Sample("agent_coordinator_spool_dropped_records", float(sp.dropped),
                   "Spooled records dropped because the spool was full (coordinator away too long)",
                   MetricKind.COUNTER),
            Sample("agent_coordinator_connects", float(self.stream.stats["connects"]),
                   "Streams opened to the coordinator (reconnects included)", MetricKind.COUNTER),
        ]

    def _agent_ready(self) -> bool:
        return self.agent is None or bool(self.agent.gpus)


def _dist_version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return ""


def build_register_request(agent: AgentView | None, incarnation: str) -> pb.RegisterRequest:
    """Node identity, GPU inventory and software versions (torch/NCCL from package metadata: the
    agent never imports torch; driver and VBIOS from the agent's own report)."""
    node = (agent.node_name if agent is not None else "") or os.uname().nodename
    req = pb.RegisterRequest(node_name=node, incarnation=incarnation, agent_version=__version__,
                             api_version=API_VERSION)
    versions = {"torch": _dist_version("torch"),
                "nccl": _dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"),
                "kernel": os.uname().release, "gpuhealth": __version__}
    if agent is not None:
        # a replayed recording: every view of the node says SIMULATED
        req.simulated = bool(getattr(agent, "simulated", False))
        per_gpu: dict[str, Any] = {}
        try:
            node_info = agent.node_report().get("node", {})
            req.backend = str(node_info.get("backend") or "")[:200]
            versions["driver"] = str(node_info.get("driver_version") or "")
            versions["cuda_driver"] = str(node_info.get("cuda_driver_version") or "")
            per_gpu = dict((node_info.get("versions") or {}).get("gpus") or {})
        except Exception:
            log.debug("no node report for registration", exc_info=True)
        for g in agent.gpus:
            vbios = str((per_gpu.get(str(g.index)) or {}).get("vbios") or "")
            req.gpus.append(pb.GpuInfo(index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, name=g.name,
                                       vbios=vbios))
    for k, v in versions.items():
        if v:
            req.versions[k] = v
    return req


def link_from_config(config: Config, *, rank_hub: RankHubLike | None = None) -> CoordinatorLink | None:
    """The link an agent config asks for (``agent.coordinator`` set), else None — every agent-side key of
    the ``coordinator`` section reaches it here. The spool lives in ``agent.state_dir``; the bearer token is
    ``coordinator.token_file`` (read at every connect), else derived from ``coordinator.node_secret_file``,
    else ``coordinator.token``; mTLS uses ``coordinator.client_tls_cert/key`` with ``coordinator.tls_ca``."""
    address = config.agent.coordinator
    if not address:
        return None
    c = config.coordinator
    if c.operator_token:
        log.warning("coordinator.operator_token is set in this agent's config: anyone who can read it on this "
                    "node can make every other node's ranks dump and run GPU work; keep it off the nodes")
    tls = None
    if c.client_tls_cert or c.client_tls_key:
        from gpuhealth.runtime.tls import SecurityConfigError, tls_files

        try:
            tls = tls_files(c.client_tls_cert, c.client_tls_key, c.tls_ca)
        except SecurityConfigError as exc:
            log.error("coordinator link not started: coordinator.client_tls_cert/client_tls_key/tls_ca: %s", exc)
            return None
    if c.token_file:
        try:
            read_token(c.token_file)
        except CredentialError as exc:  # said once now; the stream retries (a projected token may come later)
            log.error("coordinator.token_file: %s", exc)
    if c.node_secret_file and not c.token_file:
        log.warning("this agent derives its token from the cluster secret (coordinator.node_secret_file): whoever is "
                    "root here can mint every node's token; prefer a node token file (coordinator.token_file)")
    settings = LinkSettings(address=address, spool_path=str(Path(config.agent.state_dir) / "coordinator-spool.db"),
                            token=c.token, token_file=c.token_file, node_secret_file=c.node_secret_file, tls=tls,
                            # beside the rank socket: the one folder ranks (other containers, other users) share
                            work_dir=str(Path(config.agent.socket_path).parent / "fr"),
                            batch_interval_s=c.link_batch_interval_s, spool_commit_s=c.spool_commit_s,
                            max_inflight=c.max_inflight)
    try:
        link = CoordinatorLink(settings, rank_hub=rank_hub)
    except SpoolError as exc:  # the agent keeps monitoring the node without its coordinator link
        log.error("coordinator link not started: %s (set agent.state_dir to a writable folder)", exc)
        return None
    link.spool.max_records = c.spool_max_records
    return link


__all__ = ["CoordinatorLink", "LinkSettings", "build_register_request", "link_from_config"]
