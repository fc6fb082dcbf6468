"""``gpuhealth record OUT.json``: write an NVML recording of this node (a test fixture for anyone).

The file is "NVML recording v1", loadable as is by ``gpuhealth status --nvml-snapshot OUT.json``.
"""

from __future__ import annotations

import sys

import click

from gpuhealth.backends.errors import BackendUnavailable


@click.command(name="record")
@click.argument("out", metavar="OUT.json", type=click.Path(dir_okay=False, writable=True))
@click.option("--reps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Calls per getter; the median latency is recorded.")
@click.option("--anonymize", is_flag=True, help="Replace GPU UUIDs, serial numbers and PDIs with fake ones.")
def command(out: str, reps: int, anonymize: bool) -> None:
    """Write an NVML recording of this node (a test fixture)."""
    from gpuhealth.backends.recorder import record

    try:
        data = record(out, reps=reps, anonymized=anonymize)
    except BackendUnavailable as exc:
        click.echo(f"gpuhealth record: {exc}", err=True)
        sys.exit(3)
    except OSError as exc:
        click.echo(f"gpuhealth record: cannot write {out}: {exc.strerror or exc}", err=True)
        sys.exit(3)
    devices = data.get("devices", [])
    names = sorted({str(d.get("Name", {}).get("value", "?")) for d in devices})
    click.echo(f"wrote {out}: {len(devices)} GPU(s) ({', '.join(names)}), "
               f"driver {data.get('driver', {}).get('value', '?')}, NVML init {data.get('init_s', 0):.3f} s")


__all__ = ["command"]
