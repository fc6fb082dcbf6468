#!/usr/bin/env python3
"""Build deploy/grafana/gpuhealth.json, the gpuhealth Grafana dashboard. The JSON is the artifact
users import; this script is how it is edited (a test checks they match, and another runs every
query against a real Prometheus scraping a running agent and coordinator).

    python deploy/grafana/build_dashboard.py          # rewrite gpuhealth.json and the Helm chart's copy
    python deploy/grafana/build_dashboard.py --check  # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TARGET = Path(__file__).resolve().parent / "gpuhealth.json"
# The Helm chart cannot read files outside itself: its Grafana dashboard ConfigMap carries a copy, made here.
CHART_COPY = TARGET.parents[1] / "helm" / "gpuhealth" / "files" / "gpuhealth.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
N = 'instance=~"$instance"'
NG = 'instance=~"$instance", gpu=~"$gpu"'
# The labels a GPU series carries for whoever holds the GPU now (pod, Slurm job): they change with every
# job, so a per-GPU graph drops them (one line per GPU across jobs, not one per job), as the alerts do.
HOLDERS = "namespace, pod, container, slurm_job_id, hpc_job"


def per_gpu(expr):
    """A GPU gauge, one series per GPU (and its own labels: sensor, which, reason…) across job changes."""
    return f"max without ({HOLDERS}) ({expr})"


def per_gpu_rate(expr):
    """The rate of a GPU counter across job changes: each holder's series counts its own part."""
    return f"sum without ({HOLDERS}) (rate({expr}[5m]))"


panels: list[dict[str, Any]] = []
pid = [0]
y = [0]


def nid():
    pid[0] += 1
    return pid[0]


def row(title):
    panels.append(
        {
            "type": "row",
            "title": title,
            "id": nid(),
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y[0]},
            "panels": [],
        }
    )
    y[0] += 1


def place(w, h, x):
    return {"h": h, "w": w, "x": x, "y": y[0]}


def target(expr, legend="", instant=False, fmt="time_series", ref="A"):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t["instant"] = True
        t["range"] = False
    if fmt != "time_series":
        t["format"] = fmt
    return t


def stat(title, expr, x, w=4, h=4, unit="none", thresholds=None, desc=""):
    steps = thresholds or [{"color": "green", "value": None}]
    panels.append(
        {
            "type": "stat",
            "title": title,
            "id": nid(),
            "datasource": DS,
            "description": desc,
            "gridPos": place(w, h, x),
            "targets": [target(expr, instant=True)],
            "fieldConfig": {
                "defaults": {
                    "unit": unit,
                    "thresholds": {"mode": "absolute", "steps": steps},
                    "color": {"mode": "thresholds"},
                },
                "overrides": [],
            },
            "options": {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "background",
                "graphMode": "none",
                "textMode": "auto",
                "justifyMode": "auto",
                "orientation": "auto",
            },
        }
    )


def ts(title, targets, x, w=12, h=8, unit="none", desc="", stack=False, minv=None):
    defaults = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        },
    }
    if minv is not None:
        defaults["min"] = minv
    panels.append(
        {
            "type": "timeseries",
            "title": title,
            "id": nid(),
            "datasource": DS,
            "description": desc,
            "gridPos": place(w, h, x),
            "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {
                "legend": {
                    "displayMode": "table",
                    "placement": "right",
                    "calcs": ["lastNotNull", "max"],
                    "showLegend": True,
                },
                "tooltip": {"mode": "multi", "sort": "desc"},
            },
        }
    )


def table(title, expr, x, w=24, h=8, desc="", exclude=(), rename=None):
    panels.append(
        {
            "type": "table",
            "title": title,
            "id": nid(),
            "datasource": DS,
            "description": desc,
            "gridPos": place(w, h, x),
            "targets": [target(expr, instant=True, fmt="table")],
            "fieldConfig": {"defaults": {"custom": {"filterable": True}}, "overrides": []},
            "options": {"showHeader": True, "footer": {"show": False, "reducer": ["sum"], "fields": ""}},
            "transformations": [
                {
                    "id": "organize",
                    "options": {
                        "excludeByName": {"Time": True, **{k: True for k in exclude}},
                        "renameByName": rename or {},
                    },
                }
            ],
        }
    )


