"""Where gpuhealth runs decides what it may judge: bare metal, VM guest, container (backends/environment.py).

A check that cannot see from where it runs says so as info and never drains: the Fabric Manager of a board a VM
guest does not own, the host's processes from a container without hostPID, GPUs the NVIDIA runtime did not give
a container. The bare-metal fault (the manager died after the fabric trained) still drains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.backends.environment import (
    CGROUP_INIT_INO,
    NET_INIT_INO,
    PID_INIT_INO,
    UNKNOWN,
    Environment,
    detect_environment,
    environment_for,
)
from gpuhealth.backends.fabricmanager import fabric_manager_state
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.backends.sysfs import RealSysfs
from gpuhealth.collectors.base import CollectContext, History
from gpuhealth.collectors.numa import NumaCollector
from gpuhealth.collectors.nvlink import NvlinkCollector
from gpuhealth.collectors.presence import PresenceCollector
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.config import Config
from gpuhealth.model import Action, Finding, Severity

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
OTHER_INO = 4026532501  # a namespace some runtime made (dynamic inode range)

BARE_METAL = {"virtualization": "none", "container": False, "host_pid_namespace": True,
              "host_network_namespace": True, "nvswitches_visible": 4}
VM_GUEST = {"virtualization": "vm", "container": False, "host_pid_namespace": True,
            "host_network_namespace": True, "nvswitches_visible": 0}
POD_WITHOUT_HOSTPID = {"virtualization": "none", "container": True, "host_pid_namespace": False,
                       "host_network_namespace": False, "nvswitches_visible": 4}


# ------------------------------------------------------------------------------------ detection

def _host(root: Path, *, flags: str = "fpu sse2", pid: int = PID_INIT_INO, cgroup: int = CGROUP_INIT_INO,
          net: int = NET_INIT_INO, cgroup_path: str = "0::/init.scope", markers: tuple[str, ...] = (),
          nvswitches: int = 0, dmi: dict[str, str] | None = None) -> Path:
    """A root tree as the kernel shows it: /proc/cpuinfo, namespace links (as readlink text), /sys/bus/pci."""
    ns = root / "proc" / "self" / "ns"
    ns.mkdir(parents=True)
    for name, ino in (("pid", pid), ("cgroup", cgroup), ("net", net)):
        os.symlink(f"{name}:[{ino}]", ns / name)
    (root / "proc" / "cpuinfo").write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n")
    (root / "proc" / "self" / "cgroup").write_text(cgroup_path + "\n")
    for marker in markers:
        (root / marker).parent.mkdir(parents=True, exist_ok=True)
        (root / marker).write_text("")
    pci = root / "sys" / "bus" / "pci" / "devices"
    pci.mkdir(parents=True)
    for n in range(nvswitches):
        d = pci / f"0000:{0x80 + n:02x}:00.0"
        d.mkdir()
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x068000\n")
    gpu = pci / "0000:18:00.0"
    gpu.mkdir()
    (gpu / "vendor").write_text("0x10de\n")
    (gpu / "class").write_text("0x030200\n")
    for key, value in (dmi or {}).items():
        path = root / "sys" / "class" / "dmi" / "id" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return root


def test_bare_metal_hgx_host_owns_its_switches(tmp_path: Path) -> None:
    env = detect_environment(_host(tmp_path, nvswitches=4, dmi={"sys_vendor": "Supermicro"}), environ={})
    assert (env.kind, env.virtualization, env.container) == ("bare metal", "none", False)
    assert (env.host_pid_namespace, env.host_network_namespace, env.nvswitches_visible) == (True, True, 4)


def test_the_measured_cloud_vm_is_a_guest_not_a_container(tmp_path: Path) -> None:
    # What the 2 x H200 device VM showed (scripts/device/platform_facts.sh): the CPU's hypervisor flag, the host's
    # namespaces, no NVSwitch, and a /.dockerenv left in the image it was booted from.
    root = _host(tmp_path, flags="fpu sse2 hypervisor", markers=(".dockerenv",), cgroup_path="0::/process_api/x")
    env = detect_environment(root, environ={"CONTAINER_NAME": "smart-ritual"})
    assert (env.kind, env.container, env.nvswitches_visible) == ("VM guest", False, 0)
    assert "CPU flag 'hypervisor' (/proc/cpuinfo)" in env.evidence
    assert any("/.dockerenv exists, but the namespaces are the host's" in e for e in env.evidence)


def test_a_pod_without_host_pid_is_a_container_that_cannot_see_the_host(tmp_path: Path) -> None:
    root = _host(tmp_path, pid=OTHER_INO, cgroup=OTHER_INO + 1, net=OTHER_INO + 2, nvswitches=4,
                 cgroup_path="0::/kubepods.slice/kubepods-burstable.slice/cri-containerd-ab12.scope")
    env = detect_environment(root, environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert (env.kind, env.container, env.host_pid_namespace) == ("container", True, False)
    assert env.host_network_namespace is None  # not the fixed initial inode, PID 1 not the host's: unknown
    assert "own PID namespace" in env.evidence


def test_a_hostpid_pod_is_a_container_that_sees_the_host(tmp_path: Path) -> None:
    root = _host(tmp_path, flags="fpu hypervisor", cgroup_path="0::/kubepods/besteffort/pod1/abc")
    env = detect_environment(root, environ={})
    assert (env.kind, env.container, env.host_pid_namespace) == ("container in a VM guest", True, True)


def test_dmi_names_the_hypervisor_where_cpu_flags_do_not(tmp_path: Path) -> None:
    root = _host(tmp_path, flags="", dmi={"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"})
    assert detect_environment(root, environ={}).virtualization == "vm"


def test_nothing_readable_is_unknown_not_an_error(tmp_path: Path) -> None:
    env = detect_environment(tmp_path / "nothing", environ={})
    assert env.kind == "unknown" and env.container is None and env.nvswitches_visible is None
    assert env.host_pid_namespace is None and env.virtualization == "unknown"


def test_round_trip_and_hostile_recorded_values() -> None:
    env = Environment("vm", False, True, None, 0, ("x",))
    assert Environment.from_dict(env.to_dict()) == env
    bad = Environment.from_dict({"virtualization": "mainframe", "container": "yes", "nvswitches_visible": True,
                                 "host_pid_namespace": 1, "evidence": "not a list"})
    assert bad == Environment(evidence=())


def test_a_replay_is_judged_as_the_machine_it_came_from() -> None:
    fake = _replay({"environment": VM_GUEST})
    assert environment_for(fake).kind == "VM guest"
    assert environment_for(_replay({})) is UNKNOWN  # the recording does not say: a replay is not this host


# ------------------------------------------------------------------------------------ the Fabric Manager

def _replay(system: dict[str, Any], rec: str = "nvml_h200x2.json") -> FakeNvml:
    fake = FakeNvml.from_scenario({"recording": rec, "system": system})
    fake.init()
    return fake


def _run(collector: Any, fake: FakeNvml, *, sysfs: Any = None, environment: Any = None) -> list[Finding]:
    ctx = CollectContext(backend=fake, config=Config(), gpus=enumerate_gpus(fake), node_name="n1", now=time.time(),
                         sysfs=sysfs, environment=environment)
    run = CollectorRunner(timeout_s=None).run(collector, ctx, History())
    assert run.success, run.error
    return list(run.findings)


def _fm(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.code.startswith("fabric.manager")]


def test_bare_metal_with_the_fabric_manager_stopped_drains() -> None:
    # The H200 recording's GPUs have 18 NVSwitch links each; the manager died after training (state "completed").
    [f] = _fm(_run(NvlinkCollector(None), _replay({"fabric_manager": "stopped", "environment": BARE_METAL})))
    assert (f.code, f.severity, f.action) == ("fabric.manager_down", Severity.CRITICAL, Action.DRAIN)
    assert f.evidence["gpus_on_nvswitch"] == [0, 1]
    assert _fm(_run(NvlinkCollector(None), _replay({"fabric_manager": "running", "environment": BARE_METAL}))) == []


def test_a_vm_guest_without_switches_says_it_cannot_see_the_manager() -> None:
    fake_fabric = {"0": {"GpuFabricInfo": {"state": 3, "status": 0, "cliqueId": 0, "clusterUuid": []}},
                   "1": {"GpuFabricInfo": {"state": 3, "status": 0, "cliqueId": 0, "clusterUuid": []}}}
    fake = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "overrides": fake_fabric,
                                   "system": {"fabric_manager": "stopped", "environment": VM_GUEST}})
    fake.init()
    findings = _run(NvlinkCollector(None), fake)
    [f] = _fm(findings)
    assert (f.code, f.severity, f.action) == ("fabric.manager_unobserved", Severity.INFO, Action.NONE)
    assert "VM guest" in f.message and "2 GPU(s) completed/success" in f.message
    assert [x for x in findings if x.severity >= Severity.WARNING] == []


def test_a_container_without_host_pid_says_it_cannot_see_the_manager() -> None:
    [f] = _fm(_run(NvlinkCollector(None), _replay({"fabric_manager": "stopped", "environment": POD_WITHOUT_HOSTPID})))
    assert f.code == "fabric.manager_unobserved" and "PID namespace" in f.message
    # the same node seen from a hostPID pod is judged
    host_pid = {**POD_WITHOUT_HOSTPID, "host_pid_namespace": True}
    [g] = _fm(_run(NvlinkCollector(None), _replay({"fabric_manager": "stopped", "environment": host_pid})))
    assert g.code == "fabric.manager_down"


def test_a_replay_that_does_not_record_its_environment_never_drains() -> None:
    [f] = _fm(_run(NvlinkCollector(None), _replay({"fabric_manager": "stopped"})))
    assert f.code == "fabric.manager_unobserved" and f.severity is Severity.INFO


def test_a_gpu_without_nvswitch_links_needs_no_manager() -> None:
    fake = _replay({"fabric_manager": "stopped", "environment": BARE_METAL}, rec="nvml_h100x1.json")
    assert _fm(_run(NvlinkCollector(None), fake)) == []


def test_fabric_manager_is_found_in_proc(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "comm").write_text("systemd\n")
    (proc / "1" / "cmdline").write_bytes(b"/sbin/init\0")
    (proc / "self").mkdir()
    assert fabric_manager_state(proc) == "stopped"
    (proc / "4242").mkdir()
    (proc / "4242" / "comm").write_text("nv-fabricmanage\n")  # the kernel cuts comm to 15 characters
    (proc / "4242" / "cmdline").write_bytes(b"/usr/bin/nv-fabricmanager\0-c\0/usr/share/nvidia/fm.cfg\0")
    assert fabric_manager_state(proc) == "running"
    assert fabric_manager_state(tmp_path / "no-proc") is None


# ------------------------------------------------------------------------------------ GPUs outside the view

def _bus(root: Path, gpus: dict[str, str | None], *, driver_lists: dict[str, int] | None = None,
         device_nodes: tuple[int, ...] = ()) -> RealSysfs:
    """PCI GPUs → bound driver; the NVIDIA driver's /proc/driver/nvidia/gpus (bdf → minor); /dev/nvidia<N>."""
    for bdf, driver in gpus.items():
        d = root / "sys" / "bus" / "pci" / "devices" / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        if driver:
            os.symlink(f"../../../bus/pci/drivers/{driver}", d / "driver")
    for bdf, minor in (driver_lists or {}).items():
        d = root / "proc" / "driver" / "nvidia" / "gpus" / bdf
        d.mkdir(parents=True)
        (d / "information").write_text(f"Model: \t\t NVIDIA H200\nBus Location: \t {bdf}\nDevice Minor: \t {minor}\n")
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for minor in device_nodes:
        (root / "dev" / f"nvidia{minor}").write_text("")
    return RealSysfs(root)


