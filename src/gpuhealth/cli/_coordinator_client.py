"""Options shared by the CLI commands that query a coordinator (jobs, fleet, triage --job), and the one
way from those options and the config to an address, a bearer token and TLS files (``resolve``).

The token, first found wins: ``--token-file`` / ``GPUHEALTH_TOKEN_FILE`` (honoured by ``triage --job``
too, which has no flag for it), ``--token`` / ``GPUHEALTH_TOKEN``,
then the config's ``coordinator.operator_token``, ``coordinator.token_file``, ``coordinator.token``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from gpuhealth.cli._secrets import pick_secret
from gpuhealth.config import ConfigError, load_config

TOKEN_FILE_VARIABLE = "GPUHEALTH_TOKEN_FILE"
_TOKEN_FILE_HELP = "Read the bearer token from this file (first line). Env: GPUHEALTH_TOKEN_FILE."


class CoordinatorClientError(click.ClickException):
    """A config, token file or TLS setting the query cannot use: one line, exit 3 (could not ask)."""

    exit_code = 3


def coordinator_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed([
        click.option("--coordinator", "address", help="host:port (default: agent.coordinator from config)."),
        click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file."),
        click.option("--token", envvar="GPUHEALTH_TOKEN",
                     help="Bearer token (default: coordinator.operator_token, else coordinator.token_file, else "
                          "coordinator.token from config; live triage needs the operator token). Visible in ps: "
                          "prefer --token-file or the GPUHEALTH_TOKEN variable."),
        # read (and any fault said, exit 3) by resolve: the flag and the variable fail alike
        click.option("--token-file", metavar="FILE", envvar=TOKEN_FILE_VARIABLE, help=_TOKEN_FILE_HELP),
        click.option("--tls-cert", help="Client certificate (mutual TLS)."),
        click.option("--tls-key", help="Client private key."),
        click.option("--tls-ca", help="CA of the coordinator's certificate."),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    ]):
        func = opt(func)
    return func


def resolve(config_path: str | None, address: str | None, token: str | None, tls_cert: str | None,
            tls_key: str | None, tls_ca: str | None, token_file: str | None = None) -> tuple[str, str | None, Any]:
    """(address, bearer token, TLS files) for a query; ``CoordinatorClientError`` (exit 3) for a config,
    a token file (``--token-file``, ``GPUHEALTH_TOKEN_FILE`` or the config's) or TLS setting that cannot be
    used."""
    from gpuhealth.runtime.credentials import CredentialError, read_token
    from gpuhealth.runtime.tls import SecurityConfigError, tls_files

    # The variable is read here too, for commands without a --token-file flag (triage --job).
    try:
        token = pick_secret(token, token_file or os.environ.get(TOKEN_FILE_VARIABLE) or None)
    except click.UsageError as exc:  # a file that is there on the command line but unusable: could not ask (3)
        raise CoordinatorClientError(exc.message) from exc
    try:
        cfg = load_config(config_path)
        c = cfg.coordinator
        addr = address or cfg.agent.coordinator or c.listen.replace("0.0.0.0", "127.0.0.1")
        tls = tls_files(tls_cert or c.client_tls_cert, tls_key or c.client_tls_key, tls_ca or c.tls_ca)
        if not token and not c.operator_token and c.token_file:
            try:
                token = read_token(c.token_file)
            except CredentialError as exc:
                raise CoordinatorClientError(f"coordinator.token_file: {exc}") from exc
    except (ConfigError, SecurityConfigError) as exc:
        raise CoordinatorClientError(str(exc)) from exc
    return addr, token or c.operator_token or c.token, tls