def next_line(h):
    y[0] += h


HEALTH_MAPPINGS = [
    {
        "type": "value",
        "options": {
            "0": {"text": "healthy", "color": "green", "index": 0},
            "1": {"text": "degraded", "color": "orange", "index": 1},
            "2": {"text": "unhealthy", "color": "red", "index": 2},
            "3": {"text": "unknown", "color": "purple", "index": 3},
        },
    }
]


def state_timeline(title, targets, x, w=24, h=8, desc=""):
    panels.append(
        {
            "type": "state-timeline",
            "title": title,
            "id": nid(),
            "datasource": DS,
            "description": desc,
            "gridPos": place(w, h, x),
            "targets": targets,
            "fieldConfig": {
                "defaults": {
                    "mappings": HEALTH_MAPPINGS,
                    "color": {"mode": "thresholds"},
                    "thresholds": {
                        "mode": "absolute",
                        "steps": [
                            {"color": "green", "value": None},
                            {"color": "orange", "value": 1},
                            {"color": "red", "value": 2},
                            {"color": "purple", "value": 3},
                        ],
                    },
                },
                "overrides": [],
            },
            "options": {
                "showValue": "never",
                "mergeValues": True,
                "rowHeight": 0.9,
                "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
            },
        }
    )


RED = [{"color": "green", "value": None}, {"color": "red", "value": 1}]
ORANGE = [{"color": "green", "value": None}, {"color": "orange", "value": 1}]

# ---------------------------------------------------------------- fleet overview
row("Fleet overview")
stat("Agents up", 'count(up{job="gpuhealth-agent"} == 1)', 0, desc="Agents Prometheus scraped successfully.")
stat(
    "Agents down",
    'count(up{job="gpuhealth-agent"} == 0) or vector(0)',
    4,
    thresholds=RED,
    desc="Agents Prometheus could not scrape (GpuhealthAgentDown).",
)
stat("GPUs", "sum(gpuhealth_gpus)", 8, desc="GPUs the drivers enumerate, all nodes.")
stat("Unhealthy GPUs", "count(max by (instance, uuid) (gpuhealth_gpu_health) == 2) or vector(0)", 12, thresholds=RED)
stat("Degraded GPUs", "count(max by (instance, uuid) (gpuhealth_gpu_health) == 1) or vector(0)", 16, thresholds=ORANGE)
stat("Critical findings", 'sum(gpuhealth_findings{severity="critical"}) or vector(0)', 20, thresholds=RED)
next_line(4)
ts(
    "GPUs by health",
    [
        target("count(max by (instance, uuid) (gpuhealth_gpu_health) == 0) or vector(0)", "healthy", ref="A"),
        target("count(max by (instance, uuid) (gpuhealth_gpu_health) == 1) or vector(0)", "degraded", ref="B"),
        target("count(max by (instance, uuid) (gpuhealth_gpu_health) == 2) or vector(0)", "unhealthy", ref="C"),
        target("count(max by (instance, uuid) (gpuhealth_gpu_health) == 3) or vector(0)", "unknown", ref="D"),
    ],
    0,
    stack=True,
    desc="0 healthy, 1 degraded, 2 unhealthy, 3 unknown (derived from findings).",
)
table(
    "Nodes that are not healthy",
    "max by (instance) (gpuhealth_node_health) > 0",
    12,
    w=12,
    desc="Node health: 1 degraded, 2 unhealthy, 3 unknown.",
    rename={"Value": "health"},
)
next_line(8)
table(
    "Agents: version, driver, NVML",
    # gpuhealth_driver_info's labels are driver, cuda and nvml_version (catalog/metrics.csv)
    "max by (instance, version, simulated) (gpuhealth_build_info)"
    " * on (instance) group_left (driver, cuda, nvml_version)"
    " max by (instance, driver, cuda, nvml_version) (gpuhealth_driver_info)"
    " * on (instance) group_left max by (instance) (gpuhealth_nvml_up)",
    0,
    w=24,
    h=7,
    desc="Version drift shows here: nodes with different driver or agent versions.",
    rename={"Value": "nvml_up"},
)
next_line(7)

