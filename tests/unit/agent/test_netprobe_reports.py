"""POST /fabric on the agent: the fabric probe's word about this node, validated; findings made by the agent."""

from __future__ import annotations

from typing import Any

import pytest

from gpuhealth.agent.netprobe import KEEP_S, NetprobeReports, ProbeReportError, parse_report


class _Agent:
    node_name = "n5"

    def __init__(self) -> None:
        self.published: list[Any] = []

    def publish_findings(self, source: str, findings: Any, *, interval_s: float) -> None:
        self.published.append((source, list(findings)))


def _ext(clock: list[float]) -> tuple[NetprobeReports, _Agent]:
    ext = NetprobeReports(clock=lambda: clock[0])
    agent = _Agent()
    ext.start(agent)  # type: ignore[arg-type]
    return ext, agent


def test_a_slow_node_report_becomes_this_nodes_findings_and_metrics() -> None:
    clock = [1000.0]
    ext, agent = _ext(clock)
    code, body = ext.http_fabric("POST", {"name": "n5", "verdict": "node_slow", "send_ratio": "0.01",
                                          "recv_ratio": "0.02", "slow_to": "n1", "nodes": "8"}, "127.0.0.1")
    assert code == 200 and body["findings"] == ["netprobe.node_slow", "netprobe.link_slow"]
    (source, findings), = agent.published
    assert source == "netprobe" and [f.entity.id for f in findings] == ["n5", "n5->n1"]
    samples = {(s.name, dict(s.labels).get("direction")): s.value for s in ext.samples()}
    assert samples[("netprobe_bandwidth_ratio", "send")] == 0.01 and samples[("netprobe_slow", None)] == 1.0
    clock[0] += KEEP_S + 1
    assert ext.samples() == []  # a day later the word has lapsed


@pytest.mark.parametrize("query,why", [
    ({"name": "n6", "verdict": "ok"}, "must be this node"),  # about another node: not taken
    ({"name": "n5", "verdict": "drain"}, "verdict must be"),
    ({"name": "n5", "verdict": "ok", "send_ratio": "nan"}, "out of range"),
    ({"name": "n5", "verdict": "ok", "slow_to": "n1,<script>"}, "slow_to"),
    ({"name": "n5/../x y", "verdict": "ok"}, "must be this node"),
])
def test_bad_reports_are_refused_in_one_line(query: dict[str, str], why: str) -> None:
    with pytest.raises(ProbeReportError, match=why):
        parse_report(query, "n5", 0.0)
    ext, agent = _ext([0.0])
    code, body = ext.http_fabric("POST", query, "127.0.0.1")
    assert code == 400 and why.split()[0] in body["error"] and agent.published == []


def test_only_this_node_may_post() -> None:
    ext, agent = _ext([0.0])
    code, _ = ext.http_fabric("POST", {"name": "n5", "verdict": "node_slow"}, "10.0.0.7")
    assert code == 403 and agent.published == []
