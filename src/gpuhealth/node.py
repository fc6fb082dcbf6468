"""One sweep of every collector over one node, and the report users see (``gpuhealth status``).

``open_backend(snapshot)`` picks the GPU backend: a recording or scenario file → ``FakeNvml``
(simulated), else the live driver (``RealNvml``). ``collect_once(backend, config)`` enumerates the
GPUs, builds the collect context (sysfs, kernel log, thresholds), runs each collector through the
isolating ``CollectorRunner`` and returns a ``NodeReport`` whose ``to_dict()`` is the
``status --json`` document:

``{"node": {..., "environment": {...}}, "gpus": [{"index", "uuid", "name", "pci_bus_id", "health", "findings":
[...]}],
"findings": [...]}`` — ``gpus[].findings`` are the findings about that GPU (or its links);
top-level ``findings`` are those about the node as a whole.

The agent's ``/health`` is the same document from the same builder (``report_of_snapshot``): both carry
the driver and CUDA driver versions NVML reports and whether NVML is up; a running agent adds what only it
knows (``AgentFacts``: ready, its version) and per collector the counts over every run. Both are
golden-tested (``tests/golden/``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.environment import environment_for
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.kmsg import DEV_KMSG, DevKmsg, KmsgFile, KmsgLines, KmsgSource
from gpuhealth.backends.nvml_fake import BUNDLED_RECORDINGS, FakeNvml, bundled_recording_path
from gpuhealth.backends.nvml_real import RealNvml
from gpuhealth.backends.sysfs import sysfs_for
from gpuhealth.catalog.thresholds import load_thresholds
from gpuhealth.collectors.base import CollectContext, Collector, GpuIdentity, History
from gpuhealth.collectors.registry import all_collectors
from gpuhealth.collectors.runner import CollectorRun, CollectorRunner, CollectorStatus, enumerate_gpus
from gpuhealth.collectors.versions import versions_of
from gpuhealth.config import Config
from gpuhealth.exporters import ExportSnapshot
from gpuhealth.model import Action, EntityKind, Finding, Health, Severity, could_not_check, health_of, worst_action


def make_backend(snapshot: str | Path | None) -> NvmlBackend:
    """The backend, not yet initialised: ``snapshot`` (a recording/scenario path, or a bundled recording's
    name such as ``nvml_h200x2.json``) → simulated; None → the live driver. Raises ``RecordingError``."""
    if snapshot is not None:
        path = Path(snapshot)
        if not path.exists() and path.name == str(snapshot) and path.name in BUNDLED_RECORDINGS:
            path = bundled_recording_path(path.name)
        return FakeNvml.from_file(path)
    return RealNvml()


def open_backend(snapshot: str | Path | None) -> NvmlBackend:
    """``make_backend``, initialised. Raises ``RecordingError`` (bad file), ``BackendUnavailable`` (no
    driver/library) or ``NvmlError``."""
    backend = make_backend(snapshot)
    backend.init()
    return backend


def default_kmsg(backend: NvmlBackend, config: Config) -> KmsgSource | None:
    """The kernel log to read: the configured file, else a scenario's lines (simulated), else /dev/kmsg."""
    if config.collectors.kmsg_path:
        return KmsgFile(config.collectors.kmsg_path)
    if backend.simulated:
        lines = getattr(backend, "kmsg_lines", None)
        return KmsgLines(lines) if isinstance(lines, list) else None
    return DevKmsg(DEV_KMSG)


@dataclass(slots=True)
class GpuReport:
    identity: GpuIdentity
    findings: list[Finding] = field(default_factory=list)
    nvml_up: bool = True  # False: nothing current to judge the GPU by

    @property
    def health(self) -> Health:
        return health_of(self.findings) if self.nvml_up else Health.UNKNOWN

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.identity.index,
            "uuid": self.identity.uuid,
            "name": self.identity.name,
            "pci_bus_id": self.identity.pci_bus_id,
            "health": str(self.health),
            "action": str(worst_action(self.findings)),
            "findings": [f.to_dict() for f in _ordered(self.findings)],
        }


