"""Memory bandwidth probes: device copy (HBM), pinned host↔device per GPU (PCIe, NUMA wiring).

The host side of each GPU is measured with the process pinned to the CPUs of the GPU's NUMA node
(sysfs ``numa_node`` / ``local_cpulist`` of its PCI function) before the pinned buffer is touched,
so the buffer lands in that node's memory. When the machine has several NUMA nodes, the other
nodes are measured too: a remote node that beats the "local" one means sysfs (or the wiring) is
wrong. Judgement is pure (``judge``): HBM against a per-model reference, PCIe against what the
slot's maximum link speed and width can carry.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.model import Action, Entity, Finding, Severity

SOURCE = "diag.bandwidth"
GB = 1e9
# Device-to-device copy, GB/s counting bytes read + written. H200: 3.8 TB/s, under the 4.16–4.18 TB/s this
# probe measured there (docs/measurements.md); H100 SXM (3.35 TB/s HBM3 peak) and the other entries are
# estimates at ~88% of the datasheet peak, the ratio the H200 reference keeps (3.8 of 4.8 ≈ 0.8, rounded up
# for newer parts).
HBM_REFERENCE_GBPS: dict[str, float] = {
    "H200": 3800.0,
    "H100 NVL": 3400.0,
    "H100 PCIe": 1750.0,
    "H100": 2950.0,
    "A100-SXM4-80GB": 1700.0,
    "A100": 1350.0,
}
# PCIe: raw GT/s per lane → payload bytes/s per lane (encoding), times the ~88% efficiency a Gen5 x16
# slot showed (~55 GB/s of 63 GB/s, docs/measurements.md).
_ENCODING = {2.5: 0.8, 5.0: 0.8, 8.0: 128 / 130, 16.0: 128 / 130, 32.0: 128 / 130, 64.0: 242 / 256}
PCIE_EFFICIENCY = 0.88


def hbm_reference(name: str) -> float | None:
    for key, value in HBM_REFERENCE_GBPS.items():  # most specific first
        if key in name:
            return value
    return None


def pcie_expected_gbps(max_link_speed: str, max_link_width: str | int) -> float | None:
    """What a healthy link of this kind moves per direction, GB/s (None if sysfs is unreadable)."""
    m = re.search(r"([\d.]+)\s*GT/s", str(max_link_speed))
    try:
        width = int(max_link_width)
    except (TypeError, ValueError):
        return None
    if not m or width <= 0:
        return None
    gts = float(m.group(1))
    enc = _ENCODING.get(gts, 128 / 130)
    return gts * enc * width / 8 * PCIE_EFFICIENCY


@dataclass(frozen=True, slots=True)
class PciePlace:
    bdf: str
    numa_node: int  # -1 when the platform does not say (VMs)
    local_cpus: frozenset[int]
    max_link_speed: str
    max_link_width: str
    current_link_speed: str
    current_link_width: str


def parse_cpulist(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    return frozenset(cpus)


def read_pci_place(bdf: str, sysfs_root: str | Path = "/") -> PciePlace | None:
    base = Path(sysfs_root) / "sys/bus/pci/devices" / bdf

    def read(name: str) -> str:
        try:
            return (base / name).read_text().strip()
        except OSError:
            return ""

    if not base.exists():
        return None
    numa = read("numa_node")
    try:
        cpus = parse_cpulist(read("local_cpulist"))
    except ValueError:
        cpus = frozenset()
    return PciePlace(bdf, int(numa) if numa.lstrip("-").isdigit() else -1, cpus, read("max_link_speed"),
                     read("max_link_width"), read("current_link_speed"), read("current_link_width"))


def numa_nodes(sysfs_root: str | Path = "/") -> dict[int, frozenset[int]]:
    base = Path(sysfs_root) / "sys/devices/system/node"
    nodes: dict[int, frozenset[int]] = {}
    for d in sorted(base.glob("node[0-9]*")):
        try:
            nodes[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


@dataclass(slots=True)
class GpuBandwidth:
    device: str
    uuid: str
    index: int | None
    name: str
    d2d_gbps: float | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    numa_node: int = -1
    pinned_to: list[int] = field(default_factory=list)  # CPUs the host side ran on
    h2d_by_numa: dict[int, float] = field(default_factory=dict)
    pcie: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 1)

        return {"device": self.device, "uuid": self.uuid, "index": self.index, "name": self.name,
                "d2d_gbps": r(self.d2d_gbps), "h2d_gbps": r(self.h2d_gbps), "d2h_gbps": r(self.d2h_gbps),
                "numa_node": self.numa_node, "pinned_cpus": len(self.pinned_to),
                "h2d_by_numa": {str(k): round(v, 1) for k, v in self.h2d_by_numa.items()},
                "pcie": self.pcie, "notes": self.notes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GpuBandwidth:
        g = cls(str(d["device"]), str(d["uuid"]), d.get("index"), str(d.get("name", "")),
                d.get("d2d_gbps"), d.get("h2d_gbps"), d.get("d2h_gbps"), int(d.get("numa_node", -1)))
        g.h2d_by_numa = {int(k): float(v) for k, v in (d.get("h2d_by_numa") or {}).items()}
        g.pcie = dict(d.get("pcie") or {})
        return g


def judge(results: Sequence[GpuBandwidth], *, hbm_fraction: float = 0.85, pcie_fraction: float = 0.75,
          numa_margin: float = 1.15) -> list[Finding]:
    findings: list[Finding] = []
    for g in results:
        entity = Entity.gpu(g.uuid, g.index)
        ref = hbm_reference(g.name)
        if g.d2d_gbps is not None and ref is not None and g.d2d_gbps < hbm_fraction * ref:
            findings.append(Finding(
                code="bandwidth.low", severity=Severity.WARNING, entity=entity,
                message=f"GPU {g.index} device memory copy {g.d2d_gbps:.0f} GB/s is "
                        f"{g.d2d_gbps / ref:.0%} of the {ref:.0f} GB/s expected for {g.name}",
                action=Action.MONITOR,
                evidence={"path": "device", "measured_gbps": g.d2d_gbps, "reference_gbps": ref}, source=SOURCE))
        expected = pcie_expected_gbps(g.pcie.get("max_link_speed", ""), g.pcie.get("max_link_width", ""))
        for direction, value in (("host_to_device", g.h2d_gbps), ("device_to_host", g.d2h_gbps)):
            if value is None or expected is None or value >= pcie_fraction * expected:
                continue
            degraded = (g.pcie.get("current_link_width"), g.pcie.get("current_link_speed")) != (
                g.pcie.get("max_link_width"), g.pcie.get("max_link_speed"))
            findings.append(Finding(
                code="bandwidth.low", severity=Severity.WARNING, entity=entity,
                message=f"GPU {g.index} pinned {direction.replace('_', ' ')} {value:.1f} GB/s is "
                        f"{value / expected:.0%} of the {expected:.1f} GB/s a {g.pcie.get('max_link_speed')} "
                        f"x{g.pcie.get('max_link_width')} link carries"
                        + (f" (link trained at {g.pcie.get('current_link_speed')} "
                           f"x{g.pcie.get('current_link_width')})" if degraded else ""),
                action=Action.MONITOR,
                evidence={"path": direction, "measured_gbps": value, "expected_gbps": expected,
                          "numa_node": g.numa_node, **g.pcie}, source=SOURCE))
        if g.numa_node >= 0 and g.numa_node in g.h2d_by_numa and len(g.h2d_by_numa) > 1:
            best_node, best = max(g.h2d_by_numa.items(), key=lambda kv: kv[1])
            local = g.h2d_by_numa[g.numa_node]
            if best_node != g.numa_node and best > numa_margin * local:
                findings.append(Finding(
                    code="bandwidth.numa_mismatch", severity=Severity.WARNING, entity=entity,
                    message=f"GPU {g.index} is reported on NUMA node {g.numa_node} but host→device from node "
                            f"{best_node} is faster ({best:.1f} vs {local:.1f} GB/s): NUMA wiring or "
                            f"firmware tables are wrong; pinning jobs by sysfs will hurt them",
                    action=Action.MONITOR,
                    evidence={"numa_node": g.numa_node, "h2d_by_numa": dict(g.h2d_by_numa)}, source=SOURCE))
    return findings


# ---------------------------------------------------------------- measuring (torch, in the child)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def _timed_copies(torch: Any, dst: Any, src: Any, reps: int) -> float:
    """Median seconds of one ``dst.copy_(src)``, timed with device events."""
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return _median(times[1:])


def measure_cpu(torch: Any, nbytes: int, reps: int = 5) -> float:
    """Host memory copy, GB/s read+write (the CPU path of the device-copy probe)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / _median(times[1:]) / GB


