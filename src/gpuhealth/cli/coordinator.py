"""``gpuhealth coordinator``: run the cluster coordinator (gRPC ingest, stragglers, hangs)."""

from __future__ import annotations

import asyncio
import signal
import sys

import click

from gpuhealth.cli._secrets import pick_secret
from gpuhealth.cli._usage import flag_error
from gpuhealth.config import ConfigError, FlagError, load_config
from gpuhealth.runtime.logs import setup_logging

# the config key each flag stands for: a value the key's check rejects is a usage error of that flag
_FLAGS = {f"coordinator.{key}": f"--{flag}" for key, flag in (
    ("listen", "listen"), ("metrics_listen", "metrics-listen"), ("db_path", "db"), ("tls_cert", "tls-cert"),
    ("tls_key", "tls-key"), ("tls_ca", "tls-ca"), ("node_secret_file", "node-secret-file"), ("token", "token"),
    ("operator_token", "operator-token"), ("operator_names", "operator-names"), ("hang_k", "hang-k"),
    ("hang_floor_s", "hang-floor"), ("evidence_dir", "evidence-dir"))}


@click.command(name="coordinator")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file.")
@click.option("--listen", help="gRPC address (default 0.0.0.0:9500; needs authentication unless on loopback).")
@click.option("--metrics-listen", help="/metrics address (default 0.0.0.0:9501; 'off' to disable).")
@click.option("--db", "db_path", help="SQLite database (WAL).")
@click.option("--tls-cert", help="Server certificate (PEM); with --tls-key and --tls-ca: mutual TLS.")
@click.option("--tls-key", help="Server private key (PEM).")
@click.option("--tls-ca", help="CA that signs agent certificates (PEM).")
@click.option("--node-secret-file", type=click.Path(dir_okay=False),
              help="The cluster secret that verifies node tokens (`gpuhealth token`): each agent reports as its own "
                   "node only. Env: GPUHEALTH_COORDINATOR_NODE_SECRET_FILE.")
@click.option("--token", help="ONE bearer token every agent shares (any holder can report as any node); refused "
                               "unless coordinator.shared_token is true. Visible in ps: prefer --token-file or "
                               "GPUHEALTH_COORDINATOR_TOKEN.")
@click.option("--token-file", type=click.Path(dir_okay=False), envvar="GPUHEALTH_COORDINATOR_TOKEN_FILE",
              help="Read the shared token from this file (first line).")
@click.option("--operator-token", help="Token that may also act on nodes (live triage, remote diagnostics). "
                                        "Prefer --operator-token-file or GPUHEALTH_COORDINATOR_OPERATOR_TOKEN.")
@click.option("--operator-token-file", type=click.Path(dir_okay=False),
              envvar="GPUHEALTH_COORDINATOR_OPERATOR_TOKEN_FILE",
              help="Read the operator token from this file (first line).")
@click.option("--operator-names", help="Client-certificate names (CN/SAN, comma-separated) that are operators.")
@click.option("--hang-k", type=float, help="Hang when no rank progressed for max(k x typical step, floor).")
@click.option("--hang-floor", "hang_floor_s", type=float, help="Hang floor in seconds.")
@click.option("--evidence-dir", help="Where hang evidence (FR dumps, stacks) is kept.")
@click.option("--ready-file", type=click.Path(dir_okay=False), help="Write the bound ports here as JSON.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="Least severe log records written to stderr.")
@click.option("--json-logs/--text-logs", default=False, help="Log JSON lines instead of text.")
@click.option("--web.config.file", "web_config_file", metavar="FILE",
              help="TLS and basic auth for /metrics: a web config as Prometheus' exporters read it (default: "
                   "coordinator.metrics_web_config_file, none: plain HTTP).")
def command(config_path: str | None, listen: str | None, metrics_listen: str | None, db_path: str | None,
            tls_cert: str | None, tls_key: str | None, tls_ca: str | None, node_secret_file: str | None,
            token: str | None,
            token_file: str | None, operator_token: str | None, operator_token_file: str | None,
            operator_names: str | None, hang_k: float | None,
            hang_floor_s: float | None, evidence_dir: str | None, ready_file: str | None,
            log_level: str, json_logs: bool, web_config_file: str | None) -> None:
    """Run the cluster coordinator. Without authentication (node tokens, TokenReview, mutual TLS) it
    listens on loopback only, unless coordinator.allow_unauthenticated is true."""
    setup_logging(json_lines=json_logs, level=log_level)  # the agent's format: one line per record
    token = pick_secret(token, token_file)
    operator_token = pick_secret(operator_token, operator_token_file, "operator token")
    try:
        cfg = load_config(config_path, overrides={"coordinator": {
            "listen": listen, "metrics_listen": metrics_listen, "db_path": db_path, "tls_cert": tls_cert,
            "tls_key": tls_key, "tls_ca": tls_ca, "node_secret_file": node_secret_file, "token": token,
            "operator_token": operator_token,
            "operator_names": operator_names, "hang_k": hang_k, "hang_floor_s": hang_floor_s,
            "evidence_dir": evidence_dir, "metrics_web_config_file": web_config_file,
        }})
    except FlagError as exc:
        raise flag_error(exc, _FLAGS) from None
    except ConfigError as exc:
        click.echo(f"gpuhealth coordinator: {exc}", err=True)
        sys.exit(3)
    from gpuhealth.coordinator.run import CoordinatorStartError, run_coordinator

    try:
        asyncio.run(run_coordinator(cfg.coordinator, ready_file=ready_file, install_signals=_install))
    except CoordinatorStartError as exc:
        click.echo(f"gpuhealth coordinator: {exc}", err=True)
        sys.exit(3)
    except KeyboardInterrupt:
        pass


def _install(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


__all__ = ["command"]
