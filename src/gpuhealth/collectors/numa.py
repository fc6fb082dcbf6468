"""NUMA placement: is every process on a GPU running, and keeping its memory, near that GPU?

The GPU's node and local CPUs come from sysfs (``numa_node``, ``local_cpulist``) and NVML
(``NumaNodeId``, ``CpuAffinity_64x4``). For each process NVML lists on the GPU
(``ComputeRunningProcesses``), the process inspector gives its CPU affinity (psutil) and where its
memory pages are (``/proc/<pid>/numa_maps``, when readable).

A process is misplaced (``numa.process_misplaced``, warning, ``check_job``) when
- its CPU affinity has no CPU local to the GPU (pinned to the wrong socket), or
- most of its resident pages (≥ ``1 - local share``) sit on another node.
A process allowed on every CPU is not misplaced by its affinity alone (the scheduler may still do
well); its memory placement is still checked.

NVML names processes by their id in the host's PID namespace. A container without the host's PID
namespace (no ``hostPID``) would read another process under the same number in its own ``/proc``: there
the processes are not inspected, and one info finding (``numa.processes_unobserved``) says so.

When the platform has no NUMA information (VMs report ``numa_node`` = -1 and NVML
"Not Supported", as the real recordings do) nothing can be judged: the collector records that as a
node observation and one info finding (``numa.unknown``), never a warning. A host with a single
NUMA node (the kernel also reports -1 there) has nothing to misplace: no finding at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.sysfs import format_cpulist, parse_cpulist
from gpuhealth.collectors._shared import environment_of, fetch, gpu_entity, is_number, node_entity, sysfs_of
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Finding, Sample, Severity

NAME = "numa"
# A process whose pages on the GPU's node are below this share of its (node-attributed) pages is
# misplaced; fewer than MIN_PAGES resident pages say nothing (a process still starting).
LOCAL_PAGE_SHARE_MIN = 0.5
MIN_PAGES = 256


class ProcessInspector(Protocol):
    """What the collector asks about a process; each answer is None when it cannot be read."""

    def name(self, pid: int) -> str | None: ...

    def cpu_affinity(self, pid: int) -> frozenset[int] | None: ...

    def numa_pages(self, pid: int) -> dict[int, int] | None:
        """Resident pages per NUMA node (summed ``N<node>=<pages>`` of ``numa_maps``)."""
        ...


def parse_numa_maps(text: str) -> dict[int, int]:
    """Sum the ``N<node>=<pages>`` fields of every mapping in ``/proc/<pid>/numa_maps``."""
    pages: dict[int, int] = {}
    for line in text.splitlines():
        for tok in line.split()[2:]:
            if tok.startswith("N") and "=" in tok:
                node_s, _, count_s = tok[1:].partition("=")
                try:
                    node, count = int(node_s), int(count_s)
                except ValueError:
                    continue
                pages[node] = pages.get(node, 0) + count
    return pages


class SystemProcessInspector:
    """psutil for names and affinity, ``<proc_root>/<pid>/numa_maps`` for memory placement."""

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc") -> None:
        self._proc = Path(proc_root)

    def name(self, pid: int) -> str | None:
        import psutil

        try:
            return str(psutil.Process(pid).name())
        except (psutil.Error, OSError):
            return None

    def cpu_affinity(self, pid: int) -> frozenset[int] | None:
        import psutil

        try:
            return frozenset(psutil.Process(pid).cpu_affinity() or [])
        except (psutil.Error, OSError, AttributeError):
            return None

    def numa_pages(self, pid: int) -> dict[int, int] | None:
        try:
            text = (self._proc / str(pid) / "numa_maps").read_text()
        except (OSError, UnicodeDecodeError):
            return None
        return parse_numa_maps(text)


def cpus_from_mask(words: Any, word_bits: int = 64) -> frozenset[int]:
    """NVML ``CpuAffinity`` (list of 64-bit words, lowest CPU in bit 0 of word 0) → CPU set."""
    out: set[int] = set()
    if not isinstance(words, (list, tuple)):
        return frozenset()
    for w_index, word in enumerate(words):
        if not is_number(word):
            continue
        w = int(word)
        bit = 0
        while w:
            if w & 1:
                out.add(w_index * word_bits + bit)
            w >>= 1
            bit += 1
    return frozenset(out)


def _processes(value: Any) -> list[dict[str, Any]]:
    procs: list[dict[str, Any]] = []
    if isinstance(value, (list, tuple)):
        for p in value:
            if isinstance(p, Mapping) and is_number(p.get("pid")):
                procs.append({"pid": int(p["pid"]), "used_gpu_memory": p.get("usedGpuMemory")})
    return procs


class NumaCollector:
    name = NAME
    lane = Lane.SLOW

    def __init__(self, inspector: ProcessInspector | None = None) -> None:
        self._inspector: ProcessInspector = inspector or SystemProcessInspector()

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        sysfs = sysfs_of(ctx)
        nodes = sysfs.numa_nodes()
        # NVML's pids are the host's: only a view of the host's PID namespace can look them up.
        sees_pids = environment_of(ctx).host_pid_namespace is not False
        obs.node["numa_nodes"] = {n: format_cpulist(c) for n, c in nodes.items()}
        for g in ctx.gpus:
            i = g.index
            rec = obs.gpu(i)
            dev = sysfs.pci_device(g.pci_bus_id) if g.pci_bus_id else None
            node: int | None = None
            local: frozenset[int] = frozenset()
            if dev is not None:
                if dev.numa_node is not None and dev.numa_node >= 0:
                    node = dev.numa_node
                local = dev.local_cpus
            nvml_node = fetch(ctx, obs, i, "NumaNodeId")
            if node is None and is_number(nvml_node) and nvml_node >= 0:
                node = int(nvml_node)
            if not local:
                local = cpus_from_mask(fetch(ctx, obs, i, "CpuAffinity_64x4"))
            if not local and node is not None and node in nodes:
                local = nodes[node]
            rec["numa_node"] = node
            rec["local_cpus"] = format_cpulist(local)
            procs = _processes(_gpu_processes(ctx, obs, i))
            if procs and not sees_pids:
                obs.node["processes_unobserved"] = True
                rec["processes"] = [{**p, "unobserved": True} for p in procs]
                continue
            for p in procs:
                pid = p["pid"]
                p["name"] = self._inspector.name(pid)
                aff = self._inspector.cpu_affinity(pid)
                p["cpus"] = None if aff is None else format_cpulist(aff)
                pages = self._inspector.numa_pages(pid)
                p["pages_by_node"] = pages
            rec["processes"] = procs
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        out: list[Finding] = []
        unknown: list[int] = []
        for i, rec in sorted(obs.per_gpu.items()):
            node = rec.get("numa_node")
            local = parse_cpulist(rec.get("local_cpus"))
            if node is None:
                unknown.append(i)
                continue
            for p in rec.get("processes") or []:
                if p.get("unobserved"):
                    continue
                reasons: list[str] = []
                cpus_text = p.get("cpus")
                cpus = parse_cpulist(cpus_text) if cpus_text is not None else None
                if cpus and local and not (cpus & local):
                    reasons.append(f"CPU affinity {cpus_text} has no CPU local to the GPU ({format_cpulist(local)})")
                pages = p.get("pages_by_node") or {}
                total = sum(pages.values())
                local_share = None
                if total >= MIN_PAGES:
                    local_share = pages.get(node, 0) / total
                    if local_share < LOCAL_PAGE_SHARE_MIN:
                        reasons.append(f"only {local_share:.0%} of its memory is on node {node}")
                if reasons:
                    out.append(Finding(
                        "numa.process_misplaced", Severity.WARNING, gpu_entity(ctx, i),
                        f"GPU {i} (NUMA node {node}): process {p['pid']} ({p.get('name') or '?'}): "
                        + "; ".join(reasons),
                        Action.CHECK_JOB,
                        {"pid": p["pid"], "name": p.get("name"), "cpus": cpus_text, "node": node,
                         "gpu_local_cpus": format_cpulist(local),
                         "local_page_share": None if local_share is None else round(local_share, 3)},
                        NAME,
                    ))
        if obs.node.get("processes_unobserved"):
            gpus = [i for i, rec in sorted(obs.per_gpu.items()) if any(p.get("unobserved")
                                                                      for p in rec.get("processes") or [])]
            out.append(Finding(
                "numa.processes_unobserved", Severity.INFO, node_entity(ctx),
                f"process placement on GPU(s) {', '.join(map(str, gpus))} not checked: this container does not "
                "share the host's PID namespace, so NVML's process ids name processes it cannot see (hostPID)",
                Action.NONE, {"gpus": gpus}, NAME,
            ))
        if unknown and len(obs.node.get("numa_nodes") or {}) != 1:  # one node: nothing to misplace
            out.append(Finding(
                "numa.unknown", Severity.INFO, node_entity(ctx),
                f"the platform reports no NUMA node for GPU(s) {', '.join(map(str, unknown))} "
                "(common in VMs); process placement not checked",
                Action.NONE, {"gpus": unknown}, NAME,
            ))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        out: list[Sample] = []
        for i, rec in sorted(obs.per_gpu.items()):
            node = rec.get("numa_node")
            out.append(Sample("gpu_numa_node", float(node if node is not None else -1),
                              "NUMA node the GPU is attached to (-1 when the platform does not say).", gpu=i))
            out.append(Sample("gpu_processes", float(len(rec.get("processes") or [])),
                              "Compute processes running on the GPU.", gpu=i))
        return out



def _gpu_processes(ctx: CollectContext, obs: Observations, index: int) -> Any:
    """``ComputeRunningProcesses``. On a MIG-enabled GPU NVML lists the whole GPU's processes only to
    a privileged caller and answers NO_PERMISSION otherwise (nvml.h): for an unprivileged agent that
    is "cannot see", like "not supported" — not a failing GPU."""
    try:
        return ctx.backend.query(index, "ComputeRunningProcesses")
    except NvmlError as exc:
        if exc.code == errors.NO_PERMISSION:
            obs.unsupported.add((index, "ComputeRunningProcesses"))
            obs.gpu(index)["processes_hidden"] = exc.message or "no permission"
        else:
            obs.note_error(index, "ComputeRunningProcesses", exc)
        return None

def create() -> Collector:
    return NumaCollector()
