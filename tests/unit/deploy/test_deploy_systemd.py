"""The systemd units: ``systemd-analyze verify`` (the real parser) in a throwaway root, and the
properties users rely on (notify + watchdog, restart, hardening, NVML-only device access)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhealth.config import load_config

REPO = Path(__file__).resolve().parents[3]
SYSTEMD = REPO / "deploy" / "systemd"
UNITS = ("gpuhealth-agent.service", "gpuhealth-coordinator.service")
SYSTEM_UNITS = Path("/usr/lib/systemd/system")
GPUHEALTH = Path(sys.executable).parent / "gpuhealth"


def _unit_settings(path: Path) -> dict[str, list[str]]:
    """Key → all values in [Service]/[Unit]/[Install] (systemd keys may repeat; configparser can't)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def _verify(tmp_path: Path, unit_files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the real ``systemd-analyze verify`` against a root holding the distribution's units,
    our unit files and an executable at the units' ExecStart path (verify checks it exists)."""
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    bin_dir = root / "usr/local/bin"
    bin_dir.mkdir(parents=True)
    launcher = bin_dir / "gpuhealth"
    launcher.write_text(f"#!/bin/sh\nexec {GPUHEALTH} \"$@\"\n")
    launcher.chmod(0o755)
    (root / "bin").mkdir()
    shutil.copy2(shutil.which("kill") or "/bin/kill", root / "bin" / "kill")  # ExecReload's command
    etc = root / "etc/systemd/system"
    for rel, text in unit_files.items():
        target = etc / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    units = [rel for rel in unit_files if rel.endswith(".service") and "/" not in rel]
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", "--man=no", *units],
        capture_output=True, text=True, timeout=60,
    )


def _our_units() -> dict[str, str]:
    files = {name: (SYSTEMD / name).read_text() for name in UNITS}
    files["gpuhealth-agent.service.d/py-spy.conf"] = (SYSTEMD / "gpuhealth-agent.service.d/py-spy.conf").read_text()
    return files


def test_units_pass_systemd_analyze_verify_without_any_warning(tmp_path: Path) -> None:
    result = _verify(tmp_path, _our_units())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


def test_verify_harness_catches_a_broken_unit(tmp_path: Path) -> None:
    # Proves the check above can fail: an unknown key and a bad value are reported.
    bad = (SYSTEMD / UNITS[0]).read_text().replace("ProtectSystem=strict", "ProtectSystem=sometimes\nWatchDogSec=1")
    result = _verify(tmp_path, {UNITS[0]: bad})
    assert "ProtectSystem" in result.stderr or "protect system" in result.stderr
    assert "WatchDogSec" in result.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_notify_watchdog_restart_and_hardening(unit: str) -> None:
    s = _unit_settings(SYSTEMD / unit)
    if unit == UNITS[0]:  # the agent sends READY=1 / WATCHDOG=1 (see the notify integration test)
        assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
        assert int(s["WatchdogSec"][0]) >= 30
    else:
        assert s["Type"] in (["notify"], ["exec"])
        assert ("WatchdogSec" in s) == (s["Type"] == ["notify"])
    assert s["Restart"] == ["on-failure"]
    assert s["ProtectSystem"] == ["strict"] and s["NoNewPrivileges"] == ["yes"]
    assert s["DevicePolicy"] == ["closed"]
    assert s["ExecStart"][0].split()[:2] == ["/usr/local/bin/gpuhealth", unit.split("-")[1].split(".")[0]]
    assert "--config" in s["ExecStart"][0] and "/etc/gpuhealth/" in s["ExecStart"][0]


def test_agent_gets_nvml_and_kmsg_devices_and_nothing_else() -> None:
    s = _unit_settings(SYSTEMD / UNITS[0])
    assert sorted(s["DeviceAllow"]) == sorted([
        "char-nvidia-frontend rw", "char-nvidia-caps r", "char-nvidia-uvm rw", "/dev/kmsg r",
    ])
    assert s["PrivateDevices"] == ["no"]  # would hide /dev/nvidia*
    assert s.get("ProtectKernelLogs", ["no"]) == ["no"]  # would deny /dev/kmsg (XIDs)
    assert s["CapabilityBoundingSet"] == ["CAP_SYSLOG"]
    assert set(s["ReadWritePaths"][0].split()) == {"/var/lib/gpuhealth", "/run/gpuhealth"}
    assert s["StateDirectory"] == ["gpuhealth"] and s["RuntimeDirectory"] == ["gpuhealth"]


