"""The deploy examples set exactly what `gpuhealth env` prints (they are written out, so they must not drift)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from click.testing import CliRunner

from gpuhealth.agent.zerocode.environ import launch_info, launch_variables
from gpuhealth.cli.env import command

DEPLOY = Path(__file__).resolve().parents[4] / "deploy"


def test_the_slurm_task_prolog_prints_what_gpuhealth_env_prints() -> None:
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "123/4"}
    out = subprocess.run(["bash", str(DEPLOY / "slurm" / "gpuhealth-taskprolog.sh")], env=env, capture_output=True,
                         text=True, check=True).stdout
    expected = CliRunner().invoke(command, ["--format", "slurm", "--tag", "123/4"]).output
    assert out.splitlines() == expected.splitlines()
    off = subprocess.run(["bash", str(DEPLOY / "slurm" / "gpuhealth-taskprolog.sh")],
                         env={**env, "GPUHEALTH_ZEROCODE": "0"}, capture_output=True, text=True, check=True).stdout
    assert off == ""


def test_the_pod_env_example_is_what_gpuhealth_env_prints() -> None:
    pod = yaml.safe_load((DEPLOY / "kubernetes" / "examples" / "zero-code-pod-env.yaml").read_text())
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env == launch_variables("pod")
    assert launch_info({**env, "RANK": "0", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "x"}).dump_ready is None
