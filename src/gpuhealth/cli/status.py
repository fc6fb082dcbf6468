"""``gpuhealth status``: every GPU's health and every problem found, with a suggested action.

Thin edge: parse flags, call ``node.collect_once``, render (rich table or ``--json``), exit with the
chosen profile's code. Anything that stops the check (no driver, a malformed recording or config)
is one line on stderr and the profile's "could not check" code — never a traceback; with
``--json`` a report still comes out (health ``unknown``, the reason, and ``nvml.unavailable`` when
NVML would not start: a warning "could not check", or — on bare metal with the driver's module loaded and
GPUs on the bus, an error that blames the driver — critical with a reboot, health ``unhealthy``), so a
scheduler's drain reason can name it.

``--agent URL`` asks the running agent (``/health``) first: it knows what one sweep cannot (rates
over its history, XIDs that came and went). Only when it does not answer within
``--agent-timeout`` does ``status`` sweep once itself, and the report says so (``"source":
"one-shot"``, ``"agent_error"``).
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuhealth.agent.nvml_supervisor import start_failure_finding
from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.environment import Environment
from gpuhealth.backends.errors import NvmlError, RecordingError
from gpuhealth.catalog.thresholds import ThresholdsError
from gpuhealth.catalog.xid import CatalogError
from gpuhealth.cli._agent_report import AgentUnreachable, fetch_agent_report, one_line_of
from gpuhealth.cli._console import output_console
from gpuhealth.cli._node_inputs import NodeInputError, open_node
from gpuhealth.cli.exitcodes import PROFILE_NAMES, exit_code
from gpuhealth.collectors.registry import UnknownCollector
from gpuhealth.config import ConfigError, load_config
from gpuhealth.model import Action, Finding, Health, Severity, takes_node_out
from gpuhealth.node import NodeReport, collect_once

_HEALTH_STYLE = {Health.HEALTHY: "bold green", Health.DEGRADED: "bold yellow", Health.UNHEALTHY: "bold red",
                 Health.UNKNOWN: "bold magenta"}
_SEVERITY_STYLE = {Severity.INFO: "cyan", Severity.WARNING: "yellow", Severity.CRITICAL: "red"}


def _fail(message: str, profile: str, *, as_json: bool = False, driver: BaseException | None = None,
          backend: NvmlBackend | None = None, config_path: str | None = None, agent_error: str | None = None) -> None:
    """The node was not checked: one line on stderr and the profile's "could not check" code. ``driver``: NVML
    would not start or list the GPUs (that error); ``nvml.unavailable`` then says whether the driver is the
    likely fault (bare metal, module loaded, GPUs on the bus: unhealthy, reboot) or nothing could be checked."""
    click.echo(f"gpuhealth status: {message}", err=True)
    finding = None if driver is None else _nvml_finding(message, driver, backend, config_path)
    health = Health.UNHEALTHY if finding is not None and finding.action is Action.REBOOT else Health.UNKNOWN
    if as_json:  # a report all the same: the caller's drain reason names why the node was not checked
        node: dict[str, Any] = {"name": socket.gethostname(), "health": str(health), "error": message}
        if finding is not None:
            node["action"] = str(finding.action)
        doc: dict[str, Any] = {"node": node, "gpus": [],
                               "findings": [] if finding is None else [finding.to_dict()]}
        if agent_error is not None:
            doc.update(source="one-shot", agent_error=agent_error)
        click.echo(json.dumps(doc, indent=2))
    sys.exit(exit_code(health, profile, takes_node_out=finding is not None and finding.action.takes_node_out))


def _nvml_finding(message: str, error: BaseException, backend: NvmlBackend | None,
                  config_path: str | None) -> Finding:
    try:
        root = load_config(config_path).collectors.sysfs_root
    except ConfigError:
        root = "/"
    return start_failure_finding(socket.gethostname(), message, error, backend, root, "cli/status.py")


@click.command(name="status")
@click.option("--nvml-snapshot", "snapshot", metavar="FILE", default=None,
              help="Check a recording or scenario file instead of the live driver (simulated).")
@click.option("--kmsg", "kmsg_path", metavar="FILE", default=None,
              help="Read XIDs from this kernel-log file instead of /dev/kmsg.")
@click.option("--expected-gpus", type=click.IntRange(min=0), default=None,
              help="GPUs this node must have; fewer is gpu.missing.")
@click.option("--config", "config_path", metavar="FILE", default=None, help="gpuhealth YAML config file.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--exit-codes", "profile", type=click.Choice(PROFILE_NAMES), default="default", show_default=True,
              help="Exit-code dialect: default (0/1/2/3), slurm, npd, nagios.")
@click.option("--agent", "agent_url", metavar="URL", envvar="GPUHEALTH_AGENT_URL", default=None,
              help="Ask the running agent at URL (its /health: history, XID ledger) first; check once here only "
                   "if it does not answer. Env: GPUHEALTH_AGENT_URL.")
@click.option("--agent-timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              envvar="GPUHEALTH_AGENT_TIMEOUT_S",
              help="Seconds to wait for the agent before checking once here.")
def command(snapshot: str | None, kmsg_path: str | None, expected_gpus: int | None, config_path: str | None,
            as_json: bool, profile: str, agent_url: str | None, agent_timeout: float) -> None:
    """Node health per GPU, from the running agent, NVML or a recording."""
    agent_error: str | None = None
    if agent_url and not snapshot:
        try:
            from_agent = fetch_agent_report(agent_url, agent_timeout)
        except AgentUnreachable as exc:
            agent_error = str(exc)
            click.echo(f"gpuhealth status: the agent did not answer ({exc}); checking once here instead", err=True)
        else:
            findings = from_agent.findings()
            _show_agent_report(from_agent.doc, from_agent.health, findings, as_json, profile, from_agent.url)
            sys.exit(exit_code(from_agent.health, profile, takes_node_out=takes_node_out(findings)))
    try:
        config, backend = open_node(config_path, snapshot, kmsg_path, expected_gpus)
    except NodeInputError as exc:
        _fail(str(exc), profile, as_json=as_json, driver=exc.__cause__ if exc.driver else None,
              backend=exc.backend, config_path=config_path, agent_error=agent_error)
        return
    try:
        report = collect_once(backend, config)
    except NvmlError as exc:
        _fail(f"NVML cannot list the GPUs: {exc.message} (code {exc.code})", profile, as_json=as_json, driver=exc,
              backend=backend, config_path=config_path, agent_error=agent_error)
        return
    except (ThresholdsError, CatalogError, UnknownCollector, RecordingError) as exc:
        _fail(str(exc), profile, as_json=as_json, agent_error=agent_error)
        return
    finally:
        backend.shutdown()
    broken = next((r for r in report.runs if r.error_type == "RecordingError"), None)
    if broken is not None:  # a value in the recording itself is malformed: not a GPU problem
        _fail(f"bad recording: {broken.error}", profile, as_json=as_json, agent_error=agent_error)
        return
    if as_json:
        doc = report.to_dict()
        if agent_error is not None:
            doc.update(source="one-shot", agent_error=agent_error)
        click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))
    elif profile == "npd":  # node-problem-detector keeps the first line(s) as the NodeCondition message
        click.echo(one_line(report) + (" (agent down: one-shot check)" if agent_error is not None else ""))
    else:
        render(report, output_console())  # piped into a file or a log: nothing cut
    sys.exit(exit_code(report.health, profile, takes_node_out=takes_node_out(report.all_findings())))


def one_line(report: NodeReport) -> str:
    """"gpuhealth: unhealthy: GPU 3 pcie.link_degraded (drain); GPU 5 xid.79 (reboot)" — for monitors that
    keep one short message (node-problem-detector, nagios-style checks)."""
    return one_line_of(report.health, report.all_findings())


def _show_agent_report(doc: dict[str, Any], health: Health, findings: list[Finding], as_json: bool, profile: str,
                       url: str) -> None:
    if as_json:
        click.echo(json.dumps({**doc, "source": "agent", "agent_url": url}, indent=2, default=str))
        return
    if profile == "npd":
        click.echo(one_line_of(health, findings))
        return
    console = output_console()
    node = doc.get("node", {})
    head = Text(f"Node {node.get('name', '?')}: ")
    head.append(str(health).upper(), style=_HEALTH_STYLE[health])
    head.append(f"  (from the agent at {url}; {len(doc.get('gpus', []))} GPUs)")
    if node.get("simulated"):
        head.append("  SIMULATED", style="bold black on yellow")
    console.print(head)
    _print_environment(node.get("environment"), console)
    for f in sorted(findings, key=lambda f: -int(f.severity)):
        prefix = f"  GPU {f.entity.gpu_index}: " if f.entity.gpu_index is not None else "  node: "
        console.print(Text(prefix).append_text(_finding_text(f)))


def _print_environment(env: Any, console: Console) -> None:
    """Where the report was made: an operator sees why a check says "not checked" (bare metal, VM guest,
    container and its namespaces)."""
    if isinstance(env, dict):
        console.print(Text(f"Environment: {Environment.from_dict(env).summary()}", style="dim"))


def _finding_text(f: Finding) -> Text:
    text = Text()
    text.append(f"{f.severity}", style=_SEVERITY_STYLE[f.severity])
    text.append(f" {f.code}: {f.message}")
    if int(f.action):
        text.append(f" → {f.action}", style="bold")
    return text


def render(report: NodeReport, console: Console) -> None:
    """The human view: banner, one row per GPU, then node-level findings."""
    if report.simulated:
        source = report.backend.removeprefix("simulated from ")
        console.print(Text(f"SIMULATED (recording {source}) — not this machine's GPUs", style="bold black on yellow"))
    versions = report.versions
    about = ", ".join(x for x in (
        f"driver {versions['driver']}" if versions.get("driver") else "",
        f"CUDA {versions['cuda']}" if versions.get("cuda") else "",
    ) if x)
    head = Text(f"Node {report.node}: ")
    head.append(str(report.health).upper(), style=_HEALTH_STYLE[report.health])
    head.append(f"  ({len(report.gpus)} GPU{'s' if len(report.gpus) != 1 else ''}{', ' + about if about else ''})")
    if int(report.action):
        head.append(f"  action: {report.action}", style="bold")
    console.print(head)
    _print_environment(report.environment, console)
    table = Table(show_lines=False, expand=False)
    table.add_column("GPU", justify="right")
    table.add_column("Name")
    table.add_column("Bus")
    table.add_column("Health")
    table.add_column("Findings")
    for g in report.gpus:
        findings = sorted(g.findings, key=lambda f: -int(f.severity))
        cell = Text("\n").join(_finding_text(f) for f in findings) if findings else Text("—", style="dim")
        table.add_row(str(g.identity.index), g.identity.name, g.identity.pci_bus_id,
                      Text(str(g.health), style=_HEALTH_STYLE[g.health]), cell)
    console.print(table)
    if report.findings:
        console.print(Text("Node findings:", style="bold"))
        for f in sorted(report.findings, key=lambda f: -int(f.severity)):
            console.print(Text("  ").append_text(_finding_text(f)))
    failed = [r for r in report.runs if not r.success]
    if failed:
        names = ", ".join(r.name for r in failed)
        console.print(Text(f"Collectors that failed: {names} (see collector.failed findings)", style="yellow"))


def summary(report: NodeReport) -> dict[str, Any]:
    """A one-line-able digest (used by other commands that embed node health)."""
    return {"node": report.node, "health": str(report.health), "action": str(report.action),
            "gpus": len(report.gpus), "findings": len(report.all_findings())}


__all__ = ["command"]
