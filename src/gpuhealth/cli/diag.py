"""``gpuhealth diag sdc|busbw|bandwidth``: run one diagnostic now (in a child process) and show it.

``--device cpu`` runs the same code on the CPU (torch CPU matmuls, Gloo collectives): the logic is
real, the numbers are not a GPU's. ``--inject-fault`` is the SDC self-test: bit flips injected into
each output before hashing must all be detected.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpuhealth.cli._console import output_console
from gpuhealth.cli._usage import check_device
from gpuhealth.cli.exitcodes import PROFILE_NAMES, exit_code
from gpuhealth.config import Config, ConfigError, load_config
from gpuhealth.diag.golden import GoldenError, GoldenStore
from gpuhealth.diag.golden_place import resolve_golden_dir
from gpuhealth.diag.ondemand import DiagRequestError, bandwidth_args, busbw_args, run_on_demand, sdc_args
from gpuhealth.diag.runner import DiagOutcome
from gpuhealth.model import Health, health_of


def _fail(message: str, profile: str) -> None:
    click.echo(f"gpuhealth diag: {message}", err=True)
    sys.exit(exit_code(Health.UNKNOWN, profile))


BUDGETED_ENV = "GPUHEALTH_DIAG_BUDGETED"  # set by automation that must respect the GPU-time budget


def _run(kind: str, args: list[str], device: str, force: bool, config: Config, profile: str, as_json: bool) -> None:
    # A person asked: charged to the budget, not refused by it. Automation that sets
    # GPUHEALTH_DIAG_BUDGETED=1 respects the budget (docs/architecture.md, rule 7).
    try:
        outcome = run_on_demand(kind, args, config, device=device, force=force,
                                budgeted=os.environ.get(BUDGETED_ENV) == "1")
    except DiagRequestError as exc:
        _fail(str(exc), profile)
        return
    health = health_of(outcome.findings) if outcome.status == "ok" else Health.UNKNOWN
    if outcome.status == "failed" and kind == "sdc" and outcome.result.get("selftest"):
        health = Health.UNHEALTHY  # the self-test missed an injected fault: the check itself is broken
    if health is Health.HEALTHY and not_cross_checked(outcome):
        health = Health.UNKNOWN  # agreeing with itself is no verdict on SDC: nothing outside the GPU confirmed it
    if as_json:
        click.echo(json.dumps({**outcome.to_dict(), "health": str(health)}, indent=2, default=str))
    else:
        render(outcome, output_console())
    sys.exit(exit_code(health, profile))


def not_cross_checked(o: DiagOutcome) -> bool:
    """An SDC run whose digests met no golden and no peer (``sdc.reference_of``): its own agreement proves nothing
    about a GPU that is wrong the same way every time."""
    reference = o.result.get("reference") if o.diag == "sdc" else None
    return isinstance(reference, dict) and reference.get("cross_checked") is False


def _config(config_path: str | None, profile: str) -> Config:
    try:
        return load_config(config_path)
    except ConfigError as exc:
        _fail(str(exc), profile)
        raise AssertionError from exc  # unreachable: _fail exits


def _golden_place(config: Config) -> str:
    """The golden store by its rule; goldens merged in from an old place (or refused) are said on stderr."""
    place = resolve_golden_dir(config)
    for line in [*place.merged, *place.problems]:
        click.echo(f"gpuhealth diag: golden digests: {line}", err=True)
    return str(place.path)


def render(o: DiagOutcome, console: Console) -> None:
    # Text from the run is escaped: "pip install 'gpuhealth[diag]'" is not rich markup.
    console.print(f"[bold]{o.diag}[/bold]: {o.status}" + (f" — {escape(o.reason)}" if o.reason else "")
                  + f"  [dim]({o.wall_s:.1f} s)[/dim]")
    r = o.result
    if o.diag == "sdc" and r.get("devices"):
        t = Table()
        for col in ("device", "case", "digest", "matmul ms", "TFLOP/s", "hash ms"):
            t.add_column(col)
        for d in r["devices"]:
            for c in d["cases"]:
                t.add_row(d["device"], c["case"], c["digest"], f"{c['matmul_ms']:.3f}", str(c["tflops"]),
                          f"{c['hash_ms']:.3f}")
        console.print(t)
        console.print(f"golden: {r.get('golden', {}).get('status')} (key {r.get('key_id')})")
        if isinstance(r.get("reference"), dict):
            console.print(f"compared: {escape(str(r['reference'].get('compared')))}")
        if r.get("selftest"):
            s = r["selftest"]
            per_kind = ", ".join(f"{k} {v['detected']}/{v['injected']}" for k, v in s["faults"].items())
            verdict = "PASSED" if s["passed"] else "FAILED"
            console.print(f"self-test: {s['detected']}/{s['injected']} injected faults detected "
                          f"({per_kind}); {verdict}")
    elif o.diag == "busbw" and r.get("points"):
        t = Table(title=f"{r.get('backend')} × {r.get('world')} ranks")
        for col in ("collective", "size", "time µs", "algbw GB/s", "busbw GB/s", "errors", "graph"):
            t.add_column(col)
        for p in r["points"]:
            t.add_row(p["collective"], str(p["size_bytes"]), f"{p['time_us']:.1f}", f"{p['algbw_gbps']:.1f}",
                      f"{p['busbw_gbps']:.1f}", str(p["errors"]), "yes" if p["graph"] else "no")
        console.print(t)
    elif o.diag == "bandwidth":
        if "cpu_copy_gbps" in r:
            console.print(f"host memory copy: {r['cpu_copy_gbps']} GB/s")
        for g in r.get("gpus", []):
            console.print(f"GPU {g['index']} {g['name']}: device copy {g['d2d_gbps']} GB/s, H→D {g['h2d_gbps']} GB/s, "
                          f"D→H {g['d2h_gbps']} GB/s, NUMA node {g['numa_node']} {'; '.join(g['notes'])}")
    for uuid, why in o.skipped_gpus.items():
        console.print(f"[yellow]left out {uuid}: {escape(why)}[/yellow]")
    for f in o.findings:
        console.print(f"[red]{f.severity}[/red] {f.code}: {escape(f.message)} → {f.action}")
    if o.status == "ok" and not o.findings:
        if not_cross_checked(o):
            console.print("[magenta]not judged[/magenta]: no golden digests for this key and no peer device, so "
                          "nothing outside the device confirmed its results (a device that is wrong the same way "
                          "every time passes this); import a golden from a known-good node "
                          "(gpuhealth diag golden --import FILE) or run where ≥ 2 identical GPUs can vote")
        else:
            console.print("[green]no problems found[/green]")


_common = [
    click.option("--device", default="cuda", show_default=True, callback=check_device,
                 help="cuda (all GPUs), cuda:N[,cuda:M] or cpu."),
    click.option("--force", is_flag=True, help="Run on GPUs with user processes or out of GPU-time budget."),
    click.option("--config", "config_path", metavar="FILE", default=None, help="gpuhealth YAML config file."),
    click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON."),
    click.option("--exit-codes", "profile", type=click.Choice(PROFILE_NAMES), default="default", show_default=True,
                 help="Exit-code dialect: default (0/1/2/3), slurm, npd, nagios."),
]


def _check_collectives(value: str | None) -> str | None:
    from gpuhealth.diag.busbw import COLLECTIVES

    unknown = [c for c in (value or "").split(",") if c and c not in COLLECTIVES]
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(unknown)[:80]} (known: {', '.join(COLLECTIVES)})")
    return value


def _with_common(f: Any) -> Any:
    for opt in reversed(_common):
        f = opt(f)
    return f


@click.group(name="diag")
def command() -> None:
    """Run one diagnostic: sdc, busbw, bandwidth, fabric."""


@command.command(name="sdc")
@_with_common
@click.option("--inject-fault", is_flag=True, help="Self-test: inject bit flips before hashing; all must be caught.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs of every case on each GPU (a digest that changes between runs is nondeterministic).")
@click.option("--record-golden", is_flag=True, help="Store this run's digests as the golden for this environment.")
@click.option("--peers", type=click.IntRange(min=1), default=1, help="CPU only: identical 'devices' to vote.")
@click.option("--golden-dir", default=None, help="Golden digest directory (default: config diag.golden_dir).")
def sdc_cmd(device: str, force: bool, config_path: str | None, as_json: bool, profile: str, inject_fault: bool,
            repeats: int, record_golden: bool, peers: int, golden_dir: str | None) -> None:
    """Silent-data-corruption check: seeded matmuls on every datapath, hashed on the device."""
    config = _config(config_path, profile)
    golden_dir = golden_dir or _golden_place(config)
    args = sdc_args(config, cpu=device == "cpu", golden_dir=golden_dir, repeats=repeats, selftest=inject_fault,
                    record_golden=record_golden, peers=peers)
    _run("sdc", args, device, force, config, profile, as_json)


@command.command(name="busbw")
@_with_common
@click.option("--collectives", default=None, callback=lambda _c, _p, v: _check_collectives(v),
              help="Comma list (default: all six).")
@click.option("--max-bytes", type=click.IntRange(min=1), default=1 << 30, show_default=True,
              help="Largest message size (bytes).")
@click.option("--min-bytes", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="Smallest message size (bytes).")
@click.option("--ranks", type=click.IntRange(min=2), default=2, show_default=True, help="CPU only: Gloo ranks.")
def busbw_cmd(device: str, force: bool, config_path: str | None, as_json: bool, profile: str,
              collectives: str | None, max_bytes: int, min_bytes: int, ranks: int) -> None:
    """Collective bus bandwidth (nccl-tests formulas), data checked after each collective."""
    if min_bytes > max_bytes:
        raise click.BadParameter(f"{min_bytes} is above --max-bytes {max_bytes}", param_hint="'--min-bytes'")
    config = _config(config_path, profile)
    args = busbw_args(config, cpu=device == "cpu", collectives=collectives, min_bytes=min_bytes,
                      max_bytes=max_bytes, ranks=ranks)
    _run("busbw", args, device, force, config, profile, as_json)


@command.command(name="bandwidth")
@_with_common
def bandwidth_cmd(device: str, force: bool, config_path: str | None, as_json: bool, profile: str) -> None:
    """Device memory bandwidth and pinned host↔device bandwidth per GPU (NUMA-pinned)."""
    config = _config(config_path, profile)
    _run("bandwidth", bandwidth_args(config, cpu=device == "cpu"), device, force, config, profile, as_json)


@command.command(name="fabric")
@click.option("--from-env", is_flag=True,
              help="Run as one rank of a multi-node probe (under torchrun/srun: RANK, WORLD_SIZE, MASTER_ADDR set).")
@click.option("--ranks", type=click.IntRange(min=2), default=4, show_default=True,
              help="Without --from-env: Gloo ranks on this host (exercises the logic, not a fabric).")
@click.option("--node", default=None, help="This rank's node name (default: config node_name).")
@click.option("--schedule", type=click.Choice(["full", "nodes"]), default="full", show_default=True,
              help="full: every pair in N-1 rounds; nodes: fewer rounds (recursive halving), enough to name a node.")
@click.option("--size-bytes", type=click.IntRange(min=1), default=4 << 20, show_default=True,
              help="Message size per direction.")
@click.option("--iters", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed messages per direction (the best one counts).")
@click.option("--backend", type=click.Choice(["nccl", "gloo"]), default=None,
              help="Default: nccl when CUDA is available, else gloo.")
@click.option("--slow-fraction", type=click.FloatRange(0.01, 0.99), default=0.6, show_default=True,
              help="A direction below this share of the fleet's reference bandwidth is slow.")
@click.option("--latency-floor-us", type=click.FloatRange(min=0), default=500.0, show_default=True,
              help="A pair's round trip is high only this far above the median (and 4x it).")
@click.option("--heatmap", metavar="FILE.png", default=None, help="Rank 0 writes the pair matrix as a PNG here.")
@click.option("--out", metavar="FILE.json", default=None, help="Rank 0 writes the result document here.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Seconds for the probe.")
@click.option("--agent", "agent_url", metavar="URL", envvar="GPUHEALTH_AGENT_URL", default=None,
              help="This node's agent (http://127.0.0.1:9502): each rank tells it the probe's verdict on its node.")
@click.option("--config", "config_path", metavar="FILE", default=None, help="gpuhealth YAML config file.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.option("--exit-codes", "profile", type=click.Choice(PROFILE_NAMES), default="default", show_default=True,
              help="Exit-code dialect: default (0/1/2/3), slurm, npd, nagios.")
def fabric_cmd(from_env: bool, ranks: int, node: str | None, schedule: str, size_bytes: int, iters: int,
               backend: str | None, slow_fraction: float, latency_floor_us: float, heatmap: str | None,
               out: str | None, timeout_s: float, agent_url: str | None, config_path: str | None, as_json: bool,
               profile: str) -> None:
    """Fabric probe: bandwidth per direction and round trips between every pair of nodes, in rounds;
    names a slow node, the slow direction of a NIC, or a slow link. Multi-node: every rank runs
    `gpuhealth diag fabric --from-env` under torchrun or srun; rank 0 prints the result."""
    from gpuhealth.diag.fabric_run import FabricRequest, FabricRunError, run_fabric

    config = _config(config_path, profile)
    try:
        outcome = run_fabric(FabricRequest(
            from_env=from_env, ranks=ranks, node=node or config.node_name, schedule=schedule, size_bytes=size_bytes,
            iters=iters, backend=backend, slow_fraction=slow_fraction, latency_floor_us=latency_floor_us,
            heatmap=heatmap, out=out, timeout_s=timeout_s, agent_url=agent_url))
    except FabricRunError as exc:
        _fail(str(exc), profile)
        return
    if outcome is None:  # a rank other than 0: rank 0 reports
        sys.exit(0)
    unjudged = any(f.code == "netprobe.unjudged" for f in outcome.findings)
    health = health_of(outcome.findings) if outcome.status == "ok" else Health.UNKNOWN
    if health is Health.HEALTHY and unjudged:  # nothing slow among what was judged is not "healthy"
        health = Health.UNKNOWN
    if as_json:
        click.echo(json.dumps(outcome.to_dict(), indent=2, default=str))
    else:
        render_fabric(outcome, output_console())
    sys.exit(exit_code(health, profile))


def render_fabric(o: DiagOutcome, console: Console) -> None:
    r = o.result
    console.print(f"[bold]fabric[/bold]: {o.status}" + (f" — {escape(o.reason)}" if o.reason else "")
                  + f"  [dim]({o.wall_s:.1f} s)[/dim]")
    v = r.get("verdict") or {}
    names = (r.get("measurements") or {}).get("names") or []
    if names:
        ref = v.get("reference_bytes_per_second")
        rounds = r.get("round_s") or []
        console.print(f"{r.get('backend')} × {r.get('world')} ranks, {len(rounds)} rounds in {r.get('probe_s')} s; "
                      f"reference {ref * 8 / 1e9:.3g} Gb/s" if ref else "reference: none (not judged)")
        t = Table()
        for col in ("#", "node", "send ×ref", "receive ×ref", "slow sends", "slow receives", "verdict"):
            t.add_column(col)
        per = v.get("per_node") or {}
        for i, n in enumerate(names):
            p = per.get(n) or {}
            t.add_row(str(i), escape(n), str(p.get("send_ratio", "-")), str(p.get("recv_ratio", "-")),
                      f"{p.get('slow_sends', '-')}/{p.get('sends', '-')}",
                      f"{p.get('slow_recvs', '-')}/{p.get('recvs', '-')}",
                      p.get("verdict", "not judged") if p.get("judged", False) else "not judged")
        console.print(t)
    if r.get("heatmap"):
        console.print(f"pair matrix: {escape(r['heatmap'])} (row = sender #, column = receiver #)")
    for f in o.findings:
        console.print(f"[red]{f.severity}[/red] {f.code}: {escape(f.message)} → {f.action}")
    if o.status == "ok" and not o.findings:
        console.print("[green]no slow node, NIC direction or link[/green]")


@command.command(name="golden")
@click.option("--export", "export_path", metavar="FILE", default=None, help="Write every stored golden to FILE.")
@click.option("--import", "import_path", metavar="FILE", default=None, help="Merge a bundle written by --export.")
@click.option("--golden-dir", default=None, help="Golden digest directory (default: config diag.golden_dir).")
@click.option("--config", "config_path", metavar="FILE", default=None, help="gpuhealth YAML config file.")
def golden_cmd(export_path: str | None, import_path: str | None, golden_dir: str | None,
               config_path: str | None) -> None:
    """Share golden SDC digests between nodes (export / import a bundle)."""
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        _fail(str(exc), "default")
        return
    store = GoldenStore(golden_dir or _golden_place(config))
    try:
        if import_path:
            n = store.import_bundle(import_path)
            click.echo(f"imported {n} golden key(s) into {store.directory}")
        if export_path:
            n = store.export(export_path)
            click.echo(f"exported {n} golden key(s) to {export_path}")
        if not (import_path or export_path):
            for e in store.entries():
                click.echo(f"{e['key_id']}  {e['key'].get('device')}  {len(e['digests'])} cases  {e.get('source', '')}")
    except (GoldenError, OSError) as exc:
        _fail(str(exc), "default")


__all__ = ["command"]
