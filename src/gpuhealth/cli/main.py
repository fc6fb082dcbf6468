"""The ``gpuhealth`` command. Subcommands load lazily so ``gpuhealth status`` never pays for torch,
gRPC or the coordinator (and a missing optional extra only breaks the command that needs it)."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from gpuhealth import __version__
from gpuhealth.cli.exitcodes import USAGE_ERROR

# name → "module:attribute" of a click command. One line per command; each lives in its own module.
COMMANDS: dict[str, tuple[str, str]] = {
    "status": ("gpuhealth.cli.status", "Node health per GPU, from NVML or a recording."),
    "record": ("gpuhealth.cli.record", "Write an NVML recording of this node (a test fixture)."),
    "agent": ("gpuhealth.cli.agent", "Run the per-node agent (/metrics, /health)."),
    "coordinator": ("gpuhealth.cli.coordinator", "Run the cluster coordinator (gRPC ingest, hangs)."),
    "jobs": ("gpuhealth.cli.jobs", "List jobs known to the coordinator."),
    "fleet": ("gpuhealth.cli.fleet", "Fleet view: version drift, SDC votes, unhealthy GPUs."),
    "triage": ("gpuhealth.cli.triage", "Triage a hung or slow job from flight-recorder dumps."),
    "diag": ("gpuhealth.cli.diag", "Run one diagnostic: sdc, busbw, bandwidth."),
    "qualify": ("gpuhealth.cli.qualify", "Pre-job node qualification with a verdict."),
    "demo": ("gpuhealth.cli.demo", "Run agent + coordinator on the bundled real recording (simulated)."),
    "env": ("gpuhealth.cli.env", "Print launch variables for live flight-recorder dumps of unmodified jobs."),
    "token": ("gpuhealth.cli.token", "Mint one node's coordinator token from the cluster secret."),
}


# Optional dependencies, by top-level module: the extra that brings each. A command that needs one says
# so in one line (exit 3), never a ModuleNotFoundError traceback.
_EXTRA_OF_MODULE: dict[str, str] = {
    "grpc": "coordinator", "grpc_health": "coordinator", "grpc_reflection": "coordinator", "google": "coordinator",
    "torch": "diag", "numpy": "diag",
}


def _missing_extra_message(command: str, missing: str) -> str:
    """One line: which extra to install for ``command`` to find the module ``missing``."""
    root = missing.split(".")[0]
    extra = _EXTRA_OF_MODULE.get(root)
    install = f"pip install 'gpuhealth[{extra}]'" if extra else f"pip install {root}"
    return f"gpuhealth {command}: needs the module '{root}', which is not installed: {install}"


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name = entry[0]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("gpuhealth"):
                return _unavailable(cmd_name, f"not built yet ({exc.name})")
            return _unavailable(cmd_name, _missing_extra_message(cmd_name, exc.name or "?"))
        cmd = getattr(module, "command", None)
        if not isinstance(cmd, click.Command):
            return _unavailable(cmd_name, f"{module_name} defines no 'command'")
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_text) for name, (_, help_text) in sorted(COMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str, why: str) -> click.Command:
    message = why if why.startswith(f"gpuhealth {name}: ") else f"gpuhealth {name}: {why}"

    @click.command(name=name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def _cmd(**_: Any) -> None:
        click.echo(message, err=True)
        sys.exit(3)

    return _cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuhealth")
def cli() -> None:
    """gpuhealth: GPU fleet health and distributed-debug daemon."""


def main() -> None:
    """Run the CLI. A usage error (unknown flag, bad value) exits ``USAGE_ERROR`` (64), never 2:
    2 is "unhealthy" to the default and Nagios profiles, and a typo must not read as a sick node."""
    try:
        cli.main(prog_name="gpuhealth", standalone_mode=False)
    except ModuleNotFoundError as exc:  # an optional extra, imported when the command runs
        if not exc.name or exc.name.startswith("gpuhealth"):
            raise
        command = next((a for a in sys.argv[1:] if a in COMMANDS), "?")
        click.echo(_missing_extra_message(command, exc.name), err=True)
        sys.exit(3)
    except click.UsageError as exc:
        exc.show()
        sys.exit(USAGE_ERROR)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
