"""The one vocabulary every part speaks: findings, severities, health, actions, samples.

A ``Finding`` is what a collector, a diagnostic or an analyzer concludes; a GPU's (or node's) health
is derived from its findings, never stored separately (GPUd's model).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The largest job gpuhealth accepts: ranks are 0 … MAX_RANKS-1 everywhere (dumps, step records, the wire).
# Per-rank tables are sized by it, so a number above it is bad input, never a job.
MAX_RANKS = 1 << 20


class Severity(enum.IntEnum):
    """Ordered so that ``max()`` over findings gives the worst one."""

    INFO = 0
    WARNING = 1
    CRITICAL = 2

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Severity:
        return cls[text.strip().upper()]


class Health(enum.IntEnum):
    """Ordered: healthy < degraded < unhealthy < unknown is *not* implied; unknown is separate."""

    HEALTHY = 0
    DEGRADED = 1
    UNHEALTHY = 2
    UNKNOWN = 3

    def __str__(self) -> str:
        return self.name.lower()


class Action(enum.IntEnum):
    """Suggested remedy, ordered by how disruptive it is (the worst wins when aggregating)."""

    NONE = 0
    MONITOR = 1
    CHECK_JOB = 2
    RESET_GPU = 3
    REBOOT = 4
    DRAIN = 5
    RMA = 6

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Action:
        return cls[text.strip().upper()]

    @property
    def takes_node_out(self) -> bool:
        """A GPU reset, a reboot or a drain: no new job should start on the node until someone acts,
        whatever the finding's severity (a power brake is a warning that still means drain). An RMA alone
        is planned, not urgent: a GPU with its spare rows running low still runs jobs correctly."""
        return self in (Action.RESET_GPU, Action.REBOOT, Action.DRAIN)


class EntityKind(enum.StrEnum):
    NODE = "node"
    GPU = "gpu"
    LINK = "link"  # nvlink/pcie/ib port; id like "GPU-uuid/nvlink/3" or "mlx5_0/1"
    RANK = "rank"
    PROCESS = "process"
    JOB = "job"


@dataclass(frozen=True, slots=True)
class Entity:
    """What a finding is about. ``id`` is stable: GPU UUID, "nvlink:<uuid>:<n>", rank number, …"""

    kind: EntityKind
    id: str
    gpu_index: int | None = None  # convenience for display/joins when the entity sits on a GPU

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.id}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "id": self.id}
        if self.gpu_index is not None:
            out["gpu_index"] = self.gpu_index
        return out

    @classmethod
    def node(cls, name: str) -> Entity:
        return cls(EntityKind.NODE, name)

    @classmethod
    def gpu(cls, uuid: str, index: int | None = None) -> Entity:
        return cls(EntityKind.GPU, uuid, index)

    @classmethod
    def rank(cls, rank: int) -> Entity:
        return cls(EntityKind.RANK, str(rank))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Entity:
        return cls(EntityKind(data["kind"]), str(data["id"]), data.get("gpu_index"))


@dataclass(frozen=True, slots=True)
class Finding:
    """A conclusion with a stable dotted ``code`` (alerts route on it; never rename a code)."""

    code: str
    severity: Severity
    entity: Entity
    message: str
    action: Action = Action.NONE
    evidence: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""  # collector/diagnostic/analyzer that produced it

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": str(self.severity),
            "entity": self.entity.to_dict(),
            "message": self.message,
            "action": str(self.action),
            "evidence": dict(self.evidence),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        return cls(
            code=str(data["code"]),
            severity=Severity.parse(str(data["severity"])),
            entity=Entity.from_dict(data["entity"]),
            message=str(data.get("message", "")),
            action=Action.parse(str(data.get("action", "none"))),
            evidence=dict(data.get("evidence", {})),
            source=str(data.get("source", "")),
        )


def health_of(findings: Iterable[Finding]) -> Health:
    """Critical → unhealthy, warning → degraded, else healthy. Info never changes health."""
    worst = max((f.severity for f in findings), default=Severity.INFO)
    if worst is Severity.CRITICAL:
        return Health.UNHEALTHY
    if worst is Severity.WARNING:
        return Health.DEGRADED
    return Health.HEALTHY


# Evidence key of a finding that says a check the caller asked for could not be made (a kernel log named to be
# read that cannot be read or holds no kernel record): the node's health is then unknown, not healthy.
COULD_NOT_CHECK = "could_not_check"


def could_not_check(findings: Iterable[Finding]) -> bool:
    return any(f.evidence.get(COULD_NOT_CHECK) is True for f in findings)


def worst_action(findings: Iterable[Finding]) -> Action:
    return max((f.action for f in findings), default=Action.NONE)


def takes_node_out(findings: Iterable[Finding]) -> bool:
    """Some finding asks for a reset, a reboot or a drain (``Action.takes_node_out``): the node is not fit
    for a new job even when every such finding is only a warning."""
    return any(f.action.takes_node_out for f in findings)


class MetricKind(enum.StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    INFO = "info"


@dataclass(frozen=True, slots=True)
class Sample:
    """One exported reading. ``name`` is the full metric name without the ``gpuhealth_`` prefix
    (e.g. ``gpu_temperature_celsius``); counters are named without ``_total`` (the exporter adds it).
    ``gpu`` is the GPU index when the sample belongs to a GPU: the exporter then adds the standard
    GPU labels (gpu, uuid, pci_bus_id, model_name)."""

    name: str
    value: float
    help: str
    kind: MetricKind = MetricKind.GAUGE
    gpu: int | None = None
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """Who a training rank is and where it runs: sent once by the instrument hook (``found_by`` "hook"),
    or read by the agent from the process's environment (``found_by`` "discovered", zero-code)."""

    job_id: str
    rank: int
    world_size: int
    host: str
    pid: int
    local_rank: int | None = None
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    found_by: str = "hook"  # "hook" | "discovered"
    # The agent saw kernel evidence that the process belongs to the job (docs/security.md, "who is a rank"):
    # an unverified claim never moves a verified rank nor counts as the job's progress at the coordinator.
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "rank": self.rank, "world_size": self.world_size, "host": self.host,
            "pid": self.pid, "local_rank": self.local_rank, "gpu_uuid": self.gpu_uuid,
            "gpu_index": self.gpu_index, "found_by": self.found_by, "verified": self.verified,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankIdentity:
        return cls(
            job_id=str(d["job_id"]), rank=int(d["rank"]), world_size=int(d["world_size"]),
            host=str(d.get("host", "")), pid=int(d.get("pid", 0)),
            local_rank=None if d.get("local_rank") is None else int(d["local_rank"]),
            gpu_uuid=d.get("gpu_uuid"), gpu_index=None if d.get("gpu_index") is None else int(d["gpu_index"]),
            found_by="discovered" if d.get("found_by") == "discovered" else "hook",
        )


