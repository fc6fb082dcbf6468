"""Every command's usage errors exit 64 (``USAGE_ERROR``, docs/architecture.md "Exit-code profiles"): click's own
(an unknown flag, a value its type refuses) and the values a command checks itself — a listen address the agent's
config check refuses (``agent --listen notaport`` exited 3), a missing argument (``triage`` alone exited 3), a
malformed ``--device``, a node name ``token`` cannot mint for. Each through the command a user types; a command
without a case here fails the loop (a new command brings its own)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from commands import CLI

from gpuhealth.cli.exitcodes import USAGE_ERROR
from gpuhealth.cli.main import COMMANDS

pytestmark = pytest.mark.integration

# command → argument lists that are usage errors: at least one the command checks itself, beyond click's types
CASES: dict[str, list[list[str]]] = {
    "status": [["--exit-codes", "nope"], ["--kmsg", "a\x01b"], ["--agent-timeout", "abc"]],
    "record": [["--reps", "0", "out.json"], []],
    "agent": [["--listen", "notaport"], ["--listen", "1.2.3.4:99999"], ["--node-name", "a\x01b"]],
    "coordinator": [["--listen", "notaport"], ["--metrics-listen", "x:y"], ["--hang-k", "-1"]],
    "jobs": [["a", "b"], ["--bogus"]],
    "fleet": [["--sdc", "--device", "gpu0"], ["--timeout", "0"]],
    "triage": [[], ["--coordinator", "127.0.0.1:1"], ["/no/such/folder"], ["--steps", "x.jsonl", "--group", "bad"]],
    "diag": [["sdc", "--device", "gpu0"], ["sdc", "--repeats", "0"], ["busbw", "--collectives", "all_reduce,nope"],
             ["busbw", "--min-bytes", "10", "--max-bytes", "5"], ["nosuch"]],
    "qualify": [["--level", "extreme"], ["--kmsg", "a\x01b"]],
    "demo": [["--agent-listen", "notaport"], ["--duration", "-1"]],
    "env": [["--dir", "relative/folder"], ["--buffer", "0"]],
    "token": [["--node", "", "--secret-file", "SECRET"], ["--node", "n"]],
}


def test_every_command_has_usage_cases() -> None:
    assert sorted(CASES) == sorted(COMMANDS)


@pytest.mark.parametrize(("command", "args"), [(c, a) for c, cases in CASES.items() for a in cases],
                         ids=lambda v: v if isinstance(v, str) else " ".join(v) or "(none)")
def test_a_usage_error_exits_64_with_one_error_line(tmp_path: Path, command: str, args: list[str]) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(40).hex().encode())
    secret.chmod(0o600)
    argv = [str(secret) if a == "SECRET" else a for a in args]
    # a home and state of its own: nothing this run might start may touch the user's
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "GPUHEALTH_DIAG_STATE_DIR": str(tmp_path / "diag")}
    res = subprocess.run([*CLI, command, *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert res.returncode == USAGE_ERROR, (res.returncode, res.stdout, res.stderr)
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stdout == ""


def test_the_same_value_from_a_config_file_is_could_not_check(tmp_path: Path) -> None:
    """A flag is a usage error; the same bad value in a config file is a config that could not be used (3)."""
    config = tmp_path / "agent.yaml"
    config.write_text("agent:\n  listen: notaport\n")
    res = subprocess.run([*CLI, "agent", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 3 and "agent.listen" in res.stderr, res.stderr
