"""Linux sysfs, read from a root path so tests (and recordings) can supply their own tree.

Two implementations of one ``Sysfs`` protocol:
- ``RealSysfs(root="/")`` reads files under ``<root>/sys`` (PCI devices, InfiniBand ports, NUMA nodes).
- ``RecordedSysfs(backend)`` answers from the per-GPU ``sysfs`` key of an NVML recording
  (``backend.query(i, "sysfs")``), so a replayed recording is self-consistent: its GPUs' PCI link,
  NUMA node and local CPUs come from the same machine as its NVML answers.

Every reader returns ``None`` / empty for what is absent: a VM without NUMA, a host without
InfiniBand and a device without a ``max_link_width`` file are normal, not errors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpuhealth.backends.errors import NvmlError

NVIDIA_VENDOR_ID = 0x10DE
# PCI class (base class << 8 | subclass): VGA-compatible and 3D controllers. Data-centre GPUs
# present as 3D controllers (0x0302); some boards/VMs as VGA (0x0300).
GPU_PCI_CLASSES = frozenset({0x0300, 0x0302})

# Transfer rate per lane (GT/s) → PCIe generation, as the kernel writes ``current_link_speed``.
_GTS_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}

# Per-port counters the InfiniBand collector reads (``ports/N/counters/<name>``); missing ones are skipped.
IB_COUNTERS = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_rcv_data",
    "port_xmit_data",
    "port_xmit_wait",
    "port_xmit_packets",
    "port_rcv_packets",
)
# /sys/class/net/<if>/statistics counters read for Ethernet NICs (bytes are traffic; the rest errors/drops).
NET_STATISTICS = ("rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped", "rx_crc_errors")


def parse_cpulist(text: str | None) -> frozenset[int]:
    """"0-3,8,10-11" → {0,1,2,3,8,10,11}. Empty/None/garbage parts → ignored (never raises)."""
    out: set[int] = set()
    if not text:
        return frozenset()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if hi else a
        except ValueError:
            continue
        if 0 <= a <= b:
            out.update(range(a, b + 1))
    return frozenset(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """{0,1,2,3,8} → "0-3,8" (the kernel's own form, for evidence and messages)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def link_generation(speed: str | None) -> int | None:
    """"32.0 GT/s PCIe" → 5; "Unknown" or None → None."""
    if not speed:
        return None
    head = speed.strip().split(" ", 1)[0]
    try:
        gts = float(head)
    except ValueError:
        return None
    return _GTS_TO_GEN.get(gts)


def _int(text: str | None, base: int = 10) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip(), base)
    except ValueError:
        return None


def _link_name(path: Path) -> str | None:
    """The last part of a symlink's target (a device's ``driver`` → "nvidia"), None when absent."""
    try:
        return os.path.basename(os.readlink(path)) or None
    except OSError:
        return None


def normalise_bdf(bus_id: str) -> str:
    """NVML "00000000:18:00.0" or sysfs "0000:18:00.0" → "0000:18:00.0" (lower case)."""
    bus = bus_id.strip().lower()
    if bus.count(":") == 2 and len(bus.split(":")[0]) == 8:
        bus = bus[4:]
    return bus


@dataclass(frozen=True, slots=True)
class PciDevice:
    """What sysfs says about one PCI function. Fields are None when the file is absent."""

    bdf: str
    vendor: int | None = None
    device: int | None = None
    pci_class: int | None = None  # base class << 8 | subclass (0x0302 = 3D controller)
    numa_node: int | None = None  # -1 when the platform has no NUMA information
    local_cpulist: str | None = None
    current_link_speed: str | None = None
    max_link_speed: str | None = None
    current_link_width: int | None = None
    max_link_width: int | None = None
    driver: str | None = None  # the bound kernel driver ("nvidia", "vfio-pci"); None when unbound or unknown

    @property
    def current_link_gen(self) -> int | None:
        return link_generation(self.current_link_speed)

    @property
    def max_link_gen(self) -> int | None:
        return link_generation(self.max_link_speed)

    @property
    def local_cpus(self) -> frozenset[int]:
        return parse_cpulist(self.local_cpulist)

    @property
    def is_nvidia_gpu(self) -> bool:
        return self.vendor == NVIDIA_VENDOR_ID and self.pci_class in GPU_PCI_CLASSES