EIGHT = {f"0000:00:{6 + n:02x}.0": "nvidia" for n in range(8)}  # the recording's GPUs are 00:06.0 and 00:07.0
MINE = {"0000:00:06.0": 0, "0000:00:07.0": 1}
CONTAINER = Environment("vm", True, False, False, 0, ("test",))
HOST = Environment("none", False, True, True, 0, ("test",))


def test_a_container_given_two_of_eight_gpus_is_not_missing_six(tmp_path: Path) -> None:
    fake = _replay({})
    # legacy NVIDIA runtime: /proc/driver/nvidia/gpus holds only the container's GPUs
    sysfs = _bus(tmp_path / "legacy", EIGHT, driver_lists=MINE, device_nodes=(0, 1))
    [f] = _run(PresenceCollector(), fake, sysfs=sysfs, environment=CONTAINER)
    assert (f.code, f.severity, f.action) == ("gpu.outside_view", Severity.INFO, Action.NONE)
    assert "6 not given to this container" in f.message
    # CDI: the driver lists all eight, but only the container's device nodes exist
    every = {bdf: n for n, bdf in enumerate(EIGHT)}
    sysfs = _bus(tmp_path / "cdi", EIGHT, driver_lists=every, device_nodes=(0, 1))
    [g] = _run(PresenceCollector(), fake, sysfs=sysfs, environment=CONTAINER)
    assert g.code == "gpu.outside_view" and len(g.evidence["gpus"]) == 6


