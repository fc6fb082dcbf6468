"""What the shipped systemd units start reads the settings the shipped config files hold: the coordinator, started
with its unit's ExecStart arguments and the unit's own Environment= variables, keeps its database where
coordinator.yaml's db_path says (a variable in the unit would silently beat the file)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "deploy" / "systemd"
GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")


def unit_lines(name: str, key: str) -> list[str]:
    return [line.partition("=")[2] for line in (SYSTEMD / name).read_text().splitlines()
            if line.startswith(f"{key}=")]


def test_the_coordinator_unit_keeps_its_database_where_coordinator_yaml_says(tmp_path: Path) -> None:
    shipped = yaml.safe_load((SYSTEMD / "coordinator.yaml").read_text())
    unit = "gpuhealth-coordinator.service"
    [state_dir] = unit_lines(unit, "StateDirectory")
    assert shipped["coordinator"]["db_path"].startswith(f"/var/lib/{state_dir}/")  # the one folder it may write
    # the site moves the database: only db_path changes (loopback ports, a secret here, for a machine without /run)
    secret = tmp_path / "cluster.secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    moved = tmp_path / "store" / "cluster.db"
    moved.parent.mkdir()
    config = tmp_path / "coordinator.yaml"
    config.write_text(yaml.safe_dump({"coordinator": {
        **shipped["coordinator"], "db_path": str(moved), "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
        "node_secret_file": str(secret)}}))
    [exec_start] = unit_lines(unit, "ExecStart")
    argv = shlex.split(exec_start)
    argv[0] = GPUHEALTH
    argv[argv.index("--config") + 1] = str(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEALTH_")}
    env.update(dict(v.split("=", 1) for v in unit_lines(unit, "Environment")))
    ready = tmp_path / "ports.json"
    proc = subprocess.Popen([*argv, "--ready-file", str(ready)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the coordinator never started"
            time.sleep(0.1)
        assert moved.exists()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