@dataclass(frozen=True, slots=True)
class AgentFacts:
    """What only a running agent knows; its report (``/health``) carries these in ``node``."""

    ready: bool
    agent_version: str


@dataclass(slots=True)
class NodeReport:
    node: str
    simulated: bool
    backend: str
    time: float
    gpus: list[GpuReport] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)  # node-level
    versions: dict[str, Any] = field(default_factory=dict)
    runs: list[CollectorRun] = field(default_factory=list)  # a one-shot sweep's runs (status, qualify)
    collectors: list[CollectorStatus] = field(default_factory=list)
    nvml_up: bool = True
    agent: AgentFacts | None = None
    environment: dict[str, Any] | None = None  # backends.environment.Environment.to_dict(): where it runs
    driver_version: str = ""  # NVML's system driver version ("" when it did not say)
    cuda_driver_version: str = ""  # the CUDA driver API version NVML reports, e.g. "13000"

    def all_findings(self) -> list[Finding]:
        return [*self.findings, *(f for g in self.gpus for f in g.findings)]

    @property
    def health(self) -> Health:
        """Worst of all findings; UNKNOWN when there is nothing to judge by (no GPU and no finding), and
        while NVML is down unless a critical finding already says unhealthy (a warning alone would call
        unchecked GPUs fit: ``nvml.unavailable``'s "could not check")."""
        findings = self.all_findings()
        if not findings and not self.gpus:
            return Health.UNKNOWN
        unchecked = not self.nvml_up or could_not_check(findings)  # a check asked for could not be made
        if unchecked and not any(f.severity is Severity.CRITICAL for f in findings):
            return Health.UNKNOWN
        return health_of(findings)

    @property
    def action(self) -> Action:
        return worst_action(self.all_findings())

    def to_dict(self) -> dict[str, Any]:
        node: dict[str, Any] = {
            "name": self.node,
            "health": str(self.health),
            "action": str(self.action),
            "simulated": self.simulated,
            "backend": self.backend,
            "time": self.time,
            "gpu_count": len(self.gpus),
            "environment": self.environment,
            "versions": self.versions,
            "collectors": [c.to_dict(totals=self.agent is not None) for c in self.collectors],
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "nvml_up": self.nvml_up,
        }
        if self.agent is not None:
            node.update(ready=self.agent.ready, agent_version=self.agent.agent_version)
        return {
            "node": node,
            "gpus": [g.to_dict() for g in self.gpus],
            "findings": [f.to_dict() for f in _ordered(self.findings)],
        }


def assemble_report(*, node: str, simulated: bool, backend: str, time: float, gpus: Sequence[GpuIdentity],
                    findings: Iterable[Finding], versions: Mapping[str, Any], collectors: Sequence[CollectorStatus],
                    runs: Sequence[CollectorRun] = (), nvml_up: bool = True, agent: AgentFacts | None = None,
                    environment: Mapping[str, Any] | None = None, driver_version: str = "",
                    cuda_driver_version: str = "") -> NodeReport:
    """The one node-report builder. Findings are grouped by GPU (anything on a GPU: the GPU, its
    links, its processes); the rest are the node's."""
    reports = {g.index: GpuReport(g, nvml_up=nvml_up) for g in gpus}
    by_uuid = {g.uuid: g.index for g in gpus}
    node_findings: list[Finding] = []
    for f in findings:
        index = f.entity.gpu_index
        if index is None and f.entity.kind is EntityKind.GPU:
            index = by_uuid.get(f.entity.id)
        if index is not None and index in reports and f.entity.kind is not EntityKind.NODE:
            reports[index].findings.append(f)
        else:
            node_findings.append(f)
    return NodeReport(node=node, simulated=simulated, backend=backend, time=time,
                      gpus=[reports[i] for i in sorted(reports)], findings=node_findings, versions=dict(versions),
                      runs=list(runs), collectors=list(collectors), nvml_up=nvml_up, agent=agent,
                      environment=None if environment is None else dict(environment), driver_version=driver_version,
                      cuda_driver_version=cuda_driver_version)


