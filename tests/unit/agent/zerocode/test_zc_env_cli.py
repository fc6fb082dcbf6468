"""``gpuhealth env``: what it prints is what the agent reads back from a rank's environment."""

from __future__ import annotations

import json

import yaml
from click.testing import CliRunner

from gpuhealth.agent.zerocode.environ import launch_info, parse_environ
from gpuhealth.cli.env import command
from gpuhealth.cli.exitcodes import USAGE_ERROR


def test_export_lines_give_a_rank_everything_a_live_dump_needs() -> None:
    out = CliRunner().invoke(command, ["--tag", "4242"], env={"SLURM_JOB_ID": "1"})
    assert out.exit_code == 0
    lines = out.output.split()
    assert all("=" in line for line in lines)  # export $(gpuhealth env) takes the lines as they are
    env = parse_environ("\0".join(lines).encode())
    li = launch_info({**env, "RANK": "3", "WORLD_SIZE": "8", "SLURM_JOB_ID": "4242"})
    assert li.dump_ready is None and li.timing and li.fr_buffer == 2000
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == "/tmp/gpuhealth-4242-pipe-"


def test_the_tag_defaults_to_the_slurm_job_and_the_formats_agree() -> None:
    runner = CliRunner()
    plain = runner.invoke(command, [], env={"SLURM_JOB_ID": "77", "GPUHEALTH_JOB_ID": ""}).output
    assert "/tmp/gpuhealth-77-fr-" in plain
    slurm = runner.invoke(command, ["--format", "slurm", "--tag", "77"]).output.splitlines()
    assert all(line.startswith("export ") for line in slurm)
    pod = yaml.safe_load(runner.invoke(command, ["--format", "yaml", "--tag", "77", "--no-timing"]).output)
    as_json = json.loads(runner.invoke(command, ["--format", "json", "--tag", "77", "--no-timing"]).output)
    assert {e["name"]: e["value"] for e in pod} == as_json and "TORCH_NCCL_ENABLE_TIMING" not in as_json


def test_a_relative_folder_is_refused_in_words() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "env", "--dir", "relative/dir"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == USAGE_ERROR and "absolute path" in out.stderr
