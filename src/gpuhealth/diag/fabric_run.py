"""``gpuhealth diag fabric``: start the probe's child (torch-free here) and read its one document.

Locally the child launches ``--ranks`` Gloo ranks on this host; with ``--from-env`` this process is one
rank of a multi-node probe (torchrun or srun set RANK, WORLD_SIZE, MASTER_ADDR/PORT) and its child
inherits that environment; only rank 0 prints a document.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from gpuhealth.diag.runner import DiagOutcome
from gpuhealth.model import Finding


class FabricRunError(RuntimeError):
    """The probe could not run or said nothing readable: one line for the user."""


@dataclass(frozen=True)
class FabricRequest:
    """What ``gpuhealth diag fabric`` was asked (the child's options, see ``diag/child.py``)."""

    from_env: bool = False
    ranks: int = 4
    node: str = "node"
    schedule: str = "full"
    size_bytes: int = 4 << 20
    iters: int = 3
    backend: str | None = None
    slow_fraction: float = 0.6
    latency_floor_us: float = 500.0
    heatmap: str | None = None
    out: str | None = None
    timeout_s: float = 600.0
    agent_url: str | None = None  # tell this node's agent what the probe concluded about it (POST /fabric)


def child_args(r: FabricRequest) -> list[str]:
    args = ["fabric", "--node", r.node, "--schedule", r.schedule, "--size-bytes", str(r.size_bytes),
            "--iters", str(r.iters), "--slow-fraction", str(r.slow_fraction),
            "--latency-floor-us", str(r.latency_floor_us), "--rank-timeout", str(r.timeout_s)]
    args += ["--from-env", "--every-rank"] if r.from_env else ["--world", str(r.ranks), "--backend", "gloo"]
    if r.backend and r.from_env:
        args += ["--backend", r.backend]
    if r.heatmap:
        args += ["--heatmap", os.path.abspath(r.heatmap)]
    if r.out:
        args += ["--out", os.path.abspath(r.out)]
    return args


def run_fabric(r: FabricRequest) -> DiagOutcome | None:
    """The outcome on rank 0 (or a local run); None on the other ranks of a multi-node probe."""
    if r.from_env:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise FabricRunError(f"--from-env needs {', '.join(missing)} in the environment "
                                 "(run it under torchrun, or srun with them exported)")
    cmd = [sys.executable, "-m", "gpuhealth.diag", *child_args(r)]
    timeout_s, from_env = r.timeout_s, r.from_env
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=timeout_s + 60, env={**os.environ, "GPUHEALTH_DIAG_PARENT_PID": str(os.getpid())})
    except subprocess.TimeoutExpired as exc:
        raise FabricRunError(f"the fabric probe did not finish within {timeout_s:.0f} s") from exc
    text = proc.stdout.strip()
    if not text:
        if from_env and os.environ.get("RANK") != "0" and proc.returncode == 0:
            return None
        raise FabricRunError(f"the fabric probe printed nothing (exit {proc.returncode}): "
                             f"{proc.stderr.strip()[-400:]}")
    try:
        doc = json.loads(text.splitlines()[-1])
    except json.JSONDecodeError as exc:
        raise FabricRunError(f"the fabric probe printed no result: {text[-300:]!r}") from exc
    if r.agent_url and doc.get("status") == "ok":
        report_to_agent(r.agent_url, doc, r.node)
    if from_env and (doc.get("result") or {}).get("rank", 0) != 0:
        return None
    return DiagOutcome(doc.get("diag", "fabric"), doc.get("status", "failed"), doc.get("reason", ""),
                       [Finding.from_dict(f) for f in doc.get("findings", [])], doc.get("result", {}),
                       wall_s=float(doc.get("wall_s") or 0.0))


def node_reports(doc: dict[str, Any], node: str) -> list[dict[str, str]]:
    """The query of ``POST /fabric`` for each probe name of ``node`` (the node, or its rails ``node/N``)."""
    result = doc.get("result") or {}
    verdict = result.get("verdict") or {}
    names = (result.get("measurements") or {}).get("names") or []
    ref = verdict.get("reference_bytes_per_second")
    out = []
    for name in names:
        if name != node and not name.startswith(node + "/"):
            continue
        per = (verdict.get("per_node") or {}).get(name) or {}
        word = (verdict.get("nodes") or {}).get(name) or ("not_judged" if name in (verdict.get("not_judged") or {})
                                                          else "ok")
        slow_to = [link["dst"] for link in verdict.get("links") or [] if link.get("src") == name]
        q = {"name": name, "verdict": word, "nodes": str(len(names)), "slow_to": ",".join(slow_to)}
        for key in ("send_ratio", "recv_ratio"):
            if per.get(key) is not None:
                q[key] = str(per[key])
        if ref:
            q["reference_gbps"] = str(round(ref * 8 / 1e9, 4))
        out.append(q)
    return out


def report_to_agent(agent_url: str, doc: dict[str, Any], node: str) -> None:
    """POST this node's part of the verdict to its agent; a refusal is one line on stderr, never fatal."""
    for q in node_reports(doc, node):
        url = agent_url.rstrip("/") + "/fabric?" + urllib.parse.urlencode(q)
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as exc:
            print(f"gpuhealth diag fabric: the agent at {agent_url} did not take the report for {q['name']}: {exc}",
                  file=sys.stderr)


__all__ = ["FabricRequest", "FabricRunError", "child_args", "node_reports", "report_to_agent", "run_fabric"]