# ---------------------------------------------------------------- per-node GPUs
row("GPUs of $instance")
state_timeline(
    "GPU health over time",
    [
        target(
            f'max by (instance, gpu) (gpuhealth_gpu_health{{{NG}, slurm_job_id=~"$job"}})', "{{instance}} GPU {{gpu}}"
        )
    ],
    0,
    desc="Each GPU's health as the agent judged it (healthy, degraded, unhealthy, unknown): when a GPU turned "
    "bad and whether it came back. With a job chosen, the GPUs Slurm gave that job.",
)
next_line(8)
ts(
    "GPU temperature",
    [
        target(per_gpu(f'gpuhealth_gpu_temperature_celsius{{{NG}, sensor="gpu"}}'), "{{instance}} GPU {{gpu}}"),
        target(
            per_gpu(f'gpuhealth_gpu_temperature_celsius{{{NG}, sensor="memory"}}'),
            "{{instance}} GPU {{gpu}} memory",
            ref="B",
        ),
    ],
    0,
    unit="celsius",
)
ts(
    "Power",
    [
        target(per_gpu(f"gpuhealth_gpu_power_watts{{{NG}}}"), "{{instance}} GPU {{gpu}}"),
        target(per_gpu(f"gpuhealth_gpu_power_limit_watts{{{NG}}}"), "{{instance}} GPU {{gpu}} limit", ref="B"),
    ],
    12,
    unit="watt",
)
next_line(8)
ts(
    "SM clock",
    [
        target(per_gpu(f'gpuhealth_gpu_clock_hertz{{{NG}, clock="sm"}}'), "{{instance}} GPU {{gpu}}"),
        target(per_gpu(f'gpuhealth_gpu_clock_max_hertz{{{NG}, clock="sm"}}'), "{{instance}} GPU {{gpu}} max", ref="B"),
    ],
    0,
    unit="hertz",
)
ts(
    "Utilization",
    [
        target(per_gpu(f"gpuhealth_gpu_utilization_ratio{{{NG}}}"), "{{instance}} GPU {{gpu}} SM"),
        target(per_gpu(f"gpuhealth_gpu_memory_utilization_ratio{{{NG}}}"), "{{instance}} GPU {{gpu}} memory", ref="B"),
    ],
    12,
    unit="percentunit",
    minv=0,
)
next_line(8)
ts(
    "Memory used",
    [target(per_gpu(f"gpuhealth_gpu_memory_used_bytes{{{NG}}}"), "{{instance}} GPU {{gpu}}")],
    0,
    unit="bytes",
)
ts(
    "Active throttle reasons",
    [
        target(
            per_gpu(
                f'gpuhealth_gpu_throttle_reason_active{{{NG}, reason!~"gpu_idle|applications_clocks|display_clocks"}}'
            )
            + " == 1",
            "{{instance}} GPU {{gpu}} {{reason}}",
        )
    ],
    12,
    desc="Clock event reasons that cost performance (idle and application clocks are hidden).",
)
next_line(8)
ts(
    "ECC errors (rate)",
    [
        target(
            per_gpu_rate(f'gpuhealth_gpu_ecc_errors_total{{{NG}, scope="volatile"}}'),
            "{{instance}} GPU {{gpu}} {{type}}",
        )
    ],
    0,
    unit="ops",
)
ts(
    "Row remapping",
    [
        target(per_gpu(f"gpuhealth_gpu_row_remap_pending{{{NG}}}"), "{{instance}} GPU {{gpu}} pending"),
        target(per_gpu(f"gpuhealth_gpu_row_remap_failed{{{NG}}}"), "{{instance}} GPU {{gpu}} failed", ref="B"),
        target(per_gpu(f"gpuhealth_gpu_remapped_rows{{{NG}}}"), "{{instance}} GPU {{gpu}} remapped {{cause}}", ref="C"),
    ],
    12,
)
next_line(8)
ts(
    "NVLink errors (rate)",
    [
        target(
            f"sum by (instance, gpu, counter) (rate(gpuhealth_gpu_nvlink_errors_total{{{NG}}}[5m]))",
            "{{instance}} GPU {{gpu}} {{counter}}",
        )
    ],
    0,
    unit="ops",
)
ts(
    "NVLinks active / expected",
    [target(per_gpu(f"gpuhealth_gpu_nvlink_links{{{NG}}}"), "{{instance}} GPU {{gpu}} {{which}}")],
    12,
)
next_line(8)
ts(
    "PCIe link width",
    [target(per_gpu(f"gpuhealth_gpu_pcie_link_width{{{NG}}}"), "{{instance}} GPU {{gpu}} {{which}}")],
    0,
    w=8,
)
ts(
    "PCIe link generation",
    [target(per_gpu(f"gpuhealth_gpu_pcie_link_generation{{{NG}}}"), "{{instance}} GPU {{gpu}} {{which}}")],
    8,
    w=8,
)
ts(
    "PCIe replays (rate)",
    [target(per_gpu_rate(f"gpuhealth_gpu_pcie_replay_total{{{NG}}}"), "{{instance}} GPU {{gpu}}")],
    16,
    w=8,
    unit="ops",
)
next_line(8)
table(
    "GPU inventory",
    f"gpuhealth_gpu_info{{{N}}} * on (instance, uuid) group_left gpuhealth_gpu_health",
    0,
    h=7,
    exclude=("__name__", "job"),
    rename={"Value": "health"},
)
next_line(7)

