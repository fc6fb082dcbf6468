"""``gpuhealth status`` as users run it: table, --json (golden), exit-code profiles, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuhealth.cli.main import cli

GOLDEN = Path(__file__).parent.parent / "golden" / "status_h200x2.json"
UPDATE = os.environ.get("GPUHEALTH_UPDATE_GOLDEN") == "1"  # regenerate: GPUHEALTH_UPDATE_GOLDEN=1 pytest …


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["status", *args])


def _config(tmp_path: Path) -> str:
    # A fixed node name; the host collector reads the machine running the test (psutil), not the
    # recording, so it is left out of the golden comparison.
    path = tmp_path / "gpuhealth.yaml"
    path.write_text("agent: {node_name: golden-node}\ncollectors: {disabled: [host]}\n")
    return str(path)


def _scenario(tmp_path: Path, **scenario: Any) -> str:
    scenario.setdefault("recording", "nvml_h200x2.json")
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    return str(path)


def _normalise(doc: dict[str, Any]) -> dict[str, Any]:
    node = doc["node"]
    node["time"] = 0
    node["backend"] = Path(node["backend"].removeprefix("simulated from ")).name
    for run in node["collectors"]:
        run["duration_s"] = 0
    return doc


def test_json_matches_golden_on_the_real_recording(tmp_path: Path) -> None:
    result = _invoke("--nvml-snapshot", "nvml_h200x2.json", "--json", "--config", _config(tmp_path))
    assert result.exit_code == 0, result.output
    doc = _normalise(json.loads(result.output))
    if UPDATE:
        GOLDEN.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc == json.loads(GOLDEN.read_text())
    assert set(doc) == {"node", "gpus", "findings"}
    for gpu in doc["gpus"]:
        assert {"index", "uuid", "name", "health", "findings", "pci_bus_id"} <= set(gpu)
        assert gpu["health"] == "healthy"
    assert all(f["severity"] == "info" for f in doc["findings"])


def test_table_shows_banner_gpus_and_health(tmp_path: Path) -> None:
    result = _invoke("--nvml-snapshot", "nvml_h200x2.json", "--config", _config(tmp_path))
    assert result.exit_code == 0
    assert "SIMULATED (recording" in result.output and "nvml_h200x2.json" in result.output
    assert "NVIDIA H200" in result.output and "HEALTHY" in result.output
    assert "driver 580.159.04" in result.output


def test_table_lists_findings_with_actions(tmp_path: Path) -> None:
    path = _scenario(tmp_path, kmsg=["NVRM: Xid (PCI:0000:00:07): 79, pid=0, GPU has fallen off the bus."])
    result = _invoke("--nvml-snapshot", path, "--config", _config(tmp_path))
    assert result.exit_code == 2
    flat = " ".join(result.output.split())
    assert "UNHEALTHY" in flat and "xid.79" in flat and "reboot" in flat


@pytest.mark.parametrize(("profile", "critical", "warning", "unknown"),
                         [("default", 2, 1, 3), ("slurm", 1, 0, 1), ("npd", 1, 1, 2), ("nagios", 2, 1, 3)])
def test_exit_code_profiles(tmp_path: Path, profile: str, critical: int, warning: int, unknown: int) -> None:
    cfg = _config(tmp_path)
    crit = _scenario(tmp_path, kmsg=["NVRM: Xid (PCI:0000:00:06): 48, pid=1, name=x, DBE"])
    assert _invoke("--nvml-snapshot", crit, "--config", cfg, "--exit-codes", profile).exit_code == critical
    warn = _scenario(tmp_path, overrides={"1": {"VbiosVersion": "96.00.00.00.02"}})
    assert _invoke("--nvml-snapshot", warn, "--config", cfg, "--exit-codes", profile).exit_code == warning
    healthy = _invoke("--nvml-snapshot", "nvml_h200x2.json", "--config", cfg, "--exit-codes", profile)
    assert healthy.exit_code == 0
    bad = _invoke("--nvml-snapshot", str(tmp_path / "missing.json"), "--exit-codes", profile)
    assert bad.exit_code == unknown


def test_expected_gpus_flag(tmp_path: Path) -> None:
    result = _invoke("--nvml-snapshot", "nvml_h100x1.json", "--expected-gpus", "8", "--json",
                     "--config", _config(tmp_path))
    assert result.exit_code == 2
    [missing] = [f for f in json.loads(result.output)["findings"] if f["code"] == "gpu.missing"]
    assert missing["evidence"]["expected"] == 8 and missing["severity"] == "critical"


def test_kmsg_file_flag(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("Nov 26 01:02:03 node kernel: NVRM: Xid (PCI:0000:00:06): 95, pid=9, name=t, Uncontained\n")
    result = _invoke("--nvml-snapshot", "nvml_h200x2.json", "--kmsg", str(log), "--json",
                     "--config", _config(tmp_path))
    gpu0 = json.loads(result.output)["gpus"][0]
    assert gpu0["health"] == "unhealthy" and gpu0["findings"][0]["code"] == "xid.95"


def test_no_driver_is_one_clear_line_not_a_traceback() -> None:
    result = _invoke()
    if result.exit_code == 3:  # no NVIDIA driver here (CI, laptops)
        lines = [ln for ln in result.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("gpuhealth status: ")
        assert "driver" in lines[0].lower() or "nvml" in lines[0].lower()
        assert "--nvml-snapshot" in lines[0]
    else:  # a real GPU node: a live, not simulated, report
        assert result.exit_code in (0, 1, 2) and "SIMULATED" not in result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        ("{not json", r"bad\.json: not valid JSON"),
        (json.dumps({"devices": []}), r"bad\.json: 'devices' must be a non-empty list"),
        (json.dumps({"recording": "nvml_h200x2.json", "overrides": {"7": {"PowerUsage": 1}}}),
         r"bad\.json: overrides: GPU 7 does not exist"),
        ("BARE_VALUE", r"bad\.json: devices\[1\]\.PowerUsage: expected"),  # a value not wrapped in {"value": …}
    ],
)
def test_malformed_recording_names_file_and_key(tmp_path: Path, content: str, expect: str) -> None:
    bad = tmp_path / "bad.json"
    if content == "BARE_VALUE":
        from gpuhealth.backends.nvml_fake import bundled_recording_path

        rec = json.loads(bundled_recording_path().read_text())
        rec["devices"][1]["PowerUsage"] = 80307
        content = json.dumps(rec)
    bad.write_text(content)
    result = _invoke("--nvml-snapshot", str(bad), "--json")
    assert result.exit_code == 3
    assert "Traceback" not in result.output
    import re

    assert re.search(expect, result.output), result.output


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("collectors: {disabled: [nosuch]}\n")
    result = _invoke("--nvml-snapshot", "nvml_h200x2.json", "--config", str(cfg))
    assert result.exit_code == 3 and "nosuch" in result.output
    cfg.write_text("collectors: {expected_gpus: many}\n")
    result = _invoke("--nvml-snapshot", "nvml_h200x2.json", "--config", str(cfg))
    assert result.exit_code == 3 and "collectors.expected_gpus" in result.output


def test_npd_profile_prints_one_line_naming_each_problem() -> None:
    """node-problem-detector keeps a short message as the NodeCondition: one line, worst first."""
    scenario = Path(__file__).parents[1] / "fixtures" / "scenarios" / "faulty_node.yaml"
    res = CliRunner().invoke(cli, ["status", "--nvml-snapshot", str(scenario), "--exit-codes", "npd"])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("gpuhealth: unhealthy: GPU 3 pcie.link_degraded (drain)")
    assert "GPU 1 throttle.hw_slowdown" in lines[0]
    healthy = CliRunner().invoke(cli, ["status", "--nvml-snapshot", "nvml_h200x2.json", "--exit-codes", "npd"])
    assert (healthy.exit_code, healthy.output.strip()) == (0, "gpuhealth: healthy: no GPU problem found")


def test_a_field_the_driver_does_not_serve_is_not_a_failing_gpu(tmp_path: Path) -> None:
    """Drivers answer INVALID_ARGUMENT per field for field ids they don't know (newer bindings than
    driver): that is 'not available here', not collector.failed on a healthy GPU."""
    scenario = tmp_path / "old_driver.yaml"
    fields = ["NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN", "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN",
              "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN", "NVML_FI_DEV_MEMORY_TEMP"]
    over = {f: {"error": "Invalid Argument", "code": 2} for f in fields}
    scenario.write_text(json.dumps({"recording": "nvml_h200x2.json", "overrides": {"0": {"field_values": over}}}))
    res = _invoke("--nvml-snapshot", str(scenario), "--json", "--config", _config(tmp_path))
    doc = json.loads(res.output)
    assert res.exit_code == 0, res.output
    assert [g["health"] for g in doc["gpus"]] == ["healthy", "healthy"]