def _system_version(backend: NvmlBackend, key: str) -> str:
    """NVML's system ``key`` (``driver``, ``cuda_driver``) as text; "" when NVML does not say."""
    try:
        return str(backend.system(key))
    except NvmlError:
        return ""


def _ordered(findings: Sequence[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (-int(f.severity), f.code, f.entity.id))


def collect_once(
    backend: NvmlBackend,
    config: Config,
    *,
    sysfs: Any = None,
    kmsg: KmsgSource | None = None,
    collectors: Sequence[Collector] | None = None,
    runner: CollectorRunner | None = None,
) -> NodeReport:
    """Run every collector once and build the report. Raises ``NvmlError`` only when NVML cannot
    even count the GPUs; ``ThresholdsError`` for a bad ``collectors.thresholds_file``."""
    now = time.time()
    gpus = enumerate_gpus(backend)
    extras: dict[str, Any] = {"one_shot": True}
    if not backend.simulated:  # the agent's XID ledger, read-only: which GPUs were reset since their XIDs
        extras["state_dir"] = config.agent.state_dir
    if config.collectors.thresholds_file:
        extras["thresholds"] = load_thresholds(config.collectors.thresholds_file)
    ctx = CollectContext(
        backend=backend,
        config=config,
        gpus=gpus,
        node_name=config.node_name,
        now=now,
        sysfs=sysfs if sysfs is not None else sysfs_for(backend, config.collectors.sysfs_root),
        kmsg=kmsg if kmsg is not None else default_kmsg(backend, config),
        environment=environment_for(backend, config.collectors.sysfs_root),
        extras=extras,
    )
    own_collectors = collectors is None
    todo = list(all_collectors(config)) if collectors is None else list(collectors)
    own_runner = runner is None
    run_with = runner or CollectorRunner(timeout_s=config.collectors.timeout_s)
    runs: list[CollectorRun] = []
    try:
        for collector in todo:
            runs.append(run_with.run(collector, ctx, History(config.collectors.history_len)))
    finally:
        if own_runner:
            run_with.close()
        if own_collectors:
            for collector in todo:
                close = getattr(collector, "close", None)
                if callable(close):
                    close()
    return build_report(ctx, runs)


def build_report(ctx: CollectContext, runs: Sequence[CollectorRun]) -> NodeReport:
    """The report of one sweep (``gpuhealth status``)."""
    versions_run = next((r for r in runs if r.name == "versions"), None)
    return assemble_report(
        node=ctx.node_name, simulated=ctx.backend.simulated, backend=ctx.backend.description, time=ctx.now,
        gpus=ctx.gpus, findings=[f for run in runs for f in run.findings],
        versions=versions_of(versions_run.observations if versions_run else None),
        collectors=[CollectorStatus(r.name, r.lane.value, 0.0).after(r) for r in runs], runs=runs,
        environment=(ctx.environment or environment_for(ctx.backend, ctx.config.collectors.sysfs_root)).to_dict(),
        driver_version=_system_version(ctx.backend, "driver"),
        cuda_driver_version=_system_version(ctx.backend, "cuda_driver"),
    )


def report_of_snapshot(snap: ExportSnapshot, versions: Mapping[str, Any] | None = None) -> NodeReport:
    """The report of a running agent (``/health``), from its cache."""
    return assemble_report(
        node=snap.node_name, simulated=snap.simulated, backend=snap.backend, time=snap.generated_at, gpus=snap.gpus,
        findings=snap.findings, versions=versions or {}, collectors=snap.collectors, nvml_up=snap.nvml_up,
        agent=AgentFacts(ready=snap.ready, agent_version=snap.version), environment=snap.environment,
        driver_version=snap.driver_version, cuda_driver_version=snap.cuda_driver_version,
    )


__all__ = ["AgentFacts", "GpuReport", "NodeReport", "assemble_report", "build_report", "collect_once", "default_kmsg",
           "make_backend", "open_backend", "report_of_snapshot"]