def test_the_prologs_files_in_the_runtime_directory_survive_an_agent_restart() -> None:
    # The Slurm hooks keep the GPU -> job map and the screen locks under /run/gpuhealth, the agent's
    # RuntimeDirectory: systemd must not remove it when the agent stops or restarts.
    s = _unit_settings(SYSTEMD / UNITS[0])
    assert s["RuntimeDirectoryPreserve"] == ["yes"]
    lib = (REPO / "deploy" / "slurm" / "gpuhealth-slurm-lib.sh").read_text()
    for default in ("GPUHEALTH_SLURM_JOB_DIR:-/run/gpuhealth/", "GPUHEALTH_SCREEN_BLOCK_DIR:-/run/gpuhealth/"):
        assert default in lib


def test_coordinator_gets_no_devices_and_its_own_state() -> None:
    s = _unit_settings(SYSTEMD / UNITS[1])
    assert "DeviceAllow" not in s and s["PrivateDevices"] == ["yes"]
    assert s["CapabilityBoundingSet"] == [""]
    assert s["StateDirectory"] == ["gpuhealth-coordinator"]
    # the database's place is the shipped coordinator.yaml's db_path (tests/integration/test_deploy_systemd_config.py)
    assert load_config(SYSTEMD / "coordinator.yaml", env={}).coordinator.db_path.startswith(
        "/var/lib/gpuhealth-coordinator/")


def test_agent_reloads_its_config_on_systemctl_reload() -> None:
    # the agent handles SIGHUP (re-reads its config); ExecReload is how `systemctl reload` sends it
    service = _unit_settings(SYSTEMD / "gpuhealth-agent.service")
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_py_spy_drop_in_adds_ptrace_only() -> None:
    s = _unit_settings(SYSTEMD / "gpuhealth-agent.service.d/py-spy.conf")
    assert set(s["CapabilityBoundingSet"][0].split()) == {"CAP_SYSLOG", "CAP_SYS_PTRACE"}
    assert s["SystemCallFilter"] == ["@debug"]


@pytest.mark.parametrize(("name", "section"), [("agent.yaml", "agent"), ("coordinator.yaml", "coordinator")])
def test_example_configs_load(name: str, section: str) -> None:
    cfg = load_config(SYSTEMD / name, env={})
    assert getattr(cfg, section) is not None
    if section == "agent":
        assert cfg.agent.socket_path.startswith("/run/gpuhealth/")
        assert cfg.agent.state_dir == "/var/lib/gpuhealth"


@pytest.mark.parametrize("unit", UNITS)
def test_exec_start_flags_exist_on_the_real_command(unit: str) -> None:
    argv = _unit_settings(SYSTEMD / unit)["ExecStart"][0].split()
    sub = argv[1]
    help_text = subprocess.run([str(GPUHEALTH), sub, "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0, help_text.stdout + help_text.stderr
    for flag in (a for a in argv[2:] if a.startswith("--")):
        assert flag in help_text.stdout, f"{unit}: 'gpuhealth {sub}' has no {flag}"


@pytest.mark.parametrize(("unit", "max_exposure"), [(UNITS[0], 3.0), (UNITS[1], 2.0)])
def test_systemd_security_exposure_stays_low(tmp_path: Path, unit: str, max_exposure: float) -> None:
    # systemd's own hardening score (0 = locked down, 10 = exposed), for the unit without drop-ins.
    # The agent needs NVML devices, /dev/kmsg and the network; the coordinator needs only the network.
    copy = tmp_path / unit
    copy.write_text((SYSTEMD / unit).read_text())
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(copy)],
                            capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= max_exposure, result.stdout
