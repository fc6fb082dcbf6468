"""NUMA placement of GPU processes; VMs without NUMA information are not false alarms."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
from collector_kit import Sweeper, inline, problems, recording, sample_values

from gpuhealth.backends.sysfs import RealSysfs
from gpuhealth.collectors import numa
from gpuhealth.model import Action, EntityKind, Severity


class TableInspector:
    """Process facts from plain tables (what psutil and numa_maps would have said)."""

    def __init__(self, names: dict[int, str], cpus: dict[int, set[int]], pages: dict[int, dict[int, int]]):
        self.names, self.cpus, self.pages = names, cpus, pages

    def name(self, pid: int) -> str | None:
        return self.names.get(pid)

    def cpu_affinity(self, pid: int) -> frozenset[int] | None:
        c = self.cpus.get(pid)
        return None if c is None else frozenset(c)

    def numa_pages(self, pid: int) -> dict[int, int] | None:
        return self.pages.get(pid)


def two_socket_gpu(clock, pids: list[int]):
    """GPU 0 sits on NUMA node 1 (CPUs 16-31) with the given compute processes on it."""
    procs = [{"pid": p, "usedGpuMemory": 2 << 30} for p in pids]
    return inline(clock, {"0": {"sysfs": {"numa_node": "1", "local_cpulist": "16-31"},
                                "ComputeRunningProcesses": procs},
                          "1": {"sysfs": {"numa_node": "0", "local_cpulist": "0-15"}}})




def test_vm_without_numa_says_so_and_never_warns(clock):
    for rec in ("nvml_h200x2.json", "nvml_h100x1.json"):
        s = Sweeper(numa.NumaCollector(TableInspector({}, {}, {})), recording(rec, clock), clock)
        f = s.sweep()
        assert problems(f) == []
        (info,) = f
        assert (info.code, info.severity, info.entity.kind) == ("numa.unknown", Severity.INFO, EntityKind.NODE)
        assert s.last_obs.per_gpu[0]["numa_node"] is None
        assert sample_values(s.last_samples, "gpu_numa_node", 0) == [-1.0]


def test_process_pinned_to_the_other_socket_is_misplaced(clock):
    b = two_socket_gpu(clock, [4242])
    insp = TableInspector({4242: "python"}, {4242: set(range(16))}, {4242: {1: 50_000}})
    s = Sweeper(numa.NumaCollector(insp), b, clock)
    (f,) = s.sweep()
    assert (f.code, f.severity, f.action) == ("numa.process_misplaced", Severity.WARNING, Action.CHECK_JOB)
    assert f.entity.gpu_index == 0 and f.entity.id == b.query(0, "UUID")
    assert f.evidence["pid"] == 4242 and f.evidence["name"] == "python"
    assert f.evidence["cpus"] == "0-15" and f.evidence["node"] == 1
    assert f.evidence["gpu_local_cpus"] == "16-31"


def test_process_with_memory_on_the_wrong_node_is_misplaced(clock):
    b = two_socket_gpu(clock, [77])
    insp = TableInspector({77: "trainer"}, {77: set(range(32))}, {77: {0: 90_000, 1: 10_000}})
    (f,) = Sweeper(numa.NumaCollector(insp), b, clock).sweep()
    assert f.code == "numa.process_misplaced" and f.evidence["local_page_share"] == 0.1
    assert "10%" in f.message


def test_well_placed_and_unpinned_processes_are_fine(clock):
    b = two_socket_gpu(clock, [10, 11, 12])
    insp = TableInspector(
        {10: "pinned", 11: "unpinned", 12: "starting"},
        {10: set(range(16, 32)), 11: set(range(32)), 12: set(range(16, 32))},
        {10: {1: 80_000, 0: 100}, 11: {1: 60_000, 0: 20_000}, 12: {0: 100}},  # 12: too few pages to judge
    )
    s = Sweeper(numa.NumaCollector(insp), b, clock)
    assert s.sweep() == []
    assert sample_values(s.last_samples, "gpu_processes", 0) == [3.0]
    procs = s.last_obs.per_gpu[0]["processes"]
    assert [p["pid"] for p in procs] == [10, 11, 12] and procs[0]["cpus"] == "16-31"


def test_unreadable_process_facts_are_no_alarm(clock):
    b = two_socket_gpu(clock, [999])
    assert Sweeper(numa.NumaCollector(TableInspector({}, {}, {})), b, clock).sweep() == []


def test_node_from_nvml_and_cpus_from_the_node_list(clock, tmp_path):
    node = tmp_path / "sys" / "devices" / "system" / "node"
    for n, cpus in (("node0", "0-7"), ("node1", "8-15")):
        (node / n).mkdir(parents=True)
        (node / n / "cpulist").write_text(cpus + "\n")
    b = inline(clock, {"0": {"NumaNodeId": 1, "CpuAffinity_64x4": {"error": "Not Supported", "code": 3},
                             "ComputeRunningProcesses": [{"pid": 5, "usedGpuMemory": 1}]}})
    insp = TableInspector({5: "x"}, {5: {0, 1}}, {})
    s = Sweeper(numa.NumaCollector(insp), b, clock, sysfs=RealSysfs(tmp_path))
    (f,) = problems(s.sweep())  # no PCI device in this tree: node from NVML, local CPUs from node1
    assert f.evidence["gpu_local_cpus"] == "8-15" and f.evidence["node"] == 1
    assert s.last_obs.node["numa_nodes"] == {0: "0-7", 1: "8-15"}


def test_cpu_affinity_mask_decoding():
    assert numa.cpus_from_mask([0b1011, 0, 0, 0]) == {0, 1, 3}
    assert numa.cpus_from_mask([0, 1, 0, 0]) == {64}
    assert numa.cpus_from_mask([4294967295, 0, 0, 0]) == set(range(32))
    assert numa.cpus_from_mask("junk") == frozenset()


def test_numa_maps_parsing():
    text = (
        "7f0000000000 default file=/usr/lib/libc.so mapped=10 N0=6 N1=4 kernelpagesize_kB=4\n"
        "7f0000100000 interleave:0-1 anon=200 dirty=200 N0=100 N1=100\n"
        "7f0000200000 default stack anon=3 N1=3 weird=N7 Nx=5\n"
    )
    assert numa.parse_numa_maps(text) == {0: 106, 1: 107}


def test_system_inspector_reads_real_processes_and_a_proc_tree(tmp_path: Path):
    pid = os.getpid()
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "numa_maps").write_text("55d0 default anon=5 N0=5\n")
    insp = numa.SystemProcessInspector(proc_root=tmp_path)
    assert insp.name(pid) == psutil.Process(pid).name()
    assert insp.cpu_affinity(pid) == frozenset(psutil.Process(pid).cpu_affinity())
    assert insp.numa_pages(pid) == {0: 5}
    assert insp.numa_pages(pid + 1_000_000) is None
    gone = 2**22 + 12345  # above pid_max on Linux: no such process
    assert insp.name(gone) is None and insp.cpu_affinity(gone) is None


def test_single_node_host_has_nothing_to_say(clock, tmp_path):
    node0 = tmp_path / "sys" / "devices" / "system" / "node" / "node0"
    node0.mkdir(parents=True)
    (node0 / "cpulist").write_text("0-31\n")
    s = Sweeper(numa.NumaCollector(TableInspector({}, {}, {})), recording("nvml_h200x2.json", clock), clock,
                sysfs=RealSysfs(tmp_path))
    assert s.sweep() == []
    assert s.last_obs.node["numa_nodes"] == {0: "0-31"}
