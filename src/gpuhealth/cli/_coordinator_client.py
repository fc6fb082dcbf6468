"""Options shared by the CLI commands that query a coordinator (jobs, fleet)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from gpuhealth.cli._secrets import pick_secret
from gpuhealth.config import ConfigError, load_config


def coordinator_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed([
        click.option("--coordinator", "address", help="host:port (default: agent.coordinator from config)."),
        click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file."),
        click.option("--token", envvar="GPUHEALTH_TOKEN",
                     help="Bearer token (default: coordinator.operator_token, else coordinator.token from config; "
                          "live triage needs the operator token). Visible in ps: prefer --token-file or the "
                          "GPUHEALTH_TOKEN variable."),
        click.option("--token-file", type=click.Path(dir_okay=False), envvar="GPUHEALTH_TOKEN_FILE",
                     help="Read the bearer token from this file (first line). Env: GPUHEALTH_TOKEN_FILE."),
        click.option("--tls-cert", help="Client certificate (mutual TLS)."),
        click.option("--tls-key", help="Client private key."),
        click.option("--tls-ca", help="CA of the coordinator's certificate."),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    ]):
        func = opt(func)
    return func


def resolve(config_path: str | None, address: str | None, token: str | None, tls_cert: str | None,
            tls_key: str | None, tls_ca: str | None, token_file: str | None = None) -> tuple[str, str | None, Any]:
    from gpuhealth.runtime.tls import SecurityConfigError, tls_files

    token = pick_secret(token, token_file)
    try:
        cfg = load_config(config_path)
        c = cfg.coordinator
        addr = address or cfg.agent.coordinator or c.listen.replace("0.0.0.0", "127.0.0.1")
        tls = tls_files(tls_cert or c.client_tls_cert, tls_key or c.client_tls_key, tls_ca or c.tls_ca)
    except (ConfigError, SecurityConfigError) as exc:
        raise click.ClickException(str(exc)) from exc
    return addr, token or c.operator_token or c.token, tls
