"""Exporters turn the agent's cached state into wire formats (Prometheus text/OpenMetrics).

The input contract is ``ExportSnapshot``: an immutable picture of the agent's cache, published by
the agent after every collector run. Exporters read it and never touch NVML, so a scrape costs the
same whether the GPUs answer quickly, slowly or not at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.collectors.runner import CollectorStatus
from gpuhealth.model import Finding, Health, Sample, Severity, could_not_check, health_of


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """Slow-changing node state the agent sets between collector runs: who it is, the driver,
    NVML's state, the GPUs of the last enumeration, its own findings, the GPUs' extra labels."""

    node_name: str
    simulated: bool = False
    backend: str = ""
    version: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""
    nvml_up: bool = True
    nvml_reinits_total: int = 0
    gpus: tuple[GpuIdentity, ...] = ()
    agent_findings: tuple[Finding, ...] = ()  # the agent's own (nvml.unavailable); also in a snapshot's findings
    # Extra labels per GPU UUID from the agent's label provider (pod/namespace/container, slurm_job_id).
    gpu_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Where the agent runs (backends.environment.Environment.to_dict()): bare metal, VM guest, container.
    environment: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportSnapshot(NodeFacts):
    """Everything a scrape shows, captured at ``generated_at`` (wall clock): the node's facts plus
    what the collectors last said."""

    generated_at: float
    ready: bool = False
    samples: tuple[Sample, ...] = ()
    findings: tuple[Finding, ...] = ()
    collectors: tuple[CollectorStatus, ...] = ()

    def gpu_findings(self, gpu: GpuIdentity) -> list[Finding]:
        return [f for f in self.findings if finding_on_gpu(f, gpu)]

    def gpu_health(self, gpu: GpuIdentity) -> Health:
        """UNKNOWN while NVML is down (nothing current to judge by), else derived from findings."""
        if not self.nvml_up:
            return Health.UNKNOWN
        return health_of(self.gpu_findings(gpu))

    def node_health(self) -> Health:
        """UNKNOWN while NVML is down, or a check asked for could not be made, unless a critical finding says
        unhealthy (``NodeReport.health``)."""
        unchecked = not self.nvml_up or could_not_check(self.findings)
        if unchecked and not any(f.severity is Severity.CRITICAL for f in self.findings):
            return Health.UNKNOWN
        return health_of(self.findings)


def finding_on_gpu(finding: Finding, gpu: GpuIdentity) -> bool:
    """A finding belongs to a GPU when its entity is the GPU or sits on it (a link, a process)."""
    ent = finding.entity
    if ent.gpu_index is not None:
        return ent.gpu_index == gpu.index
    return ent.id == gpu.uuid


__all__ = ["CollectorStatus", "ExportSnapshot", "NodeFacts", "finding_on_gpu"]