# ---------------------------------------------------------------- NICs and the fabric probe (issue 31)
row("NICs and the fabric probe of $instance")
ts("InfiniBand/RoCE port rate", [target(f"gpuhealth_ib_port_rate_bits_per_second{{{N}}}",
                                        "{{instance}} {{device}}/{{port}}")], 0, w=8, unit="bps",
   desc="A port below its peers of the same HCA model trained down (ib.link_degraded).")
ts("InfiniBand/RoCE port width", [target(f"gpuhealth_ib_port_width{{{N}}}", "{{instance}} {{device}}/{{port}}")],
   8, w=8)
ts("port_xmit_wait (rate)", [target(f"rate(gpuhealth_ib_port_xmit_wait_total{{{N}}}[5m])",
                                    "{{instance}} {{device}}/{{port}}")], 16, w=8, unit="ops",
   desc="Ticks with data to send and no credits: compare a port with its peers (ib.congestion).")
next_line(8)
ts("Ethernet speed", [target(f"gpuhealth_net_speed_bits_per_second{{{N}}}", "{{instance}} {{interface}}")], 0, w=8,
   unit="bps")
ts("Link flaps (carrier changes / 5 min)", [target(f"increase(gpuhealth_net_carrier_changes_total{{{N}}}[5m])",
                                                   "{{instance}} {{interface}}")], 8, w=8)
ts("NIC errors and drops (rate)", [target(f"rate(gpuhealth_net_errors_total{{{N}}}[5m])",
                                          "{{instance}} {{interface}} {{counter}}")], 16, w=8, unit="ops")
next_line(8)
ts("Fabric probe: bandwidth against the fleet", [target(f"gpuhealth_netprobe_bandwidth_ratio{{{N}}}",
                                                        "{{instance}} {{probe_name}} {{direction}}")], 0, w=12,
   desc="The last gpuhealth diag fabric probe's median bandwidth of the node against the probe's reference; "
        "1 is like the fleet, under 0.6 is slow (netprobe.*).")
table("Fabric probe findings", f'gpuhealth_findings{{{N}, code=~"netprobe\\\\..+|net\\\\..+|ib\\\\..+"}}', 12, w=12,
      h=8, exclude=("__name__", "job", "gpu", "uuid", "pci_bus_id", "model_name"), rename={"Value": "count"})
next_line(8)

# ---------------------------------------------------------------- findings
row("Findings")
table(
    "Active findings",
    f"gpuhealth_findings{{{N}}}",
    0,
    w=24,
    h=9,
    desc="One row per finding: code, severity, suggested action, entity.",
    exclude=("__name__", "job", "pci_bus_id", "model_name"),
    rename={"Value": "count"},
)
next_line(9)
ts(
    "Findings by code",
    [target(f"sum by (code, severity) (gpuhealth_findings{{{N}}})", "{{code}} ({{severity}})")],
    0,
    w=24,
    stack=True,
)
next_line(8)

