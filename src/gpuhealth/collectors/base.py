"""The collector protocol (docs/architecture.md, rule 1): read in ``collect``, judge in a pure ``evaluate``.

A collector is a small object with a ``name``, a ``lane`` (fast/slow, which sets its default
interval), ``supported(ctx)``, ``collect(ctx) -> Observations``, a pure
``evaluate(obs, history) -> findings`` and a pure ``samples(obs) -> metric samples``. The runner
(``runner.py``) isolates, times and schedules them; the registry (``registry.py``) lists them all.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.errors import NvmlError
from gpuhealth.model import Finding, Sample

if TYPE_CHECKING:
    from gpuhealth.config import Config


class Lane(enum.StrEnum):
    FAST = "fast"  # cheap getters, ~5 s
    SLOW = "slow"  # NVLink counters, field-value batches, sysfs walks, ~60 s


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """Enumerated once per sweep; every collector and the exporter label GPUs with it."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str  # NVML form, "00000000:18:00.0"
    minor: int | None = None

    @property
    def bdf(self) -> str:
        """sysfs form, "0000:18:00.0" (lower case, 4-digit domain)."""
        bus = self.pci_bus_id.lower()
        if bus.count(":") == 2 and len(bus.split(":")[0]) == 8:
            bus = bus[4:]
        return bus


@dataclass(frozen=True, slots=True)
class CollectError:
    """One reading that failed for a reason other than "Not Supported"."""

    gpu: int | None
    key: str
    code: int | None
    message: str


@dataclass(slots=True)
class Observations:
    """What one ``collect`` call read. ``per_gpu`` maps GPU index → readings (plain data);
    ``node`` holds node-level readings; ``unsupported`` records keys NVML said it cannot answer
    (a normal outcome); ``errors`` everything that really failed."""

    collector: str
    time: float  # wall clock, seconds since the epoch
    per_gpu: dict[int, dict[str, Any]] = field(default_factory=dict)
    node: dict[str, Any] = field(default_factory=dict)
    unsupported: set[tuple[int | None, str]] = field(default_factory=set)
    errors: list[CollectError] = field(default_factory=list)

    def gpu(self, index: int) -> dict[str, Any]:
        return self.per_gpu.setdefault(index, {})

    def read(self, backend: NvmlBackend, index: int, key: str, store_as: str | None = None) -> Any:
        """``backend.query`` that records the outcome instead of raising; returns None on failure."""
        try:
            value = backend.query(index, key)
        except NvmlError as exc:
            self.note_error(index, key, exc)
            return None
        self.gpu(index)[store_as or key] = value
        return value

    def note_error(self, gpu: int | None, key: str, exc: NvmlError) -> None:
        if exc.not_supported:
            self.unsupported.add((gpu, key))
        else:
            self.errors.append(CollectError(gpu, key, exc.code, exc.message))


class History:
    """The last few observations of one collector (oldest first), for rates and escalation."""

    def __init__(self, maxlen: int = 64) -> None:
        self._items: deque[Observations] = deque(maxlen=maxlen)

    def append(self, obs: Observations) -> None:
        self._items.append(obs)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Observations]:
        return iter(self._items)

    def latest(self) -> Observations | None:
        return self._items[-1] if self._items else None

    def oldest(self) -> Observations | None:
        return self._items[0] if self._items else None

    def rate(self, now: Observations, gpu: int, key: str, window_s: float | None = None) -> float | None:
        """Per-second increase of a counter reading between an earlier observation and ``now``.
        Uses the oldest observation within ``window_s`` (or the oldest kept). None when there is no
        earlier value; a counter that went backwards (reset) counts from zero."""
        cur = now.per_gpu.get(gpu, {}).get(key)
        if not isinstance(cur, (int, float)):
            return None
        for past in self._items:
            if past is now or past.time >= now.time:
                continue
            if window_s is not None and now.time - past.time > window_s:
                continue
            prev = past.per_gpu.get(gpu, {}).get(key)
            if not isinstance(prev, (int, float)):
                continue
            dt = now.time - past.time
            if dt <= 0:
                return None
            delta = cur - prev if cur >= prev else cur
            return delta / dt
        return None


@dataclass(slots=True)
class CollectContext:
    """Everything a collector may touch. Dependencies come in here, never through globals."""

    backend: NvmlBackend
    config: Config
    gpus: Sequence[GpuIdentity]
    node_name: str
    now: float
    sysfs: Any = None  # backends.sysfs.Sysfs
    kmsg: Any = None  # backends.kmsg.KmsgSource
    environment: Any = None  # backends.environment.Environment (None: the backend's, see _shared.environment_of)
    extras: Mapping[str, Any] = field(default_factory=dict)

    def gpu_by_index(self, index: int) -> GpuIdentity | None:
        for g in self.gpus:
            if g.index == index:
                return g
        return None


@runtime_checkable
class Collector(Protocol):
    """A collector may also set ``needs_nvml = False`` (host, InfiniBand): the agent then keeps running
    it while the GPU driver is down."""

    name: str
    lane: Lane

    def supported(self, ctx: CollectContext) -> bool: ...

    def collect(self, ctx: CollectContext) -> Observations: ...

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        """Pure: no I/O. ``ctx`` gives identities, config and thresholds only."""
        ...

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        """Pure: metric samples for the exporter."""
        ...


__all__ = ["CollectContext", "CollectError", "Collector", "GpuIdentity", "History", "Lane", "Observations"]
