"""XID policy as data: a site's thresholds file overrides severity, action and count-in-window
escalation per XID; NVSwitch SXids from the kernel log; the Fabric Manager check on NVSwitch nodes.
Everything runs through the real collectors on the real H200 recording (the driver replayed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_xid import Harness

from gpuhealth.catalog.thresholds import ThresholdsError, load_thresholds
from gpuhealth.catalog.xid import xid_info
from gpuhealth.model import Action, Severity

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")


def _xid_lines(pci: str, xid: int, n: int, start_usec: int, step_s: float) -> list[str]:
    return [f"6,{100 + k},{start_usec + int(k * step_s * 1e6)},-;NVRM: Xid (PCI:{pci}): {xid}, pid=0, msg"
            for k in range(n)]


UPTIME_S = 30 * 86400  # the kernel log of a node up 30 days: room for XIDs hours apart, whenever the tests run


@pytest.fixture(autouse=True)
def _booted_long_ago(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's boot time is the boundary faked here: kernel-log times are boot time + offset, so a
    test placing XIDs 2.5 h in the past must not depend on this machine having been up that long."""
    import gpuhealth.backends.kmsg as kmsg_mod
    import gpuhealth.collectors.xid as xid_mod

    for mod in (kmsg_mod, xid_mod):
        monkeypatch.setattr(mod, "boot_time", lambda: time.time() - UPTIME_S - _since_start())


_START = time.monotonic()


def _since_start() -> float:
    return time.monotonic() - _START


def _boot_usec() -> int:
    """Now, as the faked kernel's microseconds since boot."""
    return int((UPTIME_S + _since_start()) * 1e6)


def _with(tmp_path: Path, policy: dict[str, Any]) -> dict[str, Any]:
    path = tmp_path / "site-thresholds.yaml"
    path.write_text(yaml.safe_dump({"xid": policy}))
    return {"thresholds": load_thresholds(path)}


def test_a_hardware_xid_repeating_within_the_window_escalates(tmp_path: Path, clock: Any) -> None:
    # XID 48 (DBE) three times within 20 minutes on GPU 0: the reset did not hold → critical, RMA
    usec = _boot_usec() - 1_200_000_000
    h = Harness(tmp_path, clock, kmsg=_xid_lines("0000:00:06", 48, 3, usec, 600))
    [f] = h.run().findings
    assert (f.code, f.severity) == ("xid.48", Severity.CRITICAL)
    assert f.action is xid_info(48).repeat_action and f.evidence["escalated"] == "3× within 3600 s"
    assert "escalated" in f.message
    # twice is not yet a pattern
    h2 = Harness(tmp_path, clock, kmsg=_xid_lines("0000:00:06", 48, 2, usec, 600))
    [g] = h2.run().findings
    assert g.action is xid_info(48).action and g.evidence["escalated"] is None


def test_occurrences_spread_wider_than_the_window_do_not_escalate(tmp_path: Path, clock: Any) -> None:
    usec = _boot_usec() - 3 * 3_000_000_000
    h = Harness(tmp_path, clock, kmsg=_xid_lines("0000:00:06", 48, 3, usec, 3000))  # 50 min apart
    [f] = h.run().findings
    assert f.evidence["count"] == 3 and f.evidence["escalated"] is None


def test_a_site_file_overrides_severity_action_and_escalation_per_xid(tmp_path: Path, clock: Any) -> None:
    usec = _boot_usec() - 100_000_000
    lines = _xid_lines("0000:00:07", 13, 5, usec, 10)  # an application XID, 5 times in a minute
    h = Harness(tmp_path, clock, kmsg=lines)
    [f] = h.run().findings  # the bundled policy: application XIDs never escalate by count
    assert (f.severity, f.action) == (Severity.INFO, Action.CHECK_JOB)
    extras = _with(tmp_path, {"codes": {"13": {"severity": "warning", "escalate_count": 5,
                                               "escalate_window_s": 300, "escalate_action": "drain"}}})
    h = Harness(tmp_path, clock, kmsg=lines)
    [f] = h.run(**extras).findings
    assert (f.severity, f.action) == (Severity.CRITICAL, Action.DRAIN)
    extras = _with(tmp_path, {"codes": {"79": {"severity": "warning", "action": "reset_gpu"}}})
    h = Harness(tmp_path, clock, kmsg=_xid_lines("0000:00:06", 79, 1, usec, 1))
    [f] = h.run(**extras).findings
    assert (f.code, f.severity, f.action) == ("xid.79", Severity.WARNING, Action.RESET_GPU)


def test_a_bad_policy_is_one_clear_error(tmp_path: Path) -> None:
    for policy, match in (({"codes": {"13": {"severity": "fatal"}}}, "xid.codes.13.severity"),
                          ({"codes": {"x": {}}}, "'x' is not a code number"),
                          ({"escalate_count": -1}, "escalate_count"),
                          ({"codes": {"13": {"when": 1}}}, "xid.codes.13.when: unknown key")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({"xid": policy}))
        with pytest.raises(ThresholdsError, match=match):
            load_thresholds(path)


