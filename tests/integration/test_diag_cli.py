"""``gpuhealth qualify`` and ``gpuhealth diag`` as users run them (real CLI, real child processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from commands import run_cli

from gpuhealth.cli.main import cli

pytestmark = pytest.mark.integration


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"GPUHEALTH_DIAG_STATE_DIR": str(tmp_path / "state"), "GPUHEALTH_DIAG_GOLDEN_DIR": str(tmp_path / "gold")}


def test_qualify_on_the_bundled_recording_reports_skipped_diagnostics(env: dict[str, str]) -> None:
    res = CliRunner().invoke(cli, ["qualify", "--nvml-snapshot", "nvml_h200x2.json", "--json"], env=env)
    assert res.exit_code == 3, res.output  # the level's diagnostics did not run: not judged
    doc = json.loads(res.output)
    assert doc["node"]["health"] == "unknown" and not doc["node"]["fit"] and doc["node"]["simulated"]
    assert doc["node"]["judged"] is False and len(doc["node"]["not_judged"]) == 3
    assert [(d["diag"], d["status"]) for d in doc["diagnostics"]] == [
        ("sdc", "skipped"), ("busbw", "skipped"), ("bandwidth", "skipped")]
    assert all("simulated" in d["reason"] for d in doc["diagnostics"])
    assert [g["index"] for g in doc["gpus"]] == [0, 1] and all(g["health"] == "unknown" for g in doc["gpus"])


@pytest.mark.parametrize(("profile", "code"), [("default", 2), ("slurm", 1), ("npd", 1), ("nagios", 2)])
def test_qualify_verdict_from_collectors_and_exit_codes(tmp_path: Path, env: dict[str, str], profile: str,
                                                        code: int) -> None:
    scenario = tmp_path / "dbe.yaml"
    scenario.write_text("recording: nvml_h200x2.json\noverrides:\n  '1': {TotalEccErrors_UNCORRECTED_VOLATILE: 2}\n")
    res = CliRunner().invoke(cli, ["qualify", "--nvml-snapshot", str(scenario), "--json", "--exit-codes", profile],
                             env=env)
    assert res.exit_code == code, res.output
    doc = json.loads(res.output)
    assert doc["node"]["health"] == "unhealthy" and not doc["node"]["fit"]
    assert doc["gpus"][1]["health"] == "unhealthy" and doc["gpus"][0]["health"] == "unknown"  # GPU 0: not tested
    assert doc["gpus"][1]["reasons"][0].startswith("ecc.dbe_volatile")


def test_qualify_human_output_and_bad_input(tmp_path: Path, env: dict[str, str]) -> None:
    res = run_cli("qualify", "--nvml-snapshot", "nvml_h100x1.json", "--level", "full", env=env)
    # Issue 33: every diagnostic skipped printed "HEALTHY  fit to run jobs" and exited 0
    assert res.returncode == 3, res.stdout + res.stderr
    assert "UNKNOWN  not judged: this level's diagnostics did not all run" in res.stdout
    assert "fit to run jobs" not in res.stdout and "busbw" in res.stdout
    assert "not judged: sdc did not run: simulated backend" in res.stdout
    assert "bandwidth did not run" in res.stdout and "busbw did not run" not in res.stdout  # one GPU: no busbw
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(cli, ["qualify", "--nvml-snapshot", str(bad), "--exit-codes", "nagios"], env=env)
    assert res.exit_code == 3
    assert "bad recording" in res.output and "Traceback" not in res.output


def test_diag_busbw_and_bandwidth_on_cpu(env: dict[str, str]) -> None:
    res = CliRunner().invoke(cli, ["diag", "busbw", "--device", "cpu", "--json", "--min-bytes", "65536",
                                   "--max-bytes", "65536", "--collectives", "all_reduce,all_to_all"], env=env)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["status"] == "ok" and [p["errors"] for p in doc["result"]["points"]] == [0, 0]
    res = CliRunner().invoke(cli, ["diag", "bandwidth", "--device", "cpu"], env=env)
    assert res.exit_code == 0, res.output
    assert "host memory copy" in res.output and "GB/s" in res.output


def test_diag_on_a_machine_without_gpus_says_so(env: dict[str, str]) -> None:
    res = CliRunner().invoke(cli, ["diag", "sdc", "--exit-codes", "npd"], env=env)
    assert res.exit_code == 2  # npd: unknown
    assert "--device cpu" in res.output and "Traceback" not in res.output


def test_golden_export_import_through_the_cli(tmp_path: Path, env: dict[str, str]) -> None:
    res = CliRunner().invoke(cli, ["diag", "sdc", "--device", "cpu", "--peers", "2", "--record-golden", "--json"],
                             env=env)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["result"]["golden"]["status"] == "recorded"
    bundle = tmp_path / "bundle.json"
    res = CliRunner().invoke(cli, ["diag", "golden", "--export", str(bundle)], env=env)
    assert res.exit_code == 0 and "exported 1" in res.output
    other = {**env, "GPUHEALTH_DIAG_GOLDEN_DIR": str(tmp_path / "other")}
    res = CliRunner().invoke(cli, ["diag", "golden", "--import", str(bundle)], env=other)
    assert res.exit_code == 0 and "imported 1" in res.output
    res = CliRunner().invoke(cli, ["diag", "sdc", "--device", "cpu", "--json"], env=other)
    doc = json.loads(res.output)
    assert doc["result"]["golden"]["status"] == "compared" and doc["findings"] == []