# ---------------------------------------------------------------- collective bandwidth and diagnostics
row("Collective bandwidth and diagnostics")
table(
    "Bandwidth probes below threshold",
    f'gpuhealth_findings{{{N}, code=~"busbw\\\\..+|bandwidth\\\\..+"}}',
    0,
    w=12,
    h=7,
    exclude=("__name__", "job"),
    rename={"Value": "count"},
    desc="busbw.low (collective bus bandwidth) and bandwidth.low (host<->device copies) from the diagnostics.",
)
table(
    "SDC check results",
    f'gpuhealth_findings{{{N}, code=~"sdc\\\\..+"}}',
    12,
    w=12,
    h=7,
    exclude=("__name__", "job"),
    rename={"Value": "count"},
    desc="Silent data corruption: a GPU whose result differs from the golden hash or its peers.",
)
next_line(7)
ts(
    "Diagnostic findings over time",
    [
        target(
            f'sum by (instance, code) (gpuhealth_findings{{{N}, code=~"busbw\\\\..+|bandwidth\\\\..+|sdc\\\\..+"}})',
            "{{instance}} {{code}}",
        )
    ],
    0,
    desc="Bandwidth and SDC findings per node; a node that keeps coming back is a hardware suspect.",
)
ts(
    "NVLinks active (all nodes)",
    [
        target('sum by (instance) (gpuhealth_gpu_nvlink_links{which="active"})', "{{instance}} active"),
        target('sum by (instance) (gpuhealth_gpu_nvlink_links{which="expected"})', "{{instance}} expected", ref="B"),
    ],
    12,
    desc="Collectives cross NVLink inside a node: fewer active links than expected means lower bus bandwidth.",
)
next_line(8)

# ---------------------------------------------------------------- stragglers and hangs (coordinator)
row("Stragglers and hangs")
J = 'job_id=~"$job"'
stat(
    "Jobs with stragglers",
    f"count(gpuhealth_coordinator_job_stragglers{{{J}}} > 0) or vector(0)",
    0,
    w=6,
    thresholds=ORANGE,
)
stat("Hangs (24h)", "sum(increase(gpuhealth_coordinator_hangs_total[24h])) or vector(0)", 6, w=6, thresholds=RED)
stat("Agents connected", "sum(gpuhealth_coordinator_connected_agents)", 12, w=6)
stat("Step records / s", "sum(rate(gpuhealth_coordinator_step_records_total[5m]))", 18, w=6, unit="ops")
next_line(4)
ts(
    "Straggler score by rank",
    [target(f"gpuhealth_coordinator_straggler_score{{{J}}}", "{{exported_job}}{{job_id}} rank {{rank}}")],
    0,
    desc="Compute time / job median; 1.0 is typical. Only the top ranks are exported.",
)
ts(
    "Seconds since progress",
    [target(f"gpuhealth_coordinator_job_seconds_since_progress{{{J}}}", "{{exported_job}}{{job_id}}")],
    12,
    unit="s",
    desc="A hang is declared at max(hang_k x typical step, hang_floor_s).",
)
next_line(8)
ts(
    "Step time quantiles",
    [target(f"gpuhealth_coordinator_job_step_seconds{{{J}}}", "{{exported_job}}{{job_id}} q{{quantile}}")],
    0,
    unit="s",
)
ts(
    "Hangs detected",
    [
        target(
            f"sum by (exported_job, job_id) (increase(gpuhealth_coordinator_job_hangs_total{{{J}}}[1h]))",
            "{{exported_job}}{{job_id}}",
        )
    ],
    12,
)
next_line(8)