def test_config_reaches_the_policy_through_status(tmp_path: Path) -> None:
    # the operator's way: collectors.thresholds_file in the config, gpuhealth status on the node
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({"xid": {"codes": {"79": {"severity": "warning",
                                                                                 "action": "reset_gpu"}}}}))
    (tmp_path / "gpuhealth.yaml").write_text(yaml.safe_dump(
        {"collectors": {"thresholds_file": str(tmp_path / "site.yaml")}}))
    scenario = tmp_path / "xid79.yaml"
    scenario.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json", "kmsg": [
        "NVRM: Xid (PCI:0000:00:06): 79, pid=0, GPU has fallen off the bus."]}))
    out = subprocess.run([GPUHEALTH, "status", "--json", "--config", str(tmp_path / "gpuhealth.yaml"),
                          "--nvml-snapshot", str(scenario)],
                         capture_output=True, text=True, timeout=120)
    doc = json.loads(out.stdout)
    [f] = [f for g in doc["gpus"] for f in g["findings"] if f["code"] == "xid.79"]
    assert (f["severity"], f["action"]) == ("warning", "reset_gpu") and doc["node"]["health"] == "degraded"


def test_xids_144_to_150_are_nvlink_errors_in_the_catalog() -> None:
    for code in range(144, 151):
        info = xid_info(code)
        assert info.known and "NVLink" in info.name and info.hardware and info.severity is Severity.CRITICAL


def _nvlink(seq: int, usec: int, link: int, word: str, status: int) -> str:
    return (f"6,{seq},{usec},-;NVRM: Xid (PCI:0000:00:07): 145, RLW_REMAP {word} XC0 i0 Link {link:02d} "
            f"(0x00000004 0x{status:08x} 0x00000000 0x00000000 0x00000000 0x00000000)")


def test_an_nvlink_xid_is_judged_by_its_decoded_line(tmp_path: Path, clock: Any) -> None:
    usec = _boot_usec()
    harmless = Harness(tmp_path, clock, kmsg=[_nvlink(100, usec, 3, "Nonfatal", 0x100)])
    [f] = harmless.run().findings  # NVIDIA: IGNORE, investigate IGNORE
    assert (f.code, f.severity, f.action) == ("xid.145", Severity.INFO, Action.NONE)
    assert f.evidence["nvlink"]["link"] == 3 and f.evidence["nvlink"]["resolution"] == "IGNORE"
    # many of them do not escalate either: NVIDIA says there is nothing to investigate
    many = Harness(tmp_path, clock, kmsg=[_nvlink(100 + k, usec + k * 10**6, 3, "Nonfatal", 0x100) for k in range(4)])
    [f] = many.run().findings
    assert (f.severity, f.action, f.evidence["count"]) == (Severity.INFO, Action.NONE, 4)
    # a fatal one on another link is not undone by a harmless one logged after it
    lines = [_nvlink(101, usec, 5, "Fatal", 0x40), _nvlink(102, usec + 10**6, 3, "Nonfatal", 0x100)]
    [f] = Harness(tmp_path, clock, kmsg=lines).run().findings  # (a third within the hour would escalate)
    assert (f.severity, f.action) == (Severity.CRITICAL, Action.RESET_GPU)
    assert f.evidence["nvlink"]["link"] == 5 and "Link 05" in f.evidence["raw"] and "link 5" in f.message
    # an undocumented status keeps the code's judgement, with the raw words
    [f] = Harness(tmp_path, clock, kmsg=[_nvlink(100, usec, 1, "Nonfatal", 0x1000)]).run().findings
    assert (f.severity, f.action) == (Severity.CRITICAL, Action.RESET_GPU)
    assert f.evidence["nvlink"]["documented"] is False and f.evidence["nvlink"]["error_status"] == "0x00001000"
    # a site's own rule for the code wins over the decode
    extras = _with(tmp_path, {"codes": {"145": {"severity": "warning", "action": "monitor"}}})
    [f] = Harness(tmp_path, clock, kmsg=[_nvlink(100, usec, 5, "Fatal", 0x40)]).run(**extras).findings
    assert (f.severity, f.action) == (Severity.WARNING, Action.MONITOR)


# ------------------------------------------------------------------------------------ NVSwitch SXids

SXIDS = ["6,200,{u},-;nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted "
         "PRIV error (First)",
         "6,201,{u},-;nvidia-nvswitch0: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
         "6,202,{u},-;nvidia-nvswitch0: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"]


def test_nvswitch_sxids_from_the_kernel_log(tmp_path: Path, clock: Any) -> None:
    lines = [x.format(u=_boot_usec()) for x in SXIDS]
    h = Harness(tmp_path, clock, kmsg=lines)
    found = {f.evidence["sxid"]: f for f in h.run().findings if f.code == "nvswitch.sxid"}
    assert (found[20034].severity, found[20034].action) == (Severity.CRITICAL, Action.DRAIN)
    assert found[20034].evidence["count"] == 2 and found[20034].evidence["pci"] == "0000:07:00.0"
    assert "LTSSM Fault Up" in found[20034].message and found[20034].entity.gpu_index is None
    assert (found[12028].severity, found[12028].action) == (Severity.WARNING, Action.MONITOR)
    # a site that knows 12028 is noise on its switches says so
    h = Harness(tmp_path, clock, kmsg=lines)
    extras = _with(tmp_path, {"sxid_codes": {"12028": {"severity": "info", "action": "none"}}})
    found = {f.evidence["sxid"]: f for f in h.run(**extras).findings if f.code == "nvswitch.sxid"}
    assert found[12028].severity is Severity.INFO and found[20034].severity is Severity.CRITICAL
