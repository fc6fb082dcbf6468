"""``gpuhealth triage``: one verdict for a hung or slow job.

Offline: ``gpuhealth triage DUMPS_DIR [--steps steps.jsonl …] [--json]`` reads flight-recorder
dumps (and step records) from disk. Live: ``gpuhealth triage --job ID --coordinator HOST:PORT``
asks the coordinator to collect dumps from the running job now and returns the same JSON shape.
Exit code: the chosen profile's code for healthy / degraded (straggler) / unhealthy (hang,
mismatch) / unknown (incomplete or could not check).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from gpuhealth.cli._usage import usage_error
from gpuhealth.cli.exitcodes import PROFILE_NAMES, exit_code
from gpuhealth.flightrec.report import Verdict
from gpuhealth.model import MAX_RANKS, Health, StepRecord

__all__ = ["command"]


class StepsFileError(ValueError):
    pass


def read_steps(paths: Sequence[str]) -> tuple[list[StepRecord], list[str]]:
    """Step records from JSONL files; bad lines are counted, not fatal. Returns (records, problems)."""
    records: list[StepRecord] = []
    problems: list[str] = []
    for p in paths:
        try:
            text = Path(p).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            problems.append(f"{p}: {exc.strerror or exc}")
            continue
        bad = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                records.append(StepRecord.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                bad += 1
        if bad:
            problems.append(f"{p}: {bad} line(s) are not step records; skipped")
    return records, problems


def _expand_steps(paths: Sequence[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        path = Path(p)
        out += [str(x) for x in sorted(path.glob("*.jsonl"))] if path.is_dir() else [p]
    return out


def render(report: Mapping[str, Any]) -> str:
    """The human view: the verdict, then only what someone needs to act on."""
    lines = [str(report.get("summary") or report.get("verdict", "?")).strip()]
    for f in report.get("findings", []):
        if f.get("severity") == "info":
            continue
        ev = f.get("evidence") or {}
        lines.append("")
        lines.append(f"[{f.get('severity')}] {f.get('code')}  {f.get('entity', {}).get('kind')} "
                     f"{f.get('entity', {}).get('id')}" + (f" on {ev['host']}" if ev.get("host") else ""))
        lines.append(f"  {f.get('message')}")
        if ev.get("group") is not None and ev.get("seq") is not None:
            coll = f"  collective: group {ev['group']}"
            if ev.get("group_desc") and ev["group_desc"] != "undefined":
                coll += f" ({ev['group_desc']})"
            coll += f", seq #{ev['seq']}"
            if ev.get("op"):
                coll += f", {ev['op']} sizes {ev.get('input_sizes')} dtypes {ev.get('input_dtypes')}"
            lines.append(coll)
        for v in ev.get("variants", []) or []:
            lines.append(f"    ranks {_ranks(v.get('ranks', []))}: {v.get('op')} {v.get('input_sizes')}→"
                         f"{v.get('output_sizes')} {v.get('input_dtypes')}")
        if ev.get("why") and str(ev["why"]) not in str(f.get("message")):
            lines.append(f"  why: {ev['why']}")
        last = ev.get("last_seen")
        if isinstance(last, Mapping):
            lines.append(f"  rank last seen in: {last.get('op')} #{last.get('seq')} of group {last.get('group')} "
                         f"({'completed' if last.get('completed') else last.get('state')})")
        stack = ev.get("stack") or []
        if stack:
            lines.append("  call site:")
            lines += [f"    {s}" for s in stack]
    missing = report.get("ranks_missing") or []
    if missing:
        lines.append("")
        what = "a dump" if report.get("groups") or report.get("rank_identity") else "step records"
        lines.append(f"ranks without {what}: {_ranks(missing)}")
    errors = [p for p in report.get("problems", []) if p.get("severity") == "error"]
    if errors:
        lines.append(f"{len(errors)} file(s) could not be read:")
        lines += [f"  {p['path']}: {p['message']}" for p in errors[:10]]
        if len(errors) > 10:
            lines.append(f"  … and {len(errors) - 10} more (see --json)")
    warnings = [p for p in report.get("problems", []) if p.get("severity") == "warning"]
    if warnings:  # read, with a caveat that may change the picture (a second dump of a rank set aside)
        lines.append(f"{len(warnings)} file(s) read with a caveat:")
        lines += [f"  {p['path']}: {p['message']}" for p in warnings[:10]]
        if len(warnings) > 10:
            lines.append(f"  … and {len(warnings) - 10} more (see --json)")
    for note in report.get("notes", []) or []:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    from gpuhealth.flightrec.text import format_ranks

    return format_ranks(ranks)


def _fail(message: str, profile: str) -> None:
    click.echo(f"gpuhealth triage: {message}", err=True)
    sys.exit(exit_code(Health.UNKNOWN, profile))


@click.command(name="triage")
@click.argument("path", required=False, type=click.Path(path_type=str))
@click.option("--steps", "steps", multiple=True, metavar="STEPS.jsonl",
              help="Step records (JSONL, one StepRecord per line, or a folder of them); repeatable.")
@click.option("--world-size", type=click.IntRange(min=1, max=MAX_RANKS), default=None,
              help="Ranks in the job (ranks without a dump are then reported as missing).")
@click.option("--group", "groups", multiple=True, metavar="NAME=R,R,…",
              help="Members of a process group (Gloo dumps do not record them); repeatable.")
@click.option("--stacks", "stacks_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Live stack captures per rank (JSON {rank: capture}, as a coordinator evidence folder's "
                   "stacks.json); default: PATH/stacks.json when PATH is such a folder.")
@click.option("--tail", "tail_entries", type=click.IntRange(min=1), default=None,
              help="Read only the newest N entries of each dump (default: automatic for very large jobs).")
@click.option("--job", "job_id", default=None, help="Live mode: the job to triage through the coordinator.")
@click.option("--coordinator", "address", default=None, metavar="HOST:PORT",
              help="Live mode: coordinator address (default: agent.coordinator from config).")
@click.option("--token", default=None, envvar="GPUHEALTH_TOKEN",
              help="Live mode: operator token (default: coordinator.operator_token from config).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Live mode: YAML config with the coordinator's address and credentials.")
@click.option("--tls-cert", default=None, help="Live mode: client certificate (mutual TLS; an operator name).")
@click.option("--tls-key", default=None, help="Live mode: client private key.")
@click.option("--tls-ca", default=None, help="Live mode: CA of the coordinator's certificate.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--exit-codes", "profile", type=click.Choice(PROFILE_NAMES), default="default", show_default=True,
              help="Exit-code dialect: default (0/1/2/3), slurm, npd, nagios.")
def command(path: str | None, steps: tuple[str, ...], world_size: int | None, groups: tuple[str, ...],
            stacks_path: str | None, tail_entries: int | None, job_id: str | None, address: str | None,
            token: str | None, config_path: str | None, tls_cert: str | None, tls_key: str | None, tls_ca: str | None,
            as_json: bool, profile: str) -> None:
    """Triage a hung or slow job from flight-recorder dumps (PATH: a folder or files)."""
    if job_id or address:
        if not job_id:
            raise usage_error("live mode needs --job ID (and a coordinator: --coordinator HOST:PORT or the config)")
        from gpuhealth.cli._coordinator_client import resolve
        from gpuhealth.config import ConfigError, load_config

        try:
            configured = load_config(config_path).agent.coordinator
        except ConfigError as exc:
            _fail(str(exc), profile)
            return
        if not (address or configured):
            raise usage_error("live mode needs a coordinator: --coordinator HOST:PORT (or agent.coordinator in the "
                              "config)")
        try:
            addr, tok, tls = resolve(config_path, address, token, tls_cert, tls_key, tls_ca)
        except click.ClickException as exc:
            _fail(exc.message, profile)
            return
        except ImportError as exc:  # grpc (the coordinator extra) is not installed
            _fail(f"live triage is not available in this installation: the coordinator part is missing ({exc}); "
                  "install gpuhealth[coordinator] or triage a folder of dumps instead", profile)
            return
        report = _live(addr, job_id, tok, tls, profile)
    else:
        if path is None and not steps:
            raise usage_error("give a folder of dumps (PATH), --steps files, or --job/--coordinator")
        if path is not None and not Path(path).exists():
            raise click.BadParameter(f"{path}: no such file or folder", param_hint="'PATH'")
        job: dict[str, Any] = {}
        if world_size:
            job["world_size"] = world_size
        if groups:
            try:
                job["groups"] = _parse_groups(groups)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="'--group'") from None
        if path is not None and stacks_path is None and (Path(path) / "fr").is_dir():
            # A coordinator evidence folder: the dumps are in fr/, the ranks' stacks beside them.
            stacks_path = str(Path(path) / "stacks.json") if (Path(path) / "stacks.json").is_file() else None
            path = str(Path(path) / "fr")
        report = _offline(path, steps, job, stacks_path, tail_entries, profile)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo(render_jobs(report) if "jobs" in report else render(report))
    try:
        health = Verdict(str(report.get("verdict", "incomplete"))).health
    except ValueError:
        health = Health.UNKNOWN
    sys.exit(exit_code(health, profile))


def _offline(path: str | None, steps: Sequence[str], job: dict[str, Any], stacks_path: str | None,
             tail_entries: int | None, profile: str) -> dict[str, Any]:
    """Triage the dumps under PATH: each job found there on its own (``flightrec.jobs``), with the step
    records given — or, given none, those in ``*.jsonl`` files beside the dumps."""
    from gpuhealth.flightrec.jobs import assign_steps, find_jobs, no_clean_bill_on_evidence_set_aside
    from gpuhealth.flightrec.verdict import triage

    jobs, loose = find_jobs(path) if path is not None else ([], [])
    if len(jobs) > 1 and (job or stacks_path):
        raise usage_error(f"--world-size, --group and --stacks describe one job, but {path} holds {len(jobs)} jobs "
                          f"({_names(jobs)}): give one job's folder")
    step_files, notes = _step_files(steps, path)
    stacks, stack_problem = _read_stacks(stacks_path)
    notes += [stack_problem] if stack_problem else []
    if len(jobs) <= 1:
        records = [r for _, recs in step_files for r in recs]
        rep = triage([path] if path else [], steps=records, job=job, tail_entries=tail_entries, stacks=stacks)
        report = no_clean_bill_on_evidence_set_aside(rep).to_dict()
        report["notes"] = list(report.get("notes", [])) + notes
        return report
    per_job, set_aside = assign_steps(step_files, jobs)
    reports = []
    for one, records in zip(jobs, per_job, strict=True):
        rep = triage(one.files, steps=records, tail_entries=tail_entries)
        reports.append({"job": one.name, "files": len(one.files),
                        **no_clean_bill_on_evidence_set_aside(rep, set_aside).to_dict()})
    worst = max(reports, key=lambda r: _WORSE.index(str(r["verdict"])))
    counts = ", ".join(f"{sum(r['verdict'] == v for r in reports)} {v}" for v in _WORSE[::-1]
                       if any(r["verdict"] == v for r in reports))
    return {"verdict": worst["verdict"],
            "summary": f"{len(jobs)} jobs in {path}, each triaged on its own: {counts}",
            "jobs": reports, "problems": [p.to_dict() for p in loose], "notes": notes + set_aside}


# From least to most in need of a look: the verdict of several jobs is the worst of theirs.
_WORSE = ["healthy", "straggler", "incomplete", "hang", "mismatch"]


def _names(jobs: Sequence[Any]) -> str:
    names = [j.name for j in jobs]
    return ", ".join(names[:5]) + (f", … ({len(names) - 5} more)" if len(names) > 5 else "")


def _step_files(steps: Sequence[str], path: str | None) -> tuple[list[tuple[str, list[StepRecord]]], list[str]]:
    """(file, records) for the --steps given, else for the ``*.jsonl`` under PATH that hold step records
    (a straggler shows in step times, not in dumps: files beside the dumps are read, not left out)."""
    if steps:
        files, found = _expand_steps(steps), False
    elif path is not None and Path(path).is_dir():
        files, found = sorted(str(p) for p in Path(path).rglob("*.jsonl") if not p.name.startswith(".")), True
    else:
        files, found = [], False
    out: list[tuple[str, list[StepRecord]]] = []
    notes: list[str] = []
    for f in files:
        records, problems = read_steps([f])
        if found and not records:
            continue  # another kind of JSON lines (a log): not step records, nothing set aside
        notes += problems
        if records:
            out.append((f, records))
    if found and out:
        notes.insert(0, f"step records read from {len(out)} file(s) beside the dumps "
                        f"({', '.join(Path(f).name for f, _ in out[:4])}{', …' if len(out) > 4 else ''})")
    return out, notes


def render_jobs(report: Mapping[str, Any]) -> str:
    """Several jobs: the line that says so, one line per job, then each job as ``render`` shows one."""
    lines = [str(report.get("summary", ""))]
    for r in report.get("jobs", []):
        lines.append(f"  {r['job']}: {str(r.get('summary', '')).strip()}")
    for r in report.get("jobs", []):
        lines += ["", f"=== job {r['job']} ({r['files']} file(s)) ===", render(r)]
    loose = report.get("problems") or []
    if loose:
        lines += ["", f"{len(loose)} file(s) outside any job could not be read as dumps:"]
        lines += [f"  {p['path']}: {p['message']}" for p in loose[:10]]
        if len(loose) > 10:
            lines.append(f"  … and {len(loose) - 10} more (see --json)")
    lines += [f"note: {n}" for n in report.get("notes", []) or []]
    return "\n".join(lines)


MAX_STACKS_BYTES = 256 * 2**20


def _read_stacks(path: str | None) -> tuple[dict[str, Any] | None, str]:
    """The stacks file as {rank: capture}, or (None, why not) — a bad file is a note, never fatal."""
    if path is None:
        return None, ""
    try:
        p = Path(path)
        if p.stat().st_size > MAX_STACKS_BYTES:
            return None, f"{path}: larger than {MAX_STACKS_BYTES >> 20} MiB; stacks not used"
        doc = json.loads(p.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{path}: not readable as JSON ({exc}); stacks not used"
    if not isinstance(doc, dict):
        return None, f"{path}: not a JSON object of rank -> stack capture; stacks not used"
    return doc, ""


def _parse_groups(items: Sequence[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for item in items:
        name, sep, ranks = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--group {item!r}: expected NAME=R,R,… (e.g. 1=0,1)")
        try:
            out[name] = [int(r) for r in ranks.split(",") if r.strip()]
        except ValueError as exc:
            raise ValueError(f"--group {item!r}: ranks must be integers") from exc
        if any(not 0 <= r < MAX_RANKS for r in out[name]):
            raise ValueError(f"--group {item!r}: ranks must be 0 … {MAX_RANKS - 1}")
    return out


def _live(address: str, job_id: str, token: str | None, tls: Any, profile: str) -> dict[str, Any]:
    try:
        from gpuhealth.coordinator.query import live_triage
    except ImportError as exc:
        _fail(f"live triage is not available in this installation: the coordinator part is missing ({exc}); "
              "install gpuhealth[coordinator] or triage a folder of dumps instead", profile)
        raise AssertionError("unreachable") from exc
    from gpuhealth.coordinator.triage_wire import reply_to_dict

    try:
        return reply_to_dict(live_triage(address, job_id, token=token, tls=tls))
    except Exception as exc:
        _fail(f"coordinator {address}: {type(exc).__name__}: {exc}", profile)
        raise AssertionError("unreachable") from exc
