"""PCIe width/generation against the maximum (NVML and sysfs) and the replay rate budget."""

from __future__ import annotations

from pathlib import Path

import pytest
from collector_kit import Sweeper, by_code, inline, problems, recording, sample_values, scenario

from gpuhealth.backends.sysfs import RealSysfs
from gpuhealth.collectors import pcie
from gpuhealth.model import Action, EntityKind, MetricKind, Severity

UNSUPPORTED = {"error": "Not Supported", "code": 3}


def write_pci(root: Path, bdf: str, **attrs: str) -> None:
    d = root / "sys" / "bus" / "pci" / "devices" / bdf
    d.mkdir(parents=True)
    for k, v in attrs.items():
        (d / k).write_text(v + "\n")


@pytest.mark.parametrize("rec", ["nvml_h200x2.json", "nvml_h100x1.json"])
def test_real_recordings_are_healthy(clock, rec):
    s = Sweeper(pcie.create(), recording(rec, clock), clock)
    assert s.sweep() == []
    assert s.after(60) == []
    rec0 = s.last_obs.per_gpu[0]
    got = (rec0["width_current"], rec0["sysfs_width_max"], rec0["gen_current"], rec0["sysfs_gen_max"])
    assert got == (16, 16, 5, 5)
    assert sample_values(s.last_samples, "gpu_pcie_link_width", 0, which="current") == [16.0]
    assert sample_values(s.last_samples, "gpu_pcie_link_generation", 0, which="max") == [5.0]
    (replay,) = [x for x in s.last_samples if x.name == "gpu_pcie_replay" and x.gpu == 0]
    assert replay.kind is MetricKind.COUNTER


def test_x8_link_is_critical_on_the_pcie_link_entity(clock):
    b = scenario("pcie_x8.yaml", clock)
    (f,) = problems(Sweeper(pcie.create(), b, clock).sweep())
    assert (f.code, f.severity, f.action) == ("pcie.link_degraded", Severity.CRITICAL, Action.DRAIN)
    assert f.entity.kind is EntityKind.LINK and f.entity.gpu_index == 0
    assert f.entity.id == f"{b.query(0, 'UUID')}/pcie"
    assert f.evidence["kind"] == "width" and f.evidence["width_current"] == 8


def test_generation_below_max_while_idle_is_normal_but_not_when_busy(clock):
    idle = inline(clock, {"0": {"CurrPcieLinkGeneration": 1, "sysfs": {"current_link_speed": "2.5 GT/s PCIe"}}})
    assert Sweeper(pcie.create(), idle, clock).sweep() == []
    busy = inline(clock, {"0": {"CurrPcieLinkGeneration": 3, "UtilizationRates": {"gpu": 95, "memory": 40}}})
    (f,) = problems(Sweeper(pcie.create(), busy, clock).sweep())
    assert (f.code, f.severity, f.evidence["kind"]) == ("pcie.link_degraded", Severity.WARNING, "generation")


def test_slot_narrower_than_the_gpu_is_a_warning(clock):
    # NVML's max is what GPU and slot allow together (8); sysfs says the GPU itself can do x16.
    b = inline(clock, {"0": {"CurrPcieLinkWidth": 8, "MaxPcieLinkWidth": 8, "sysfs": {"current_link_width": "8"}}})
    (f,) = problems(Sweeper(pcie.create(), b, clock).sweep())
    assert (f.severity, f.action, f.evidence["kind"]) == (Severity.WARNING, Action.MONITOR, "slot_width")


