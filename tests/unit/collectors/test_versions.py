"""Versions as info samples; mixed firmware across GPUs of one model → version.drift."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import CollectContext, History
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.collectors.versions import VersionsCollector, cuda_version_text, versions_of
from gpuhealth.config import Config
from gpuhealth.model import Action, EntityKind, MetricKind, Severity


def _run(fake: FakeNvml):  # type: ignore[no-untyped-def]
    ctx = CollectContext(backend=fake, config=Config(), gpus=enumerate_gpus(fake), node_name="n1", now=time.time())
    return CollectorRunner(timeout_s=None).run(VersionsCollector(), ctx, History())


def _scenario(tmp_path: Path, overrides: dict) -> FakeNvml:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"recording": "nvml_h200x2.json", "gpu_count": 4, "overrides": overrides}))
    fake = FakeNvml.from_file(path)
    fake.init()
    return fake


def test_real_recording_versions_and_no_drift(h200_recording: Path) -> None:
    fake = FakeNvml.from_file(h200_recording)
    fake.init()
    run = _run(fake)
    assert run.success and run.findings == []
    v = versions_of(run.observations)
    assert v["driver"] == "580.159.04" and v["cuda"] == "13.0" and v["nvml_version"] == "13.580.159.04"
    assert v["gpus"]["1"] == {"vbios": "96.00.A5.00.1A", "inforom": "G520.0282.02.02", "gsp_firmware": "580.159.04"}
    info = [s for s in run.samples if s.kind is MetricKind.INFO]
    assert ("driver", "580.159.04") in info[0].labels
    assert {s.gpu for s in info if s.gpu is not None} == {0, 1}


def test_mixed_vbios_is_drift_naming_each_gpu(tmp_path: Path) -> None:
    fake = _scenario(tmp_path, {"2": {"VbiosVersion": "96.00.99.00.01"}})
    [f] = _run(fake).findings
    assert (f.code, f.severity, f.action, f.entity.kind) == ("version.drift", Severity.WARNING, Action.MONITOR,
                                                            EntityKind.NODE)
    assert f.evidence["field"] == "vbios"
    assert f.evidence["per_gpu"][2] == "96.00.99.00.01" and f.evidence["per_gpu"][0] == "96.00.A5.00.1A"
    assert "VBIOS" in f.message


def test_gsp_firmware_not_matching_driver_is_drift(tmp_path: Path) -> None:
    fake = _scenario(tmp_path, {str(i): {"GspFirmwareVersion": "570.86.15"} for i in range(4)})
    [f] = _run(fake).findings
    assert f.evidence == {"field": "gsp_firmware", "driver": "580.159.04",
                          "per_gpu": {0: "570.86.15", 1: "570.86.15", 2: "570.86.15", 3: "570.86.15"}}


def test_different_models_are_not_compared(tmp_path: Path) -> None:
    fake = _scenario(tmp_path, {"3": {"Name": "NVIDIA H100 80GB HBM3", "VbiosVersion": "96.00.DA.00.0C"}})
    assert _run(fake).findings == []


def test_cuda_version_text() -> None:
    assert cuda_version_text(13000) == "13.0" and cuda_version_text(12080) == "12.8"
    assert cuda_version_text(None) is None
