"""The agent's NVML lifecycle as a state machine: the transition table, and each path through it driven
by a recorded backend whose driver goes away and comes back on a stepped clock."""

from __future__ import annotations

from typing import Any

import pytest

from gpuhealth.agent.nvml_supervisor import (
    LIB_RM_VERSION_MISMATCH,
    NVML_UNAVAILABLE,
    TRANSITIONS,
    NvmlChange,
    NvmlEvent,
    NvmlPolicy,
    NvmlState,
    NvmlSupervisor,
    StartView,
    driver_fault_at_start,
    start_view,
    unavailable_finding,
)
from gpuhealth.backends import errors
from gpuhealth.backends.errors import BackendUnavailable, NvmlError
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.model import Action, Severity

S, E = NvmlState, NvmlEvent


class Quiesce:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def _supervisor(clock: Any, events: list[dict[str, Any]], **policy: float) -> tuple[NvmlSupervisor, list[NvmlChange],
                                                                                     Quiesce]:
    backend = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "events": events}, clock=clock)
    changes: list[NvmlChange] = []
    quiesce = Quiesce()
    return NvmlSupervisor(backend, changes.append, policy=NvmlPolicy(**policy), quiesce=quiesce, clock=clock), \
        changes, quiesce


def test_the_transition_table() -> None:
    assert TRANSITIONS == {
        (S.STARTING, E.INIT_OK): S.UP, (S.STARTING, E.INIT_FAILED): S.DOWN,
        (S.DOWN, E.INIT_OK): S.UP, (S.DOWN, E.INIT_FAILED): S.DOWN,
        (S.UP, E.DRIVER_LOST): S.DOWN, (S.UP, E.GPUS_ENUMERATED): S.UP, (S.UP, E.HANDLES_REFRESHED): S.UP,
        (S.STARTING, E.STOP): S.STOPPED, (S.UP, E.STOP): S.STOPPED, (S.DOWN, E.STOP): S.STOPPED,
    }
    assert not any(state is S.STOPPED for state, _ in TRANSITIONS)  # nothing leaves STOPPED


def test_up_then_the_driver_goes_then_it_is_back_with_backoff(clock: Any) -> None:
    sup, changes, quiesce = _supervisor(clock, [{"at": 5, "type": "driver_unloaded", "until": 200},
                                                {"at": 300, "type": "driver_unloaded", "until": 400}])
    assert sup.state is S.STARTING
    sup.initialise()
    up = changes[-1]
    assert (up.event, up.state, up.reinits, up.driver_version) == (E.INIT_OK, S.UP, 0, "580.159.04")
    assert [g.index for g in up.gpus] == [0, 1] and quiesce.calls == 0  # nothing to quiesce on a first start
    clock.advance(6)
    sup.enumerate(up.gpus)  # the device count fails: the driver is gone
    lost = changes[-1]
    assert (lost.event, lost.state) == (E.DRIVER_LOST, S.DOWN) and "device count failed" in lost.reason
    assert lost.retry_in_s == 1.0
    sup.driver_lost("a collector saw it too")  # a second witness changes nothing
    sup.enumerate(up.gpus)  # not UP: no enumeration
    assert changes[-1] is lost
    retries = []
    for _ in range(8):
        sup.initialise(up.gpus)
        assert (changes[-1].event, changes[-1].state) == (E.INIT_FAILED, S.DOWN)
        retries.append(changes[-1].retry_in_s)
    assert retries == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert "Driver Not Loaded" in changes[-1].reason and quiesce.calls == 8  # readers stopped before each init
    clock.advance(200)
    sup.initialise(up.gpus)
    back = changes[-1]
    assert (back.event, back.state, back.reinits) == (E.INIT_OK, S.UP, 1)
    clock.advance(100)  # gone again: the backoff starts over
    sup.driver_lost("collector ecc saw NVML error 9")
    sup.initialise(back.gpus)
    assert (changes[-1].event, changes[-1].retry_in_s) == (E.INIT_FAILED, 1.0)


def test_nvml_that_never_starts_is_down_with_a_finding(clock: Any) -> None:
    sup, changes, _ = _supervisor(clock, [{"at": 0, "type": "driver_unloaded"}])
    sup.initialise()
    failed = changes[-1]
    assert (failed.event, failed.state, failed.retry_in_s) == (E.INIT_FAILED, S.DOWN, 1.0)
    # the scenario's driver never loaded: nothing says the driver is at fault (the recording shows no GPU on the
    # bus while NVML is down), so "could not check" — a warning that does not take the node out
    assert failed.driver_fault is False
    finding = unavailable_finding("n1", failed)
    assert finding.code == NVML_UNAVAILABLE and finding.severity is Severity.WARNING
    assert finding.action is Action.NONE and not finding.action.takes_node_out
    assert finding.message.startswith("could not check the GPUs")
    assert finding.evidence == {"reason": failed.reason, "retry_in_s": 1.0, "driver_fault": False}


