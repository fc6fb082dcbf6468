"""Every setting of the Slurm hooks does what slurm.env and docs/deploy-slurm.md say: the real scripts under bash,
with a stand-in ``gpuhealth`` that logs its arguments and a stand-in ``scontrol`` (the live checks are in
tests/integration/test_deploy_slurm_config.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SLURM = REPO / "deploy" / "slurm"
DOC = REPO / "docs" / "deploy-slurm.md"
SNIPPET = SLURM / "slurm.conf.snippet"

STUB = """#!/bin/bash
printf '%s\\n' "$*" >> "$STUB_LOG"
[ "$(basename "$0")" = scontrol ] && [ "$1" = show ] && echo "NodeName=n1 State=IDLE"
exit "${STUB_RC:-0}"
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("gpuhealth", "scontrol"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(tmp_path / "calls.log"), "SLURMD_NODENAME": "n1",
            "GPUHEALTH_SLURM_ENV": str(tmp_path / "absent.env"), "GPUHEALTH_SLURM_JOB_DIR": str(tmp_path / "jobs"),
            "GPUHEALTH_SCREEN_BLOCK_DIR": str(tmp_path / "block"), "GPUHEALTH_DIAG_LOCK_DIR": str(tmp_path / "locks"),
            "GPUHEALTH_AGENT_URL": "", "GPUHEALTH_CONFIG": str(tmp_path / "agent.yaml"), "TMPDIR": str(tmp_path),
            "NVIDIA_SMI": "absent-nvidia-smi"}


def run(script: str, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SLURM / script)], env={**env, **extra}, capture_output=True, text=True,
                          timeout=60)


def calls(env: dict[str, str]) -> list[str]:
    log = Path(env["STUB_LOG"])
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("script", ["gpuhealth-prolog.sh", "gpuhealth-epilog.sh", "gpuhealth-healthcheck.sh"])
def test_every_check_of_every_hook_gets_the_nodes_config_file_when_it_exists(env: dict[str, str],
                                                                            script: str) -> None:
    run(script, env, SLURM_JOB_ID="5")
    checks = [c for c in calls(env) if not c.startswith(("show ", "update "))]
    assert checks and not any("--config" in c for c in checks)  # no file: the defaults, as before
    Path(env["GPUHEALTH_CONFIG"]).write_text("collectors: {expected_gpus: 8}\n")
    Path(env["STUB_LOG"]).unlink()
    run(script, env, SLURM_JOB_ID="5")
    checks = [c for c in calls(env) if not c.startswith(("show ", "update "))]
    assert checks and all(c.endswith(f" --config {env['GPUHEALTH_CONFIG']}") for c in checks), checks
    Path(env["STUB_LOG"]).unlink()
    run(script, env, SLURM_JOB_ID="5", GPUHEALTH_CONFIG="")  # "" in slurm.env: never a file
    checks = [c for c in calls(env) if not c.startswith(("show ", "update "))]
    assert checks and not any("--config" in c for c in checks)


def test_an_on_error_value_that_is_neither_drain_nor_ignore_is_named_in_one_line(env: dict[str, str]) -> None:
    result = run("gpuhealth-prolog.sh", env, SLURM_JOB_ID="6", STUB_RC="3", GPUHEALTH_ON_ERROR="drian")
    lines = [x for x in result.stderr.splitlines() if "GPUHEALTH_ON_ERROR" in x]
    assert lines == ["gpuhealth-slurm: GPUHEALTH_ON_ERROR=drian is neither drain nor ignore; using ignore"]
    assert result.returncode == 0  # ignore: the job starts, as before, but no longer unnoticed
    assert not any(c.startswith("update ") for c in calls(env))


def test_an_empty_healthcheck_args_skips_the_check_like_the_other_hooks_args(env: dict[str, str]) -> None:
    assert run("gpuhealth-healthcheck.sh", env, GPUHEALTH_HEALTHCHECK_ARGS="").returncode == 0
    assert calls(env) == []


def test_the_task_prolog_and_its_settings_are_in_the_snippet_and_the_guide() -> None:
    assert re.search(r"^TaskProlog=/etc/slurm/gpuhealth-taskprolog\.sh$", SNIPPET.read_text(), re.M)
    doc = DOC.read_text()
    assert "TaskProlog=/etc/slurm/gpuhealth-taskprolog.sh" in doc
    for name in ("GPUHEALTH_ZEROCODE", "GPUHEALTH_ZEROCODE_DIR", "GPUHEALTH_FR_BUFFER_SIZE", "GPUHEALTH_JOB_ID",
                 "GPUHEALTH_CONFIG"):
        assert f"`{name}`" in doc, name


def test_the_task_prolog_defaults_are_the_ones_documented(tmp_path: Path) -> None:
    out = subprocess.run(["bash", str(SLURM / "gpuhealth-taskprolog.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "812"}, timeout=30).stdout
    assert "export TORCH_FR_BUFFER_SIZE=2000" in out
    assert "export TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/tmp/gpuhealth-812-pipe-" in out
    doc = DOC.read_text()
    assert re.search(r"`GPUHEALTH_ZEROCODE_DIR`[^\n]*`/tmp`", doc)
    assert re.search(r"`GPUHEALTH_FR_BUFFER_SIZE`[^\n]*`2000`", doc)
