"""Usage errors: a flag's value a command rejects exits ``USAGE_ERROR`` (64) in every profile, as click's own
do (``cli/main.py`` turns every ``click.UsageError`` into it). A value the config layer checks for a flag
(``config.FlagError``) is one of them; the same value from a config file or a ``GPUHEALTH_`` variable is not
(that is "could not check", 3)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import click

from gpuhealth.config import FlagError


def flag_error(exc: FlagError, flags: Mapping[str, str]) -> click.BadParameter:
    """``Invalid value for '--listen': 'x' is not host:port …`` for the flag that stands for ``exc.key``."""
    message = str(exc).removeprefix(f"flags: {exc.key}: ")
    flag = flags.get(exc.key)
    return click.BadParameter(message, param_hint=f"'{flag}'" if flag else exc.key)


# what a --device flag may say: the CPU, every GPU, or GPUs by NVML index (the coordinator's check is the same)
_DEVICE = re.compile(r"cpu|cuda(:\d{1,4}(,cuda:\d{1,4}){0,63})?")


def check_device(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A click callback: ``cpu``, ``cuda`` or ``cuda:N[,cuda:M]``, else a usage error of the flag."""
    if value is not None and not _DEVICE.fullmatch(str(value)):
        raise click.BadParameter(f"{str(value)[:60]!r}: expected cpu, cuda or cuda:N[,cuda:M]")
    return value


def usage_error(message: str) -> click.UsageError:
    """A command's own usage error (arguments that do not go together, one that is missing)."""
    return click.UsageError(message, ctx=click.get_current_context(silent=True))


__all__ = ["check_device", "flag_error", "usage_error"]
