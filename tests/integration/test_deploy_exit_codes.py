"""The exit codes the docs promise, from the real ``gpuhealth`` command: a token file a coordinator query cannot
use is "could not ask" (3, docs/coordinator.md), whichever way it was named, as ``triage --job`` already said; a
usage error is 64 in every profile, also through a variable that stands for a flag (docs/architecture.md,
docs/security.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
# nothing is asked of it: the token is read (and refused) before any connection
COORDINATOR = "127.0.0.1:9"


def gpuhealth(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEALTH_")}
    return subprocess.run([GPUHEALTH, *args], capture_output=True, text=True, timeout=60, env={**base, **env})


@pytest.fixture
def unusable(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    return {"missing": tmp_path / "missing", "empty": empty, "a folder": tmp_path}


@pytest.mark.parametrize("command", ["jobs", "fleet"])
@pytest.mark.parametrize("kind", ["missing", "empty", "a folder"])
def test_an_unusable_token_file_is_could_not_ask(command: str, kind: str, unusable: dict[str, Path]) -> None:
    path = str(unusable[kind])
    for result in (gpuhealth(command, "--coordinator", COORDINATOR, "--token-file", path),
                   gpuhealth(command, "--coordinator", COORDINATOR, GPUHEALTH_TOKEN_FILE=path)):
        assert result.returncode == 3, result.stderr
        [line] = result.stderr.strip().splitlines()  # one line, no usage text, no traceback
        assert line.startswith(f"gpuhealth {command}: ") and path in line, line
    # as `triage --job` (no --token-file flag: the variable) has said all along
    result = gpuhealth("triage", "--job", "j1", "--coordinator", COORDINATOR, GPUHEALTH_TOKEN_FILE=path)
    assert result.returncode == 3 and path in result.stderr, result.stderr


@pytest.mark.parametrize(("argv", "env"), [
    (["status", "--agent-timeout", "abc"], {}),
    (["status", "--exit-codes", "slurm"], {"GPUHEALTH_AGENT_TIMEOUT_S": "abc"}),
    (["status", "--exit-codes", "nagios", "--json", "--no-such-flag"], {}),
])
def test_a_usage_error_is_64_in_every_profile_as_documented(argv: list[str], env: dict[str, str]) -> None:
    result = gpuhealth(*argv, **env)
    assert result.returncode == 64, result.stderr
    assert "Traceback" not in result.stderr
    for doc in ("architecture.md", "security.md"):
        text = (REPO / "docs" / doc).read_text()
        assert re.search(r"usage error[^|\n]*(\n[^|\n]+)*?exit[s]? \**64", text), doc
