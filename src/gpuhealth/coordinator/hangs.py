"""Evidence collection and the hang verdict.

On a hang (or a live ``triage --job``), the coordinator asks every agent that hosts ranks of the job
for flight-recorder dumps and Python stacks, waits until all answered or the deadline passed
(partial evidence is fine: the analyzer says what it can), writes the dumps as JSON files, runs
the flight-recorder analyzer on them and joins the culprit ranks with their GPUs' findings.

Payloads are only ever parsed as JSON (``json.loads``) and written back out as JSON: nothing an
agent sends is executed or unpickled.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuhealth.proto import gpuhealth_v1_pb2 as pb

if TYPE_CHECKING:
    from gpuhealth.coordinator.jobs import JobState
    from gpuhealth.coordinator.service import Coordinator

RANK_LEVEL_PREFIXES = ("collective.", "rank.", "job.")


@dataclass(slots=True)
class RankAnswer:
    node: str
    ok: bool
    payload: Any = None  # parsed JSON
    error: str = ""


# What one request may bring in (all ranks' dumps or stacks together): bounds the coordinator's memory
# when a job is huge or a node misbehaves; past it, ranks are recorded as "budget spent".
MAX_EVIDENCE_BYTES = 2 << 30


@dataclass(eq=False)
class PendingRequest:
    """Answers to one request sent to several agents (one answer per rank, ``final`` per agent)."""

    request_id: int
    kind: int
    job_id: str
    waiting: set[str]
    answers: dict[int, RankAnswer] = field(default_factory=dict)
    node_errors: dict[str, str] = field(default_factory=dict)
    node_answers: dict[str, RankAnswer] = field(default_factory=dict)  # rank -1 answers (diagnostics)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    rank_nodes: dict[int, str] = field(default_factory=dict)  # where each rank runs, when known
    max_bytes: int = MAX_EVIDENCE_BYTES
    bytes_received: int = 0

    def __post_init__(self) -> None:
        if not self.waiting:
            self.done.set()

    def add(self, node: str, msg: pb.RequestResult) -> None:
        if node not in self.waiting:
            return  # an agent we did not ask, or one that already said it was done
        if msg.rank >= 0:
            owner = self.rank_nodes.get(msg.rank)
            if (owner is not None and owner != node) or msg.rank in self.answers:
                return  # another node's rank, or a second answer: a node speaks only for its own ranks, once
            self.bytes_received += len(msg.payload)
            if self.bytes_received > self.max_bytes:
                self.answers[msg.rank] = RankAnswer(node, False, error="evidence budget of this request spent")
                if msg.final:
                    self.node_lost(node)
                return
            answer = RankAnswer(node, msg.ok, error=msg.error[:2000])
            if msg.ok:
                try:
                    answer.payload = json.loads(msg.payload)
                except (ValueError, UnicodeDecodeError) as exc:
                    answer = RankAnswer(node, False, error=f"payload is not JSON: {exc}")
            self.answers[msg.rank] = answer
        elif not msg.ok and msg.error:
            self.node_errors[node] = msg.error[:2000]
        elif msg.ok and msg.payload:
            try:
                self.node_answers[node] = RankAnswer(node, True, payload=json.loads(msg.payload))
            except (ValueError, UnicodeDecodeError) as exc:
                self.node_errors[node] = f"payload is not JSON: {exc}"
        if msg.final:
            self.node_lost(node)

    def node_lost(self, node: str) -> None:
        self.waiting.discard(node)
        if not self.waiting:
            self.done.set()

    async def wait(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.done.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


def safe_name(text: str) -> str:
    """A folder name for a job id that came over the network: readable, never "." / ".." or a path,
    and unique (a hash of the full id, so ids that differ only in replaced characters don't collide)."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", text)[:64].strip("_") or "job"
    return f"{readable}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def run_triage(folder: Path, job: dict[str, Any]) -> dict[str, Any]:
    """The flight-recorder analyzer (``gpuhealth.flightrec.verdict.triage``) on the dumps we got."""
    from gpuhealth.flightrec.verdict import triage

    return dict(triage(str(folder), job=job).to_dict())


def culprit_ranks(report: dict[str, Any]) -> list[int]:
    ranks: list[int] = [int(r) for r in report.get("culprits", []) if isinstance(r, int)]
    for f in report.get("findings", []):
        code = str(f.get("code", ""))
        rank = (f.get("evidence") or {}).get("rank")
        if code.startswith(RANK_LEVEL_PREFIXES) and isinstance(rank, int) and rank not in ranks:
            ranks.append(rank)
    return ranks


async def investigate(
    coord: Coordinator, job: JobState, *, reason: str, hang: Any = None, timeout_s: float | None = None
) -> dict[str, Any]:
    settings = coord.settings
    timeout = timeout_s if timeout_s is not None else settings.evidence_timeout_s
    started = time.monotonic()
    nodes = coord.job_nodes(job)
    agent_timeout = max(1.0, timeout * 0.75)  # agents answer before our own deadline
    owners = {r: p.node for r, p in job.placements.items()}
    fr = coord.send_request(job.job_id, pb.DUMP_FLIGHT_RECORDER, agent_timeout, nodes, rank_nodes=owners)
    st = coord.send_request(job.job_id, pb.CAPTURE_STACKS, agent_timeout, nodes, rank_nodes=owners)
    try:
        await asyncio.gather(fr.wait(timeout), st.wait(timeout))
    finally:
        coord.forget_request(fr.request_id)
        coord.forget_request(st.request_id)

    root = Path(settings.evidence_dir)
    folder = root / safe_name(job.job_id) / f"{int(coord.clock() * 1000)}-{reason}"
    if not folder.resolve().is_relative_to(root.resolve()):  # belt and braces: names come from the network
        raise ValueError(f"evidence folder {folder} is outside {root}")
    dump_dir = folder / "fr"
    # Dumps and stacks show code paths and arguments of the job: readable by the service only.
    dump_dir.mkdir(parents=True, exist_ok=True)
    for d in (Path(settings.evidence_dir), folder.parent, folder, dump_dir):
        d.chmod(0o700)
    dumps: dict[int, str] = {}
    errors: dict[str, str] = {}
    for rank, ans in sorted(fr.answers.items()):
        if ans.ok and isinstance(ans.payload, dict):
            path = dump_dir / f"rank_{rank}.json"
            path.write_text(json.dumps(ans.payload))
            dumps[rank] = str(path)
        else:
            errors[f"fr/{rank}"] = ans.error or "not a JSON object"
    stacks: dict[int, Any] = {}
    for rank, ans in sorted(st.answers.items()):
        if ans.ok:
            stacks[rank] = ans.payload
        else:
            errors[f"stacks/{rank}"] = ans.error
    for node, err in {**fr.node_errors, **st.node_errors}.items():
        errors[f"node/{node}"] = err
    (folder / "stacks.json").write_text(json.dumps({str(r): s for r, s in stacks.items()}))

    try:
        job_info = {"job_id": job.job_id, "world_size": job.world_size or None}
        report = await asyncio.to_thread(run_triage, dump_dir, {k: v for k, v in job_info.items() if v})
    except Exception as exc:  # the analyzer's own bugs must not lose the evidence we gathered
        report = {"verdict": "incomplete", "findings": [], "ranks_seen": sorted(dumps),
                  "ranks_missing": [], "groups": [], "culprits": [], "error": f"triage failed: {exc}"}

    ranks = culprit_ranks(report)
    if not ranks and reason == "hang":
        # No rank-level FR finding: fall back to the ranks whose progress is behind the others'.
        behind = job.slowest_ranks()
        if len(behind) < max(1, len(job.last_step)):
            ranks = behind
    culprits = [coord.culprit(job, r) for r in ranks]
    report["culprits"] = ranks
    for c in culprits:
        c["stack"] = stacks.get(c["rank"])
    expected = sorted(job.placements) or sorted(job.last_step)
    missing = [r for r in expected if r not in dumps]
    summary_who = "; ".join(c["line"] for c in culprits) or "culprit not determined from the evidence"
    doc: dict[str, Any] = {
        **report,
        "job_id": job.job_id,
        "reason": reason,
        "culprit_details": culprits,
        "summary": f"{_label(reason, str(report.get('verdict', '?')))}: {summary_who}",
        "evidence": {
            "dir": str(folder), "fr_dumps": {str(r): p for r, p in dumps.items()},
            "stacks_ranks": sorted(stacks), "fr_missing_ranks": missing, "errors": errors,
            "collect_seconds": round(time.monotonic() - started, 3), "agents_asked": sorted(nodes),
        },
        "stacks": {str(r): s for r, s in stacks.items()},
        "created_at": coord.clock(),
    }
    if hang is not None:
        doc["hang"] = {"stalled_s": round(hang.stalled_s, 3), "threshold_s": round(hang.threshold_s, 3),
                       "typical_step_s": hang.typical_step_s, "last_step": hang.last_step}
    return doc


def sdc_digests_of(result: Any) -> list[tuple[str, str, str]]:
    """(gpu_uuid, key, digest) from a ``gpuhealth diag sdc --json`` document: one vote per device
    and case, keyed by the run's golden key id (GPU model, SM count, library versions, flags)."""
    out: list[tuple[str, str, str]] = []
    if not isinstance(result, dict) or result.get("diag") != "sdc":
        return out
    res = result.get("result") or {}
    key_id = res.get("key_id") if isinstance(res, dict) else None
    if not isinstance(key_id, str) or not key_id:
        return out
    for dev in res.get("devices") or []:
        uuid = dev.get("uuid") if isinstance(dev, dict) else None
        if not isinstance(uuid, str) or not uuid:
            continue
        for case in dev.get("cases") or []:
            if isinstance(case, dict) and isinstance(case.get("digest"), str) and isinstance(case.get("case"), str):
                out.append((uuid, f"{key_id}/{case['case']}", case["digest"]))
    return out


def _label(reason: str, verdict: str) -> str:
    """"hang" when an investigation of a hang finds one; else what it found and why it looked."""
    return verdict if verdict == reason else f"{verdict} (looked because: {reason.replace('_', ' ')})"
