"""``gpuhealth fleet``: version drift, SDC votes, unhealthy GPUs and screening coverage across the nodes."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
from rich.markup import escape

from gpuhealth.cli._console import output_console
from gpuhealth.cli._coordinator_client import CoordinatorClientError, coordinator_options, resolve
from gpuhealth.cli._usage import check_device


@click.command(name="fleet")
@coordinator_options
@click.option("--sdc", "run_sdc", is_flag=True, help="Run the SDC check on the agents now and vote the digests.")
@click.option("--device", callback=check_device,
              help="With --sdc: cpu, cuda or cuda:N (default: the agents' GPUs).")
@click.option("--node", "nodes", multiple=True, help="With --sdc: only these nodes (repeatable).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1.0), default=300.0, show_default=True,
              help="With --sdc: seconds.")
def command(address: str | None, config_path: str | None, token: str | None,
            token_file: str | None, tls_cert: str | None,
            tls_key: str | None, tls_ca: str | None, as_json: bool, run_sdc: bool, device: str | None,
            nodes: tuple[str, ...], timeout_s: float) -> None:
    """Fleet view from the coordinator: nodes, version drift, SDC votes, unhealthy GPUs, and screening
    (coverage, the GPUs screened longest ago, failed screens, who holds a screening turn), the fabric probe's
    word on each node. Nodes whose agent replays a recording are marked SIMULATED. Exit 0 when clean, 1 on
    drift/SDC/unhealthy GPUs, a failed screen or a slow node or link, 3 when the coordinator could not be asked
    (or the config is bad) or no node has registered with it (nothing to judge)."""
    try:
        addr, tok, tls = resolve(config_path, address, token, tls_cert, tls_key, tls_ca, token_file)
    except CoordinatorClientError as exc:
        click.echo(f"gpuhealth fleet: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    from gpuhealth.coordinator.query import CoordinatorQueryError, fleet, run_diagnostic

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
    registered: list[dict[str, Any]] = doc.get("nodes") or []
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    elif not registered:
        output_console().print(f"no nodes: no agent has registered with the coordinator at {addr} — nothing to "
                               "judge (set agent.coordinator on the nodes' agents)", markup=False, highlight=False)
    else:
        from rich.table import Table

        console = output_console()
        simulated = [n["name"] for n in registered if n.get("simulated")]
        if simulated:
            console.print(f"SIMULATED: {len(simulated)} of {len(registered)} node(s) replay a recording, not real "
                          f"GPUs: {', '.join(simulated[:10])}" + (" …" if len(simulated) > 10 else ""),
                          style="bold black on yellow", markup=False, highlight=False)
        table = Table(title="nodes")
        for col in ("node", "connected", "health", "GPUs", "driver", "cuda", "torch", "nccl"):
            table.add_column(col)
        for n in registered:
            v = n.get("versions", {})
            name = f"{n['name']} (SIMULATED)" if n.get("simulated") else n["name"]
            table.add_row(name, "yes" if n["connected"] else "no", n["health"], str(n["gpus"]),
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
        for f in doc.get("fabric", []):
            colour = "yellow" if f["severity"] == "warning" else "dim"
            console.print(f"[{colour}]{f['code']} {escape(f['entity']['id'])}: {escape(f['message'])}[/{colour}]")
        for line in _screening_lines(doc.get("screening"), doc.get("generated_at") or time.time()):
            console.print(line, markup=False, highlight=False)
    if not registered:
        sys.exit(3)  # no node to judge: "could not check", never a clean fleet
    bad = (doc.get("version_drift") or doc.get("sdc") or doc.get("unhealthy_gpus")
           or (doc.get("screening") or {}).get("failed")
           or any(f["severity"] != "info" for f in doc.get("fabric", [])))
    sys.exit(1 if bad else 0)


def _screening_lines(scr: dict[str, Any] | None, now: float) -> list[str]:
    """The screening part of the fleet view, in words."""
    if not scr:
        return []  # an older coordinator
    window = _ago(scr["window_s"])
    if not scr["gpus"]:  # 0 of 0 is no coverage at all, not 100 %
        lines = ["screening: no GPUs known to the coordinator; nothing screened"]
    else:
        lines = [f"screening: {scr['screened']} of {scr['gpus']} GPUs ({100 * scr['coverage_ratio']:.1f} %) "
                 f"screened within {window}; {scr['unscreened']} not"]
    oldest = scr.get("least_recently_screened") or []
    for g in oldest[:5]:
        gpu = f"node {g['node']} GPU {g['gpu'] if g['gpu'] is not None else '?'} ({g['uuid']})"
        if g["screened_at"] is None:
            what = f"never screened (known for {_ago(g['age_s'])})"
        else:
            what = f"screened {_ago(g['age_s'])} ago ({g['level']}, {g['result']})"
        last = g.get("last_attempt")
        if last and last["result"] not in ("pass", "fail"):
            what += f"; last attempt {last['result']}" + (f": {last['reason']}" if last["reason"] else "")
        lines.append(f"  least recently screened: {gpu}: {what}")
    for f in scr.get("failed") or []:
        ago = _ago(max(0.0, now - f["finished_at"]))
        lines.append(f"  screen FAILED: node {f['node']} GPU {f['gpu']} ({f['uuid']}), {f['level']} ({f['trigger']}), "
                     f"{ago} ago: {f['reason'] or 'no reason given'}")
    rot = scr.get("rotation") or {}
    if not rot.get("enabled", True):
        lines.append("  rotation off (coordinator.screen_rotation): every agent keeps its own schedule")
        return lines
    turns = rot.get("turns") or []
    held = ", ".join(f"{t['node']} ({_ago(t['remaining_s'])} left)" for t in turns) or "none"
    lines.append(f"  screening turns ({len(turns)} of {rot.get('slots', 0)} slots, {_ago(rot['turn_s'])} each): {held}")
    upcoming = rot.get("next") or []
    if upcoming:
        lines.append("  next: " + ", ".join(f"{n['node']} (in {_ago(max(0.0, n['estimated_start'] - now))})"
                                            for n in upcoming[:5]))
    return lines


def _ago(seconds: float) -> str:
    """A duration as people say it: 45 s, 12 min, 5.0 h, 2.0 d."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.1f} d"


__all__ = ["command"]
