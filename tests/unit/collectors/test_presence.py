"""gpu.missing (config vs NVML vs PCI bus) and gpu.lost (GPU_IS_LOST / RESET_REQUIRED)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gpuhealth.backends.environment import Environment
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.backends.sysfs import RealSysfs, RecordedSysfs
from gpuhealth.collectors.base import CollectContext, History
from gpuhealth.collectors.presence import PresenceCollector
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.config import Config
from gpuhealth.model import Action, EntityKind, Severity

VM_RECORDING = Path(__file__).resolve().parents[2] / "fixtures" / "recordings" / "h200x2_vm_guest.json"


def _scenario(tmp_path: Path, clock, **scenario) -> FakeNvml:  # type: ignore[no-untyped-def]
    scenario.setdefault("recording", "nvml_h200x2.json")
    path = tmp_path / "s.json"
    path.write_text(json.dumps(scenario))
    fake = FakeNvml.from_file(path, clock=clock)
    fake.init()
    return fake


def _run(fake: FakeNvml, config: Config | None = None, sysfs=None, gpus=None):  # type: ignore[no-untyped-def]
    ctx = CollectContext(backend=fake, config=config or Config(), gpus=gpus or enumerate_gpus(fake),
                         node_name="n1", now=time.time(), sysfs=sysfs or RecordedSysfs(fake))
    return CollectorRunner(timeout_s=None).run(PresenceCollector(), ctx, History())


def _pci_tree(root: Path, bdfs: list[str]) -> RealSysfs:
    for bdf in bdfs:
        d = root / "sys" / "bus" / "pci" / "devices" / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
    nic = root / "sys" / "bus" / "pci" / "devices" / "0000:40:00.0"  # a non-GPU device is ignored
    nic.mkdir(parents=True)
    (nic / "vendor").write_text("0x15b3\n")
    (nic / "class").write_text("0x020700\n")
    return RealSysfs(root)


def test_real_recordings_have_everything_present(h200_recording: Path, h100_recording: Path) -> None:
    for rec in (h200_recording, h100_recording):
        fake = FakeNvml.from_file(rec)
        fake.init()
        run = _run(fake)
        assert run.success and run.findings == []
        samples = {s.name: s.value for s in run.samples if s.gpu is None}
        assert samples["gpus"] == samples["gpus_on_pci_bus"] == fake.device_count()


def test_fewer_gpus_than_expected_is_critical_missing(h100_recording: Path) -> None:
    fake = FakeNvml.from_file(h100_recording)
    fake.init()
    cfg = Config()
    cfg.collectors.expected_gpus = 8
    [f] = _run(fake, cfg).findings
    assert (f.code, f.severity, f.entity.kind) == ("gpu.missing", Severity.CRITICAL, EntityKind.NODE)
    assert f.evidence["expected"] == 8 and f.evidence["nvml"] == 1
    assert "7 GPU(s) missing" in f.message


def test_gpu_on_pci_bus_but_not_in_nvml_names_the_bus_id(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    fake = _scenario(tmp_path, clock)
    sysfs = _pci_tree(tmp_path / "root", ["0000:00:06.0", "0000:00:07.0", "0000:00:08.0"])
    [f] = _run(fake, sysfs=sysfs).findings
    assert f.code == "gpu.missing" and f.action is Action.REBOOT  # the driver did not bring it up
    assert f.evidence["on_pci_not_in_nvml"] == ["0000:00:08.0"]
    assert "0000:00:08.0" in f.message


def test_lost_gpu_is_critical_on_that_gpu_and_not_missing(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    fake = _scenario(tmp_path, clock, events=[{"at": 1, "type": "lost", "gpu": 1}])
    before = enumerate_gpus(fake)
    clock.advance(2)
    run = _run(fake, gpus=enumerate_gpus(fake, before))
    [f] = run.findings
    assert (f.code, f.severity, f.action) == ("gpu.lost", Severity.CRITICAL, Action.REBOOT)
    assert f.entity.id == before[1].uuid and f.entity.gpu_index == 1
    assert "00000000:00:07.0" in f.message
    present = {s.gpu: s.value for s in run.samples if s.name == "gpu_present"}
    assert present == {0: 1.0, 1: 0.0}
    # Restored: no finding any more.
    fake2 = _scenario(tmp_path, clock, events=[{"at": 1, "type": "lost", "gpu": 1},
                                               {"at": 3, "type": "restore", "gpu": 1}])
    clock.advance(5)
    assert _run(fake2).findings == []


def test_reset_required_asks_for_a_gpu_reset(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    fake = _scenario(tmp_path, clock, overrides={"0": {"UUID": {"error": "Reset Required", "code": 16}}})
    gpus = enumerate_gpus(fake)
    findings = _run(fake, gpus=gpus).findings
    assert [(f.code, f.action, f.entity.gpu_index) for f in findings] == [("gpu.lost", Action.RESET_GPU, 0)]


def test_pci_walk_is_cached_but_redone_when_nvml_count_changes(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    fake = _scenario(tmp_path, clock)
    root = tmp_path / "root"
    sysfs = _pci_tree(root, ["0000:00:06.0", "0000:00:07.0"])
    collector = PresenceCollector(pci_rescan_s=60)
    gpus = enumerate_gpus(fake)

    def run(now: float):  # type: ignore[no-untyped-def]
        ctx = CollectContext(backend=fake, config=Config(), gpus=gpus, node_name="n1", now=now, sysfs=sysfs)
        return CollectorRunner(timeout_s=None).run(collector, ctx, History())

    assert run(1000.0).findings == []
    extra = root / "sys" / "bus" / "pci" / "devices" / "0000:00:08.0"
    extra.mkdir()
    (extra / "vendor").write_text("0x10de\n")
    (extra / "class").write_text("0x030200\n")
    assert run(1030.0).findings == []  # within the rescan interval: the cached walk
    [f] = run(1061.0).findings  # rescanned: the third GPU on the bus is not in NVML
    assert f.evidence["on_pci_not_in_nvml"] == ["0000:00:08.0"]


# ------------------------------------------------------------------------------ restricted views (audit item 2)
# The PCI bus shows all 8 GPUs of the node to every view; whether this process was given a GPU is told by the
# driver's GPU list and the GPU's /dev/nvidia<minor>, whatever the environment detection says.

NODE = [f"0000:00:{6 + n:02x}.0" for n in range(8)]  # the recording's two GPUs are 00:06.0 and 00:07.0
NOT_A_CONTAINER = Environment("none", False, True, True, 4, ("test",))  # Slurm job, Apptainer, enroot
CONTAINER = Environment("none", True, False, False, 4, ("test",))


class _CgroupSysfs(RealSysfs):
    """A tree whose /dev/nvidia<N> the device cgroup refuses except for ``allowed`` (a cgroup cannot be made
    in a temporary folder; RealSysfs's own check is tested below)."""

    def __init__(self, root: Path, allowed: set[int]) -> None:
        super().__init__(root)
        self.allowed = allowed

    def device_node_refused(self, minor: int) -> bool:
        return self.device_node_exists(minor) and minor not in self.allowed


def _node(root: Path, *, listed: list[str], nodes: list[int], unbound: tuple[str, ...] = (),
          on_bus: list[str] = NODE) -> Path:
    """8 GPUs on the bus bound to nvidia (``unbound`` to none), the driver's list in this view, /dev nodes."""
    for bdf in on_bus:
        d = root / "sys" / "bus" / "pci" / "devices" / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        if bdf not in unbound:
            os.symlink("../../../bus/pci/drivers/nvidia", d / "driver")
    for bdf in listed:
        p = root / "proc" / "driver" / "nvidia" / "gpus" / bdf
        p.mkdir(parents=True)
        (p / "information").write_text(f"Model: \t\t NVIDIA H200\nBus Location: \t {bdf}\n"
                                       f"Device Minor: \t {NODE.index(bdf)}\n")
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for minor in nodes:
        (root / "dev" / f"nvidia{minor}").write_text("")
    return root


def _judge(sysfs, environment: Environment, expected: int | None = None):  # type: ignore[no-untyped-def]
    fake = FakeNvml.from_file(VM_RECORDING)
    fake.init()
    cfg = Config()
    cfg.collectors.expected_gpus = expected
    ctx = CollectContext(backend=fake, config=cfg, gpus=enumerate_gpus(fake), node_name="n1", now=time.time(),
                         sysfs=sysfs, environment=environment)
    run = CollectorRunner(timeout_s=None).run(PresenceCollector(), ctx, History())
    assert run.success, run.error
    return {f.code: f for f in run.findings}


def test_a_slurm_job_whose_cgroup_refuses_six_gpus_lacks_none(tmp_path: Path) -> None:
    sysfs = _CgroupSysfs(_node(tmp_path, listed=NODE, nodes=list(range(8))), allowed={0, 1})
    found = _judge(sysfs, NOT_A_CONTAINER, expected=8)
    assert set(found) == {"gpu.outside_view"}
    f = found["gpu.outside_view"]
    assert (f.severity, f.action) == (Severity.INFO, Action.NONE)
    assert sorted(f.evidence["gpus"]) == NODE[2:] and "6 refused to this process by the device cgroup" in f.message


def test_a_masked_driver_list_or_missing_device_nodes_outside_a_detected_container(tmp_path: Path) -> None:
    # enroot/libnvidia-container: only the job's GPUs in /proc/driver/nvidia/gpus; CDI: only their /dev nodes.
    masked = RealSysfs(_node(tmp_path / "masked", listed=NODE[:2], nodes=[0, 1]))
    cdi = RealSysfs(_node(tmp_path / "cdi", listed=NODE, nodes=[0, 1]))
    for sysfs, why in ((masked, "not listed in this view's /proc/driver/nvidia/gpus"),
                       (cdi, "with no /dev/nvidia device node in this view")):
        found = _judge(sysfs, NOT_A_CONTAINER, expected=8)
        assert set(found) == {"gpu.outside_view"} and f"6 {why}" in found["gpu.outside_view"].message


def test_expected_gpus_counts_the_gpus_outside_the_view(tmp_path: Path) -> None:
    sysfs = RealSysfs(_node(tmp_path / "pod", listed=NODE[:2], nodes=[0, 1]))
    assert set(_judge(sysfs, CONTAINER, expected=8)) == {"gpu.outside_view"}  # a pod given 2 of 8
    # One of the node's GPUs is not even on the bus: 1 missing, hands-on work.
    gone = RealSysfs(_node(tmp_path / "gone", listed=NODE[:2], nodes=[0, 1], on_bus=NODE[:7]))
    f = _judge(gone, CONTAINER, expected=8)["gpu.missing"]
    assert (f.severity, f.action) == (Severity.CRITICAL, Action.DRAIN)
    assert f.message.startswith("1 GPU(s) missing: NVML lists 2 of 8 and 5 are outside this view")


def test_gpus_the_driver_lost_stay_missing_beside_the_ones_outside_the_view(tmp_path: Path) -> None:
    # 00:08.0: listed by the driver, its device node opens, NVML does not list it; 00:09.0: bound to no driver.
    root = _node(tmp_path, listed=[b for b in NODE if b != NODE[3]], nodes=list(range(8)), unbound=(NODE[3],))
    found = _judge(_CgroupSysfs(root, allowed={0, 1, 2}), NOT_A_CONTAINER, expected=8)
    f = found["gpu.missing"]
    assert (f.severity, f.action) == (Severity.CRITICAL, Action.REBOOT)
    assert f.evidence["on_pci_not_in_nvml"] == [NODE[2], NODE[3]] and f.evidence["outside_view"] == 4
    assert f.message.startswith(f"2 GPU(s) missing ({NODE[2]}, {NODE[3]})")
    assert sorted(found["gpu.outside_view"].evidence["gpus"]) == NODE[4:]


def test_real_sysfs_asks_the_kernel_whether_this_process_may_open_the_node(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    sysfs = RealSysfs(_node(tmp_path, listed=NODE, nodes=[0, 1]))
    asked: list[tuple[str, int]] = []

    def access(path: str, mode: int) -> bool:  # the kernel's answer under a device cgroup allowing nvidia0
        asked.append((os.path.basename(path), mode))
        return os.path.basename(path) == "nvidia0"

    monkeypatch.setattr(os, "access", access)
    assert [sysfs.device_node_refused(m) for m in (0, 1, 2)] == [False, True, False]  # 2: absent, not refused
    assert asked == [("nvidia0", os.R_OK | os.W_OK), ("nvidia1", os.R_OK | os.W_OK)]
