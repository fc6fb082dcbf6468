"""The SDC check end to end on the CPU, through the real child process and runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from commands import run_cli

from gpuhealth.cli.main import cli
from gpuhealth.config import DiagConfig
from gpuhealth.diag.runner import DiagRunner

pytestmark = pytest.mark.integration


def _sdc(tmp_path: Path, *extra: str) -> dict:
    runner = DiagRunner(DiagConfig(), state_dir=tmp_path / "state")
    out = runner.run("sdc", ["--device", "cpu", "--golden-dir", str(tmp_path / "golden"), *extra], timeout_s=120)
    assert out.status in ("ok", "failed"), out.reason
    return {"outcome": out, "result": out.result}


def test_identical_devices_agree_record_a_golden_then_match_it(tmp_path: Path) -> None:
    first = _sdc(tmp_path, "--cpu-peers", "3")
    assert first["outcome"].status == "ok" and first["outcome"].findings == []
    devices = first["result"]["devices"]
    digests = [{c["case"]: c["digest"] for c in d["cases"]} for d in devices]
    assert len(digests[0]) == 8 and digests[0] == digests[1] == digests[2]
    assert first["result"]["golden"]["status"] == "recorded"
    assert set(first["result"]["skipped_datapaths"]) == {"tf32", "fp8_e4m3"}
    again = _sdc(tmp_path, "--cpu-peers", "1")  # a lone device is now judged against the golden
    assert again["result"]["golden"]["status"] == "compared" and again["outcome"].findings == []
    bad = _sdc(tmp_path, "--cpu-peers", "1", "--corrupt-peer", "0:word")
    assert {f.evidence["basis"] for f in bad["outcome"].findings} == {"golden"}
    assert len(bad["outcome"].findings) == 8  # every case of the bad device


def test_a_corrupted_peer_is_outvoted_and_a_transient_one_is_told_apart(tmp_path: Path) -> None:
    run = _sdc(tmp_path, "--cpu-peers", "3", "--corrupt-peer", "1:paired_bits", "--corrupt-peer", "2:single_bit:1")
    findings = run["outcome"].findings
    persistent = [f for f in findings if f.entity.id == "cpu-1"]
    transient = [f for f in findings if f.entity.id == "cpu-2"]
    assert len(persistent) == 8 and all(f.evidence["persistence"] == "persistent" for f in persistent)
    assert all(f.severity.name == "CRITICAL" and f.evidence["basis"] == "peers" for f in persistent)
    # device 2 was wrong only on its first run: one case, and its re-runs agree with the peers
    assert len(transient) == 1 and transient[0].evidence["persistence"] == "transient"
    assert transient[0].severity.name == "WARNING"
    assert not [f for f in findings if f.entity.id == "cpu-0"]
    assert run["result"]["golden"]["status"] == "absent"  # never learn a golden from a disagreeing node
    msg = persistent[0].message
    assert "GPU 1" in msg and persistent[0].evidence["datapath"] in msg and persistent[0].evidence["shape"] in msg


def test_cli_self_test_detects_every_injected_fault(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["diag", "sdc", "--device", "cpu", "--inject-fault", "--json",
                                   "--golden-dir", str(tmp_path / "g")],
                             env={"GPUHEALTH_DIAG_STATE_DIR": str(tmp_path / "s")})
    # one device and no golden: the self-test passed, but nothing outside the device confirmed its digests
    assert res.exit_code == 3, res.output
    doc = json.loads(res.output)
    assert doc["health"] == "unknown" and doc["result"]["reference"]["basis"] == "none"
    st = doc["result"]["selftest"]
    assert st["passed"] and st["injected"] == st["detected"] == 32
    assert set(st["faults"]) == {"single_bit", "paired_bits", "word", "warp_tile"}
    assert st["findings_named"] == 32
    example = st["example_findings"][0]
    assert example["code"] == "sdc.mismatch" and example["evidence"]["injected"] is True


def test_a_device_compared_only_with_itself_is_not_judged(tmp_path: Path) -> None:
    """Issue 33: ``gpuhealth diag sdc`` with no golden and no peers said "ok … no problems found" and exited 0. It
    compared the device with nothing outside it: say so, and exit "could not check"; with peers or a golden, judge."""
    env = {"GPUHEALTH_DIAG_STATE_DIR": str(tmp_path / "state"), "GPUHEALTH_DIAG_GOLDEN_DIR": str(tmp_path / "g")}
    alone = run_cli("diag", "sdc", "--device", "cpu", env=env, timeout=180)
    assert alone.returncode == 3, alone.stdout + alone.stderr
    assert "no problems found" not in alone.stdout
    assert "compared: nothing (one device, one run of each case, no golden digests)" in alone.stdout
    assert "not judged" in alone.stdout and "nothing outside the device confirmed" in " ".join(alone.stdout.split())
    repeated = run_cli("diag", "sdc", "--device", "cpu", "--repeats", "2", "--json", "--exit-codes", "nagios",
                       env=env, timeout=180)
    doc = json.loads(repeated.stdout)
    assert repeated.returncode == 3 and doc["health"] == "unknown"  # nagios UNKNOWN
    assert doc["result"]["reference"] == {"basis": "self", "cross_checked": False,
                                          "compared": "the device with itself only (2 runs of each case)"}
    # two identical devices vote (and learn the golden); then one device alone is judged against that golden
    peers = run_cli("diag", "sdc", "--device", "cpu", "--peers", "2", env=env, timeout=180)
    assert peers.returncode == 0 and "compared: 2 devices with each other" in peers.stdout, peers.stdout
    again = run_cli("diag", "sdc", "--device", "cpu", env=env, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "compared: the golden digests" in again.stdout and "no problems found" in again.stdout


def test_goldens_recorded_before_the_state_folder_existed_survive_its_arrival(tmp_path: Path) -> None:
    """Issue 33: a golden recorded while /var/lib/gpuhealth did not exist went to ~/.cache/gpuhealth and was not
    found once the folder existed (the store moved). One rule for the place, and the old place merged in."""
    home, var = tmp_path / "home", tmp_path / "var" / "lib"
    home.mkdir()
    var.mkdir(parents=True)
    env = {"HOME": str(home), "XDG_CACHE_HOME": "", "GPUHEALTH_DIAG_STATE_DIR": "",
           "GPUHEALTH_AGENT_STATE_DIR": str(var / "gpuhealth"),
           "GPUHEALTH_DIAG_GOLDEN_DIR": str(var / "gpuhealth" / "golden")}
    first = run_cli("diag", "sdc", "--device", "cpu", "--peers", "2", "--json", env=env, timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    doc = json.loads(first.stdout)
    cache = home / ".cache" / "gpuhealth" / "diag" / "golden"
    assert doc["result"]["golden"]["status"] == "recorded" and Path(doc["result"]["golden"]["path"]).parent == cache
    (var / "gpuhealth").mkdir()  # the package (or the agent) makes /var/lib/gpuhealth
    alone = run_cli("diag", "sdc", "--device", "cpu", "--json", env=env, timeout=180)
    assert alone.returncode == 0, alone.stdout + alone.stderr  # one device, judged against the golden
    assert json.loads(alone.stdout)["result"]["golden"]["status"] == "compared"
    assert f"merged into {var / 'gpuhealth' / 'golden'}" in alone.stderr, alone.stderr
    kept = sorted(p.name for p in cache.glob("*.json"))
    assert kept and sorted(p.name for p in (var / "gpuhealth" / "golden").glob("*.json")) == kept  # both copies
    listed = run_cli("diag", "golden", env=env)
    assert listed.returncode == 0 and doc["result"]["key_id"] in listed.stdout and "merged" not in listed.stderr
