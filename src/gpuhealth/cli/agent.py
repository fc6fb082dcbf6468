"""``gpuhealth agent``: run the per-node agent until SIGTERM/SIGINT; SIGHUP reloads the config."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from gpuhealth.cli._usage import flag_error
from gpuhealth.config import AgentConfig, Config, ConfigError, FlagError, load_config


def _overrides(listen: str | None, dcgm_compat: bool | None, json_logs: bool | None, snapshot: str | None,
               node_name: str | None, log_level: str | None,
               nvlink_per_link: bool | None = None, dcgm_schema: str | None = None,
               web_config_file: str | None = None) -> dict[str, dict[str, Any]]:
    return {"agent": {"listen": listen, "dcgm_compat": dcgm_compat, "json_logs": json_logs,
                      "nvml_snapshot": snapshot, "node_name": node_name, "log_level": log_level,
                      "nvlink_per_link": nvlink_per_link, "dcgm_schema": dcgm_schema,
                      "web_config_file": web_config_file}}


# the config key each flag stands for: a value the key's check rejects is a usage error of that flag
_FLAGS = {"agent.listen": "--listen", "agent.nvml_snapshot": "--nvml-snapshot", "agent.node_name": "--node-name",
          "agent.log_level": "--log-level"}


@click.command(name="agent")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML config file.")
@click.option("--listen", metavar="ADDR:PORT",
              help=f"Where to serve /metrics, /health, /ready (default: agent.listen, {AgentConfig().listen}).")
@click.option("--nvml-snapshot", "--scenario", "snapshot", metavar="FILE",
              help="Replay an NVML recording or scenario instead of the live driver (SIMULATED).")
@click.option("--dcgm-compat/--no-dcgm-compat", default=None,
              help="Also expose the readings under dcgm-exporter's metric names and labels.")
@click.option("--dcgm-schema", type=click.Choice(["4.10", "4.8", "both"]), default=None,
              help="Which dcgm-exporter release's names --dcgm-compat serves (default: agent.dcgm_schema, 4.10; "
                   "4.8 for dashboards written for 4.5-4.8; both while they migrate).")
@click.option("--nvlink-per-link/--nvlink-per-gpu", default=None,
              help="NVLink series for every link instead of summed per GPU (default: agent.nvlink_per_link, per "
                   "GPU; one scrape can ask /metrics?nvlink=link).")
@click.option("--json-logs/--text-logs", default=None, help="Log JSON lines instead of text.")
@click.option("--node-name", help="Node name in reports and the dcgm-compat hostname label (default: hostname).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
              help="Least severe log records written (default: agent.log_level, info).")
@click.option("--web.config.file", "web_config_file", metavar="FILE",
              help="TLS and basic auth for /metrics and /health: a web config as Prometheus' exporters read it "
                   "(default: agent.web_config_file, none: plain HTTP).")
def command(config_file: str | None, listen: str | None, snapshot: str | None, dcgm_compat: bool | None,
            dcgm_schema: str | None, nvlink_per_link: bool | None, json_logs: bool | None, node_name: str | None,
            log_level: str | None, web_config_file: str | None) -> None:
    """Run the per-node agent: collectors on a schedule, /metrics (Prometheus), /health, /ready."""
    overrides = _overrides(listen, dcgm_compat, json_logs, snapshot, node_name, log_level, nvlink_per_link,
                           dcgm_schema, web_config_file)

    def load() -> Config:
        return load_config(config_file, overrides=overrides)

    try:
        config = load()
    except FlagError as exc:
        raise flag_error(exc, _FLAGS) from None
    except ConfigError as exc:
        click.echo(f"gpuhealth agent: {exc}", err=True)
        sys.exit(3)
    problem = check_config(config)
    if problem:
        click.echo(f"gpuhealth agent: {problem}", err=True)
        sys.exit(3)
    sys.exit(run_agent(config, load))


def check_config(config: Config) -> str | None:
    """What the agent cannot start with, as one line (None when fine)."""
    from gpuhealth.agent.daemon import config_problem

    return config_problem(config)


def run_agent(config: Config, reload_config: Any = None) -> int:
    from gpuhealth.agent.daemon import Agent
    from gpuhealth.backends.base import NvmlBackend
    from gpuhealth.backends.errors import BackendUnavailable, NvmlError, RecordingError
    from gpuhealth.backends.nvml_fake import BUNDLED_RECORDINGS, FakeNvml, bundled_recording_path
    from gpuhealth.backends.nvml_real import RealNvml
    from gpuhealth.runtime import threadnames
    from gpuhealth.runtime.logs import setup_logging

    threadnames.install()  # top -H and /proc/<pid>/task/*/comm name the agent's threads
    log = logging.getLogger("gpuhealth.agent")
    backend: NvmlBackend
    snapshot = config.agent.nvml_snapshot
    if snapshot:
        from pathlib import Path

        path = Path(snapshot)
        if not path.exists() and snapshot in BUNDLED_RECORDINGS:
            path = bundled_recording_path(snapshot)
        try:
            backend = FakeNvml.from_file(path)
        except RecordingError as exc:
            click.echo(f"gpuhealth agent: {exc}", err=True)
            return 3
    else:
        backend = RealNvml()  # initialised (and re-initialised) by the agent, with backoff
    setup_logging(json_lines=config.agent.json_logs, level=config.agent.log_level, simulated=backend.simulated)
    if backend.simulated:
        log.warning("SIMULATED: readings are replayed from %s, not read from a GPU", snapshot)
    try:
        agent = Agent(config, backend)
    except (BackendUnavailable, NvmlError, ValueError) as exc:
        click.echo(f"gpuhealth agent: {exc}", err=True)
        return 3
    def reload() -> Config:
        new = reload_config() if reload_config is not None else config
        problem = check_config(new)
        if problem:
            raise ValueError(problem)
        setup_logging(json_lines=new.agent.json_logs, level=new.agent.log_level, simulated=backend.simulated)
        return new

    try:
        return agent.run_until_signalled(reload)
    except OSError as exc:  # the listen address is taken or not ours
        click.echo(f"gpuhealth agent: agent.listen {config.agent.listen}: cannot listen: {exc.strerror or exc}",
                   err=True)
        agent.stop()
        return 3


__all__ = ["command"]
