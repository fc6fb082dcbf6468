"""The Grafana dashboard: generated from its builder, well formed (unique ids, panels that do not
overlap, every query on the dashboard's data-source variable), templated by node and GPU, and it
has the sections users look for. Queries are run against a real Prometheus in
tests/integration/test_deploy_metrics.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
GRAFANA = REPO / "deploy" / "grafana"


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GRAFANA / "gpuhealth.json").read_text())
    return data


def test_json_is_what_the_builder_makes() -> None:
    result = subprocess.run([sys.executable, str(GRAFANA / "build_dashboard.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_panels_are_well_formed_and_do_not_overlap() -> None:
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
        if p["type"] != "row":
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert t["expr"].strip()


def test_templated_by_node_and_gpu() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert "gpuhealth_gpu_info" in variables["instance"]["definition"]
    assert '$instance' in variables["gpu"]["definition"]
    per_gpu = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", []) if 'gpu=~"$gpu"' in t["expr"]]
    assert len(per_gpu) >= 10


def test_has_the_sections_users_look_for() -> None:
    rows = [p["title"] for p in dashboard()["panels"] if p["type"] == "row"]
    assert rows == ["Fleet overview", "GPUs of $instance", "NICs and the fabric probe of $instance", "Findings",
                    "Collective bandwidth and diagnostics", "Stragglers and hangs", "gpuhealth agent"]
    titles = {p["title"] for p in dashboard()["panels"]}
    assert {"SDC check results", "Bandwidth probes below threshold", "Straggler score by rank",
            "Seconds since progress", "Active findings", "InfiniBand/RoCE port width", "port_xmit_wait (rate)",
            "Ethernet speed", "Link flaps (carrier changes / 5 min)", "Fabric probe: bandwidth against the fleet",
            "Fabric probe findings"} <= titles


def test_gpu_health_timeline_job_filter_and_the_agents_driver_columns() -> None:
    panels = {p["title"]: p for p in dashboard()["panels"]}
    timeline = panels["GPU health over time"]
    assert timeline["type"] == "state-timeline"
    assert 'gpuhealth_gpu_health{' in timeline["targets"][0]["expr"]
    mapped = timeline["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {k: v["text"] for k, v in mapped.items()} == {"0": "healthy", "1": "degraded", "2": "unhealthy",
                                                         "3": "unknown"}
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert "job_id" in variables["job"]["definition"] and variables["job"]["allValue"] == ".*"
    coordinator = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])
                   if "gpuhealth_coordinator_job" in t["expr"] or "straggler_score" in t["expr"]]
    assert coordinator and all('job_id=~"$job"' in e for e in coordinator)
    # the agents table groups by the labels gpuhealth_driver_info really has
    from gpuhealth.catalog.metrics import metric_families

    info_labels = set(metric_families()["gpuhealth_driver_info"].labels)
    agents = panels["Agents: version, driver, NVML"]["targets"][0]["expr"]
    grouped = agents.split("group_left (", 1)[1].split(")", 1)[0]
    assert {g.strip() for g in grouped.split(",")} <= info_labels, (grouped, info_labels)


# The labels the agent puts on a GPU series for whoever holds the GPU now: they change with every job (issue 32).
HOLDER_LABELS = {"namespace", "pod", "container", "slurm_job_id", "hpc_job"}


def _keeps_holders(expr: str) -> bool:
    """Whether the outermost aggregation of ``expr`` leaves a holder label on its result."""
    head = expr.strip()
    without = re.match(r"(?:max|sum|min|avg|count) without \(([^)]*)\)", head)
    if without:
        return not {label.strip() for label in without.group(1).split(",")} >= HOLDER_LABELS
    by = re.match(r"(?:count\()?(?:max|sum|min|avg|count) by \(([^)]*)\)", head)
    if by:
        return bool({label.strip() for label in by.group(1).split(",")} & HOLDER_LABELS)
    return True


def test_per_gpu_graphs_are_one_line_per_gpu_across_job_changes() -> None:
    """A graph of a GPU series aggregates the holder labels away: otherwise a job starting or ending on the GPU
    starts a new line (and a rate over the change loses its count), as a new job restarted the alerts."""
    checked = 0
    for panel in dashboard()["panels"]:
        if panel["type"] not in ("timeseries", "state-timeline"):
            continue
        for t in panel["targets"]:
            if 'gpu=~"$gpu"' in t["expr"] or "gpuhealth_gpu_health" in t["expr"]:
                checked += 1
                assert not _keeps_holders(t["expr"]), (panel["title"], t["expr"])
    assert checked >= 15
