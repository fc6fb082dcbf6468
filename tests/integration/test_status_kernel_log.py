"""`gpuhealth status --kmsg FILE` (issue 33, item 2): a kernel log someone named that cannot be read, or holds no
kernel record, leaves the XID check undone — health unknown, "could not check" in every exit profile — never a
clean bill. A real kernel log (mostly non-XID lines) is read as before. /dev/kmsg refused or absent where the
agent runs (a container) stays information: NVML events still count (docs/environments.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
from commands import CLI

from gpuhealth.backends.kmsg import DevKmsg
from gpuhealth.config import CollectorsConfig, load_config
from gpuhealth.model import Health
from gpuhealth.node import collect_once, open_backend

RECORDING = "nvml_h200x2.json"
COULD_NOT_CHECK = {"default": 3, "slurm": 1, "npd": 2, "nagios": 3}


def status(tmp_path: Path, kmsg: Path | str, *extra: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "gpuhealth.yaml"  # the host collector reads this machine (psutil): left out
    config.write_text("agent: {node_name: kmsg-node}\ncollectors: {disabled: [host]}\n")
    return subprocess.run([*CLI, "status", "--nvml-snapshot", RECORDING, "--config", str(config), "--kmsg", str(kmsg),
                           *extra], capture_output=True, text=True, timeout=120, check=False)


def _random_bytes(tmp_path: Path) -> Path:
    path = tmp_path / "random.log"
    path.write_bytes(os.urandom(64 * 1024))
    return path


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.log"
    path.write_text("")
    return path


@pytest.mark.parametrize("make", [lambda p: p / "nonexistent.log", _random_bytes, _empty],
                         ids=["missing", "random-bytes", "empty"])
def test_a_named_log_that_gives_no_kernel_record_is_could_not_check(tmp_path: Path, make) -> None:  # type: ignore[no-untyped-def]
    log = make(tmp_path)
    for profile, code in COULD_NOT_CHECK.items():
        res = status(tmp_path, log, "--exit-codes", profile)
        assert res.returncode == code, (profile, res.stdout, res.stderr)
    res = status(tmp_path, log, "--json")
    doc = json.loads(res.stdout)
    assert doc["node"]["health"] == "unknown"
    [f] = [f for f in doc["findings"] if f["code"].startswith("kmsg.")]
    assert f["code"] == "kmsg.unreadable" and f["evidence"]["could_not_check"] is True
    assert "CAP_SYSLOG" not in f["message"] and "needs root" not in f["message"]  # not a permission problem
    text = status(tmp_path, log).stdout
    assert "UNKNOWN" in text and "kmsg.unreadable" in text and "HEALTHY" not in text


def test_real_kernel_logs_with_non_xid_lines_are_read_as_before(tmp_path: Path) -> None:
    clean = {
        "dmesg": "[    0.000000] Linux version 6.8.0 (buildd@lcy02)\n"
                 "[   12.345678] nvidia: loading out-of-tree module\n",
        "dmesg -T": "[Tue Dec  8 02:10:03 2026] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.159.04\n",
        "journalctl -k": "Dec 08 02:10:03 node7 kernel: pci 0000:18:00.0: [10de:2335] type 00 class 0x030200\n",
        "kern.log iso": "2026-12-08T02:10:03.123456+00:00 node7 kernel: EXT4-fs (sda1): mounted filesystem\n",
        "/dev/kmsg": "6,1234,5678901,-;nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver\n",
    }
    for name, lines in clean.items():
        log = tmp_path / "kern.log"
        log.write_text(lines)
        res = status(tmp_path, log, "--json")
        doc = json.loads(res.stdout)
        assert res.returncode == 0 and doc["node"]["health"] == "healthy", (name, res.stdout[-2000:])
        assert not [f for f in doc["findings"] if f["code"].startswith("kmsg.")], name
    # An XID among them is found, as before.
    log = tmp_path / "kern.log"
    log.write_text(clean["dmesg"] + "[   99.000001] NVRM: Xid (PCI:0000:00:06): 79, pid=0, GPU has fallen off the "
                   "bus.\n")
    res = status(tmp_path, log, "--json")
    assert res.returncode == 2 and json.loads(res.stdout)["gpus"][0]["findings"][0]["code"] == "xid.79"


def test_dev_kmsg_absent_where_the_agent_runs_is_information_not_unknown(tmp_path: Path) -> None:
    # A container without /dev/kmsg mounted: the environment's limit, never a fault nor "could not check".
    backend = open_backend(RECORDING)
    config = dataclasses.replace(load_config(None), collectors=CollectorsConfig(disabled=["host"]))
    try:
        report = collect_once(backend, config, kmsg=DevKmsg(str(tmp_path / "kmsg")))
    finally:
        backend.shutdown()
    [f] = [f for f in report.all_findings() if f.code.startswith("kmsg.")]
    assert (f.code, str(f.severity), report.health) == ("kmsg.unavailable", "info", Health.HEALTHY)
    assert "container" in f.message and "CAP_SYSLOG" not in f.message and "NVML events still count" in f.message


def test_qualify_with_a_named_log_it_cannot_read_is_not_judged_fit(tmp_path: Path) -> None:
    res = subprocess.run([*CLI, "qualify", "--nvml-snapshot", RECORDING, "--level", "quick", "--kmsg",
                          str(tmp_path / "nonexistent.log"), "--json"], capture_output=True, text=True, timeout=300,
                         check=False)
    doc = json.loads(res.stdout)
    assert res.returncode == 3, res.stderr[-2000:]
    assert doc["node"]["health"] == "unknown" and doc["node"]["fit"] is False
