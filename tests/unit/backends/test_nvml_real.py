"""The real NVML backend's key → pynvml call mapping, checked without a GPU.

``RealNvml`` is given a pynvml-shaped driver (the recorder test's ``RecordedDriver``, widened to every
field id of the real bindings) that answers from a real recording. A node report taken through the
real backend must equal the one taken through the fake backend from the same recording: every key a
collector asks for reaches the right NVML getter with the right arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml
import pytest
from test_recorder import RecordedDriver, _Struct, _sysfs_tree

from gpuhealth.backends.errors import BackendUnavailable, NvmlError
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.backends.nvml_keys import ALL_KEYS
from gpuhealth.backends.nvml_real import RealNvml
from gpuhealth.backends.recorder import Recorder
from gpuhealth.config import Config
from gpuhealth.node import collect_once

FIELD_IDS = {k: v for k, v in vars(pynvml).items() if k.startswith("NVML_FI_DEV_") and isinstance(v, int)}


class BindingsDriver(RecordedDriver):
    """RecordedDriver with the real bindings' field ids and (field id, scope) field-value requests."""

    locals().update(FIELD_IDS)
    NVML_CLOCK_VIDEO = "VIDEO"

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[Any]) -> list[Any]:
        names = {v: k for k, v in FIELD_IDS.items()}
        requests = [(names[f], s) for f, s in ids]
        out = []
        for (fid, _), res in zip(ids, self.fake.field_values(h, requests), strict=True):
            ok = not isinstance(res, NvmlError)
            out.append(_Struct({"fieldId": fid, "nvmlReturn": 0 if ok else res.code, "valueType": 3,
                                "value": {"ullVal": res if ok else 0}}))
        return out


def _comparable(report: Any) -> dict[str, Any]:
    # The environment (bare metal, VM, container) is read from the host, not NVML: a replay says what its
    # recording says, the live path reads the test's tree (tests/unit/collectors/test_environment.py).
    d = report.to_dict()
    node = {k: v for k, v in d["node"].items()
            if k not in ("backend", "simulated", "time", "collectors", "environment")}
    findings = [f for f in d["findings"] if f["code"] != "fabric.manager_unobserved"]
    return {"node": node, "gpus": d["gpus"], "findings": findings, "health": str(report.health)}


@pytest.mark.parametrize("name", ["nvml_h200x2.json", "nvml_h100x1.json"])
def test_real_backend_reads_what_the_fake_replays(name: str, tmp_path: Path) -> None:
    config = Config()
    config.collectors.disabled = ["host"]  # reads this test machine, not the recording
    fake = FakeNvml.bundled(name)
    fake.init()
    _sysfs_tree(tmp_path, fake)  # the live path reads sysfs from disk: lay the recorded one out there
    config.collectors.sysfs_root = str(tmp_path)
    via_fake = collect_once(fake, config)
    real = RealNvml(BindingsDriver(FakeNvml.bundled(name)))
    real.init()
    assert not real.simulated
    via_real = collect_once(real, config)
    real.shutdown()
    assert _comparable(via_real) == _comparable(via_fake)
    assert [r.name for r in via_real.runs if not r.success] == []


def test_real_backend_maps_argument_getters_and_errors() -> None:
    real = RealNvml(BindingsDriver(FakeNvml.bundled("nvml_h200x2.json")))
    real.init()
    assert real.system("driver") == "580.159.04"
    assert real.query(0, "TotalEccErrors_UNCORRECTED_VOLATILE") == 0
    assert real.query(0, "ClockInfo_SM") == 345
    assert real.query(0, "ViolationStatus_LOW_UTILIZATION")["violationTime"] > 0
    assert real.nvlink(0, 3, "err_DL_CRC_DATA") == 6
    with pytest.raises(NvmlError) as exc:
        real.query(0, "NumaNodeId")
    assert exc.value.not_supported
    temp, bogus = real.field_values(0, [("NVML_FI_DEV_MEMORY_TEMP", 0), ("NVML_FI_DEV_NO_SUCH_FIELD", 0)])
    assert temp == 39 and isinstance(bogus, NvmlError) and bogus.not_supported
    real.shutdown()
    with pytest.raises(NvmlError) as gone:
        real.query(0, "Name")
    assert gone.value.driver_gone


