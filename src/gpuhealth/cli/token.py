"""``gpuhealth token``: mint one node's coordinator token from the cluster secret.

The token is an HMAC of the node name under the secret (``runtime.credentials``): the coordinator
verifies it with the secret alone, and it is good for that node only. The secret is read from a
file, never from the command line (``ps`` shows arguments to every user); the token goes to stdout
or, with ``--out``, to a file only its owner can read.
"""

from __future__ import annotations

import os
import sys

import click

from gpuhealth.runtime.credentials import CredentialError, node_token, read_secret


@click.command(name="token")
@click.option("--node", required=True, help="The node's name, as its agent registers (agent.node_name, else the "
                                           "hostname).")
@click.option("--secret-file", required=True, type=click.Path(dir_okay=False),
              help="The cluster secret (the coordinator's coordinator.node_secret_file).")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Write the token to this file (mode 0600; give it to the agent as coordinator.token_file) "
                   "instead of printing it.")
def command(node: str, secret_file: str, out: str | None) -> None:
    """Mint the coordinator token of one node from the cluster secret."""
    try:
        secret = read_secret(secret_file)
    except CredentialError as exc:  # a secret file that cannot be used: could not mint (3)
        click.echo(f"gpuhealth token: {exc}", err=True)
        sys.exit(3)
    try:
        token = node_token(secret, node)
    except CredentialError as exc:  # the name given: a usage error (64)
        raise click.BadParameter(str(exc), param_hint="'--node'") from None
    if out is None:
        click.echo(token)
        return
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT: set it
            fh.write(token + "\n")
    except OSError as exc:
        click.echo(f"gpuhealth token: cannot write {out}: {exc.strerror or exc}", err=True)
        sys.exit(3)


__all__ = ["command"]