def test_on_the_host_the_same_bus_is_six_missing_gpus(tmp_path: Path) -> None:
    every = {bdf: n for n, bdf in enumerate(EIGHT)}
    sysfs = _bus(tmp_path, EIGHT, driver_lists=every, device_nodes=tuple(range(8)))
    [f] = _run(PresenceCollector(), _replay({}), sysfs=sysfs, environment=HOST)
    assert (f.code, f.severity) == ("gpu.missing", Severity.CRITICAL)
    assert len(f.evidence["on_pci_not_in_nvml"]) == 6


def test_gpus_handed_to_vfio_are_outside_the_hosts_view(tmp_path: Path) -> None:
    bus = {**dict(list(EIGHT.items())[:2]), "0000:00:08.0": "vfio-pci", "0000:00:09.0": "vfio-pci"}
    [f] = _run(PresenceCollector(), _replay({}), sysfs=_bus(tmp_path, bus), environment=HOST)
    assert f.code == "gpu.outside_view" and "2 bound to vfio-pci" in f.message
    unbound = {**bus, "0000:00:0a.0": None}  # the driver failed to probe it: really missing
    [g] = [x for x in _run(PresenceCollector(), _replay({}), sysfs=_bus(tmp_path / "u", unbound), environment=HOST)
           if x.code == "gpu.missing"]
    assert g.evidence["on_pci_not_in_nvml"] == ["0000:00:0a.0"]


