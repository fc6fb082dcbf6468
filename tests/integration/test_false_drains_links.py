"""No drain, reboot or critical finding for a healthy node because of where it runs — through the shipped
``gpuhealth status --nvml-snapshot SCENARIO --json`` — while the real link faults stay critical.

The cases are the false drains of the 2026-11-28 audit (items 1, 4, 5), each beside the fault it must still
find: NVLink state unknown or links never trained (a VM slice) beside one link down among 17 up; an x8 slot
whose maximum NVML does not give beside an x8 link trained down in an x16 slot; a Fabric Manager hidden by
/proc hidepid beside one that is really stopped on bare metal.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from commands import REPO, run_cli

from gpuhealth.backends.environment import CGROUP_INIT_INO, NET_INIT_INO, PID_INIT_INO
from gpuhealth.backends.nvml_fake import FakeNvml, bundled_recording_path
from gpuhealth.backends.recorder import Recorder

sys.path.insert(0, str(REPO / "tests" / "unit" / "backends"))
from test_recorder import RecordedDriver  # the pynvml-shaped driver over a real recording

SCENARIOS = REPO / "tests" / "fixtures" / "scenarios"
TAKES_OUT = {"drain", "reboot", "reset_gpu"}


def _status(snapshot: Path) -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
    out = run_cli("status", "--nvml-snapshot", str(snapshot), "--json")
    assert out.stdout, out.stderr
    doc = json.loads(out.stdout)
    findings = doc["findings"] + [f for g in doc["gpus"] for f in g["findings"]]
    return out.returncode, doc, findings


def _assert_in_service(rc: int, doc: dict[str, Any], findings: list[dict[str, Any]]) -> None:
    assert doc["node"]["action"] not in TAKES_OUT and doc["node"]["health"] != "unhealthy"
    assert [f["code"] for f in findings if f["severity"] == "critical" or f["action"] in TAKES_OUT] == []
    assert rc in (0, 1)  # healthy, or degraded (a warning): never the exit code of a node to take out


# ---------------------------------------------------------------------------------- item 1: NVLink state

def test_nvlink_state_nobody_can_read_is_info_not_a_reboot() -> None:
    rc, doc, findings = _status(SCENARIOS / "nvlink_state_field_unserved.yaml")
    _assert_in_service(rc, doc, findings)
    assert rc == 0
    assert sorted((f["code"], f["entity"]["gpu_index"]) for f in findings if f["code"].startswith("nvlink.")) == [
        ("nvlink.state_unknown", 0), ("nvlink.state_unknown", 1)]


def test_a_vm_slice_whose_nvlinks_never_trained_is_info_not_18_links_down() -> None:
    rc, doc, findings = _status(SCENARIOS / "nvlink_vm_1gpu_untrained.yaml")
    _assert_in_service(rc, doc, findings)
    assert rc == 0
    [f] = [f for f in findings if f["code"].startswith("nvlink.")]
    assert (f["code"], f["severity"], f["action"]) == ("nvlink.untrained", "info", "none")


def test_one_link_down_among_17_up_is_still_critical() -> None:
    rc, doc, findings = _status(SCENARIOS / "nvlink_down.yaml")
    [f] = [f for f in findings if f["code"] == "nvlink.link_down"]
    assert (rc, doc["node"]["action"], f["severity"], f["action"]) == (2, "reboot", "critical", "reboot")
    assert f["entity"]["id"].endswith("/nvlink/5") and f["evidence"]["up"] == 17


# ---------------------------------------------------------------------------------- item 4: PCIe width

def test_an_x8_slot_without_an_nvml_maximum_is_a_warning_not_a_drain() -> None:
    rc, doc, findings = _status(SCENARIOS / "pcie_max_unsupported_x8_slot.yaml")
    _assert_in_service(rc, doc, findings)
    [f] = [f for f in findings if f["code"] == "pcie.link_degraded"]
    assert (rc, f["severity"], f["action"], f["evidence"]["kind"]) == (1, "warning", "monitor", "slot_width")


def test_an_x8_link_in_an_x16_slot_by_nvml_is_still_a_critical_drain() -> None:
    rc, doc, findings = _status(SCENARIOS / "pcie_x8.yaml")
    [f] = [f for f in findings if f["code"] == "pcie.link_degraded"]
    assert (rc, doc["node"]["action"], f["severity"], f["action"]) == (2, "drain", "critical", "drain")
    assert f["evidence"]["kind"] == "width"


# ---------------------------------------------------------------------------------- item 5: Fabric Manager

def _bare_metal_hgx(root: Path, *, processes: dict[int, str]) -> Path:
    """A bare-metal HGX host as the kernel shows it (no hypervisor flag, the initial namespaces, 4 NVSwitch PCI
    functions) whose /proc lists ``processes`` (pid → argv0): what this reader is allowed to see."""
    ns = root / "proc" / "self" / "ns"
    ns.mkdir(parents=True)
    for name, ino in (("pid", PID_INIT_INO), ("cgroup", CGROUP_INIT_INO), ("net", NET_INIT_INO)):
        os.symlink(f"{name}:[{ino}]", ns / name)
    (root / "proc" / "cpuinfo").write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2\n\n")
    (root / "proc" / "self" / "cgroup").write_text("0::/system.slice/gpuhealth.service\n")
    for pid, argv0 in processes.items():
        (root / "proc" / str(pid)).mkdir()
        (root / "proc" / str(pid) / "comm").write_text(Path(argv0).name[:15] + "\n")
        (root / "proc" / str(pid) / "cmdline").write_bytes(argv0.encode() + b"\0")
    for n in range(4):
        d = root / "sys" / "bus" / "pci" / "devices" / f"0000:{0x80 + n:02x}:00.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x068000\n")
    return root


def _record(root: Path, out: Path) -> Path:
    """What ``gpuhealth record`` writes on that host: its recorder reads the host facts (environment, Fabric
    Manager) from ``root``; the GPUs' readings are the real H200 recording's (the pynvml-shaped test driver does
    not carry its field values, which put the GPUs on NVSwitches)."""
    host = Recorder(RecordedDriver(FakeNvml.bundled("nvml_h200x2.json")), reps=1, sysfs_root=str(root)).record()
    recording = json.loads(bundled_recording_path("nvml_h200x2.json").read_text())
    recording.update({k: host[k] for k in ("environment", "fabric_manager") if k in host})
    out.write_text(json.dumps(recording))
    return out


def test_a_recorder_under_proc_hidepid_never_makes_the_node_drain(tmp_path: Path) -> None:
    # An unprivileged agent (DynamicUser) under /proc hidepid=2 sees only its own process: no PID 1, no manager.
    root = _bare_metal_hgx(tmp_path / "host", processes={4242: "/usr/bin/python3"})
    rc, doc, findings = _status(_record(root, tmp_path / "hidepid.json"))
    assert doc["node"]["environment"]["kind"] == "bare metal"
    _assert_in_service(rc, doc, findings)
    [f] = [f for f in findings if f["code"].startswith("fabric.manager")]
    assert (f["code"], f["severity"]) == ("fabric.manager_unobserved", "info") and "hidepid" in f["message"]


def test_the_manager_stopped_on_a_bare_metal_host_that_sees_everything_still_drains(tmp_path: Path) -> None:
    root = _bare_metal_hgx(tmp_path / "host", processes={1: "/sbin/init", 4242: "/usr/bin/python3"})
    rc, doc, findings = _status(_record(root, tmp_path / "full.json"))
    assert (rc, doc["node"]["action"]) == (2, "drain")
    assert [f["code"] for f in findings if f["code"].startswith("fabric.manager")] == ["fabric.manager_down"]
    rc, doc, _ = _status(SCENARIOS / "fabric_manager_stopped_bare_metal.yaml")  # the audit's repro G, committed
    assert (rc, doc["node"]["action"]) == (2, "drain")


# ------------------------------------------------------------------------ gpuhealth record of a restricted view

def _host_with_eight_gpus(root: Path, *, others_driver: str | None, in_driver_list: bool) -> Path:
    """A host whose bus holds 8 GPUs: the recording's 2 (00:06.0, 00:07.0) and 6 more, bound to ``others_driver``;
    the view's /proc/driver/nvidia/gpus lists the 6 (minors 2–7) when ``in_driver_list``; their /dev nodes are
    absent from this view (enroot, CDI: only the given GPUs' nodes)."""
    drivers = root / "sys" / "bus" / "pci" / "drivers"
    for name in ("nvidia", "vfio-pci"):
        (drivers / name).mkdir(parents=True, exist_ok=True)
    bus = [f"0000:00:{n:02x}.0" for n in (6, 7)] + [f"0000:{0x10 * n:02x}:00.0" for n in range(1, 7)]
    for i, bdf in enumerate(bus):
        d = root / "sys" / "bus" / "pci" / "devices" / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        driver = "nvidia" if i < 2 else others_driver
        if driver:
            os.symlink(drivers / driver, d / "driver")
        if i < 2 or in_driver_list:
            info = root / "proc" / "driver" / "nvidia" / "gpus" / bdf
            info.mkdir(parents=True)
            (info / "information").write_text(f"Model: NVIDIA H200\nDevice Minor: {i}\n")
    (root / "dev").mkdir()
    for minor in (0, 1):
        (root / "dev" / f"nvidia{minor}").write_text("")
    return root


def _record_view(root: Path, out: Path) -> tuple[Path, list[dict[str, Any]]]:
    host = Recorder(RecordedDriver(FakeNvml.bundled("nvml_h200x2.json")), reps=1, sysfs_root=str(root)).record()
    recording = json.loads(bundled_recording_path("nvml_h200x2.json").read_text())
    recording.update({k: host[k] for k in ("other_pci_gpus",) if k in host})
    out.write_text(json.dumps(recording))
    return out, host.get("other_pci_gpus", {}).get("value", [])


def test_a_recording_of_a_restricted_view_replays_with_its_other_gpus_outside_it(tmp_path: Path) -> None:
    """``gpuhealth record`` inside a Slurm job or enroot container given 2 of 8 GPUs keeps the other 6 as what they
    were there (the driver's, no /dev node here): the replay says outside the view, never 6 GPUs missing."""
    root = _host_with_eight_gpus(tmp_path / "view", others_driver="nvidia", in_driver_list=True)
    recording, others = _record_view(root, tmp_path / "view.json")
    assert [(o["driver"], o["minor"], o["device_node"]) for o in others] == [
        ("nvidia", m, "absent") for m in range(2, 8)]
    rc, doc, findings = _status(recording)
    _assert_in_service(rc, doc, findings)
    assert not [f for f in findings if f["code"] == "gpu.missing"]


def test_a_recording_of_gpus_the_driver_lost_still_replays_as_missing(tmp_path: Path) -> None:
    # The same 6 on the bus bound to no driver and in no driver list: the driver failed to probe them.
    root = _host_with_eight_gpus(tmp_path / "lost", others_driver=None, in_driver_list=False)
    recording, others = _record_view(root, tmp_path / "lost.json")
    assert [o["driver"] for o in others] == [None] * 6 and all("minor" not in o for o in others)
    rc, _, findings = _status(recording)
    assert rc == 2 and [f["severity"] for f in findings if f["code"] == "gpu.missing"] == ["critical"], findings


def test_a_recordings_other_gpus_are_checked_when_it_loads(tmp_path: Path) -> None:
    recording = json.loads(bundled_recording_path("nvml_h200x2.json").read_text())
    recording["other_pci_gpus"] = {"value": [{"bdf": f"0000:{n % 256:02x}:{n // 256:02x}.0"} for n in range(5000)]}
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(recording))
    out = run_cli("status", "--nvml-snapshot", str(path), "--json")
    assert out.returncode == 3 and "other_pci_gpus: expected a list of at most 256" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
