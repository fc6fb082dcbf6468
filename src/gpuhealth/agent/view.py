"""The agent's extension seam: what its HTTP edge and its extensions may see and do.

``AgentView`` is everything a part beside the scheduler gets: the HTTP server renders from it, and an
extension's ``start(view)`` receives it (the running ``Agent`` implements it; tests may pass their
own). Nothing else of the agent is reachable from outside, so its internals can change freely.

- ``config``, ``node_name``, ``simulated``: who and what this agent is.
- ``gpus``: the GPUs of the last enumeration (empty until NVML is up).
- ``snapshot()``: the immutable picture a scrape renders (``exporters.ExportSnapshot``); ``ready``.
- ``current_findings()``: every active finding (collectors, diagnostics, the agent's own).
- ``node_report()``: the ``/health`` document (``status --json`` plus what only an agent knows).
- ``add_findings_listener(cb)``: ``cb(findings)`` runs on an agent thread whenever the active findings
  change (keep it quick; never block). Extensions start before the first sweep, so a listener added
  in ``start`` sees every change.
- ``set_gpu_label_provider(fn)``: ``fn() -> {gpu_uuid_or_index: {label: value}}`` adds labels
  (``pod``, ``namespace``, ``container``, ``slurm_job_id``) to every GPU series. Called from the
  agent's own thread every fast interval, never from a scrape.
- ``publish_findings(source, findings, interval_s=…)``: findings made outside the scheduler
  (periodic diagnostics) join the node's findings, ``/health`` and ``/metrics`` as if ``source`` were
  a collector; each call replaces that source's previous findings.

An ``AgentExtension`` (``name``, ``start(view)``, ``stop()``, optionally ``samples()`` for
``/metrics``) must not block in ``start``: it runs its own threads. One that fails to start is
logged and the agent runs without it.

A view may also list the compute processes NVML sees on each GPU (``ListsGpuProcesses``:
``gpu_processes()``; the running agent does, on live NVML). Zero-code job discovery starts from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from gpuhealth.collectors.base import GpuIdentity
    from gpuhealth.config import Config
    from gpuhealth.exporters import ExportSnapshot
    from gpuhealth.model import Finding, Sample

FindingsListener = Callable[[list["Finding"]], None]
GpuLabelProvider = Callable[[], Mapping[str, Mapping[str, str]]]


class AgentView(Protocol):
    @property
    def config(self) -> Config: ...

    @property
    def node_name(self) -> str: ...

    @property
    def simulated(self) -> bool: ...

    @property
    def gpus(self) -> list[GpuIdentity]: ...

    @property
    def ready(self) -> bool: ...

    def snapshot(self) -> ExportSnapshot: ...

    def current_findings(self) -> list[Finding]: ...

    def node_report(self) -> dict[str, Any]: ...

    def add_findings_listener(self, callback: FindingsListener) -> None: ...

    def set_gpu_label_provider(self, provider: GpuLabelProvider | None) -> None: ...

    def publish_findings(self, source: str, findings: Sequence[Finding], *, interval_s: float,
                         ok: bool = True, error: str = "") -> None: ...


@runtime_checkable
class AgentExtension(Protocol):
    """A part that runs beside the agent's scheduler (rank hub, coordinator link, periodic diagnostics)."""

    name: str

    def start(self, agent: AgentView) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One compute process on one GPU, as NVML lists it (PIDs in the agent's PID namespace)."""

    gpu_index: int
    gpu_uuid: str
    pid: int
    used_memory_bytes: int | None = None


@runtime_checkable
class ListsGpuProcesses(Protocol):
    """A view that can list each GPU's compute processes (empty while NVML is down)."""

    def gpu_processes(self) -> list[GpuProcess]: ...


@runtime_checkable
class ReportsSamples(Protocol):
    """An extension that says something about itself on ``/metrics`` (connected ranks, link state)."""

    def samples(self) -> list[Sample]: ...


__all__ = ["AgentExtension", "AgentView", "FindingsListener", "GpuLabelProvider", "ReportsSamples"]
