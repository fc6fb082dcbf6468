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
