"""`gpuhealth agent` refuses bad input with one clear line and exit code 3."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuhealth.agent.http import parse_listen
from gpuhealth.cli.agent import command


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nvml-snapshot", "/nonexistent/rec.json"], "/nonexistent/rec.json"),
        (["--config", "/nonexistent/agent.yaml"], "cannot read"),
    ],
)
def test_bad_input_is_one_line_and_exit_3(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 3, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--listen", "nowhere"], "Invalid value for '--listen': 'nowhere' is not host:port"),
        (["--listen", "127.0.0.1:99999"], "a port from 0 to 65535"),
    ],
)
def test_a_bad_flag_value_is_a_usage_error(args: list[str], needle: str) -> None:
    # click's 2 here; through the gpuhealth command every usage error is 64 (tests/integration/test_usage_exit_codes.py)
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_bad_config_values_are_named(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("collectors:\n  fast_interval_s: 0\n")
    result = CliRunner().invoke(command, ["--config", str(cfg)])
    assert result.exit_code == 3 and "fast_interval_s" in result.output
    cfg.write_text("agent:\n  no_such_key: 1\n")
    result = CliRunner().invoke(command, ["--config", str(cfg)])
    assert result.exit_code == 3 and "agent.no_such_key" in result.output
    cfg.write_text("collectors:\n  disabled: [eccc]\n")
    result = CliRunner().invoke(command, ["--config", str(cfg)])
    assert result.exit_code == 3 and "eccc" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.0.0.0:9400", ("0.0.0.0", 9400)), (":9400", ("0.0.0.0", 9400)), ("[::]:9400", ("::", 9400)),
     ("127.0.0.1:0", ("127.0.0.1", 0))],
)
def test_listen_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected
