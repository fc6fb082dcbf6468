"""Evidence collection and the triage verdict of a live job.

On a hang (or a live ``triage --job``), the coordinator asks every agent that hosts ranks of the job for
flight-recorder dumps and Python stacks, waits until all answered or the deadline passed (partial
evidence is fine: the analyser says what it can), writes the dumps as the agents sent them into the
evidence folder, runs the flight-recorder analyser on them once — in a child process under a memory cap
(``coordinator/triage_child.py``), never in the coordinator's own — and joins the culprit ranks with their
GPUs' findings. The result is a ``pb.TriageReply``: the analyser's typed report
plus where each culprit runs.

This module works for the coordinator through :class:`EvidenceSource` — the few things it needs — and
never imports the service that calls it. Payloads are parsed only as flight-recorder dumps or JSON:
nothing an agent sends is executed. NCCL's pickled dumps (ranks found by discovery) are read by the
analyser's plain-data unpickler (``flightrec/safe_pickle.py``), which refuses every global.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from gpuhealth.coordinator.jobs import HangCheck, JobState
from gpuhealth.coordinator.requests import PendingRequest
from gpuhealth.coordinator.triage_child import run_triage as run_triage  # in this process: tests
from gpuhealth.coordinator.triage_child import triage_in_child
from gpuhealth.coordinator.triage_wire import report_to_pb
from gpuhealth.flightrec.report import RootKind, TriageReport, Verdict
from gpuhealth.model import Finding
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import finding_to_pb


class EvidenceSource(Protocol):
    """What an investigation needs from the coordinator."""

    @property
    def evidence_dir(self) -> str: ...

    def clock(self) -> float: ...

    def job_nodes(self, job: JobState) -> set[str]: ...

    def send_request(self, job_id: str, kind: Any, timeout_s: float, nodes: set[str], rank: int = -1,
                     rank_nodes: dict[int, str] | None = None) -> PendingRequest: ...

    def forget_request(self, rid: int) -> None: ...

    def culprit(self, job: JobState, rank: int) -> dict[str, Any]: ...


def safe_name(text: str) -> str:
    """A folder name for a job id that came over the network: readable, never "." / ".." or a path,
    and unique (a hash of the full id, so ids that differ only in replaced characters don't collide)."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", text)[:64].strip("_") or "job"
    return f"{readable}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def culprit_ranks(report: TriageReport) -> list[int]:
    """The headline root's ranks (what the verdict is about), else every rank a finding blames."""
    real = [r for r in report.roots if r.kind is not RootKind.BEHIND]
    if real and real[0].ranks:
        return list(real[0].ranks)
    return report.culprits


def _failed_report(ranks_seen: list[int], error: str) -> TriageReport:
    return TriageReport(verdict=Verdict.INCOMPLETE, summary=f"INCOMPLETE: {error}", findings=[],
                        ranks_seen=ranks_seen, ranks_missing=[], groups=[])


async def investigate(source: EvidenceSource, job: JobState, *, reason: str, timeout_s: float,
                      hang: HangCheck | None = None, suspects: Sequence[int] = ()) -> pb.TriageReply:
    """Collect every rank's dump and stacks, triage them, join the culprits with their GPUs. ``suspects``:
    the ranks whoever reported the hang named (an agent's NCCL RAS view), used when the dumps name none."""
    started = time.monotonic()
    nodes = source.job_nodes(job)
    agent_timeout = max(1.0, timeout_s * 0.75)  # agents answer before our own deadline
    owners = {r: p.node for r, p in job.placements.items()}
    root = Path(source.evidence_dir)
    fr = source.send_request(job.job_id, pb.DUMP_FLIGHT_RECORDER, agent_timeout, nodes, rank_nodes=owners)
    # Each dump to disk as it arrives (set before the first await: no answer can come in between), so the
    # coordinator holds one message at a time, not the job's dumps.
    fr.spool_dir = _spool_dir(root, job.job_id, fr.request_id)
    st = source.send_request(job.job_id, pb.CAPTURE_STACKS, agent_timeout, nodes, rank_nodes=owners)
    try:
        await asyncio.gather(fr.wait(timeout_s), st.wait(timeout_s))
    finally:
        source.forget_request(fr.request_id)
        source.forget_request(st.request_id)

    folder = root / safe_name(job.job_id) / f"{int(source.clock() * 1000)}-{reason}"
    if not folder.resolve().is_relative_to(root.resolve()):  # belt and braces: names come from the network
        raise ValueError(f"evidence folder {folder} is outside {root}")
    dump_dir = folder / "fr"
    dumps, errors = await asyncio.to_thread(_write_evidence, root, folder, dump_dir, fr, st)
    stacks = {r: a.payload for r, a in sorted(st.answers.items()) if a.ok}
    job_info = {"job_id": job.job_id, "world_size": job.world_size or None}
    # Never in this process: the dumps are the job's, and the analyser's memory is theirs to spend.
    got, error = await triage_in_child(dump_dir, {k: v for k, v in job_info.items() if v}, folder / "stacks.json")
    report = got if got is not None else _failed_report(sorted(dumps), error)

    ranks = culprit_ranks(report)
    if not ranks and reason == "hang":
        # No rank-level FR finding: fall back to the ranks the reporter named, else to the ranks whose
        # progress is behind the others'.
        behind = job.slowest_ranks()
        if suspects:
            ranks = sorted(set(suspects))
        elif len(behind) < max(1, len(job.last_step)):
            ranks = behind
    details = [source.culprit(job, r) for r in ranks]
    expected = sorted(job.placements) or sorted(job.last_step)
    who = "; ".join(c["line"] for c in details) or "culprit not determined from the evidence"
    reply = pb.TriageReply(
        report=report_to_pb(report), job_id=job.job_id, reason=reason,
        summary=f"{_label(reason, report.verdict.value)}: {who}", culprits=ranks,
        culprit_details=[_culprit_pb(c) for c in details],
        evidence=pb.TriageEvidence(
            dir=str(folder), fr_dumps={r: p for r, p in dumps.items()}, stacks_ranks=sorted(stacks),
            fr_missing_ranks=[r for r in expected if r not in dumps], errors=errors,
            collect_seconds=round(time.monotonic() - started, 3), agents_asked=sorted(nodes)),
        created_at=source.clock(), error=error,
        stacks_json={r: json.dumps(s) for r, s in stacks.items()},
    )
    if hang is not None:
        reply.hang.CopyFrom(pb.HangCheck(stalled_s=round(hang.stalled_s, 3), threshold_s=round(hang.threshold_s, 3),
                                         last_step=hang.last_step))
        if hang.typical_step_s is not None:
            reply.hang.typical_step_s = hang.typical_step_s
    return reply


def _write_evidence(root: Path, folder: Path, dump_dir: Path, fr: PendingRequest, st: PendingRequest
                    ) -> tuple[dict[int, str], dict[str, str]]:
    """Dumps as the agents sent them (no parse, no re-serialisation) and the stacks, readable by the
    service only: they show code paths and arguments of the job."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    for d in (root, folder.parent, folder, dump_dir):
        d.chmod(0o700)
    dumps: dict[int, str] = {}
    errors: dict[str, str] = {}
    for rank, ans in sorted(fr.answers.items()):
        path = dump_dir / f"rank_{rank}.{'pkl' if ans.format == 'fr_pickle' else 'json'}"
        if ans.ok and ans.path:
            try:
                os.replace(ans.path, path)  # spooled as it arrived: moved, not copied
                dumps[rank] = str(path)
            except OSError as exc:
                errors[f"fr/{rank}"] = f"the dump received could not be kept: {exc.strerror or exc}"
        elif ans.ok and ans.raw:
            path.write_bytes(ans.raw)
            dumps[rank] = str(path)
        else:
            errors[f"fr/{rank}"] = ans.error or "no dump"
    if fr.spool_dir is not None:
        shutil.rmtree(fr.spool_dir, ignore_errors=True)  # what is left: answers past the deadline
    for rank, ans in sorted(st.answers.items()):
        if not ans.ok:
            errors[f"stacks/{rank}"] = ans.error
    for node, err in {**fr.node_errors, **st.node_errors}.items():
        errors[f"node/{node}"] = err
    stacks = {str(r): a.payload for r, a in sorted(st.answers.items()) if a.ok}
    (folder / "stacks.json").write_text(json.dumps(stacks))
    return dumps, errors


def _spool_dir(root: Path, job_id: str, request_id: int) -> Path | None:
    """A private folder for one request's dumps as they arrive; None (kept in memory) when it cannot be made."""
    spool = root / safe_name(job_id) / f".incoming-{request_id}"
    try:
        spool.mkdir(parents=True, exist_ok=True)
        for d in (root, spool.parent, spool):
            d.chmod(0o700)
    except OSError:
        return None
    return spool


def _culprit_pb(c: Mapping[str, Any]) -> pb.Culprit:
    m = pb.Culprit(rank=int(c["rank"]), node=c.get("node") or "", gpu_uuid=c.get("gpu_uuid") or "",
                   gpu_inferred=bool(c.get("gpu_inferred_from_local_rank")), line=str(c.get("line", "")),
                   gpu_findings=[finding_to_pb(Finding.from_dict(f)) for f in c.get("gpu_findings") or []],
                   host=str(c.get("host") or ""))
    if c.get("gpu_index") is not None:
        m.gpu_index = int(c["gpu_index"])
    if c.get("pid") is not None:
        m.pid = int(c["pid"])
    if c.get("local_rank") is not None:
        m.local_rank = int(c["local_rank"])
    return m


def _label(reason: str, verdict: str) -> str:
    """"hang" when an investigation of a hang finds one; else what it found and why it looked."""
    return verdict if verdict == reason else f"{verdict} (looked because: {reason.replace('_', ' ')})"