def test_sysfs_alone_finds_a_degraded_link_when_nvml_cannot(clock, tmp_path):
    b = inline(clock, {"0": {"CurrPcieLinkWidth": UNSUPPORTED, "MaxPcieLinkWidth": UNSUPPORTED}})
    write_pci(tmp_path, "0000:00:06.0", vendor="0x10de", **{"class": "0x030200"}, current_link_width="4",
              max_link_width="16", current_link_speed="32.0 GT/s PCIe", max_link_speed="32.0 GT/s PCIe")
    s = Sweeper(pcie.create(), b, clock, sysfs=RealSysfs(tmp_path))
    (f,) = problems(s.sweep())
    assert f.entity.gpu_index == 0 and f.evidence["sysfs_width_current"] == 4
    # sysfs's max_link_width is the GPU's capability, not the slot's: x4 in an x4 slot looks the same
    assert (f.severity, f.action, f.evidence["kind"]) == (Severity.WARNING, Action.MONITOR, "slot_width")
    assert "sysfs_width_current" not in s.last_obs.per_gpu[1]  # GPU 1 has no device in this tree


# --- Width from one source (audit 2026-11-28, item 4) ---

def test_an_x8_slot_with_no_nvml_maximum_is_a_warning_not_a_drain(clock):
    """NVML gives the current width (8) but no maximum; sysfs's x16 is the GPU's capability, not the slot's."""
    (f,) = problems(Sweeper(pcie.create(), scenario("pcie_max_unsupported_x8_slot.yaml", clock), clock).sweep())
    assert (f.code, f.severity, f.action) == ("pcie.link_degraded", Severity.WARNING, Action.MONITOR)
    assert f.evidence["kind"] == "slot_width" and "NVML gives no slot maximum" in f.message


def test_nvml_current_is_never_paired_with_another_sources_maximum(clock):
    # NVML's current width missing, its maximum 16, sysfs says 8 of 16: no pair from one source says x8 of x16
    b = inline(clock, {"0": {"CurrPcieLinkWidth": UNSUPPORTED, "sysfs": {"current_link_width": "8"}}})
    (f,) = problems(Sweeper(pcie.create(), b, clock).sweep())
    assert (f.severity, f.evidence["kind"]) == (Severity.WARNING, "slot_width")


def test_nvml_x8_of_x16_stays_critical_whatever_sysfs_says(clock):
    # A hypervisor may emulate the guest's sysfs link registers (x16 / x16): NVML's own pair decides.
    b = inline(clock, {"0": {"CurrPcieLinkWidth": 8, "MaxPcieLinkWidth": 16,
                             "sysfs": {"current_link_width": "16", "max_link_width": "16"}}})
    (f,) = problems(Sweeper(pcie.create(), b, clock).sweep())
    assert (f.severity, f.action, f.evidence["kind"]) == (Severity.CRITICAL, Action.DRAIN, "width")
    assert "x8, below its maximum x16" in f.message


def test_replay_budget_follows_dcgm():
    assert pcie.replay_budget_per_minute(5, 16, 1e-12) == 31
    assert pcie.replay_budget_per_minute(4, 16, 1e-12) == 16
    assert pcie.replay_budget_per_minute(3, 8, 1e-12) == 4
    assert pcie.replay_budget_per_minute(1, 1, 1e-12) == 1
    assert pcie.replay_budget_per_minute(9, 16, 1e-12) == 62  # unknown future gen: capped at Gen6
    assert pcie.replay_budget_per_minute(None, 16, 1e-12) is None


def test_replay_rate_above_budget_warns_after_a_minute(clock):
    b = scenario("pcie_replay_ramp.yaml", clock)
    s = Sweeper(pcie.create(), b, clock)
    assert s.sweep() == []
    assert s.after(20) == []  # 20 s is too short to judge
    (f,) = problems(s.after(40))
    assert (f.code, f.severity, f.entity.gpu_index) == ("pcie.replay_rate", Severity.WARNING, 0)
    assert f.evidence["budget_per_minute"] == 31
    assert f.evidence["per_minute"] == pytest.approx(60.0)


def test_replay_rate_within_budget_is_quiet(clock):
    b = inline(clock, {"0": {"PcieReplayCounter": {"ramp": 0.5}}})  # 30/min < 31/min at Gen5 x16
    s = Sweeper(pcie.create(), b, clock)
    s.sweep()
    assert by_code(s.after(60), "pcie.replay_rate") == []