# ---------------------------------------------------------------- the agent itself
row("gpuhealth agent")
ts("Collector success", [target(f"gpuhealth_collector_success{{{N}}}", "{{instance}} {{collector}}")], 0, w=8)
ts(
    "Collector duration",
    [target(f"gpuhealth_collector_duration_seconds{{{N}}}", "{{instance}} {{collector}}")],
    8,
    w=8,
    unit="s",
)
ts(
    "Agent CPU and memory",
    [
        target(f'rate(process_cpu_seconds_total{{job="gpuhealth-agent", {N}}}[5m])', "{{instance}} CPU (cores)"),
        target(
            f'process_resident_memory_bytes{{job="gpuhealth-agent", {N}}} / 2^20', "{{instance}} RSS (MiB)", ref="B"
        ),
    ],
    16,
    w=8,
    desc="Goal: <= 0.01 cores and <= 80 MiB RSS per node.",
)
next_line(8)
ts(
    "Link to the coordinator",
    [target(f"gpuhealth_agent_coordinator_connected{{{N}}}", "{{instance}}")],
    0,
    w=8,
    desc="1 while the agent streams to the coordinator (GpuhealthCoordinatorUnreachable after 10 minutes at 0).",
)
ts(
    "Records spooled for the coordinator",
    [target(f"gpuhealth_agent_coordinator_spool_records{{{N}}}", "{{instance}}")],
    8,
    w=8,
    desc="Records waiting in the agent's disk spool while the coordinator is away; sent when it is back.",
)
ts(
    "Instrumented ranks on the node",
    [target(f"gpuhealth_agent_ranks_connected{{{N}}}", "{{instance}}")],
    16,
    w=8,
    desc="Training ranks connected to the agent's socket (gpuhealth.instrument); per job: "
    "gpuhealth_agent_job_ranks_connected. A job missing here is invisible to straggler and hang detection.",
)
next_line(8)

dashboard = {
    "__requires": [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
    ],
    "uid": "gpuhealth-fleet",
    "title": "gpuhealth: GPU fleet health",
    "description": "GPU fleet health, findings, diagnostics, stragglers and hangs (gpuhealth agent + coordinator).",
    "tags": ["gpuhealth", "gpu", "nvidia"],
    "timezone": "browser",
    "editable": True,
    "graphTooltip": 1,
    "schemaVersion": 39,
    "version": 1,
    "refresh": "30s",
    "time": {"from": "now-6h", "to": "now"},
    "annotations": {
        "list": [
            {
                "builtIn": 1,
                "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True,
                "hide": True,
                "iconColor": "rgba(0, 211, 255, 1)",
                "name": "Annotations & Alerts",
                "type": "dashboard",
            }
        ]
    },
    "templating": {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
                "regex": "",
                "options": [],
            },
            {
                "name": "instance",
                "label": "Node",
                "type": "query",
                "datasource": DS,
                "query": {"query": "label_values(gpuhealth_gpu_info, instance)", "refId": "instance"},
                "definition": "label_values(gpuhealth_gpu_info, instance)",
                "refresh": 2,
                "includeAll": True,
                "multi": True,
                "allValue": ".+",
                "current": {},
                "sort": 1,
                "hide": 0,
                "regex": "",
                "options": [],
            },
            {
                "name": "gpu",
                "label": "GPU",
                "type": "query",
                "datasource": DS,
                "query": {"query": 'label_values(gpuhealth_gpu_info{instance=~"$instance"}, gpu)', "refId": "gpu"},
                "definition": 'label_values(gpuhealth_gpu_info{instance=~"$instance"}, gpu)',
                "refresh": 2,
                "includeAll": True,
                "multi": True,
                "allValue": ".+",
                "current": {},
                "sort": 3,
                "hide": 0,
                "regex": "",
                "options": [],
            },
            {
                "name": "job",
                "label": "Job",
                "type": "query",
                "datasource": DS,
                "query": {
                    "query": "label_values(gpuhealth_coordinator_job_step_records_total, job_id)",
                    "refId": "job",
                },
                "definition": "label_values(gpuhealth_coordinator_job_step_records_total, job_id)",
                "refresh": 2,
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "current": {},
                "sort": 1,
                "hide": 0,
                "regex": "",
                "options": [],
            },
        ]
    },
    "panels": panels,
}


def render() -> str:
    return json.dumps(dashboard, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that gpuhealth.json is up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = [p for p in (TARGET, CHART_COPY) if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"{p} is out of date; run {Path(__file__).name}", file=sys.stderr)
        return 1 if stale else 0
    for p in (TARGET, CHART_COPY):
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
