"""``gpuhealth jobs``: jobs the coordinator knows, with stragglers, hangs and the latest verdicts."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from gpuhealth.cli._console import output_console
from gpuhealth.cli._coordinator_client import CoordinatorClientError, coordinator_options, resolve


@click.command(name="jobs")
@click.argument("job_id", required=False, default="")
@coordinator_options
def command(job_id: str, address: str | None, config_path: str | None, token: str | None,
            token_file: str | None, tls_cert: str | None,
            tls_key: str | None, tls_ca: str | None, as_json: bool) -> None:
    """List jobs (or one JOB_ID) known to the coordinator. Exit 0 when no running job is hung, straggling,
    slowed in its communication or waiting on a node cut off (a finished job's verdicts are history: shown, not
    an alarm), 1 when one is, 3 when the coordinator could not be asked (or the config is bad, or it does not know
    JOB_ID)."""
    try:
        addr, tok, tls = resolve(config_path, address, token, tls_cert, tls_key, tls_ca, token_file)
    except CoordinatorClientError as exc:
        click.echo(f"gpuhealth jobs: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    from gpuhealth.coordinator.query import CoordinatorQueryError, list_jobs

    try:
        doc = list_jobs(addr, job_id, token=tok, tls=tls)
    except CoordinatorQueryError as exc:
        click.echo(f"gpuhealth jobs: {exc}", err=True)
        sys.exit(3)
    jobs = doc.get("jobs", [])
    if job_id and not jobs:
        click.echo(f"gpuhealth jobs: the coordinator at {addr} knows no job {job_id!r}", err=True)
        sys.exit(3)
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        _render(jobs)
    sys.exit(1 if any(needs_a_look(j) for j in jobs) else 0)


def needs_a_look(job: dict[str, Any]) -> bool:
    """A job hung, straggling, slowed in its communication or waiting on a node cut off, now. A finished job's
    verdicts are history: shown, not an alarm."""
    if job.get("state") == "finished":
        return False
    return (job.get("state") == "hung" or bool(job.get("stragglers")) or bool(job.get("comm_slow"))
            or bool(job.get("cut_off")))


def _render(jobs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="jobs")
    for col in ("job", "state", "ranks", "nodes", "last step", "step p50 (s)", "stragglers", "hangs"):
        table.add_column(col)
    simulated = sorted({n for j in jobs for n in j.get("simulated_nodes") or []})
    if simulated:
        output_console().print(f"SIMULATED: node(s) {', '.join(simulated[:10])} replay a recording: the GPUs joined "
                               "with these ranks are not real", style="bold black on yellow", markup=False,
                               highlight=False)
    for j in jobs:
        q = j.get("step_time_quantiles") or {}
        p50 = q.get("0.5") if isinstance(q, dict) else None
        # Both counts (straggler ranks now, hangs so far); which ranks and why: the lines below the table.
        table.add_row(str(j["job_id"]), str(j["state"]), f"{j['ranks_seen']}/{j['world_size'] or '?'}",
                      ",".join(f"{n} (SIMULATED)" if n in (j.get("simulated_nodes") or []) else n
                               for n in j.get("nodes") or []),
                      str(j.get("last_step")), f"{p50:.3f}" if isinstance(p50, float) else "-",
                      str(len(j.get("stragglers") or [])), str(j.get("hangs", 0)))
    console = output_console()
    console.print(table)
    for j in jobs:
        for line in _detail_lines(j):
            console.print(line, markup=False, highlight=False)


def _detail_lines(job: dict[str, Any]) -> list[str]:
    """The job's latest verdicts (3 at most, each said once), then each current straggler rank that no
    verdict shown already names."""
    lines: list[str] = []
    named: set[int] = set()
    for v in (job.get("verdicts") or [])[:3]:
        text = f"{job['job_id']}: {v.get('summary') or v['kind']}"
        if text not in lines:
            lines.append(text)
        if v.get("kind") == "straggler":
            named.update(r for r in v.get("culprits") or [] if isinstance(r, int))
    for c in job.get("straggler_culprits") or []:
        if c.get("rank") not in named:
            lines.append(f"{job['job_id']}: straggler {c['line']}")
            named.add(c.get("rank"))
    return lines


__all__ = ["command"]
