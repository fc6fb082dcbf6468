"""The narrow GPU-access protocol every collector uses.

Keys are those of "NVML recording v1" (docs/architecture.md): the NVML getter name without ``nvmlDeviceGet``
plus argument suffixes (``TotalEccErrors_UNCORRECTED_VOLATILE``, ``ClockInfo_SM``,
``TemperatureThreshold_SLOWDOWN``, ``ViolationStatus_THERMAL``). Values are plain JSON-like data:
ints, strings, lists, and dicts named by the NVML struct's fields (``MemoryInfo`` →
``{"total", "free", "used"}``). A failed call raises ``NvmlError``; "Not Supported" is a normal
answer a collector must handle. This is what lets the fake replay a recording byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from gpuhealth.backends.errors import NvmlError

# Per-link keys accepted by ``NvmlBackend.nvlink`` (recording v1 names).
NVLINK_KEYS = (
    "state",
    "version",
    "remote_pci",
    "remote_type",
    "err_DL_REPLAY",
    "err_DL_RECOVERY",
    "err_DL_CRC_FLIT",
    "err_DL_CRC_DATA",
    "err_DL_ECC_DATA",
)
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS on current drivers (Hopper: 18)


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An XID seen by the NVML event set (or the kernel log, see ``kmsg``)."""

    gpu_index: int | None
    xid: int
    timestamp: float  # seconds since the epoch
    source: str = "nvml"  # "nvml" or "kmsg"
    pci_bus_id: str = ""
    detail: str = ""
    seq: int | None = None  # the kernel log's record number (unique per boot); None for NVML events
    raw: str = ""  # the kernel log line as logged (NVML events have none)


FieldResult = Any | NvmlError  # the value, or the error NVML gave for that one field


@runtime_checkable
class NvmlBackend(Protocol):
    """What collectors may ask of a GPU driver. Implementations: ``nvml_real.RealNvml``,
    ``nvml_fake.FakeNvml``. Calls are made from one thread at a time per backend, except
    ``wait_xid_events``, which runs on its own thread."""

    @property
    def simulated(self) -> bool:
        """True when readings come from a recording/scenario, not a live driver."""
        ...

    @property
    def description(self) -> str: ...

    def init(self) -> None:
        """(Re-)initialise. Raises ``BackendUnavailable`` or ``NvmlError``."""
        ...

    def shutdown(self) -> None: ...

    def system(self, key: str) -> Any:
        """System-wide readings: ``driver``, ``nvml_version``, ``cuda_driver``."""
        ...

    def device_count(self) -> int: ...

    def query(self, index: int, key: str) -> Any:
        """One device reading by recording key. Raises ``NvmlError``."""
        ...

    def nvlink(self, index: int, link: int, key: str) -> Any:
        """One per-link reading (``NVLINK_KEYS``). Raises ``NvmlError``."""
        ...

    def field_values(self, index: int, requests: Sequence[tuple[str, int]]) -> list[FieldResult]:
        """Batched read: ``(NVML_FI_DEV_* name, scope_id)`` pairs; scope_id is the link for per-link
        fields, else 0. One result per request, an ``NvmlError`` for a field that failed."""
        ...

    def wait_xid_events(self, timeout_ms: int) -> list[XidEvent]:
        """Block up to ``timeout_ms`` for XID critical-error events on any GPU."""
        ...


__all__ = ["NVLINK_KEYS", "NVLINK_MAX_LINKS", "FieldResult", "NvmlBackend", "XidEvent"]