# ------------------------------------------------------------------------------------ process placement

class _WrongSocket:
    """An inspector that would call every process misplaced (pinned far from the GPU)."""

    def name(self, pid: int) -> str | None:
        return "python"

    def cpu_affinity(self, pid: int) -> frozenset[int] | None:
        return frozenset({63})

    def numa_pages(self, pid: int) -> dict[int, int] | None:
        return {1: 10_000}


def test_a_container_without_host_pid_does_not_judge_host_pids(tmp_path: Path) -> None:
    procs = {"ComputeRunningProcesses": [{"pid": 4242, "usedGpuMemory": 1 << 30}], "NumaNodeId": 0,
             "sysfs": {"numa_node": "0", "local_cpulist": "0-31"}}
    fake = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "overrides": {"0": procs}})
    fake.init()
    seen = _run(NumaCollector(_WrongSocket()), fake, environment=HOST)
    assert [f.code for f in seen if f.severity >= Severity.WARNING] == ["numa.process_misplaced"]
    unseen = _run(NumaCollector(_WrongSocket()), fake, environment=CONTAINER)
    assert [f.code for f in unseen if f.severity >= Severity.WARNING] == []
    assert [f.evidence["gpus"] for f in unseen if f.code == "numa.processes_unobserved"] == [[0]]


