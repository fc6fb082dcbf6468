"""No drain for the environment a healthy node runs in: restricted views of the node's GPUs (false-drain audit
2026-11-28, items 2 and 3), through the shipped ``gpuhealth status --nvml-snapshot SCENARIO --json``.

A Slurm job's device cgroup, a pod given 2 of 8 GPUs, enroot: the PCI bus and the host's kernel log still show
every GPU. GPUs this view was not given are ``gpu.outside_view`` and their XIDs ``xid.outside_view`` (info);
a GPU the driver lost, or an XID on a GPU this view holds, still takes the node out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.integration.commands import run_cli

SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
TAKES_OUT = {"reboot", "reset_gpu", "drain"}


def _status(scenario: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = run_cli("status", "--nvml-snapshot", str(scenario), "--json", "--exit-codes", "slurm", *args, timeout=120)
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout)


def _findings(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The node's findings and every GPU's (``status --json`` files a GPU's under ``gpus[i].findings``)."""
    return [*doc["findings"], *(f for gpu in doc["gpus"] for f in gpu["findings"])]


def _codes(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in _findings(doc):
        out.setdefault(f["code"], []).append(f)
    return out


def test_a_slurm_job_given_two_of_eight_gpus_is_healthy() -> None:
    # The device cgroup refuses /dev/nvidia2..7; not a detected container (host PID and cgroup namespaces).
    rc, doc = _status(SCENARIOS / "view_slurm_cgroup_2of8.yaml", "--expected-gpus", "8")
    codes = _codes(doc)
    assert (rc, doc["node"]["health"], doc["node"]["action"]) == (0, "healthy", "none"), codes
    assert doc["node"]["environment"]["container"] is False
    assert "gpu.missing" not in codes
    [outside] = codes["gpu.outside_view"]
    assert (outside["severity"], outside["action"]) == ("info", "none")
    assert len(outside["evidence"]["gpus"]) == 6 and "device cgroup" in outside["message"]


def test_a_pod_given_two_of_eight_is_healthy_and_other_pods_xids_are_info() -> None:
    rc, doc = _status(SCENARIOS / "view_container_foreign_xid.yaml", "--expected-gpus", "8")
    codes = _codes(doc)
    assert (rc, doc["node"]["health"], doc["node"]["action"]) == (0, "healthy", "none"), codes
    assert not [f for f in _findings(doc) if f["action"] in TAKES_OUT]
    assert "gpu.missing" not in codes and not [c for c in codes if c.startswith("xid.") and c != "xid.outside_view"]
    foreign = {f["evidence"]["pci"]: f for f in codes["xid.outside_view"]}
    assert set(foreign) == {"0000:b8:00", "0000:c1:00"}
    assert {f["evidence"]["xid"] for f in foreign.values()} == {79, 48}
    for pci, f in foreign.items():
        assert (f["severity"], f["action"], f["entity"]["kind"]) == ("info", "none", "node")
        assert pci in f["message"] and "does not watch" in f["message"]


def test_an_xid_on_a_gpu_this_pod_holds_still_reboots(tmp_path: Path) -> None:
    scenario = yaml.safe_load((SCENARIOS / "view_container_foreign_xid.yaml").read_text())
    scenario["recording"] = str((SCENARIOS / scenario["recording"]).resolve())
    scenario["kmsg"].append("NVRM: Xid (PCI:0000:00:06): 79, pid=0, GPU has fallen off the bus.")
    path = tmp_path / "own_xid.yaml"
    path.write_text(yaml.safe_dump(scenario))
    rc, doc = _status(path, "--expected-gpus", "8")
    codes = _codes(doc)
    assert (rc, doc["node"]["health"], doc["node"]["action"]) == (1, "unhealthy", "reboot"), codes
    [own] = codes["xid.79"]
    assert (own["severity"], own["action"], own["entity"]["kind"], own["entity"]["gpu_index"]) == (
        "critical", "reboot", "gpu", 0)
    assert sorted(f["evidence"]["pci"] for f in codes["xid.outside_view"]) == ["0000:b8:00", "0000:c1:00"]


def test_gpus_the_driver_lost_are_still_missing_beside_the_ones_outside_the_view() -> None:
    rc, doc = _status(SCENARIOS / "view_driver_lost_gpus.yaml", "--expected-gpus", "8")
    codes = _codes(doc)
    assert (rc, doc["node"]["health"], doc["node"]["action"]) == (1, "unhealthy", "reboot"), codes
    [missing] = codes["gpu.missing"]
    assert (missing["severity"], missing["action"]) == ("critical", "reboot")
    # Listed by the driver with a device node this process may open, or bound to no driver: lost, not outside.
    assert missing["evidence"]["on_pci_not_in_nvml"] == ["0000:9a:00.0", "0000:ab:00.0"]
    assert missing["evidence"]["outside_view"] == 4 and "2 GPU(s) missing" in missing["message"]
    assert len(codes["gpu.outside_view"][0]["evidence"]["gpus"]) == 4


def test_on_bare_metal_with_every_gpu_visible_an_unknown_address_keeps_its_action(tmp_path: Path) -> None:
    # Today's behaviour where the view holds every GPU on the bus; and the same line on a bus GPU that NVML does
    # not list is left to gpu.missing (one reboot, not two).
    base = {"recording": str((SCENARIOS / "../recordings/h200x2_vm_guest.json").resolve()),
            "kmsg": ["NVRM: Xid (PCI:0000:9a:00): 79, pid=0, GPU has fallen off the bus."],
            "system": {"fabric_manager": "running",
                       "environment": {"virtualization": "none", "container": False, "host_pid_namespace": True,
                                       "host_network_namespace": True, "nvswitches_visible": 4}}}
    every = tmp_path / "every.yaml"
    every.write_text(yaml.safe_dump(base))
    rc, doc = _status(every)
    [node] = _codes(doc)["xid.79"]
    assert (rc, node["severity"], node["action"], node["entity"]["kind"]) == (1, "critical", "reboot", "node")
    base["system"]["other_pci_gpus"] = [{"bdf": "0000:9a:00.0", "driver": "nvidia", "minor": 2}]
    lost = tmp_path / "lost.yaml"
    lost.write_text(yaml.safe_dump(base))
    rc, doc = _status(lost)
    codes = _codes(doc)
    assert rc == 1 and [f["action"] for f in codes["gpu.missing"]] == ["reboot"] and "xid.79" not in codes
    [xid] = codes["xid.outside_view"]
    assert xid["evidence"]["pci"] == "0000:9a:00" and "not listed by NVML" in xid["message"]


def test_a_malformed_bus_entry_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"recording": str((SCENARIOS / "../recordings/h200x2_vm_guest.json").resolve()),
                                    "system": {"other_pci_gpus": [{"bdf": "0000:9a:00.0", "device_node": "gone"}]}}))
    out = run_cli("status", "--nvml-snapshot", str(path), "--json", timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "other_pci_gpus[0].device_node" in out.stderr and len(out.stderr.strip().splitlines()) == 1
