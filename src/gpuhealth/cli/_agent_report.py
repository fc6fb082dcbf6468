"""Ask the running agent for its node report (``GET /health``), for the commands a scheduler runs.

A one-shot ``status`` sweeps once: it has no history (rates: NVLink CRC growth, SBE and PCIe-replay
rates) and no XID ledger (an XID that came and went). The agent has both. So the Slurm health
check, prolog and the node-problem-detector plugin ask the agent first, with a short timeout, and
fall back to a one-shot sweep only when it does not answer — saying so in the report.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from gpuhealth.model import Finding, Health, Severity


class AgentUnreachable(Exception):
    """The agent did not answer, or not with a node report; the message says which."""


@dataclass(frozen=True, slots=True)
class AgentReport:
    url: str
    doc: dict[str, Any]

    @property
    def health(self) -> Health:
        text = str(self.doc["node"].get("health", "unknown"))
        return {str(h): h for h in Health}.get(text, Health.UNKNOWN)

    def findings(self) -> list[Finding]:
        out = [Finding.from_dict(f) for f in self.doc.get("findings", [])]
        for gpu in self.doc.get("gpus", []):
            out += [Finding.from_dict(f) for f in gpu.get("findings", [])]
        return out


def health_url(agent: str) -> str:
    """``http://host:port`` (or ``host:port``) → its ``/health`` URL."""
    base = agent if "://" in agent else f"http://{agent}"
    return base.rstrip("/") + "/health" if not base.rstrip("/").endswith("/health") else base


def fetch_agent_report(agent: str, timeout_s: float) -> AgentReport:
    url = health_url(agent)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read(64 << 20)
    except urllib.error.HTTPError as exc:
        raise AgentUnreachable(f"{url} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AgentUnreachable(f"{url}: {reason}") from exc
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict) or not isinstance(doc.get("node"), dict):
            raise ValueError("no node report in the answer")
        report = AgentReport(url, doc)
        report.findings()  # every finding must parse, or the answer is not a report we can judge
    except (ValueError, KeyError, TypeError) as exc:
        raise AgentUnreachable(f"{url} did not answer with a node report: {exc}") from exc
    return report


def one_line_of(health: Health, findings: list[Finding]) -> str:
    """"gpuhealth: unhealthy: GPU 3 pcie.link_degraded (drain); …" — for monitors that keep one line."""
    problems = [f for f in findings if f.severity >= Severity.WARNING]
    if not problems:
        return f"gpuhealth: {health}: no GPU problem found"
    problems.sort(key=lambda f: (-int(f.severity), f.entity.gpu_index if f.entity.gpu_index is not None else -1))
    parts = [(f"GPU {f.entity.gpu_index} " if f.entity.gpu_index is not None else "") + f"{f.code} ({f.action})"
             for f in problems]
    return f"gpuhealth: {health}: " + "; ".join(parts)


__all__ = ["AgentReport", "AgentUnreachable", "fetch_agent_report", "health_url", "one_line_of"]
