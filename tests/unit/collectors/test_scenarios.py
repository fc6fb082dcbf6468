"""Every scenario fixture through every hardware collector: the named fault, on the named GPU, and
nothing else; the unmodified real recordings produce no warning or critical finding at all."""

from __future__ import annotations

import importlib

import pytest
from collector_kit import SCENARIOS, Sweeper, context, problems, recording, scenario

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import History
from gpuhealth.collectors.runner import CollectorRunner
from gpuhealth.model import Action, Finding, Severity

MINE = ("ecc", "throttle", "telemetry", "pcie", "nvlink", "numa", "infiniband")


def sweep_all(backend, clock, steps=(0.0,)) -> list[Finding]:
    sweepers = [Sweeper(importlib.import_module(f"gpuhealth.collectors.{n}").create(), backend, clock) for n in MINE]
    out: list[Finding] = []
    for dt in steps:
        clock.advance(dt)
        out = [f for s in sweepers for f in s.sweep()]
    return out


@pytest.mark.parametrize("rec", ["nvml_h200x2.json", "nvml_h100x1.json"])
def test_unmodified_real_recordings_have_no_problem(clock, rec):
    assert problems(sweep_all(recording(rec, clock), clock, steps=(0.0, 30.0, 60.0))) == []


# file → (code, severity, action, GPU index, seconds of history needed)
EXPECTED = {
    "pcie_x8.yaml": ("pcie.link_degraded", Severity.CRITICAL, Action.DRAIN, 0, ()),
    "dbe_volatile.yaml": ("ecc.dbe_volatile", Severity.CRITICAL, Action.RESET_GPU, 1, ()),
    "row_remap_failed.yaml": ("memory.row_remap_failed", Severity.CRITICAL, Action.RMA, 0, ()),
    "row_remap_pending.yaml": ("memory.row_remap_pending", Severity.WARNING, Action.RESET_GPU, 1, ()),
    "row_remap_spares_low.yaml": ("memory.row_remap_spares_low", Severity.WARNING, Action.RMA, 0, ()),
    "hw_slowdown.yaml": ("throttle.hw_slowdown", Severity.WARNING, Action.MONITOR, 1, ()),
    "hw_power_brake.yaml": ("throttle.hw_power_brake", Severity.WARNING, Action.DRAIN, 0, (30.0,)),
    "nvlink_down.yaml": ("nvlink.link_down", Severity.CRITICAL, Action.REBOOT, 0, ()),
    # Counters rotate four links a sweep: link 3, read at t=0, is read again at t=100: +30100 in 100 s.
    "nvlink_crc_ramp.yaml": ("nvlink.errors", Severity.CRITICAL, Action.DRAIN, 1, (20.0,) * 5),
    "pcie_replay_ramp.yaml": ("pcie.replay_rate", Severity.WARNING, Action.MONITOR, 0, (60.0,)),
    "sbe_ramp.yaml": ("ecc.sbe_rate", Severity.WARNING, Action.MONITOR, 1, (60.0,)),
    "fabric_degraded.yaml": ("fabric.degraded", Severity.CRITICAL, Action.REBOOT, 0, ()),
}


def test_the_fault_class_fixtures_exist_under_their_stable_names():
    assert set(EXPECTED) | {"hot_gpu.yaml", "faulty_node.yaml"} <= {p.name for p in SCENARIOS.glob("*.yaml")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scenario_produces_its_fault_and_only_on_its_gpu(clock, name):
    code, severity, action, gpu, steps = EXPECTED[name]
    b = scenario(name, clock)
    found = problems(sweep_all(b, clock, steps=(0.0, *steps)))
    assert found, f"{name}: no finding"
    assert {f.code for f in found} == {code}, [f.to_dict() for f in found]
    assert max(f.severity for f in found) is severity
    assert max(f.action for f in found) is action
    uuid = b.query(gpu, "UUID")
    assert all(f.entity.gpu_index == gpu and f.entity.id.startswith(uuid) for f in found)


def test_hot_gpu_scenario(clock):
    found = problems(sweep_all(scenario("hot_gpu.yaml", clock), clock))
    assert sorted((f.code, f.entity.gpu_index, str(f.severity)) for f in found) == [
        ("thermal.gpu_temp", 0, "warning"), ("thermal.gpu_temp", 1, "critical"),
        ("thermal.memory_temp", 1, "critical")]


def test_faulty_node_has_eight_gpus_with_the_documented_faults(clock):
    b = scenario("faulty_node.yaml", clock)
    assert b.device_count() == 8
    uuids = [b.query(i, "UUID") for i in range(8)]
    assert len(set(uuids)) == 8
    found = problems(sweep_all(b, clock))
    assert sorted((f.code, f.entity.gpu_index) for f in found) == [("pcie.link_degraded", 3),
                                                                     ("throttle.hw_slowdown", 1)]
    assert b.wait_xid_events(0) == []
    clock.advance(1.5)
    (xid,) = b.wait_xid_events(0)
    assert (xid.gpu_index, xid.xid) == (5, 79)
    assert xid.pci_bus_id == b.query(5, "PciInfo")["busId"]


def test_scenarios_load_through_the_public_loader():
    for path in sorted(SCENARIOS.glob("*.yaml")):
        FakeNvml.from_file(path)  # raises RecordingError with the file and key on a malformed file


def test_through_the_runner_the_faulty_node_reports_and_samples(clock):
    """The agent's own path: CollectorRunner → collect/evaluate/samples → history, for these collectors."""
    b = scenario("faulty_node.yaml", clock)
    runner = CollectorRunner(timeout_s=5.0)
    try:
        runs = {}
        for n in MINE:
            c = importlib.import_module(f"gpuhealth.collectors.{n}").create()
            runs[n] = runner.run(c, context(b, clock), History())
    finally:
        runner.close()
    assert all(r.success for r in runs.values()), {n: r.error for n, r in runs.items()}
    codes = sorted((f.code, f.entity.gpu_index) for r in runs.values() for f in problems(r.findings))
    assert codes == [("pcie.link_degraded", 3), ("throttle.hw_slowdown", 1)]
    widths = {s.gpu: s.value for s in runs["pcie"].samples
              if s.name == "gpu_pcie_link_width" and dict(s.labels)["which"] == "current"}
    assert widths == {0: 16.0, 1: 16.0, 2: 16.0, 3: 8.0, 4: 16.0, 5: 16.0, 6: 16.0, 7: 16.0}
    assert {s.gpu for s in runs["telemetry"].samples} == set(range(8))


def test_a_gpu_that_falls_off_the_bus_raises_no_false_hardware_findings(clock):
    # GPU 1 answers at first, then every call on it fails with GPU_IS_LOST (presence → gpu.lost).
    b = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "events": [{"at": 30, "type": "lost", "gpu": 1}]},
                               clock=clock)
    b.init()
    sweepers = [Sweeper(importlib.import_module(f"gpuhealth.collectors.{n}").create(), b, clock) for n in MINE]
    for s in sweepers:
        assert problems(s.sweep()) == []
    clock.advance(60)
    for s in sweepers:
        assert problems(s.sweep()) == [], s.collector.name
        assert all(e.gpu == 1 and e.code == 15 for e in s.last_obs.errors), s.collector.name
