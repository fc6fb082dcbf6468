"""``gpuhealth fleet``: version drift, SDC votes and unhealthy GPUs across the nodes."""

from __future__ import annotations

import json
import sys

import click

from gpuhealth.cli._coordinator_client import coordinator_options, resolve


@click.command(name="fleet")
@coordinator_options
def command(address: str | None, config_path: str | None, token: str | None, tls_cert: str | None,
            tls_key: str | None, tls_ca: str | None, as_json: bool) -> None:
    """Fleet view from the coordinator. Exit 0 when clean, 1 on drift/SDC/unhealthy GPUs, 3 when
    the coordinator could not be asked."""
    from gpuhealth.coordinator.query import CoordinatorQueryError, fleet

    addr, tok, tls = resolve(config_path, address, token, tls_cert, tls_key, tls_ca)
    try:
        doc = fleet(addr, token=tok, tls=tls)
    except CoordinatorQueryError as exc:
        click.echo(f"gpuhealth fleet: {exc}", err=True)
        sys.exit(3)
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        nodes = Table(title="nodes")
        for col in ("node", "connected", "health", "GPUs", "driver", "cuda", "torch", "nccl"):
            nodes.add_column(col)
        for n in doc.get("nodes", []):
            v = n.get("versions", {})
            nodes.add_row(n["name"], "yes" if n["connected"] else "no", n["health"], str(n["gpus"]),
                          v.get("driver", "-"), v.get("cuda_driver", "-"), v.get("torch", "-"), v.get("nccl", "-"))
        console.print(nodes)
        for f in doc.get("version_drift", []):
            console.print(f"[yellow]version.drift {f['entity']['id']}: {f['message']}[/yellow]")
        for f in doc.get("sdc", []):
            console.print(f"[red]sdc.mismatch {f['entity']['id']}: {f['message']}[/red]")
        for g in doc.get("unhealthy_gpus", []):
            console.print(f"[red]{g['health']}: node {g['node']} GPU {g['gpu']} ({g['uuid']}): "
                          f"{', '.join(g['codes'])} → {g['action']}[/red]")
    bad = doc.get("version_drift") or doc.get("sdc") or doc.get("unhealthy_gpus")
    sys.exit(1 if bad else 0)
