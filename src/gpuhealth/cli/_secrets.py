"""Secrets for the command line without putting them on it: a token given as an argument is visible
to every user in ``ps`` and lands in shell history. ``--token-file`` reads it from a file (the first
line, surrounding whitespace dropped), and the ``GPUHEALTH_*`` variables carry it in the environment."""

from __future__ import annotations

from pathlib import Path

import click


def read_secret_file(path: str, what: str = "token") -> str:
    """The secret in ``path``; a missing, unreadable or empty file is one clear error."""
    p = Path(path)
    try:
        text = p.read_text(errors="strict")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise click.UsageError(f"cannot read the {what} file {p}: {reason}") from exc
    lines = text.strip().splitlines()
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise click.UsageError(f"the {what} file {p} is empty")
    return secret


def pick_secret(value: str | None, file: str | None, what: str = "token") -> str | None:
    """``--X-file`` wins over ``--X`` (either may come from the environment)."""
    return read_secret_file(file, what) if file else value


__all__ = ["pick_secret", "read_secret_file"]