def test_no_driver_is_backend_unavailable() -> None:
    # The real bindings on a machine without libnvidia-ml (CI): one clear error, not a traceback.
    with pytest.raises(BackendUnavailable, match=r"NVIDIA driver not available|libnvidia-ml"):
        RealNvml().init()


def test_the_live_backend_reads_exactly_the_keys_the_recorder_writes(tmp_path: Path) -> None:
    """One key list (``backends/nvml_keys``): a key only one side knows could be recorded but never
    read live, or read live but never replayed."""
    fake = FakeNvml.bundled("nvml_h200x2.json")
    fake.init()
    _sysfs_tree(tmp_path, fake)
    driver = BindingsDriver(FakeNvml.bundled("nvml_h200x2.json"))
    recorded = Recorder(driver, reps=1, sysfs_root=str(tmp_path)).record()["devices"][0]
    structure = {"nvlink", "field_values", "event_wait", "sysfs", "sweep10_median_us"}
    assert set(recorded) - structure == set(ALL_KEYS)
    real = RealNvml(driver)
    real.init()
    try:
        assert set(real._dispatch) == set(ALL_KEYS)
        # the H200 recording has no video clock: recorded as the (replayed) driver answered
        assert recorded["ClockInfo_VIDEO"] == {"error": "not recorded: ClockInfo_VIDEO", "code": 3}
    finally:
        real.shutdown()


def test_a_constant_the_bindings_lack_makes_only_its_key_unavailable() -> None:
    class OldBindings(BindingsDriver):
        NVML_CLOCK_VIDEO = property(lambda self: (_ for _ in ()).throw(AttributeError("NVML_CLOCK_VIDEO")))

    real = RealNvml(OldBindings(FakeNvml.bundled("nvml_h200x2.json")))
    real.init()
    try:
        with pytest.raises(NvmlError) as exc:
            real.query(0, "ClockInfo_VIDEO")
        assert "no getter" in exc.value.message
        assert real.query(0, "ClockInfo_SM") == 345
    finally:
        real.shutdown()


def test_gpm_ratios_and_mig_instances_come_back_as_data_not_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # Our own readers answer GPM and MIG with dicts: turned into a repr, the GPM ratios never reached /metrics on
    # real GPUs (2 x H200, 2026-11-28: gpuhealth_gpu_sm_active_ratio absent) and MIG instances were unreadable.
    from gpuhealth.backends import nvml_real
    from gpuhealth.collectors.telemetry import TelemetryCollector

    monkeypatch.setattr(nvml_real, "read_gpm", lambda n, h, state: {"SM_UTIL": 95.2, "GRAPHICS_UTIL": 99.4})
    monkeypatch.setattr(nvml_real, "read_mig_devices", lambda n, h: [{"uuid": "MIG-1", "name": "H200 MIG 1g.18gb"}])
    real = RealNvml(BindingsDriver(FakeNvml.bundled("nvml_h200x2.json")))
    real.init()
    assert real.query(0, "GpmMetrics") == {"SM_UTIL": 95.2, "GRAPHICS_UTIL": 99.4}
    assert real.query(0, "MigDevices") == [{"uuid": "MIG-1", "name": "H200 MIG 1g.18gb"}]
    report = collect_once(real, Config(), collectors=[TelemetryCollector()])
    [run] = report.runs
    sm = {s.gpu: s.value for s in run.samples if s.name == "gpu_sm_active_ratio"}
    assert sm == {0: pytest.approx(0.952), 1: pytest.approx(0.952)}
    real.shutdown()
