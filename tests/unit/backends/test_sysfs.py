"""The sysfs reader on real file trees built in tmp_path, and the recorded sysfs of a recording."""

from __future__ import annotations

from pathlib import Path

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.backends.sysfs import (
    RealSysfs,
    RecordedSysfs,
    Sysfs,
    format_cpulist,
    link_generation,
    normalise_bdf,
    parse_cpulist,
    sysfs_for,
)


def pci(root: Path, bdf: str, **attrs: str) -> None:
    d = root / "sys" / "bus" / "pci" / "devices" / bdf
    d.mkdir(parents=True)
    for k, v in attrs.items():
        (d / k).write_text(v + "\n")


def gpu_attrs(**over: str) -> dict[str, str]:
    a = {"vendor": "0x10de", "device": "0x2335", "class": "0x030200", "numa_node": "1", "local_cpulist": "16-31",
         "current_link_speed": "32.0 GT/s PCIe", "max_link_speed": "32.0 GT/s PCIe", "current_link_width": "16",
         "max_link_width": "16"}
    a.update(over)
    return a


def test_pci_devices_and_nvidia_gpu_listing(tmp_path):
    pci(tmp_path, "0000:18:00.0", **gpu_attrs())
    pci(tmp_path, "0000:2a:00.0", **gpu_attrs(**{"class": "0x030000", "current_link_width": "8",
                                                   "current_link_speed": "16.0 GT/s PCIe"}))
    pci(tmp_path, "0000:18:00.1", **gpu_attrs(**{"class": "0x040300"}))  # the GPU's audio function
    pci(tmp_path, "0000:3b:00.0", vendor="0x15b3", **{"class": "0x020700"})  # a Mellanox NIC
    pci(tmp_path, "0000:5d:00.0", vendor="0x10de", **{"class": "0x068000"})  # an NVSwitch bridge
    s = RealSysfs(tmp_path)
    assert isinstance(s, Sysfs)
    gpus = s.nvidia_pci_devices()
    assert [g.bdf for g in gpus] == ["0000:18:00.0", "0000:2a:00.0"]
    g = s.pci_device("00000000:18:00.0")  # NVML form works too
    assert g is not None and g.numa_node == 1 and g.local_cpus == frozenset(range(16, 32))
    assert (g.current_link_gen, g.max_link_gen, g.current_link_width, g.max_link_width) == (5, 5, 16, 16)
    narrow = s.pci_device("0000:2A:00.0")
    assert narrow is not None and narrow.current_link_width == 8 and narrow.current_link_gen == 4
    assert s.pci_device("0000:99:00.0") is None


def test_missing_files_and_vm_values_are_none_not_errors(tmp_path):
    pci(tmp_path, "0000:00:06.0", vendor="0x10de", **{"class": "0x030200"}, numa_node="-1",
        current_link_speed="Unknown")
    d = RealSysfs(tmp_path).pci_device("0000:00:06.0")
    assert d is not None
    assert d.numa_node == -1 and d.local_cpulist is None and d.max_link_width is None
    assert d.current_link_gen is None and d.local_cpus == frozenset()
    empty = RealSysfs(tmp_path / "nothing-here")
    assert empty.nvidia_pci_devices() == [] and empty.infiniband_ports() == [] and empty.numa_nodes() == {}


def test_infiniband_ports_and_numa_nodes(tmp_path):
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (port / "counters" / "symbol_error").write_text("3\n")
    (port / "counters" / "link_downed").write_text("garbage\n")
    for n, cpus in ((0, "0-15,32-47"), (1, "16-31,48-63")):
        (tmp_path / "sys" / "devices" / "system" / "node" / f"node{n}").mkdir(parents=True)
        (tmp_path / "sys" / "devices" / "system" / "node" / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "sys" / "devices" / "system" / "node" / "possible").write_text("0-1\n")
    s = RealSysfs(tmp_path)
    (p,) = s.infiniband_ports()
    assert (p.id, p.state_name, p.phys_state_name, p.rate_gbps, p.link_layer) == (
        "mlx5_0/1", "ACTIVE", "LINKUP", 400.0, "InfiniBand")
    assert dict(p.counters) == {"symbol_error": 3}  # unreadable counters are skipped
    assert s.numa_nodes() == {0: parse_cpulist("0-15,32-47"), 1: parse_cpulist("16-31,48-63")}


def test_recorded_sysfs_answers_from_the_recording():
    b = FakeNvml.bundled("nvml_h200x2.json")
    b.init()
    s = sysfs_for(b)
    assert isinstance(s, RecordedSysfs) and isinstance(s, Sysfs)
    gpus = s.nvidia_pci_devices()
    assert [g.bdf for g in gpus] == ["0000:00:06.0", "0000:00:07.0"]
    d = s.pci_device("00000000:00:07.0")
    assert d is not None and d.numa_node == -1 and d.local_cpulist == "0-31" and d.current_link_width == 16
    assert d.current_link_gen == 5 and d.is_nvidia_gpu
    assert s.infiniband_ports() == [] and s.numa_nodes() == {}


def test_recorded_sysfs_follows_scenario_clones_and_overrides():
    b = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "gpu_count": 4,
                                "overrides": {"2": {"sysfs": {"current_link_width": "8"}}}})
    b.init()
    s = RecordedSysfs(b)
    bdfs = [g.bdf for g in s.nvidia_pci_devices()]
    assert len(bdfs) == 4 and len(set(bdfs)) == 4
    bus2 = b.query(2, "PciInfo")["busId"]
    d = s.pci_device(bus2)
    assert d is not None and d.current_link_width == 8 and d.bdf == normalise_bdf(bus2)


def test_real_sysfs_for_a_live_backend(tmp_path):
    class Live:
        simulated = False

    assert isinstance(sysfs_for(Live(), tmp_path), RealSysfs)


def test_cpulist_and_speed_helpers():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == frozenset() and parse_cpulist(None) == frozenset()
    assert parse_cpulist("3-1,x,5") == {5}
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert format_cpulist([]) == ""
    assert [link_generation(f"{g} GT/s PCIe") for g in ("2.5", "5.0", "8.0", "16.0", "32.0", "64.0")] == [
        1, 2, 3, 4, 5, 6]
    assert link_generation("Unknown") is None and link_generation(None) is None
    assert normalise_bdf("00000000:1A:00.0") == "0000:1a:00.0" and normalise_bdf("0000:1a:00.0") == "0000:1a:00.0"
