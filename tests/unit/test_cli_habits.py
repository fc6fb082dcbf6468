"""How the CLI behaves for scripts and operators: usage errors are not verdicts, secrets stay off
the command line, and nothing is cut when the output is piped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from gpuhealth.cli._coordinator_client import resolve
from gpuhealth.cli._secrets import read_secret_file
from gpuhealth.cli.exitcodes import PROFILE_NAMES, USAGE_ERROR, exit_code
from gpuhealth.model import Health

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUHEALTH, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("argv", [["status", "--bogus"], ["status", "--exit-codes", "nagios", "--no-such"],
                                  ["qualify", "--level", "extreme"], ["nosuch"], ["jobs", "a", "b"]])
def test_usage_errors_exit_with_their_own_code(argv: list[str]) -> None:
    result = _run(*argv)
    assert result.returncode == USAGE_ERROR == 64, result.stderr
    assert "Error:" in result.stderr and "Traceback" not in result.stderr
    # no profile uses it for a health verdict
    assert USAGE_ERROR not in {exit_code(h, p) for h in Health for p in PROFILE_NAMES}


def test_help_and_version_still_exit_zero() -> None:
    assert _run("--version").returncode == 0
    assert _run("status", "--help").returncode == 0


def test_tokens_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret-token\n")
    secret.chmod(0o600)
    assert resolve(None, "127.0.0.1:1", None, None, None, None, str(secret))[1] == "s3cret-token"
    assert resolve(None, "127.0.0.1:1", "from-arg", None, None, None, None)[1] == "from-arg"
    assert read_secret_file(str(secret)) == "s3cret-token"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(click.UsageError, match="is empty"):
        read_secret_file(str(empty))
    with pytest.raises(click.UsageError, match="cannot read the token file"):
        read_secret_file(str(tmp_path / "missing"))
    # through the real command: the file given by the environment, a clear line when it is missing
    result = _run("jobs", "--coordinator", "127.0.0.1:9", env={"GPUHEALTH_TOKEN_FILE": str(tmp_path / "missing")})
    assert result.returncode == 3 and "cannot read the token file" in result.stderr  # could not ask, as triage --job
    help_text = _run("jobs", "--help").stdout
    assert "--token-file" in help_text and "GPUHEALTH_TOKEN" in help_text
    assert "--token-file" in _run("coordinator", "--help").stdout


def test_piped_tables_keep_ids_whole(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuhealth.cli import jobs

    long_id = "train-llama-70b-" + "x" * 90 + "-final"
    render = jobs._render  # the command's renderer, fed what the coordinator answers
    render([{"job_id": long_id, "state": "running", "ranks_seen": 8, "world_size": 8,
             "nodes": ["gpu-node-0001.cluster.example.org", "gpu-node-0002.cluster.example.org"],
             "last_step": 10, "step_time_quantiles": {"0.5": 0.25}, "stragglers": [], "hangs": 0}])
    out = capsys.readouterr().out
    assert long_id in out and "…" not in out
    assert "gpu-node-0001.cluster.example.org,gpu-node-0002.cluster.example.org" in out


def test_piped_status_keeps_every_finding_on_one_whole_line() -> None:
    # what a cron job or `| grep` gets: a narrow COLUMNS (a terminal's setting inherited by the pipe)
    # must not cut or fold a finding, the node's verdict or an id
    scenario = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios" / "faulty_node.yaml"
    result = _run("status", "--nvml-snapshot", str(scenario), env={"COLUMNS": "40", "TERM": "xterm"})
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout
    assert any("critical pcie.link_degraded: GPU 3: PCIe link trained at x8, below its maximum x16 → drain" in line
               for line in lines), result.stdout
    assert any("00000000:48:00.0" in line and "unhealthy" in line for line in lines)
