"""Requests the coordinator sends down to agents, and the answers it collects (one per rank, or one per
node for a diagnostic). Pure bookkeeping: the service pushes the requests and feeds answers in.

Flight-recorder dumps are kept as the bytes the agent sent (JSON from a rank's hook, NCCL's pickle from a
discovered rank), never parsed here (a 30 MiB dump parsed on the loop stalled every stream for half a
second; the analyser reads them once, in its own capped process). With ``spool_dir`` set, each goes to a
file there as it arrives, so the coordinator holds one message at a time, not a whole job's dumps (the
request's budget, ``MAX_EVIDENCE_BYTES``, is then disk, not memory). Stacks and diagnostic results are
small and parsed here.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.proto import gpuhealth_v1_pb2 as pb

# What one request may bring in (all ranks' dumps or stacks together): bounds the coordinator's memory
# when a job is huge or a node misbehaves; past it, ranks are recorded as "budget spent".
MAX_EVIDENCE_BYTES = 2 << 30
# Answers kept as bytes, unparsed (the analyser reads them once).
RAW_KINDS = frozenset({pb.DUMP_FLIGHT_RECORDER})


@dataclass(slots=True)
class RankAnswer:
    node: str
    ok: bool
    payload: Any = None  # parsed JSON (stacks, diagnostics)
    error: str = ""
    raw: bytes = b""  # the payload as sent (flight-recorder dumps), when not spooled
    format: str = ""  # fr_json | fr_pickle (a discovered rank's own NCCL dump)
    path: str = ""  # where the payload was spooled (PendingRequest.spool_dir), instead of ``raw``


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
    spool_dir: Path | None = None  # dumps go to files here as they arrive (None: kept in memory)

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
            if msg.ok and self.kind in RAW_KINDS:
                payload, answer.format = msg.payload, msg.format or "fr_json"
                if answer.format == "fr_pickle":
                    # kept as bytes; only the analyser's plain-data unpickler reads it (no global is loaded)
                    if payload[:1] != b"\x80" or payload[-1:] != b".":
                        answer = RankAnswer(node, False, error="payload is not a complete pickle")
                elif answer.format != "fr_json" or payload.lstrip()[:1] != b"{":
                    answer = RankAnswer(node, False, error="payload is not a JSON object")
                if answer.ok:
                    answer = self._keep(answer, msg.rank, payload)
            elif msg.ok:
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

    def _keep(self, answer: RankAnswer, rank: int, payload: bytes) -> RankAnswer:
        """The dump in a file of ``spool_dir`` (readable by the service only), else as bytes in memory."""
        if self.spool_dir is None:
            answer.raw = bytes(payload)
            return answer
        path = self.spool_dir / f"rank_{rank}.{'pkl' if answer.format == 'fr_pickle' else 'json'}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
        except OSError as exc:
            return RankAnswer(answer.node, False, error=f"cannot keep the dump: {exc.strerror or exc}")
        answer.path = str(path)
        return answer

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
