"""``gpuhealth env``: the launch variables that let the agent take flight-recorder dumps from a live job.

    export $(gpuhealth env)              # then torchrun … as usual: the job imports nothing of ours
    gpuhealth env --format yaml          # a Kubernetes container's env: list
    gpuhealth env --format slurm         # lines for a Slurm TaskProlog (``export NAME=value``)

Each rank then creates a FIFO and, when the agent writes to it (on a hang, or for ``gpuhealth triage
--job``), writes its flight-recorder dump while the job keeps running. Hang detection through NCCL's
RAS service needs none of this. The tag (default: the Slurm job id, else a random one) keeps two jobs
on one node apart.
"""

from __future__ import annotations

import json
import os
import secrets

import click

from gpuhealth.agent.zerocode.environ import launch_variables


def _default_tag() -> str:
    return (os.environ.get("GPUHEALTH_JOB_ID") or os.environ.get("SLURM_JOB_ID") or secrets.token_hex(4)).strip()


@click.command(name="env")
@click.option("--tag", default=None, help="Names this job's files (default: $GPUHEALTH_JOB_ID, $SLURM_JOB_ID, "
                                          "else random).")
@click.option("--dir", "folder", default="/tmp", show_default=True,
              help="An existing folder the ranks can write, as the job sees it.")
@click.option("--buffer", "buffer_entries", type=click.IntRange(min=1, max=1 << 20), default=2000, show_default=True,
              help="Flight-recorder entries per rank (TORCH_FR_BUFFER_SIZE).")
@click.option("--timing/--no-timing", default=True, show_default=True,
              help="Collective durations in the dumps (TORCH_NCCL_ENABLE_TIMING; stragglers need them).")
@click.option("--format", "fmt", type=click.Choice(["env", "slurm", "yaml", "json"]), default="env", show_default=True,
              help="env: NAME=value lines for export $(…); slurm: TaskProlog lines; yaml: a pod's env list; json.")
def command(tag: str | None, folder: str, buffer_entries: int, timing: bool, fmt: str) -> None:
    """Print the launch variables for live flight-recorder dumps of an unmodified job."""
    if not folder.startswith("/"):  # a usage error: exits 64 through cli/main.py
        raise click.BadParameter(f"must be an absolute path (the agent finds it in the rank's root), got {folder!r}",
                                 param_hint="'--dir'")
    variables = launch_variables(tag or _default_tag(), folder=folder, buffer_entries=buffer_entries, timing=timing)
    if fmt == "json":
        click.echo(json.dumps(variables, indent=2))
    elif fmt == "yaml":
        click.echo("\n".join(f"- name: {k}\n  value: {json.dumps(v)}" for k, v in variables.items()))
    else:
        prefix = "export " if fmt == "slurm" else ""
        click.echo("\n".join(f"{prefix}{k}={v}" for k, v in variables.items()))


__all__ = ["command"]