# ------------------------------------------------------------------------------------ through the command

def _status(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUHEALTH, "status", "--nvml-snapshot", str(path), *args], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize(("environment", "fm", "rc", "action"), [
    (VM_GUEST, "stopped", 0, "none"),
    (POD_WITHOUT_HOSTPID, "stopped", 0, "none"),
    (BARE_METAL, "stopped", 2, "drain"),
    (BARE_METAL, "running", 0, "none"),
])
def test_status_drains_only_where_the_manager_is_proven_down(tmp_path: Path, environment: dict[str, Any], fm: str,
                                                             rc: int, action: str) -> None:
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"recording": "nvml_h200x2.json",
                                "system": {"fabric_manager": fm, "environment": environment}}))
    out = _status(path, "--json")
    assert out.returncode == rc, out.stderr
    doc = json.loads(out.stdout)
    assert doc["node"]["action"] == action
    assert doc["node"]["environment"]["kind"] == Environment.from_dict(environment).kind
    human = _status(path)
    assert f"Environment: {Environment.from_dict(environment).kind}" in human.stdout


# ------------------------------------------------------------------------------------ the real cloud VM recording

VM_RECORDING = Path(__file__).resolve().parents[2] / "fixtures" / "recordings" / "h200x2_vm_guest.json"


def test_the_recorded_cloud_vm_is_healthy_and_fit_through_the_commands(tmp_path: Path) -> None:
    # `gpuhealth record --anonymize` on a 2 x H200 VM guest of an 8-GPU HGX board
    # (scripts/device/vm_guest_validation.sh, 2026-11-28): fabric Completed/Success on both GPUs, no NVSwitch in
    # the guest, the CPU's hypervisor flag, and no nv-fabricmanager in the guest (the host runs it).
    rec = json.loads(VM_RECORDING.read_text())
    assert rec["fabric_manager"]["value"] == "stopped"
    assert rec["environment"]["value"]["kind"] == "VM guest" and rec["environment"]["value"]["nvswitches_visible"] == 0
    assert {d["GpuFabricInfo"]["value"]["state"] for d in rec["devices"]} == {3}
    for profile in ("slurm", "npd", "default"):
        out = _status(VM_RECORDING, "--json", "--exit-codes", profile)
        assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["node"]["health"], doc["node"]["action"]) == ("healthy", "none")
    assert [f["code"] for f in doc["findings"] if f["code"].startswith("fabric")] == ["fabric.manager_unobserved"]
    fit = subprocess.run([GPUHEALTH, "qualify", "--nvml-snapshot", str(VM_RECORDING), "--json",
                          "--exit-codes", "slurm"], capture_output=True, text=True, timeout=120, check=False)
    # On a recording qualify's diagnostics cannot run: not judged (unknown, never a drain), and nothing but the
    # diagnostics is missing — the collectors found this VM guest healthy.
    node = json.loads(fit.stdout)["node"]
    assert fit.returncode == 1 and (node["health"], node["action"], node["judged"]) == ("unknown", "none", False)
    assert all("did not run: simulated backend" in why for why in node["not_judged"]), node["not_judged"]


@pytest.mark.parametrize(("environment", "drains"), [(BARE_METAL, True), (POD_WITHOUT_HOSTPID, False)])
def test_the_same_board_on_bare_metal_drains_and_in_a_container_cannot_see(
        tmp_path: Path, environment: dict[str, Any], drains: bool) -> None:
    # No bare-metal HGX recording exists here: the VM recording's GPUs (on NVSwitches, fabric completed) with the
    # environment of a host that owns the switches, the manager stopped after training — the case only this check sees.
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"recording": str(VM_RECORDING), "system": {"environment": environment}}))
    out = _status(path, "--json", "--exit-codes", "slurm")
    codes = [f["code"] for f in json.loads(out.stdout)["findings"] if f["code"].startswith("fabric.manager")]
    assert (out.returncode, codes) == ((1, ["fabric.manager_down"]) if drains else (0, ["fabric.manager_unobserved"]))
