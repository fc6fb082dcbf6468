"""Where this process runs — bare metal or a VM guest, inside a container or not — and so what it can see.

A check may judge only what it can see. A VM guest holding two GPUs of an 8-GPU NVSwitch board does not own
the switches (the host runs the fabric and its Fabric Manager); a container without the host's PID namespace
sees only its own processes; a container given two of eight GPUs still sees all eight on the PCI bus. Checks
read these facts (``environment_of`` in ``collectors/_shared.py``) and say "cannot see" as info where they
lack what they need, instead of calling a healthy node faulty.

Evidence, read from a root path (``/`` live; a tree in tests), strongest first:

- **PID namespace**: the host's (initial) one has the fixed inode 0xEFFFFFFC (``PROC_PID_INIT_INO``, kernel
  ``include/linux/proc_ns.h``, since 3.8). Any other inode: this process cannot see the host's processes.
- **cgroup namespace**: the initial one is 0xEFFFFFFB (``PROC_CGROUP_INIT_INO``); a private one is how
  container runtimes start containers on cgroup v2.
- **network namespace**: 0xEFFFFFF9 (``PROC_NET_INIT_INO``) on kernels that fix it; else the same as PID 1's
  when PID 1 is the host's init and readable; else unknown.
- **cgroup path** naming a container runtime (``kubepods``, ``docker``, ``containerd``, ``crio``, ``libpod``,
  ``lxc``): a container even where it shares the host's namespaces (a ``hostPID`` pod).
- **marker files** ``/.dockerenv``, ``/run/.containerenv``: weak. Images built as containers and booted as
  VMs keep them (the cloud VMs gpuhealth was measured on do), so they are only noted, never decisive.
- **virtualization**: the CPU's ``hypervisor`` flag (x86: CPUID.1:ECX[31], set by hypervisors for their
  guests), ``/sys/hypervisor/type`` (Xen), a device-tree ``hypervisor`` node (Arm), DMI strings of
  hypervisors (QEMU, KVM, VMware, Hyper-V, Xen, VirtualBox, Google Compute Engine, OpenStack). x86 with CPU
  flags and none of these is bare metal; elsewhere without evidence either way: unknown.
- **NVSwitches**: PCI functions of vendor 0x10de and class 0x0680 (bridge, other) under ``/sys/bus/pci``.
  On an HGX board's bare-metal host they are there; a guest given only GPUs has none.

A recording (``gpuhealth record``) stores these facts under the system key ``environment``, so a replay is
judged as the machine it came from; a recording that does not say is ``UNKNOWN`` (nothing to prove a fault
with).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.backends.errors import NvmlError

# include/linux/proc_ns.h: the initial namespaces' fixed inode numbers.
PID_INIT_INO = 0xEFFFFFFC
CGROUP_INIT_INO = 0xEFFFFFFB
NET_INIT_INO = 0xEFFFFFF9

NVIDIA_VENDOR_ID = 0x10DE
NVSWITCH_PCI_CLASS = 0x0680  # bridge, other: how NVSwitches enumerate

VIRTUALIZATION_NONE, VIRTUALIZATION_VM, VIRTUALIZATION_UNKNOWN = "none", "vm", "unknown"

_RUNTIME_CGROUP = re.compile(r"kubepods|docker|containerd|cri-containerd|crio|libpod|lxc", re.IGNORECASE)
# DMI sys_vendor / product_name of hypervisors (lower case, substring). "Amazon EC2" is absent on purpose:
# metal instances say it too; the CPU flag tells their VMs apart.
_VM_DMI = ("qemu", "kvm", "vmware", "virtualbox", "innotek", "xen", "bochs", "parallels", "openstack",
           "google compute engine", "virtual machine", "cloud hypervisor", "firecracker")


@dataclass(frozen=True, slots=True)
class Environment:
    """The facts, each None when it could not be read. ``evidence`` says what each answer rests on."""

    virtualization: str = VIRTUALIZATION_UNKNOWN  # "none" (bare metal), "vm" (a guest), "unknown"
    container: bool | None = None
    host_pid_namespace: bool | None = None
    host_network_namespace: bool | None = None
    nvswitches_visible: int | None = None  # NVSwitch PCI functions this host sees
    evidence: tuple[str, ...] = field(default_factory=tuple)

    @property
    def kind(self) -> str:
        """"bare metal", "VM guest", "container", "container in a VM guest" or "unknown"."""
        if self.container:
            return "container in a VM guest" if self.virtualization == VIRTUALIZATION_VM else "container"
        if self.virtualization == VIRTUALIZATION_VM:
            return "VM guest"
        if self.virtualization == VIRTUALIZATION_NONE and self.container is False:
            return "bare metal"
        return "unknown"

    def summary(self) -> str:
        """One line for logs and the human view: kind, namespaces, NVSwitches."""
        parts = [self.kind if self.kind != "unknown" or not self.evidence else f"unknown ({self.evidence[0]})"]
        ns = []
        if self.host_pid_namespace is not None:
            ns.append(("host" if self.host_pid_namespace else "own") + " PID namespace")
        if self.host_network_namespace is not None:
            ns.append(("host" if self.host_network_namespace else "own") + " network namespace")
        parts.extend(ns)
        if self.nvswitches_visible is not None:
            parts.append(f"{self.nvswitches_visible} NVSwitch(es) visible")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "virtualization": self.virtualization, "container": self.container,
                "host_pid_namespace": self.host_pid_namespace,
                "host_network_namespace": self.host_network_namespace,
                "nvswitches_visible": self.nvswitches_visible, "evidence": list(self.evidence)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Environment:
        """From ``to_dict`` (a recording's ``environment``); fields of the wrong type read as unknown."""

        def flag(key: str) -> bool | None:
            v = data.get(key)
            return v if isinstance(v, bool) else None

        virt = data.get("virtualization")
        switches = data.get("nvswitches_visible")
        evidence = data.get("evidence")
        return cls(
            virtualization=virt if virt in (VIRTUALIZATION_NONE, VIRTUALIZATION_VM) else VIRTUALIZATION_UNKNOWN,
            container=flag("container"), host_pid_namespace=flag("host_pid_namespace"),
            host_network_namespace=flag("host_network_namespace"),
            nvswitches_visible=switches if isinstance(switches, int) and not isinstance(switches, bool)
            and switches >= 0 else None,
            evidence=tuple(str(e)[:200] for e in evidence[:20]) if isinstance(evidence, list) else (),
        )


# A replay of a recording that does not say where it was made: nothing here can prove a fault.
UNKNOWN = Environment(evidence=("replayed from a recording that does not record its environment",))


def _read(path: Path, limit: int = 1 << 20) -> str | None:
    try:
        with path.open("rb") as fh:
            return fh.read(limit).decode(errors="replace")
    except OSError:
        return None


def _ns_inode(link: Path) -> int | None:
    """``pid:[4026531836]`` → 4026531836 (readlink, so a test tree can hold the link as text)."""
    try:
        target = os.readlink(link)
    except OSError:
        return None
    m = re.fullmatch(r"\w+:\[(\d+)\]", target)
    return int(m.group(1)) if m else None


def _cpu_flags(proc: Path) -> set[str] | None:
    text = _read(proc / "cpuinfo", 1 << 16)  # the first CPU's block is enough
    if text is None:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set() if "processor" in text else None


def _virtualization(root: Path) -> tuple[str, list[str]]:
    proc, sys = root / "proc", root / "sys"
    evidence: list[str] = []
    flags = _cpu_flags(proc)
    if flags and "hypervisor" in flags:
        evidence.append("CPU flag 'hypervisor' (/proc/cpuinfo)")
    xen = _read(sys / "hypervisor" / "type")
    if xen and xen.strip():
        evidence.append(f"/sys/hypervisor/type = {xen.strip()[:40]}")
    if (proc / "device-tree" / "hypervisor").exists():
        evidence.append("device tree has a 'hypervisor' node")
    dmi = {k: (_read(sys / "class" / "dmi" / "id" / k) or "").strip()[:80] for k in ("sys_vendor", "product_name")}
    for key, value in dmi.items():
        if value and any(v in value.lower() for v in _VM_DMI):
            evidence.append(f"DMI {key} = {value}")
    if evidence:
        return VIRTUALIZATION_VM, evidence
    if flags:  # x86 (and Arm "Features") read, no hypervisor anywhere
        return VIRTUALIZATION_NONE, ["no hypervisor flag in /proc/cpuinfo, no hypervisor in DMI or sysfs"]
    if any(dmi.values()):
        return VIRTUALIZATION_NONE, [f"DMI names no hypervisor ({dmi['sys_vendor'] or dmi['product_name']})"]
    return VIRTUALIZATION_UNKNOWN, ["no CPU flags or DMI strings readable"]


def _namespaces(root: Path) -> tuple[bool | None, bool | None, bool | None, list[str]]:
    """(host PID ns, host cgroup ns, host network ns, evidence)."""
    proc = root / "proc"
    evidence: list[str] = []
    pid = _ns_inode(proc / "self" / "ns" / "pid")
    cgroup = _ns_inode(proc / "self" / "ns" / "cgroup")
    net = _ns_inode(proc / "self" / "ns" / "net")
    host_pid = None if pid is None else pid == PID_INIT_INO
    host_cgroup = None if cgroup is None else cgroup == CGROUP_INIT_INO
    host_net: bool | None = None
    if net is not None and net == NET_INIT_INO:
        host_net = True
    elif net is not None and host_pid:
        init_net = _ns_inode(proc / "1" / "ns" / "net")  # needs ptrace access to PID 1 (root)
        host_net = None if init_net is None else init_net == net
    if host_pid is not None:
        evidence.append(f"PID namespace {'is' if host_pid else 'is not'} the host's (inode {pid})")
    if host_cgroup is not None and not host_cgroup:
        evidence.append(f"cgroup namespace is not the host's (inode {cgroup})")
    if host_net is not None:
        evidence.append(f"network namespace {'is' if host_net else 'is not'} the host's (inode {net})")
    return host_pid, host_cgroup, host_net, evidence


def _container(root: Path, host_pid: bool | None, host_cgroup: bool | None,
               environ: Mapping[str, str]) -> tuple[bool | None, list[str]]:
    strong: list[str] = []
    weak: list[str] = []
    if host_pid is False:
        strong.append("own PID namespace")
    if host_cgroup is False:
        strong.append("own cgroup namespace")
    cgroups = _read(root / "proc" / "self" / "cgroup", 1 << 16) or ""
    m = _RUNTIME_CGROUP.search(cgroups)
    if m:
        strong.append(f"cgroup path names a container runtime ({m.group(0)})")
    if environ.get("KUBERNETES_SERVICE_HOST"):
        strong.append("KUBERNETES_SERVICE_HOST is set (a Kubernetes pod)")
    for marker in (".dockerenv", "run/.containerenv"):
        if (root / marker).exists():
            weak.append(f"/{marker} exists")
    if strong:
        return True, strong + weak
    if host_pid is None and host_cgroup is None:
        return (True if weak else None), weak or ["namespaces unreadable"]
    if weak:  # host namespaces, no runtime cgroup: an image built as a container, booted as a machine
        return False, [f"{w}, but the namespaces are the host's" for w in weak]
    return False, []


def _nvswitches(root: Path) -> tuple[int | None, list[str]]:
    base = root / "sys" / "bus" / "pci" / "devices"
    try:
        names = os.listdir(base)
    except OSError:
        return None, ["/sys/bus/pci unreadable: NVSwitches unknown"]
    count = 0
    for name in names:
        vendor = _read(base / name / "vendor", 64)
        if vendor is None or vendor.strip().lower() != "0x10de":
            continue
        cls = _read(base / name / "class", 64)
        try:
            if cls is not None and int(cls.strip(), 16) >> 8 == NVSWITCH_PCI_CLASS:
                count += 1
        except ValueError:
            continue
    return count, [f"{count} NVSwitch PCI function(s) (vendor 0x10de, class 0x0680) in /sys/bus/pci"]


def detect_environment(root: str | os.PathLike[str] = "/", environ: Mapping[str, str] | None = None) -> Environment:
    """Read the facts now (a few hundred small reads: ~1 ms). Never raises."""
    base = Path(root)
    virtualization, v_evidence = _virtualization(base)
    host_pid, host_cgroup, host_net, ns_evidence = _namespaces(base)
    container, c_evidence = _container(base, host_pid, host_cgroup, os.environ if environ is None else environ)
    switches, s_evidence = _nvswitches(base)
    return Environment(virtualization=virtualization, container=container, host_pid_namespace=host_pid,
                       host_network_namespace=host_net, nvswitches_visible=switches,
                       evidence=tuple(v_evidence + ns_evidence + c_evidence + s_evidence))


@functools.lru_cache(maxsize=8)
def _live(root: str) -> Environment:
    # Read once per process: none of these change while it runs.
    return detect_environment(root)


def environment_for(backend: Any, root: str | os.PathLike[str] = "/") -> Environment:
    """The environment a backend's readings come from: a replay's recorded one (``UNKNOWN`` when it does
    not say: a replayed node is not this host), else this host's."""
    if getattr(backend, "simulated", False):
        try:
            recorded = backend.system("environment")
        except NvmlError:
            return UNKNOWN
        return Environment.from_dict(recorded) if isinstance(recorded, Mapping) else UNKNOWN
    return _live(os.fspath(root))


__all__ = ["UNKNOWN", "Environment", "detect_environment", "environment_for"]
