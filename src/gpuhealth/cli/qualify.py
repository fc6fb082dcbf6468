"""``gpuhealth qualify``: is this node fit to run a job? Collectors + diagnostics → one verdict.

Thin edge: parse, call ``diag.qualify.run_qualify``, render (rich, with a progress bar on a
terminal) or ``--json``, exit with the chosen profile's code.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from gpuhealth.agent.nvml_supervisor import start_failure_finding
from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.errors import NvmlError
from gpuhealth.cli._console import output_console
from gpuhealth.cli._node_inputs import NodeInputError, open_node
from gpuhealth.cli.exitcodes import PROFILE_NAMES, exit_code
from gpuhealth.config import ConfigError, load_config
from gpuhealth.diag.qualify import LEVELS, QualifyReport, default_state_dir, run_qualify
from gpuhealth.diag.runner import DiagRunner
from gpuhealth.model import Action, Health
from gpuhealth.node import collect_once

_STYLE = {Health.HEALTHY: "bold green", Health.DEGRADED: "bold yellow", Health.UNHEALTHY: "bold red",
          Health.UNKNOWN: "bold magenta"}


def _fail(message: str, profile: str, *, as_json: bool = False, level: str = "", driver: BaseException | None = None,
          backend: NvmlBackend | None = None, root: str = "/") -> None:
    click.echo(f"gpuhealth qualify: {message}", err=True)
    # NVML would not start: "could not check" unless the driver is the likely fault (cli/status.py alike)
    finding = None if driver is None else start_failure_finding(socket.gethostname(), message, driver, backend, root,
                                                                 "cli/qualify.py")
    reboot = finding is not None and finding.action is Action.REBOOT
    health = Health.UNHEALTHY if reboot else Health.UNKNOWN
    if as_json:  # a report all the same: a scheduler hook tells "could not check" (health unknown) from "not fit"
        click.echo(json.dumps({"node": {"name": socket.gethostname(), "level": level, "health": str(health),
                                        "fit": False, "error": message},
                               "gpus": [], "findings": [] if finding is None else [finding.to_dict()]}, indent=2))
    sys.exit(exit_code(health, profile, takes_node_out=reboot))


def _sysfs_root(config_path: str | None) -> str:
    try:
        return load_config(config_path).collectors.sysfs_root
    except ConfigError:
        return "/"


@click.command(name="qualify")
@click.option("--level", type=click.Choice(LEVELS), default="quick", show_default=True,
              help="quick (SDC, short probes, ≤ 60 s), standard (more sizes and repeats), full (+ self-test).")
@click.option("--nvml-snapshot", "snapshot", metavar="FILE", default=None,
              help="Judge a recording or scenario file instead of the live driver (diagnostics are skipped).")
@click.option("--kmsg", "kmsg_path", metavar="FILE", default=None, help="Kernel-log file to read XIDs from.")
@click.option("--expected-gpus", type=click.IntRange(min=0), default=None, help="GPUs this node must have.")
@click.option("--config", "config_path", metavar="FILE", default=None, help="gpuhealth YAML config file.")
@click.option("--force", is_flag=True, help="Test GPUs that run user processes or are out of GPU-time budget.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
@click.option("--exit-codes", "profile", type=click.Choice(PROFILE_NAMES), default="default", show_default=True,
              help="Exit-code dialect: default (0/1/2/3), slurm, npd, nagios.")
def command(level: str, snapshot: str | None, kmsg_path: str | None, expected_gpus: int | None,
            config_path: str | None, force: bool, as_json: bool, profile: str) -> None:
    """Pre-job node qualification with a verdict per GPU and for the node."""
    t0 = time.monotonic()
    try:
        config, backend = open_node(config_path, snapshot, kmsg_path, expected_gpus)
    except NodeInputError as exc:
        _fail(str(exc), profile, as_json=as_json, level=level, driver=exc.__cause__ if exc.driver else None,
              backend=exc.backend, root=_sysfs_root(config_path))
        return
    err = Console(stderr=True, highlight=False)
    show_progress = not as_json and err.is_terminal
    try:
        report = collect_once(backend, config)
        runner = DiagRunner(config.diag, state_dir=default_state_dir(config),
                            backend=None if backend.simulated else backend)
        if show_progress:
            with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                          console=err, transient=True) as bar:
                task = bar.add_task(f"qualify --level {level}", total=None)
                result = run_qualify(report, config, level, runner, force=force, t0=t0,
                                     progress=lambda _d, text: bar.update(task, description=text))
        else:
            result = run_qualify(report, config, level, runner, force=force, t0=t0)
    except NvmlError as exc:
        _fail(f"NVML failed: {exc}", profile, as_json=as_json, level=level, driver=exc, backend=backend,
              root=config.collectors.sysfs_root)
        return
    except (ValueError, OSError) as exc:
        _fail(str(exc), profile, as_json=as_json, level=level)
        return
    finally:
        backend.shutdown()
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        render(result, output_console())
    sys.exit(exit_code(result.health, profile, takes_node_out=result.takes_node_out))


def render(r: QualifyReport, console: Console) -> None:
    if r.simulated:
        console.print(Text("SIMULATED (recording) — not this machine's GPUs", style="bold black on yellow"))
    head = Text(f"Node {r.node} ({r.level}): ")
    head.append(str(r.health).upper(), style=_STYLE[r.health])
    if r.health is Health.UNKNOWN:
        head.append("  not judged: this level's diagnostics did not all run" if r.not_judged
                    else "  not judged: the check could not be completed", style="bold")
    else:
        head.append("  fit to run jobs" if r.fit else "  NOT fit to run jobs", style="bold")
    head.append(f"  [{r.wall_s:.1f} s]", style="dim")
    console.print(head)
    table = Table()
    for col in ("GPU", "Name", "Verdict", "Reasons"):
        table.add_column(col)
    for g in r.gpus:
        reasons = "\n".join(g.reasons) if g.reasons else "—"
        table.add_row(str(g.index), g.name, Text(str(g.health), style=_STYLE[g.health]), reasons)
    console.print(table)
    diag_table = Table(title="Diagnostics")
    for col in ("Diagnostic", "Status", "Time", "Notes"):
        diag_table.add_column(col)
    for d in r.diagnostics:
        notes = d.reason or ", ".join(f"{len(d.gpus)} GPU(s)" for _ in [0])
        diag_table.add_row(d.diag, d.status, f"{d.wall_s:.1f} s", notes)
    console.print(diag_table)
    node_reasons: list[Any] = [x for x in r.reasons if not x.startswith("GPU ")]
    for reason in node_reasons:
        console.print(Text(f"  • {reason}"))
    for why in r.not_judged:
        console.print(Text(f"  • not judged: {why}", style="magenta"))


__all__ = ["command"]