def test_a_driver_that_was_up_and_went_away_is_critical_reboot(clock: Any) -> None:
    sup, changes, _ = _supervisor(clock, [{"at": 5, "type": "driver_unloaded"}])
    sup.initialise()
    gpus = changes[-1].gpus
    clock.advance(6)
    sup.enumerate(gpus)
    lost = changes[-1]
    assert (lost.event, lost.driver_fault) == (E.DRIVER_LOST, True)
    sup.initialise(gpus)  # the re-inits that fail after it: still the driver's fault
    assert (changes[-1].event, changes[-1].driver_fault) == (E.INIT_FAILED, True)
    for change in (lost, changes[-1]):
        finding = unavailable_finding("n1", change)
        assert (finding.severity, finding.action) == (Severity.CRITICAL, Action.REBOOT)


BARE_METAL_DRIVER_LOADED = StartView(owns_gpus=True, driver_loaded=True, gpus_on_bus=8)


class FailingInit:
    """NVML's library loads but ``nvmlInit`` answers ``error`` (the live backend's two wrappings)."""

    simulated = False
    description = "failing"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def init(self) -> None:
        raise self.error

    def shutdown(self) -> None:
        pass


class BindingsError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def _unavailable(code: int) -> BackendUnavailable:
    """What RealNvml.init raises for LIBRARY_NOT_FOUND / DRIVER_NOT_LOADED: the bindings' error as the cause."""
    try:
        raise BindingsError(code)
    except BindingsError as exc:
        try:
            raise BackendUnavailable(f"NVIDIA driver not available: {exc}") from exc
        except BackendUnavailable as wrapped:
            return wrapped


@pytest.mark.parametrize(("error", "view", "fault"), [
    # a host that owns the GPUs on its bus, an error that blames the driver: reboot (no GPU job can run)
    (_unavailable(errors.DRIVER_NOT_LOADED), BARE_METAL_DRIVER_LOADED, True),
    (NvmlError(LIB_RM_VERSION_MISMATCH, "Driver/library version mismatch"), BARE_METAL_DRIVER_LOADED, True),
    # the agent's view, not the driver: could not check
    (_unavailable(errors.LIBRARY_NOT_FOUND), BARE_METAL_DRIVER_LOADED, False),  # no libnvidia-ml here
    (NvmlError(errors.NO_PERMISSION, "Insufficient Permissions"), BARE_METAL_DRIVER_LOADED, False),
    (NvmlError(errors.UNKNOWN, "Unknown Error"), BARE_METAL_DRIVER_LOADED, False),  # unsure
    (BackendUnavailable("nvidia-ml-py is not installed"), BARE_METAL_DRIVER_LOADED, False),
    # the module did not load at all (no /proc/driver/nvidia) on bare metal or in a VM guest: the fault itself
    (_unavailable(errors.DRIVER_NOT_LOADED), StartView(owns_gpus=True, driver_loaded=False, gpus_on_bus=8), True),
    # a container's view of the host's bus (a pod without the NVIDIA runtime): could not check
    (_unavailable(errors.DRIVER_NOT_LOADED), StartView(owns_gpus=False, driver_loaded=True, gpus_on_bus=8), False),
    (_unavailable(errors.DRIVER_NOT_LOADED), StartView(owns_gpus=True, driver_loaded=True, gpus_on_bus=0), False),
])
def test_nvml_that_never_starts_blames_the_driver_only_where_it_must(error: Exception, view: StartView,
                                                                     fault: bool) -> None:
    changes: list[NvmlChange] = []
    sup = NvmlSupervisor(FailingInit(error), changes.append, view=lambda: view)  # type: ignore[arg-type]
    sup.initialise()
    assert (changes[-1].event, changes[-1].driver_fault) == (E.INIT_FAILED, fault)
    finding = unavailable_finding("n1", changes[-1])
    assert finding.action.takes_node_out is fault
    assert finding.severity is (Severity.CRITICAL if fault else Severity.WARNING)


