"""The agent's NVML lifecycle in one place: states, the events that move between them, and what each
transition does to the backend.

```
            init_ok                     driver_lost
 STARTING ───────────> UP <─────────────────────────────┐  (UP ─driver_lost─> DOWN)
    │                  │ ↺ gpus_enumerated, handles_refreshed
    │ init_failed      │                                 │
    └──────────> DOWN ─┴── init_ok ──────────────────────┘
                 ↺ init_failed (retry after 1 s, doubling to 60 s)
 any state ── stop ──> STOPPED (nothing moves it again: errors during shutdown are ours)
```

- **STARTING**: never initialised. The agent's re-init job calls ``initialise``.
- **UP**: NVML answers. ``enumerate`` (the fast-lane job) refreshes the GPU list; while a GPU answers
  GPU_IS_LOST it re-opens NVML in place now and then (30 s, doubling to 10 min) in case a reset
  brought it back.
- **DOWN**: the driver went away (a collector saw UNINITIALIZED / DRIVER_NOT_LOADED /
  LIBRARY_NOT_FOUND, or NVML would not start). ``initialise`` is retried with backoff.
- **STOPPED**: the agent is stopping.

While NVML is not answering the agent serves ``nvml.unavailable``, in one of two forms
(``unavailable_finding``): **critical, reboot** when the driver is the likely fault — NVML was up with
GPUs and went away, or it never starts where this host owns the GPUs on its PCI bus (bare metal or a VM guest,
GPUs bound to ``nvidia`` or to no driver) and NVML answers a driver error — the module not loaded, a
library/module version mismatch (``driver_fault_at_start``): such a node cannot run a GPU job. Otherwise
**warning, no action: could not check** — a container's view (a pod without the NVIDIA runtime), no library,
no permission on ``/dev/nvidia*``. That says nothing about the GPUs, so it must not take the node out; the
node's health is ``unknown`` (docs/environments.md).

Events not in ``TRANSITIONS`` are ignored (a second collector that sees the same gone driver). The
supervisor owns the backend's ``init``/``shutdown``; what the agent makes of each transition (its
cache, its schedule, its findings) it learns through one callback, ``on_change(NvmlChange)``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuhealth.backends import errors
from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.errors import BackendUnavailable, NvmlError
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.collectors.runner import enumerate_gpus
from gpuhealth.model import Action, Entity, Finding, Severity

log = logging.getLogger("gpuhealth.agent")

NVML_UNAVAILABLE = "nvml.unavailable"

# nvml.h's NVML_ERROR_LIB_RM_VERSION_MISMATCH: the library is newer than the loaded kernel module (a driver
# upgraded without a reboot). Not in backends.errors: nothing else acts on it.
LIB_RM_VERSION_MISMATCH = 18
# Start-up errors that blame the driver itself, not the agent's view of it: on a host that owns its GPUs, a
# module that did not load or does not match the library keeps every GPU job off the node. LIBRARY_NOT_FOUND,
# NO_PERMISSION, UNKNOWN and the rest are the view (no runtime, no device nodes, an unprivileged agent) or unsure.
DRIVER_FAULT_AT_START_CODES = frozenset({errors.DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH, errors.IRQ_ISSUE,
                                         errors.GPU_IS_LOST, errors.RESET_REQUIRED})


class NvmlState(enum.StrEnum):
    STARTING = "starting"
    UP = "up"
    DOWN = "down"
    STOPPED = "stopped"


class NvmlEvent(enum.StrEnum):
    INIT_OK = "init_ok"
    INIT_FAILED = "init_failed"
    DRIVER_LOST = "driver_lost"
    GPUS_ENUMERATED = "gpus_enumerated"  # the GPU list changed
    HANDLES_REFRESHED = "handles_refreshed"  # NVML re-opened in place for a lost GPU
    STOP = "stop"


S, E = NvmlState, NvmlEvent
TRANSITIONS: dict[tuple[NvmlState, NvmlEvent], NvmlState] = {
    (S.STARTING, E.INIT_OK): S.UP,
    (S.STARTING, E.INIT_FAILED): S.DOWN,
    (S.DOWN, E.INIT_OK): S.UP,
    (S.DOWN, E.INIT_FAILED): S.DOWN,
    (S.UP, E.DRIVER_LOST): S.DOWN,
    (S.UP, E.GPUS_ENUMERATED): S.UP,
    (S.UP, E.HANDLES_REFRESHED): S.UP,
    (S.STARTING, E.STOP): S.STOPPED,
    (S.UP, E.STOP): S.STOPPED,
    (S.DOWN, E.STOP): S.STOPPED,
}
del S, E


@dataclass(frozen=True, slots=True)
class NvmlPolicy:
    backoff_min_s: float = 1.0  # first retry after NVML would not start
    backoff_max_s: float = 60.0
    lost_gpu_reinit_s: float = 30.0  # first in-place re-open after a GPU answers GPU_IS_LOST
    lost_gpu_reinit_max_s: float = 600.0


@dataclass(frozen=True, slots=True)
class NvmlChange:
    """One transition, as the agent needs to hear it."""

    event: NvmlEvent
    state: NvmlState
    gpus: tuple[GpuIdentity, ...] = ()  # INIT_OK, GPUS_ENUMERATED: the GPUs now
    driver_version: str = ""  # INIT_OK
    cuda_driver_version: str = ""  # INIT_OK
    reinits: int = 0  # re-initialisations so far (the first start is not one)
    reason: str = ""  # INIT_FAILED, DRIVER_LOST: why NVML is not answering
    retry_in_s: float = 0.0  # INIT_FAILED: when the next attempt is due; DRIVER_LOST: the next backoff
    driver_fault: bool = False  # INIT_FAILED, DRIVER_LOST: the driver is the likely fault (reboot), not the view


@dataclass(frozen=True, slots=True)
class StartView:
    """What the host shows while NVML will not start: could a broken driver be the cause?"""

    owns_gpus: bool = False  # bare metal or a VM guest: the GPUs on this PCI bus are this host's, not a container's
    #                          view of another's
    driver_loaded: bool = False  # the driver's /proc/driver/nvidia is there: the kernel module is loaded (evidence)
    gpus_on_bus: int = 0  # NVIDIA GPU functions on the PCI bus bound to nvidia or to no driver (not vfio-pci's)

    def to_dict(self) -> dict[str, object]:
        return {"owns_gpus": self.owns_gpus, "driver_loaded": self.driver_loaded, "gpus_on_bus": self.gpus_on_bus}


def start_view(backend: NvmlBackend | None, root: str = "/", *, sysfs: Any = None) -> StartView:
    """The environment, the driver's /proc directory and the PCI bus as ``backend``'s node shows them
    (a replay's recorded ones for a simulated backend; ``sysfs``: a given one). Unreadable: "not seen"."""
    from gpuhealth.backends.environment import environment_for
    from gpuhealth.backends.sysfs import sysfs_for

    try:
        env = environment_for(backend, root)
        sysfs = sysfs if sysfs is not None else sysfs_for(backend, root)
        ours = [d for d in sysfs.nvidia_pci_devices() if getattr(d, "driver", None) in (None, "nvidia")]
        return StartView(owns_gpus=env.kind in ("bare metal", "VM guest"),
                         driver_loaded=sysfs.nvidia_driver_gpus() is not None, gpus_on_bus=len(ours))
    except (OSError, ValueError, NvmlError):
        log.debug("cannot read the host's view of the driver", exc_info=True)
        return StartView()


def failure_code(exc: BaseException) -> int | None:
    """NVML's return code behind a start-up failure; the live backend wraps LIBRARY_NOT_FOUND and
    DRIVER_NOT_LOADED in ``BackendUnavailable`` with the bindings' error (its ``value``) as the cause."""
    if isinstance(exc, NvmlError):
        return exc.code
    value = getattr(exc.__cause__, "value", None)
    return value if isinstance(value, int) else None


def driver_fault_at_start(code: int | None, view: StartView) -> bool:
    """NVML never started: is the driver the likely fault (reboot) rather than this view of it? Only where this
    host owns GPUs on its bus (bare metal, a VM guest; never a container, whose bus is the host's), for an error
    that blames the driver: there a module that did not load is the fault, and no GPU job can run. When unsure,
    no: a false reboot drains a healthy node."""
    return code in DRIVER_FAULT_AT_START_CODES and view.owns_gpus and view.gpus_on_bus > 0


def unavailable_finding(node_name: str, change: NvmlChange, source: str = "agent",
                        view: StartView | None = None) -> Finding:
    """The finding while NVML is not answering: critical/reboot when the driver is the likely fault,
    else a warning that GPU health could not be checked (no action: the node is not taken out)."""
    evidence: dict[str, object] = {"reason": change.reason, "retry_in_s": change.retry_in_s,
                                   "driver_fault": change.driver_fault}
    if view is not None:
        evidence["view"] = view.to_dict()
    if change.driver_fault:
        return Finding(
            NVML_UNAVAILABLE, Severity.CRITICAL, Entity.node(node_name),
            f"NVML is not answering ({change.reason}); the driver is the likely fault; GPU health is unknown "
            "until it is back", Action.REBOOT, evidence, source,
        )
    return Finding(
        NVML_UNAVAILABLE, Severity.WARNING, Entity.node(node_name),
        f"could not check the GPUs: NVML did not start here ({change.reason}); a view without the NVIDIA library, "
        "/dev/nvidia* access or a driver is not a GPU fault: the node is not taken out",
        Action.NONE, evidence, source,
    )


def start_failure_finding(node_name: str, reason: str, error: BaseException, backend: NvmlBackend | None,
                          root: str = "/", source: str = "agent") -> Finding:
    """A one-shot check's ``nvml.unavailable`` (``status``, ``qualify``): it never saw NVML up, so the
    driver is blamed only where ``driver_fault_at_start`` says so."""
    view = start_view(backend, root)
    change = NvmlChange(NvmlEvent.INIT_FAILED, NvmlState.DOWN, reason=reason,
                        driver_fault=driver_fault_at_start(failure_code(error), view))
    return unavailable_finding(node_name, change, source, view)


class NvmlSupervisor:
    """Drives ``backend`` through the states above. ``initialise`` and ``enumerate`` run on the
    agent's backend thread; ``driver_lost`` may come from any collector's thread; ``quiesce`` stops
    whatever waits inside NVML (the XID event pump) before NVML is shut down under it."""

    def __init__(
        self,
        backend: NvmlBackend,
        on_change: Callable[[NvmlChange], None],
        *,
        policy: NvmlPolicy | None = None,
        quiesce: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        view: Callable[[], StartView] = StartView,
    ) -> None:
        self.backend = backend
        self.policy = policy or NvmlPolicy()
        self._on_change = on_change
        self._quiesce = quiesce
        self._clock = clock
        self._view = view  # read only when NVML never started: is the driver the fault?
        self._saw_gpus = False  # NVML was up with GPUs at least once: losing it now is the driver's fault
        self._lock = threading.RLock()
        self._state = NvmlState.STARTING
        self._ever_up = False
        self._backoff_s = self.policy.backoff_min_s
        self._reinits = 0
        self._down_since: float | None = None
        self._lost: frozenset[int] = frozenset()
        self._lost_since = 0.0
        self._lost_wait_s = self.policy.lost_gpu_reinit_s

    @property
    def state(self) -> NvmlState:
        return self._state

    @property
    def lost_gpus(self) -> frozenset[int]:
        return self._lost

    # ------------------------------------------------------------------ events from the agent
    def initialise(self, known: Sequence[GpuIdentity] = ()) -> None:
        """STARTING/DOWN: (re)start NVML. Success → UP; failure → DOWN, retried after the backoff."""
        if self._state not in (NvmlState.STARTING, NvmlState.DOWN):
            return
        try:
            try:
                if self._ever_up:
                    self._quiesce()
                self.backend.shutdown()
            except Exception:
                log.debug("shutdown before init failed", exc_info=True)
            self.backend.init()
            gpus = tuple(enumerate_gpus(self.backend, known))
            driver, cuda = _system(self.backend, "driver"), _system(self.backend, "cuda_driver")
        except (NvmlError, BackendUnavailable, OSError) as exc:
            with self._lock:
                retry = self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, self.policy.backoff_max_s)
                if self._down_since is None:
                    self._down_since = self._clock()
                fault = self._saw_gpus or driver_fault_at_start(failure_code(exc), self._view())
                log.warning("NVML unavailable (%s); retrying in %.0f s", exc, retry)
                self._move(NvmlEvent.INIT_FAILED, reason=f"NVML init failed: {exc}", retry_in_s=retry,
                           driver_fault=fault)
            return
        with self._lock:
            if self._ever_up:
                self._reinits += 1
                log.warning("NVML is back after %.1f s (re-initialised)", self._clock() - (self._down_since or 0.0))
            else:
                log.info("NVML up: %d GPU(s), driver %s", len(gpus), driver)
            self._ever_up = True
            self._saw_gpus = self._saw_gpus or bool(gpus)
            self._down_since = None
            self._backoff_s = self.policy.backoff_min_s
            self._move(NvmlEvent.INIT_OK, gpus=gpus, driver_version=driver, cuda_driver_version=cuda)

    def driver_lost(self, why: str) -> None:
        """UP: the driver went away under a running agent. Ignored in any other state."""
        with self._lock:
            if self._state is not NvmlState.UP:
                return
            log.error("NVML went away (%s); re-initialising with backoff", why)
            self._down_since = self._clock()
            self._move(NvmlEvent.DRIVER_LOST, reason=why, retry_in_s=self._backoff_s, driver_fault=self._saw_gpus)

    def enumerate(self, known: Sequence[GpuIdentity]) -> None:
        """UP: list the GPUs again; re-open NVML in place when a lost GPU has waited long enough."""
        if self._state is not NvmlState.UP:
            return
        try:
            gpus = tuple(enumerate_gpus(self.backend, known))
        except NvmlError as exc:
            if exc.driver_gone:
                self.driver_lost(f"device count failed: {exc.message}")
            else:
                log.warning("GPU enumeration failed: %s", exc.message)
            return
        if gpus != tuple(known):
            if known:
                log.warning("GPU list changed: %d → %d GPUs", len(known), len(gpus))
            with self._lock:
                self._saw_gpus = self._saw_gpus or bool(gpus)
                self._move(NvmlEvent.GPUS_ENUMERATED, gpus=gpus)
        if self._lost and self._clock() - self._lost_since > self._lost_wait_s:
            self._lost_since = self._clock()
            self._lost_wait_s = min(self._lost_wait_s * 2, self.policy.lost_gpu_reinit_max_s)
            self._refresh_handles()

    def note_lost_gpus(self, lost: frozenset[int]) -> None:
        """The GPUs answering GPU_IS_LOST / RESET_REQUIRED now (from the collectors' findings)."""
        if lost == self._lost:
            return
        if lost - self._lost:
            log.error("GPU(s) %s answer GPU_IS_LOST/RESET_REQUIRED", sorted(lost - self._lost))
            self._lost_since = self._clock()
            self._lost_wait_s = self.policy.lost_gpu_reinit_s
        if self._lost - lost:
            log.warning("GPU(s) %s answer again", sorted(self._lost - lost))
        self._lost = lost

    def stop(self) -> None:
        with self._lock:
            self._move(NvmlEvent.STOP)

    # ------------------------------------------------------------------ internals
    def _refresh_handles(self) -> None:
        """A GPU answers GPU_IS_LOST: fresh NVML handles in case it came back after a reset."""
        try:
            self._quiesce()
            self.backend.shutdown()
            self.backend.init()
        except (NvmlError, BackendUnavailable) as exc:
            self.driver_lost(f"re-initialisation failed: {exc}")
            return
        with self._lock:
            if self._state is not NvmlState.UP:
                return
            self._reinits += 1
            log.info("NVML re-initialised to refresh handles of lost GPU(s) %s", sorted(self._lost))
            self._move(NvmlEvent.HANDLES_REFRESHED)

    def _move(self, event: NvmlEvent, **details: object) -> None:
        """Apply ``event`` (lock held): the new state first, then the agent hears of it."""
        target = TRANSITIONS.get((self._state, event))
        if target is None:
            log.debug("NVML %s ignored in state %s", event, self._state)
            return
        self._state = target
        self._on_change(NvmlChange(event, target, reinits=self._reinits, **details))  # type: ignore[arg-type]


def _system(backend: NvmlBackend, key: str) -> str:
    try:
        return str(backend.system(key))
    except NvmlError:
        return ""


__all__ = ["DRIVER_FAULT_AT_START_CODES", "LIB_RM_VERSION_MISMATCH", "NVML_UNAVAILABLE", "TRANSITIONS", "NvmlChange",
           "NvmlEvent", "NvmlPolicy", "NvmlState", "NvmlSupervisor", "StartView", "driver_fault_at_start",
           "failure_code", "start_failure_finding", "start_view", "unavailable_finding"]
