"""``gpuhealth fleet``: version drift, SDC votes and unhealthy GPUs across the nodes."""

from __future__ import annotations

import json
import sys

import click

from gpuhealth.cli._console import output_console
from gpuhealth.cli._coordinator_client import coordinator_options, resolve


@click.command(name="fleet")
@coordinator_options
@click.option("--sdc", "run_sdc", is_flag=True, help="Run the SDC check on the agents now and vote the digests.")
@click.option("--device", help="With --sdc: cpu, cuda or cuda:N (default: the agents' GPUs).")
@click.option("--node", "nodes", multiple=True, help="With --sdc: only these nodes (repeatable).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True, help="With --sdc: seconds.")
def command(address: str | None, config_path: str | None, token: str | None,
            token_file: str | None, tls_cert: str | None,
            tls_key: str | None, tls_ca: str | None, as_json: bool, run_sdc: bool, device: str | None,
            nodes: tuple[str, ...], timeout_s: float) -> None:
    """Fleet view from the coordinator. Exit 0 when clean, 1 on drift/SDC/unhealthy GPUs, 3 when
    the coordinator could not be asked."""
    from gpuhealth.coordinator.query import CoordinatorQueryError, fleet, run_diagnostic

    addr, tok, tls = resolve(config_path, address, token, tls_cert, tls_key, tls_ca, token_file)
    try:
        if run_sdc:
            ran = run_diagnostic(addr, "sdc", nodes=nodes, device=device, token=tok, tls=tls, timeout_s=timeout_s)
            doc = ran.pop("fleet")
            doc["sdc_run"] = ran
        else:
            doc = fleet(addr, token=tok, tls=tls)
    except CoordinatorQueryError as exc:
        click.echo(f"gpuhealth fleet: {exc}", err=True)
        sys.exit(3)
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        from rich.table import Table

        console = output_console()
        table = Table(title="nodes")
        for col in ("node", "connected", "health", "GPUs", "driver", "cuda", "torch", "nccl"):
            table.add_column(col)
        for n in doc.get("nodes", []):
            v = n.get("versions", {})
            table.add_row(n["name"], "yes" if n["connected"] else "no", n["health"], str(n["gpus"]),
                          v.get("driver", "-"), v.get("cuda_driver", "-"), v.get("torch", "-"), v.get("nccl", "-"))
        console.print(table)
        for f in doc.get("version_drift", []):
            console.print(f"[yellow]version.drift {f['entity']['id']}: {f['message']}[/yellow]")
        for f in doc.get("sdc", []):
            console.print(f"[red]sdc.mismatch {f['entity']['id']}: {f['message']}[/red]")
        run = doc.get("sdc_run")
        if run:
            console.print(f"SDC check: {len(run['results'])} node(s) answered, {run['sdc_digests_stored']} digests "
                          f"stored; errors: {run['errors'] or 'none'}")
        for g in doc.get("unhealthy_gpus", []):
            console.print(f"[red]{g['health']}: node {g['node']} GPU {g['gpu']} ({g['uuid']}): "
                          f"{', '.join(g['codes'])} → {g['action']}[/red]")
    bad = doc.get("version_drift") or doc.get("sdc") or doc.get("unhealthy_gpus")
    sys.exit(1 if bad else 0)


__all__ = ["command"]
