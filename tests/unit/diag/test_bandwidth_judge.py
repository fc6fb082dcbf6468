"""Bandwidth judgement and the sysfs reading it rests on (pure; sysfs is a temp tree)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuhealth.diag.bandwidth import (
    GpuBandwidth,
    hbm_reference,
    judge,
    numa_nodes,
    parse_cpulist,
    pcie_expected_gbps,
    read_pci_place,
)

GEN5_X16 = {"max_link_speed": "32.0 GT/s PCIe", "max_link_width": "16",
            "current_link_speed": "32.0 GT/s PCIe", "current_link_width": "16"}


def _gpu(**kw: object) -> GpuBandwidth:
    g = GpuBandwidth("cuda:0", "GPU-x", 0, "NVIDIA H200", d2d_gbps=3800.0, h2d_gbps=55.5, d2h_gbps=55.4)
    g.pcie = dict(GEN5_X16)
    for k, v in kw.items():
        setattr(g, k, v)
    return g


def test_expected_pcie_rates() -> None:
    assert pcie_expected_gbps("32.0 GT/s PCIe", "16") == pytest.approx(55.4, abs=0.5)  # measured 55.5
    assert pcie_expected_gbps("16.0 GT/s PCIe", 16) == pytest.approx(27.7, abs=0.5)
    assert pcie_expected_gbps("", "16") is None and pcie_expected_gbps("8 GT/s", "x") is None


def test_the_measured_h200_passes() -> None:
    assert judge([_gpu()]) == []


def test_a_slow_hbm_and_a_half_width_link_are_flagged() -> None:
    findings = judge([_gpu(d2d_gbps=2500.0, h2d_gbps=26.0, d2h_gbps=26.5,
                           pcie={**GEN5_X16, "current_link_width": "8"})])
    paths = sorted(f.evidence["path"] for f in findings)
    assert paths == ["device", "device_to_host", "host_to_device"]
    assert all(f.code == "bandwidth.low" for f in findings)
    h2d = next(f for f in findings if f.evidence["path"] == "host_to_device")
    assert "x8" in h2d.message  # says the link trained narrower than the slot


def test_wrong_numa_wiring_is_flagged() -> None:
    g = _gpu(numa_node=0, h2d_by_numa={0: 30.0, 1: 54.0})
    assert [f.code for f in judge([g])] == ["bandwidth.numa_mismatch"]
    assert judge([_gpu(numa_node=0, h2d_by_numa={0: 54.0, 1: 52.0})]) == []


def test_unknown_models_are_not_judged_on_hbm() -> None:
    assert hbm_reference("NVIDIA H100 80GB HBM3") == 2950.0
    assert hbm_reference("NVIDIA H100 PCIe") == 1750.0
    assert hbm_reference("Tesla T4") is None
    assert judge([_gpu(name="Tesla T4", d2d_gbps=1.0)]) == []


def test_sysfs_place_and_numa_nodes(tmp_path: Path) -> None:
    dev = tmp_path / "sys/bus/pci/devices/0000:18:00.0"
    dev.mkdir(parents=True)
    for name, val in {"numa_node": "1", "local_cpulist": "16-31,48-63", **GEN5_X16}.items():
        (dev / name).write_text(val + "\n")
    for n, cpus in ((0, "0-15,32-47"), (1, "16-31,48-63")):
        d = tmp_path / f"sys/devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    place = read_pci_place("0000:18:00.0", tmp_path)
    assert place is not None and place.numa_node == 1 and 20 in place.local_cpus and 5 not in place.local_cpus
    assert place.max_link_width == "16"
    assert read_pci_place("0000:99:00.0", tmp_path) is None
    assert set(numa_nodes(tmp_path)) == {0, 1}
    assert parse_cpulist("0-2,7") == frozenset({0, 1, 2, 7})
