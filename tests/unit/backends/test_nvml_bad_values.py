"""Recordings and scenarios that are not what they claim, and readings no GPU can give.

- A malformed scenario or recording (an NVML code of "abc", ``gpu_count: abc``, an event on GPU "x",
  a ramp of "abc", 100,000,000 GPUs, 100,000-deep JSON, non-UTF-8 bytes …) is one line from the real
  ``gpuhealth status``, exit 3, under a memory and a time cap — never a traceback, never 8 GB.
- A reading that cannot be real (an ECC counter of "lots", NaN or -5, a NaN temperature, a PCIe
  width of -8, a negative NVLink counter, a NaN field value) is an ``nvml.bad_value`` finding on that
  GPU and the GPU is not called healthy (``status`` exits non-zero).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from capped import run_capped

from gpuhealth.backends.errors import RecordingError
from gpuhealth.backends.nvml_fake import FakeNvml, bundled_recording_path
from gpuhealth.backends.plausible import BAD_VALUE, BadValue, check_field, check_nvlink, check_reading

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = REPO / "tests" / "fixtures" / "scenarios"
CAP_BYTES = 1 << 30


def _status(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_capped([sys.executable, "-m", "gpuhealth.cli.main", "status", "--nvml-snapshot", str(path), *extra],
                      mem_bytes=CAP_BYTES, cpu_s=60, capture_output=True, text=True, timeout=120)


def _scenario(tmp_path: Path, name: str, doc: dict[str, Any] | str) -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump({"recording": "nvml_h200x2.json", **doc}))
    return p


def _recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(bundled_recording_path().read_text())
    return data


def _bad_recording(tmp_path: Path, name: str, change: Any) -> Path:
    rec = _recording()
    change(rec)
    p = tmp_path / name
    p.write_text(json.dumps(rec))
    return p


MALFORMED_SCENARIOS: dict[str, tuple[dict[str, Any] | str, str]] = {
    "code_abc": ({"overrides": {"0": {"NumaNodeId": {"error": "x", "code": "abc"}}}},
                 "overrides.0.NumaNodeId: 'code' must be an NVML return code"),
    "gpu_count_abc": ({"gpu_count": "abc"}, "gpu_count 'abc': expected an integer"),
    "gpu_count_huge": ({"gpu_count": 100_000_000}, "gpu_count must be 1..256, got 100000000"),
    "gpu_count_float": ({"gpu_count": 2.5}, "gpu_count 2.5: expected an integer"),
    "event_gpu_x": ({"events": [{"at": 1, "type": "xid", "gpu": "x", "xid": 79}]}, "events[0].gpu 'x'"),
    "event_gpu_missing": ({"events": [{"at": 1, "type": "lost", "gpu": 9}]}, "names GPU 9, which does not exist"),
    "event_at_nan": ({"events": [{"at": float("nan"), "type": "lost", "gpu": 0}]}, "events[0].at: expected seconds"),
    "event_xid_text": ({"events": [{"type": "xid", "gpu": 0, "xid": "seventy"}]}, "events[0].xid"),
    "event_set_ramp": ({"events": [{"type": "set", "gpu": 0, "key": "PcieReplayCounter", "value": {"ramp": "x"}}]},
                       "'ramp' must be a finite number"),
    "events_not_list": ({"events": {"a": 1}}, "'events' must be a list"),
    "ramp_abc": ({"overrides": {"0": {"PcieReplayCounter": {"ramp": "abc"}}}}, "'ramp' must be a finite number"),
    "ramp_on_text": ({"overrides": {"0": {"Name": {"ramp": 5}}}}, "is not a number to ramp from"),
    "nvlink_not_map": ({"overrides": {"0": {"nvlink": [1, 2]}}}, "overrides.0.nvlink: expected {LINK"),
    "nvlink_link_999": ({"overrides": {"0": {"nvlink": {"999": {"state": 0}}}}}, "overrides.0.nvlink: expected"),
    "sysfs_list": ({"overrides": {"0": {"sysfs": {"current_link_width": [8]}}}}, "expected a line of text"),
    "override_gpu_abc": ({"overrides": {"abc": {"CurrPcieLinkWidth": 8}}}, "overrides: key 'abc'"),
    "override_gpu_missing": ({"overrides": {"7": {"CurrPcieLinkWidth": 8}}}, "GPU 7 does not exist"),
    "kmsg_not_list": ({"kmsg": "NVRM: Xid 79"}, "'kmsg' must be a list"),
    "recording_missing": ({"recording": "no-such.json"}, "no-such.json: cannot read"),
    "not_yaml": ("recording: [nvml_h200x2.json\n", "not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_SCENARIOS))
def test_a_malformed_scenario_is_one_line_under_caps(tmp_path: Path, case: str) -> None:
    doc, expected = MALFORMED_SCENARIOS[case]
    path = _scenario(tmp_path, f"{case}.yaml", doc)
    proc = _status(path)
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], proc.stderr


def _deep(tmp_path: Path) -> Path:
    p = tmp_path / "deep.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    return p


MALFORMED_RECORDINGS: dict[str, tuple[Any, str]] = {
    "entry_code_abc": (lambda r: r["devices"][0].update(NumaNodeId={"error": "x", "code": "abc"}),
                       "devices[0].NumaNodeId: 'code' must be an NVML return code"),
    "nvlink_bad_shape": (lambda r: r["devices"][0].update(nvlink={"0": 5}), "devices[0].nvlink.0: expected"),
    "field_values_bad": (lambda r: r["devices"][0].update(field_values={"fields": {"X": 5}}), "fields.X: expected"),
    "uuid_number": (lambda r: r["devices"][0].update(UUID={"value": 5}), "devices[0].UUID: expected"),
    "too_many_devices": (lambda r: r.update(devices=r["devices"] * 200), "400 devices, more than 256"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_RECORDINGS))
def test_a_malformed_recording_is_one_line_under_caps(tmp_path: Path, case: str) -> None:
    change, expected = MALFORMED_RECORDINGS[case]
    path = _bad_recording(tmp_path, f"{case}.json", change)
    proc = _status(path)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], proc.stderr


def test_deep_and_non_utf8_files_are_one_line_under_caps(tmp_path: Path) -> None:
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"recording: caf\xe9.json\n")
    big = tmp_path / "big.json"
    with big.open("wb") as fh:
        fh.truncate(65 << 20)  # sparse: 65 MiB of NULs, over the limit
    for path, expected in ((_deep(tmp_path), "nested too deeply"), (latin, "not UTF-8 text (byte 0xe9"),
                           (big, "over 64 MiB")):
        proc = _status(path)
        assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and expected in lines[0], proc.stderr


# ------------------------------------------------------------------ readings that cannot be real
IMPLAUSIBLE: dict[str, tuple[dict[str, Any], str]] = {
    "ecc_lots": ({"TotalEccErrors_UNCORRECTED_VOLATILE": "lots"}, "TotalEccErrors_UNCORRECTED_VOLATILE"),
    "ecc_nan": ({"TotalEccErrors_CORRECTED_VOLATILE": float("nan")}, "TotalEccErrors_CORRECTED_VOLATILE"),
    "ecc_negative": ({"TotalEccErrors_UNCORRECTED_AGGREGATE": -5}, "TotalEccErrors_UNCORRECTED_AGGREGATE"),
    "temperature_nan": ({"Temperature_GPU": float("nan")}, "Temperature_GPU"),
    "temperature_inf": ({"Temperature_GPU": float("inf")}, "Temperature_GPU"),
    "pcie_width_negative": ({"CurrPcieLinkWidth": -8}, "CurrPcieLinkWidth"),
    "pcie_width_text": ({"MaxPcieLinkWidth": "x16"}, "MaxPcieLinkWidth"),
    "replay_float": ({"PcieReplayCounter": 1.5}, "PcieReplayCounter"),
    "remapped_rows_negative": ({"RemappedRows": [0, -1, 0, 0]}, "RemappedRows"),
    "utilization_200": ({"UtilizationRates": {"gpu": 200, "memory": 0}}, "UtilizationRates"),
    "power_negative": ({"PowerUsage": -80_000}, "PowerUsage"),
    "nvlink_counter_negative": ({"nvlink": {"0": {"err_DL_CRC_FLIT": -1}}}, "NVML_FI_DEV_NVLINK_ERROR_DL_CRC"),
    "field_nan": ({"field_values": {"NVML_FI_DEV_MEMORY_TEMP": float("nan")}}, "NVML_FI_DEV_MEMORY_TEMP"),
}


@pytest.mark.parametrize("case", sorted(IMPLAUSIBLE))
def test_a_reading_that_cannot_be_real_is_a_bad_value_finding(tmp_path: Path, case: str) -> None:
    override, key = IMPLAUSIBLE[case]
    path = _scenario(tmp_path, f"{case}.yaml", {"overrides": {"1": override}})
    proc = _status(path, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode != 0, "a GPU with a reading no GPU can give was called healthy"
    report = json.loads(proc.stdout)
    gpu1 = report["gpus"][1]
    assert gpu1["health"] != "healthy"
    bad = [f for f in gpu1["findings"] if f["code"] == "nvml.bad_value"]
    assert bad and key in bad[0]["message"], gpu1["findings"]
    assert report["gpus"][0]["health"] == "healthy"  # the other GPU is judged as before


def test_the_shipped_recordings_and_scenarios_hold_no_bad_value() -> None:
    paths = [bundled_recording_path(n) for n in ("nvml_h200x2.json", "nvml_h100x1.json")]
    paths += sorted(SCENARIOS.glob("*.yaml")) + sorted((REPO / "tests" / "fixtures" / "recordings").glob("*.json"))
    from gpuhealth.config import Config
    from gpuhealth.node import collect_once

    for path in paths:
        fake = FakeNvml.from_file(path)
        fake.init()
        config = Config()
        config.collectors.disabled = ["host"]
        codes = {f.code for f in collect_once(fake, config).all_findings()}
        assert "nvml.bad_value" not in codes, path


def test_the_rules_by_kind_of_reading() -> None:
    with pytest.raises(BadValue) as info:
        check_reading("TemperatureThreshold_SLOWDOWN", 900)
    assert info.value.code == BAD_VALUE and "900" in str(info.value)
    assert check_reading("TemperatureThreshold_SLOWDOWN", 89) == 89
    assert check_reading("ViolationStatus_THERMAL", {"referenceTime": 1, "violationTime": 0})["violationTime"] == 0
    with pytest.raises(BadValue):
        check_reading("ViolationStatus_THERMAL", {"referenceTime": 1, "violationTime": -1})
    with pytest.raises(BadValue):
        check_reading("SomeFutureKey", {"nested": [1.0, float("nan")]})  # any number anywhere must be finite
    assert check_reading("SomeFutureKey", {"nested": [1.0, "x"]}) == {"nested": [1.0, "x"]}
    with pytest.raises(BadValue):
        check_nvlink(3, "state", 7)
    assert isinstance(check_field("NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0", -3), BadValue)
    assert check_field("NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0", 3) == 3


def test_a_set_event_that_turns_a_value_bad_is_caught_when_it_fires() -> None:
    clock = [0.0]
    fake = FakeNvml.from_scenario(
        {"recording": "nvml_h200x2.json",
         "events": [{"at": 5, "type": "set", "gpu": 0, "key": "Temperature_GPU", "value": float("nan")}]},
        clock=lambda: clock[0])
    fake.init()
    assert fake.query(0, "Temperature_GPU") == 36
    clock[0] = 6.0
    with pytest.raises(BadValue):
        fake.query(0, "Temperature_GPU")


def test_constructor_limits_hold_without_a_scenario_file() -> None:
    with pytest.raises(RecordingError, match=r"gpu_count must be 1\.\.256"):
        FakeNvml(_recording(), gpu_count=100_000_000)


# ------------------------------------------------------------------ the live backend's guard
def test_the_live_backend_reports_garbage_from_the_driver_as_bad_values(tmp_path: Path) -> None:
    """``RealNvml`` given bindings whose driver answers garbage on GPU 1 (under the replayed recording,
    so the fake's own guard is not what catches it): the same findings as from a recording."""
    from test_nvml_real import BindingsDriver, _sysfs_tree

    from gpuhealth.backends.nvml_real import RealNvml
    from gpuhealth.config import Config
    from gpuhealth.node import collect_once

    class GarbageDriver(BindingsDriver):
        def nvmlDeviceGetTemperature(self, h: int, c: str) -> Any:
            return float("nan") if h == 1 else super().nvmlDeviceGetTemperature(h, c)

        def nvmlDeviceGetTotalEccErrors(self, h: int, et: str, ct: str) -> Any:
            return -5 if h == 1 else super().nvmlDeviceGetTotalEccErrors(h, et, ct)

        def __getattr__(self, name: str) -> Any:
            if name == "nvmlDeviceGetCurrPcieLinkWidth":
                return lambda h: -8 if h == 1 else self._q(self.fake.query, h, "CurrPcieLinkWidth")
            return super().__getattr__(name)

    fake = FakeNvml.bundled("nvml_h200x2.json")
    fake.init()
    _sysfs_tree(tmp_path, fake)
    config = Config()
    config.collectors.disabled = ["host"]
    config.collectors.sysfs_root = str(tmp_path)
    real = RealNvml(GarbageDriver(FakeNvml.bundled("nvml_h200x2.json")))
    real.init()
    try:
        report = collect_once(real, config)
    finally:
        real.shutdown()
    gpu0, gpu1 = report.gpus
    assert str(gpu0.health) == "healthy"
    assert str(gpu1.health) != "healthy"
    bad = " ".join(f.message for f in gpu1.findings if f.code == "nvml.bad_value")
    for key in ("Temperature_GPU", "TotalEccErrors_UNCORRECTED_VOLATILE", "CurrPcieLinkWidth"):
        assert key in bad, bad
    assert "nvml.bad_value" in {f.code for f in gpu1.findings}
