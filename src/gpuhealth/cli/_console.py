"""The console the human views print to. On a terminal, its width; piped into a file, a log or
``grep``, wide enough that no table cell is cut or folded: an id (job, UUID, digest) must come out
whole wherever it is read, never as ``GPU-0000…``."""

from __future__ import annotations

from rich.console import Console

PIPED_WIDTH = 4096  # rich pads nothing beyond what a table needs: only the limit changes


def output_console(*, stderr: bool = False) -> Console:
    console = Console(highlight=False, soft_wrap=False, stderr=stderr)
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=False, stderr=stderr, width=PIPED_WIDTH)
    return console


__all__ = ["output_console"]