@dataclass(frozen=True, slots=True)
class IbPort:
    """One InfiniBand/RoCE port (``class/infiniband/<device>/ports/<port>``)."""

    device: str  # "mlx5_0"
    port: int
    state: str | None = None  # "4: ACTIVE"
    phys_state: str | None = None  # "5: LinkUp"
    rate: str | None = None  # "400 Gb/sec (4X NDR)"
    link_layer: str | None = None  # "InfiniBand" or "Ethernet" (RoCE)
    counters: Mapping[str, int] = field(default_factory=dict)
    model: str | None = None  # the HCA's hca_type ("MT4129"), else its board_id: peers share it

    @property
    def id(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def width(self) -> int | None:
        """Lanes from the rate's "(4X NDR)" → 4."""
        if not self.rate or "(" not in self.rate:
            return None
        word = self.rate.split("(", 1)[1].split()[0].upper()
        return _int(word[:-1]) if word.endswith("X") else None

    @property
    def state_name(self) -> str:
        """"4: ACTIVE" → "ACTIVE"."""
        return _state_word(self.state)

    @property
    def phys_state_name(self) -> str:
        return _state_word(self.phys_state)

    @property
    def rate_gbps(self) -> float | None:
        if not self.rate:
            return None
        try:
            return float(self.rate.split()[0])
        except (ValueError, IndexError):
            return None


@dataclass(frozen=True, slots=True)
class NetInterface:
    """One network interface (``class/net/<name>``): link facts and statistics."""

    name: str
    physical: bool  # backed by a device (a ``device`` link): not lo, veth, bridges, bonds, tunnels
    operstate: str | None = None  # "up", "down", "lowerlayerdown", "unknown"
    speed_mbps: int | None = None  # None when absent or -1 (unknown: no link, or a virtual NIC)
    duplex: str | None = None  # "full" / "half" / "unknown"
    carrier_changes: int | None = None
    driver: str | None = None  # device/driver link name ("mlx5_core", "ice"): peers share it
    statistics: Mapping[str, int] = field(default_factory=dict)


def _state_word(text: str | None) -> str:
    if not text:
        return ""
    return text.split(":", 1)[-1].strip().upper()


@runtime_checkable
class Sysfs(Protocol):
    """Read-only sysfs facts the collectors need."""

    @property
    def description(self) -> str: ...

    def pci_device(self, bdf: str) -> PciDevice | None:
        """The PCI function at ``bdf`` (NVML or sysfs form), or None when absent."""
        ...

    def nvidia_pci_devices(self) -> list[PciDevice]:
        """Every NVIDIA GPU function the kernel enumerated (vendor 0x10de, display class)."""
        ...

    def nvidia_driver_gpus(self) -> dict[str, int | None] | None:
        """The GPUs the NVIDIA driver shows this view (``/proc/driver/nvidia/gpus/<bdf>``) → their device
        minor (``/dev/nvidia<minor>``), or None when the driver's directory cannot be read. In a container the
        NVIDIA runtime mounts only the container's own GPUs there."""
        ...

    def device_node_exists(self, minor: int) -> bool:
        """``/dev/nvidia<minor>`` is present in this view (a container gets only its GPUs' nodes)."""
        ...

    def device_node_refused(self, minor: int) -> bool:
        """``/dev/nvidia<minor>`` is present but this process may not open it: the device cgroup (Slurm
        ``ConstrainDevices``, Apptainer/enroot under Slurm) or its file mode refuses it."""
        ...

    def infiniband_ports(self) -> list[IbPort]: ...

    def net_interfaces(self) -> list[NetInterface]:
        """Every ``/sys/class/net`` interface; empty where there is no such tree (a recording)."""
        ...

    def numa_nodes(self) -> dict[int, frozenset[int]]:
        """NUMA node → its CPUs; empty when the platform exposes no NUMA topology."""
        ...


class RealSysfs:
    """sysfs under ``root`` (``/`` on a real host; a tmp tree in tests)."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self._root = Path(root)
        self._sys = self._root / "sys"

    @property
    def description(self) -> str:
        return f"sysfs at {self._sys}"

    @staticmethod
    def _read(path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None

    def _device_at(self, bdf: str, path: Path) -> PciDevice:
        r = self._read
        cls = _int(r(path / "class"), 16)
        return PciDevice(
            bdf=bdf,
            vendor=_int(r(path / "vendor"), 16),
            device=_int(r(path / "device"), 16),
            pci_class=None if cls is None else cls >> 8,
            numa_node=_int(r(path / "numa_node")),
            local_cpulist=r(path / "local_cpulist"),
            current_link_speed=r(path / "current_link_speed"),
            max_link_speed=r(path / "max_link_speed"),
            current_link_width=_int(r(path / "current_link_width")),
            max_link_width=_int(r(path / "max_link_width")),
            driver=_link_name(path / "driver"),
        )

    def nvidia_driver_gpus(self) -> dict[str, int | None] | None:
        base = self._root / "proc" / "driver" / "nvidia" / "gpus"
        try:
            names = os.listdir(base)
        except OSError:
            return None
        out: dict[str, int | None] = {}
        for name in names:
            minor = None
            for line in (self._read(base / name / "information") or "").splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "Device Minor":
                    minor = _int(value)
            out[normalise_bdf(name)] = minor
        return out

    def device_node_exists(self, minor: int) -> bool:
        return (self._root / "dev" / f"nvidia{minor}").exists()

    def device_node_refused(self, minor: int) -> bool:
        # access(2) runs the kernel's open checks (file mode, then the device cgroup) without calling
        # the driver's open, which would try to bring an uninitialised GPU up.
        path = self._root / "dev" / f"nvidia{minor}"
        return path.exists() and not os.access(path, os.R_OK | os.W_OK)

    def pci_device(self, bdf: str) -> PciDevice | None:
        norm = normalise_bdf(bdf)
        path = self._sys / "bus" / "pci" / "devices" / norm
        if not path.is_dir():
            return None
        return self._device_at(norm, path)

    def nvidia_pci_devices(self) -> list[PciDevice]:
        base = self._sys / "bus" / "pci" / "devices"
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        out = []
        for name in names:
            vendor = _int(self._read(base / name / "vendor"), 16)
            if vendor != NVIDIA_VENDOR_ID:
                continue
            dev = self._device_at(name, base / name)
            if dev.is_nvidia_gpu:
                out.append(dev)
        return out

    def infiniband_ports(self) -> list[IbPort]:
        base = self._sys / "class" / "infiniband"
        try:
            devices = sorted(os.listdir(base))
        except OSError:
            return []
        out = []
        for dev in devices:
            ports_dir = base / dev / "ports"
            try:
                ports = sorted(os.listdir(ports_dir), key=lambda p: _int(p) or 0)
            except OSError:
                continue
            for port in ports:
                num = _int(port)
                if num is None:
                    continue
                pdir = ports_dir / port
                counters: dict[str, int] = {}
                for name in IB_COUNTERS:
                    value = _int(self._read(pdir / "counters" / name))
                    if value is not None:
                        counters[name] = value
                out.append(
                    IbPort(
                        device=dev,
                        port=num,
                        state=self._read(pdir / "state"),
                        phys_state=self._read(pdir / "phys_state"),
                        rate=self._read(pdir / "rate"),
                        link_layer=self._read(pdir / "link_layer"),
                        counters=counters,
                        model=self._read(base / dev / "hca_type") or self._read(base / dev / "board_id"),
                    )
                )
        return out

    def net_interfaces(self) -> list[NetInterface]:
        base = self._sys / "class" / "net"
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        out = []
        for name in names:
            d = base / name
            speed = _int(self._read(d / "speed"))
            stats: dict[str, int] = {}
            for counter in NET_STATISTICS:
                value = _int(self._read(d / "statistics" / counter))
                if value is not None:
                    stats[counter] = value
            out.append(NetInterface(
                name=name, physical=(d / "device").exists() and not (d / "bridge").exists(),
                operstate=self._read(d / "operstate"), speed_mbps=speed if speed is not None and speed > 0 else None,
                duplex=self._read(d / "duplex"), carrier_changes=_int(self._read(d / "carrier_changes")),
                driver=_link_name(d / "device" / "driver"), statistics=stats))
        return out

    def numa_nodes(self) -> dict[int, frozenset[int]]:
        base = self._sys / "devices" / "system" / "node"
        try:
            names = os.listdir(base)
        except OSError:
            return {}
        out: dict[int, frozenset[int]] = {}
        for name in names:
            if not name.startswith("node"):
                continue
            num = _int(name[4:])
            if num is None:
                continue
            out[num] = parse_cpulist(self._read(base / name / "cpulist"))
        return dict(sorted(out.items()))


class RecordedSysfs:
    """Answers from a recording's per-GPU ``sysfs`` key (``backend.query(i, "sysfs")``).

    A recording holds only its GPUs' PCI attributes: there are no InfiniBand ports, network
    interfaces or NUMA node list in it, so those answer empty (what a host without them would say) —
    unless ``nic_root`` names a sysfs tree for the node's NICs (a configured ``collectors.sysfs_root``
    other than ``/``: a replayed GPU node given a fixture NIC tree; the host's own NICs never leak
    into a replay)."""

    def __init__(self, backend: Any, nic_root: str | os.PathLike[str] | None = None) -> None:
        self._backend = backend
        self._nics = RealSysfs(nic_root) if nic_root is not None else None

    @property
    def description(self) -> str:
        return f"sysfs recorded in {getattr(self._backend, 'description', 'a recording')}"

    def _recorded(self) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = []
        try:
            count = int(self._backend.device_count())
        except NvmlError:
            return out
        for i in range(count):
            try:
                data = self._backend.query(i, "sysfs")
            except NvmlError:
                continue
            if isinstance(data, Mapping):
                out.append(data)
        return out

    @staticmethod
    def _device(data: Mapping[str, Any]) -> PciDevice:
        def text(key: str) -> str | None:
            v = data.get(key)
            return None if v is None else str(v)

        return PciDevice(
            bdf=normalise_bdf(str(data.get("bdf", ""))),
            # The recorder only stored GPUs: vendor/class default to an NVIDIA 3D controller.
            vendor=_int(text("vendor"), 16) if "vendor" in data else NVIDIA_VENDOR_ID,
            device=_int(text("device"), 16),
            pci_class=(_int(text("class"), 16) or 0) >> 8 if "class" in data else 0x0302,
            numa_node=_int(text("numa_node")),
            local_cpulist=text("local_cpulist"),
            current_link_speed=text("current_link_speed"),
            max_link_speed=text("max_link_speed"),
            current_link_width=_int(text("current_link_width")),
            max_link_width=_int(text("max_link_width")),
        )

    def pci_device(self, bdf: str) -> PciDevice | None:
        norm = normalise_bdf(bdf)
        for data in self._recorded():
            if normalise_bdf(str(data.get("bdf", ""))) == norm:
                return self._device(data)
        return None

    def _others(self) -> list[Mapping[str, Any]]:
        """A scenario's ``system.other_pci_gpus``: NVIDIA GPUs on the host's bus that its NVML does not list
        (``{bdf, driver, minor, device_node}``, checked by the fake backend when it loads the scenario)."""
        try:
            others = self._backend.system("other_pci_gpus")
        except NvmlError:
            return []
        if not isinstance(others, list):
            return []
        return [o for o in others if isinstance(o, Mapping) and isinstance(o.get("bdf"), str)]

    def _other_node(self, minor: int) -> str:
        return next((str(o.get("device_node", "present")) for o in self._others() if o.get("minor") == minor),
                    "present")

    def _recorded_gpus(self) -> list[PciDevice]:
        return [d for d in (self._device(x) for x in self._recorded() if x.get("bdf")) if d.is_nvidia_gpu]

    def nvidia_pci_devices(self) -> list[PciDevice]:
        recorded = self._recorded_gpus()
        others = [PciDevice(bdf=normalise_bdf(o["bdf"]), vendor=NVIDIA_VENDOR_ID, pci_class=0x0302,
                            driver=o.get("driver", "nvidia")) for o in self._others()]
        return recorded + others

    def nvidia_driver_gpus(self) -> dict[str, int | None] | None:
        # a recording holds only the driver's GPUs; another GPU is listed when the scenario gives its minor
        listed: dict[str, int | None] = {d.bdf: None for d in self._recorded_gpus()}
        for o in self._others():
            if isinstance(o.get("minor"), int):
                listed[normalise_bdf(o["bdf"])] = o["minor"]
        return listed

    def device_node_exists(self, minor: int) -> bool:
        return self._other_node(minor) != "absent"

    def device_node_refused(self, minor: int) -> bool:
        return self._other_node(minor) == "refused"

    def infiniband_ports(self) -> list[IbPort]:
        return self._nics.infiniband_ports() if self._nics else []

    def net_interfaces(self) -> list[NetInterface]:
        return self._nics.net_interfaces() if self._nics else []

    def numa_nodes(self) -> dict[int, frozenset[int]]:
        return {}


def sysfs_for(backend: Any, root: str | os.PathLike[str] = "/") -> Sysfs:
    """The sysfs that matches a backend: the recording's own for a simulated one (NICs from ``root`` when
    it is a tree other than ``/``), else the host's."""
    if getattr(backend, "simulated", False):
        return RecordedSysfs(backend, nic_root=None if os.path.abspath(root) == "/" else root)
    return RealSysfs(root)
