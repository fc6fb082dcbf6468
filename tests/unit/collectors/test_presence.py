"""gpu.missing (config vs NVML vs PCI bus) and gpu.lost (GPU_IS_LOST / RESET_REQUIRED)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.backends.sysfs import RealSysfs, RecordedSysfs
from gpuhealth.collectors.base import CollectContext, History
from gpuhealth.collectors.presence import PresenceCollector
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.config import Config
from gpuhealth.model import Action, EntityKind, Severity


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
