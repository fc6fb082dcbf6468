"""The fabric probe's verdict about this node, handed to its agent: ``POST /fabric`` (loopback only).

Each rank of ``gpuhealth diag fabric --agent URL`` tells its own node's agent what the probe concluded about
that node (or its rail): numbers and one word in the query string, never free text. The agent makes the
``netprobe.*`` findings itself — so they go up the coordinator stream as this node's findings like any
collector's, onto ``gpuhealth fleet`` — and serves the node's summary on ``/metrics`` (one series per
rail: bounded). A later probe replaces an earlier one; findings are dropped after ``KEEP_S``.

Query: ``name`` (this node, or ``node/rail``), ``verdict`` (ok | node_slow | nic_send_slow | nic_recv_slow |
not_judged), ``send_ratio``, ``recv_ratio`` (median bandwidth / the probe's reference), ``slow_to`` (comma
list of peers this node sends to slowly on a named link), ``reference_gbps``, ``nodes`` (probe size).
"""

from __future__ import annotations

import ipaddress
import math
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from gpuhealth.agent.view import AgentView
from gpuhealth.model import Action, Entity, EntityKind, Finding, Sample, Severity

KEEP_S = 24 * 3600.0  # a probe's word holds until the next probe, at most a day
MAX_RAILS = 16
MAX_LINKS = 64
VERDICTS = {"ok": None, "not_judged": "netprobe.unjudged", "node_slow": "netprobe.node_slow",
            "nic_send_slow": "netprobe.nic_send_slow", "nic_recv_slow": "netprobe.nic_recv_slow"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/#-]{0,127}$")
SOURCE = "netprobe"


def is_loopback(host: str) -> bool:
    """A client on this node. A dual-stack listener ([::]:9502) sees a local IPv4 client as ::ffff:127.0.0.1,
    which Python 3.11 does not call loopback."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


class ProbeReportError(ValueError):
    """A report the agent refuses (one line back to the caller)."""


def _ratio(query: Mapping[str, str], key: str) -> float | None:
    text = query.get(key)
    if text in (None, ""):
        return None
    try:
        v = float(text)
    except ValueError as exc:
        raise ProbeReportError(f"{key} must be a number") from exc
    if not math.isfinite(v) or not 0.0 <= v <= 1000.0:
        raise ProbeReportError(f"{key} out of range")
    return v


def parse_report(query: Mapping[str, str], node: str, now: float) -> dict[str, Any]:
    """A validated report about ``node`` (or one of its rails), or ``ProbeReportError``."""
    name = query.get("name", "")
    if not _NAME.match(name) or not (name == node or name.startswith(node + "/")):
        raise ProbeReportError(f"name must be this node ({node!r}) or {node}/<rail>")
    verdict = query.get("verdict", "")
    if verdict not in VERDICTS:
        raise ProbeReportError(f"verdict must be one of {', '.join(VERDICTS)}")
    slow_to = [p for p in query.get("slow_to", "").split(",") if p]
    if len(slow_to) > MAX_LINKS or not all(_NAME.match(p) for p in slow_to):
        raise ProbeReportError(f"slow_to: at most {MAX_LINKS} node names")
    nodes = query.get("nodes", "0")
    if not nodes.isdigit() or int(nodes) > 1_000_000:
        raise ProbeReportError("nodes must be a count")
    return {"name": name, "verdict": verdict, "send_ratio": _ratio(query, "send_ratio"),
            "recv_ratio": _ratio(query, "recv_ratio"), "reference_gbps": _ratio(query, "reference_gbps"),
            "slow_to": slow_to, "nodes": int(nodes), "at": now}


def findings_of(report: Mapping[str, Any]) -> list[Finding]:
    name, verdict = report["name"], report["verdict"]
    ratios = f"send {report['send_ratio']}×, receive {report['recv_ratio']}× the probe's reference"
    ev = {k: report[k] for k in ("send_ratio", "recv_ratio", "reference_gbps", "nodes", "at")}
    out = []
    code = VERDICTS[verdict]
    if code == "netprobe.unjudged":
        out.append(Finding(code, Severity.INFO, Entity(EntityKind.NODE, name),
                           f"fabric probe: {name} not judged (too few peers measured)", Action.NONE, ev, SOURCE))
    elif code is not None:
        what = {"node_slow": "sends and receives", "nic_send_slow": "sends", "nic_recv_slow": "receives"}[verdict]
        out.append(Finding(code, Severity.WARNING, Entity(EntityKind.NODE, name),
                           f"fabric probe: {name}'s {what} are slow against its peers ({ratios})", Action.MONITOR,
                           ev, SOURCE))
    for peer in report["slow_to"]:
        out.append(Finding("netprobe.link_slow", Severity.WARNING, Entity(EntityKind.LINK, f"{name}->{peer}"),
                           f"fabric probe: {name} → {peer} is slow while neither node is slow with its other peers",
                           Action.MONITOR, {**ev, "src": name, "dst": peer}, SOURCE))
    return out


class NetprobeReports:
    """Agent extension: routes ``/fabric``, publishes the latest probe's findings, serves its numbers."""

    name = SOURCE

    def __init__(self, clock: Any = time.time) -> None:
        self.clock = clock
        self.agent: AgentView | None = None
        self._lock = threading.Lock()
        self._reports: dict[str, dict[str, Any]] = {}

    def start(self, agent: AgentView) -> None:
        self.agent = agent
        http = getattr(agent, "http", None)
        if http is not None and hasattr(http, "route"):
            http.route("/fabric", self.http_fabric)

    def stop(self) -> None:
        pass

    def _current(self) -> list[dict[str, Any]]:
        now = self.clock()
        with self._lock:
            for k in [k for k, r in self._reports.items() if now - r["at"] > KEEP_S]:
                del self._reports[k]
            return list(self._reports.values())

    def http_fabric(self, method: str, query: Mapping[str, str], client: str) -> tuple[int, dict[str, Any]]:
        if method == "GET":
            return 200, {"reports": self._current()}
        if not is_loopback(client):
            return 403, {"error": "POST /fabric is taken from this node only (a loopback address)"}
        if self.agent is None:
            return 503, {"error": "the agent has not started"}
        try:
            report = parse_report(query, self.agent.node_name, self.clock())
        except ProbeReportError as exc:
            return 400, {"error": str(exc)}
        with self._lock:
            if report["name"] not in self._reports and len(self._reports) >= MAX_RAILS:
                return 429, {"error": f"at most {MAX_RAILS} rails per node"}
            self._reports[report["name"]] = report
        findings = [f for r in self._current() for f in findings_of(r)]
        self.agent.publish_findings(SOURCE, findings, interval_s=KEEP_S)
        return 200, {"accepted": True, "findings": [f.code for f in findings_of(report)]}

    def samples(self) -> list[Sample]:
        out: list[Sample] = []
        for r in self._current():
            labels = (("probe_name", r["name"]),)
            for key, direction in (("send_ratio", "send"), ("recv_ratio", "receive")):
                if r[key] is not None:
                    out.append(Sample("netprobe_bandwidth_ratio", float(r[key]),
                                      "The fabric probe's median bandwidth of this node (or rail) against the "
                                      "probe's reference, by direction (1: like the fleet).",
                                      labels=(*labels, ("direction", direction))))
            out.append(Sample("netprobe_slow", 0.0 if r["verdict"] in ("ok", "not_judged") else 1.0,
                              "1 when the last fabric probe named this node (or rail) slow.", labels=labels))
            out.append(Sample("netprobe_last_timestamp_seconds", float(r["at"]),
                              "When the last fabric probe reported about this node (or rail).", labels=labels))
        return out


__all__ = ["KEEP_S", "NetprobeReports", "ProbeReportError", "findings_of", "is_loopback", "parse_report"]