def _host_to_device(torch: Any, device: Any, nbytes: int, reps: int) -> tuple[float, float]:
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    host.uniform_()  # first touch happens here, on the CPUs we are pinned to
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    h2d = nbytes / _timed_copies(torch, dev, host, reps) / GB
    d2h = nbytes / _timed_copies(torch, host, dev, reps) / GB
    del host, dev
    return h2d, d2h


def measure_gpu(torch: Any, index: int, *, d2d_bytes: int, host_bytes: int, reps: int = 5,
                sysfs_root: str = "/", all_numa: bool = True, device_copy: bool = True,
                host_copy: bool = True) -> GpuBandwidth:
    """``device_copy``/``host_copy`` False leave that part out (quick qualification measures the
    device copy on every GPU at once, and the host copies one GPU at a time: they share the host)."""
    props = torch.cuda.get_device_properties(index)
    device = torch.device("cuda", index)
    bdf = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    g = GpuBandwidth(f"cuda:{index}", f"GPU-{props.uuid}", index, props.name)
    with torch.cuda.device(device):
        if device_copy:
            src = torch.randn(d2d_bytes // 4, device=device)
            dst = torch.empty_like(src)
            g.d2d_gbps = 2 * d2d_bytes / _timed_copies(torch, dst, src, reps) / GB
            del src, dst
        if not host_copy:
            return g
        place = read_pci_place(bdf, sysfs_root)
        saved = os.sched_getaffinity(0)
        try:
            if place is None:
                g.notes.append(f"no sysfs entry for {bdf}: host side not pinned")
            else:
                g.numa_node = place.numa_node
                g.pcie = {"bdf": bdf, "max_link_speed": place.max_link_speed,
                          "max_link_width": place.max_link_width,
                          "current_link_speed": place.current_link_speed,
                          "current_link_width": place.current_link_width}
                if place.numa_node < 0:
                    g.notes.append("sysfs numa_node is -1 (no NUMA information, e.g. a VM): not pinned")
                elif place.local_cpus:
                    os.sched_setaffinity(0, place.local_cpus & saved or place.local_cpus)
            g.pinned_to = sorted(os.sched_getaffinity(0))
            g.h2d_gbps, g.d2h_gbps = _host_to_device(torch, device, host_bytes, reps)
            nodes = numa_nodes(sysfs_root) if all_numa and place is not None and place.numa_node >= 0 else {}
            if len(nodes) > 1:
                g.h2d_by_numa[place.numa_node] = g.h2d_gbps  # type: ignore[union-attr]
                for node, cpus in nodes.items():
                    if node == g.numa_node or not (cpus & saved):
                        continue
                    os.sched_setaffinity(0, cpus & saved)
                    g.h2d_by_numa[node] = _host_to_device(torch, device, host_bytes, reps)[0]
        finally:
            os.sched_setaffinity(0, saved)
    return g