_MAX_SECTION_NAME = 128  # characters kept of a step record's section name


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One training step of one rank. Wall time alone cannot show a straggler (every rank waits at
    the collective): ``compute_s`` and ``comm_wait_s`` carry the signal. Either may be None when
    the hook could not split them."""

    job_id: str
    rank: int
    step: int
    start_time: float  # wall clock, seconds since the epoch
    wall_s: float
    compute_s: float | None = None
    comm_wait_s: float | None = None
    # One code section of the step (``compute_s`` is that section's), or None: the whole step. Offline
    # triage judges each section on its own (docs/stragglers.md).
    section: str | None = None
    # Ranks in the job, as the rank knew it (the hook writes it): offline triage of some ranks' records
    # then knows which ranks it lacks. None: an older hook or another producer (not said).
    world_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "job_id": self.job_id, "rank": self.rank, "step": self.step, "start_time": self.start_time,
            "wall_s": self.wall_s, "compute_s": self.compute_s, "comm_wait_s": self.comm_wait_s,
        }
        if self.section is not None:
            d["section"] = self.section
        if self.world_size is not None:
            d["world_size"] = self.world_size
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepRecord:
        def opt(key: str) -> float | None:
            v = d.get(key)
            return None if v is None else float(v)

        return cls(
            job_id=str(d["job_id"]), rank=int(d["rank"]), step=int(d["step"]),
            start_time=float(d["start_time"]), wall_s=float(d["wall_s"]),
            compute_s=opt("compute_s"), comm_wait_s=opt("comm_wait_s"),
            section=None if d.get("section") is None else str(d["section"])[:_MAX_SECTION_NAME],
            world_size=_world_size_of(d),
        )


def _world_size_of(d: Mapping[str, Any]) -> int | None:
    """A step record's ``world_size``: absent is None; one that cannot hold its own rank is a bad record."""
    if d.get("world_size") is None:
        return None
    world = int(d["world_size"])
    if not int(d["rank"]) < world <= MAX_RANKS:
        raise ValueError(f"world_size {world} cannot hold rank {d['rank']} (1 … {MAX_RANKS})")
    return world


__all__ = ["COULD_NOT_CHECK", "MAX_RANKS", "Action", "Entity", "EntityKind", "Finding", "Health", "MetricKind",
           "RankIdentity", "Sample", "Severity", "StepRecord", "could_not_check", "health_of", "takes_node_out",
           "worst_action"]