def test_start_view_reads_the_environment_the_driver_directory_and_the_bus() -> None:
    class Backend:
        simulated = True

        def system(self, key: str) -> Any:
            assert key == "environment"
            return {"virtualization": "none", "container": False}

    class Sysfs:
        def __init__(self, proc: dict[str, int | None] | None, gpus: int) -> None:
            self.proc, self.gpus = proc, gpus

        def nvidia_driver_gpus(self) -> dict[str, int | None] | None:
            return self.proc

        def nvidia_pci_devices(self) -> list[object]:
            return [object()] * self.gpus

    view = start_view(Backend(), sysfs=Sysfs({}, 8))  # type: ignore[arg-type]
    assert view == StartView(owns_gpus=True, driver_loaded=True, gpus_on_bus=8)
    assert start_view(Backend(), sysfs=Sysfs(None, 2)) == StartView(True, False, 2)  # type: ignore[arg-type]


def test_start_view_counts_only_the_gpus_this_host_could_drive() -> None:
    """GPUs bound to vfio-pci (passed on to VMs) are not this host's to drive; a container's bus is the host's."""
    from types import SimpleNamespace

    class Backend:
        simulated = True

        def __init__(self, env: dict[str, Any]) -> None:
            self.env = env

        def system(self, key: str) -> Any:
            return self.env

    class Sysfs:
        def nvidia_driver_gpus(self) -> None:
            return None  # the module did not load

        def nvidia_pci_devices(self) -> list[object]:
            return [SimpleNamespace(driver=d) for d in ("vfio-pci", "vfio-pci", None, "nvidia")]

    vm = start_view(Backend({"virtualization": "vm", "container": False}), sysfs=Sysfs())  # type: ignore[arg-type]
    assert vm == StartView(owns_gpus=True, driver_loaded=False, gpus_on_bus=2)
    pod = start_view(Backend({"virtualization": "none", "container": True}), sysfs=Sysfs())  # type: ignore[arg-type]
    assert not pod.owns_gpus
    assert driver_fault_at_start(errors.DRIVER_NOT_LOADED, vm)
    assert not driver_fault_at_start(errors.DRIVER_NOT_LOADED, pod)


def test_a_lost_gpu_gets_fresh_handles_now_and_then(clock: Any) -> None:
    sup, changes, quiesce = _supervisor(clock, [{"at": 5, "type": "lost", "gpu": 1}], lost_gpu_reinit_s=30.0,
                                        lost_gpu_reinit_max_s=50.0)
    sup.initialise()
    gpus = changes[-1].gpus
    clock.advance(6)
    sup.enumerate(gpus)  # the lost GPU keeps its identity from the last list: no change
    assert changes[-1].event is E.INIT_OK
    sup.note_lost_gpus(frozenset({1}))
    clock.advance(29)
    sup.enumerate(gpus)
    assert changes[-1].event is E.INIT_OK  # not yet
    clock.advance(2)
    sup.enumerate(gpus)
    assert (changes[-1].event, changes[-1].state, changes[-1].reinits) == (E.HANDLES_REFRESHED, S.UP, 1)
    assert quiesce.calls == 1
    clock.advance(31)
    sup.enumerate(gpus)
    assert changes[-1].reinits == 1  # the wait doubled (to the 50 s cap)
    clock.advance(20)
    sup.enumerate(gpus)
    assert changes[-1].reinits == 2
    sup.note_lost_gpus(frozenset())  # it answers again
    clock.advance(100)
    sup.enumerate(gpus)
    assert changes[-1].reinits == 2 and sup.lost_gpus == frozenset()


def test_a_changed_gpu_list_is_reported(clock: Any) -> None:
    sup, changes, _ = _supervisor(clock, [])
    sup.initialise()
    gpus = changes[-1].gpus
    sup.enumerate(gpus[:1])  # the agent knew one GPU; NVML lists two
    assert (changes[-1].event, [g.index for g in changes[-1].gpus]) == (E.GPUS_ENUMERATED, [0, 1])
    before = len(changes)
    sup.enumerate(changes[-1].gpus)
    assert len(changes) == before  # unchanged: nothing to say


def test_after_stop_errors_are_ours_not_the_drivers(clock: Any) -> None:
    sup, changes, _ = _supervisor(clock, [])
    sup.initialise()
    sup.stop()
    assert (changes[-1].event, sup.state) == (E.STOP, S.STOPPED)
    sup.driver_lost("shutdown closed the handles")
    sup.initialise()
    sup.enumerate(changes[0].gpus)
    assert changes[-1].event is E.STOP and sup.state is S.STOPPED
