"""/metrics from the cache: names, units, labels, findings, health, formats; promtool-clean."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from exporter_testing import GPU0, GPU1, real_snapshot
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuhealth.exporters import CollectorStatus, ExportSnapshot
from gpuhealth.exporters.prometheus import MetricsEndpoint, build_families, encode_text
from gpuhealth.model import Action, Entity, EntityKind, Finding, MetricKind, Sample, Severity

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
FIXTURES = Path(__file__).parents[2] / "fixtures"


def _snapshot(**kw: object) -> ExportSnapshot:
    base = ExportSnapshot(
        node_name="node-a", generated_at=1_800_000_000.0, simulated=False, backend="NVML (live)", version="0.1.0",
        driver_version="580.159.04", nvml_up=True, ready=True, gpus=(GPU0, GPU1),
        samples=(
            Sample("gpu_temperature_celsius", 41.0, "GPU temperature by sensor.", gpu=0, labels=(("sensor", "gpu"),)),
            Sample("gpu_energy_joules", 1234.5, "Energy used.", MetricKind.COUNTER, gpu=1),
            Sample("host_kernel", 1.0, "Kernel (value 1).", MetricKind.INFO, labels=(("release", "6.8.0"),)),
            Sample("gpu_xid_errors", 2.0, "XIDs.", MetricKind.COUNTER, gpu=1, labels=(("xid", "79"),)),
        ),
        findings=(
            Finding("xid.79", Severity.CRITICAL, Entity.gpu("GPU-bbbb", 1), "fell off the bus", Action.REBOOT),
            Finding("nvlink.errors", Severity.WARNING, Entity(EntityKind.LINK, "GPU-aaaa/nvlink/3", 0), "crc",
                    Action.MONITOR),
            Finding("nvlink.errors", Severity.WARNING, Entity(EntityKind.LINK, "GPU-aaaa/nvlink/3", 0), "crc 2",
                    Action.MONITOR),
            Finding("numa.unknown", Severity.INFO, Entity.node("node-a"), "VM"),
        ),
        collectors=(
            CollectorStatus("ecc", "fast", 5.0, True, 0.002, 1_799_999_999.0, 10, 0, 0),
            CollectorStatus("nvlink", "slow", 60.0, False, 10.0, None, 3, 3, 1, "timed out after 10 s"),
        ),
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def _text(snap: ExportSnapshot, dcgm: bool = False) -> str:
    return encode_text(build_families(snap, dcgm_compat=dcgm)).decode()


def _values(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in parse_text(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(values: dict, name: str, **labels: str) -> float:
    for (n, ls), v in values.items():
        if n == name and set(labels.items()) <= set(ls):
            return v
    raise KeyError(f"{name} {labels}")


def test_gpu_series_carry_the_standard_labels_and_counters_end_in_total() -> None:
    text = _text(_snapshot())
    assert ('gpuhealth_gpu_temperature_celsius{gpu="0",uuid="GPU-aaaa",pci_bus_id="00000000:18:00.0",'
            'model_name="NVIDIA H100 80GB HBM3",sensor="gpu"} 41.0') in text
    assert "# TYPE gpuhealth_gpu_energy_joules_total counter" in text
    assert re.search(r'^gpuhealth_gpu_energy_joules_total\{gpu="1",[^}]*\} 1234\.5$', text, re.M)
    assert 'gpuhealth_host_kernel_info{release="6.8.0"} 1.0' in text
    assert 'gpuhealth_gpu_xid_errors_total{gpu="1",uuid="GPU-bbbb",' in text and 'xid="79"} 2.0' in text
    assert "hostname" not in text.lower()  # the scrape target names the node


def test_health_findings_and_collector_metrics() -> None:
    v = _values(_text(_snapshot()))
    assert _get(v, "gpuhealth_gpu_health", gpu="0") == 1.0  # warning on a link of GPU 0 → degraded
    assert _get(v, "gpuhealth_gpu_health", gpu="1") == 2.0  # critical XID → unhealthy
    assert _get(v, "gpuhealth_node_health") == 2.0
    assert _get(v, "gpuhealth_findings", code="xid.79", severity="critical", gpu="1", uuid="GPU-bbbb",
                action="reboot") == 1.0
    assert _get(v, "gpuhealth_findings", code="nvlink.errors", entity="GPU-aaaa/nvlink/3", gpu="0") == 2.0
    assert _get(v, "gpuhealth_findings", code="numa.unknown", severity="info", entity_kind="node") == 1.0
    assert _get(v, "gpuhealth_collector_success", collector="ecc") == 1.0
    assert _get(v, "gpuhealth_collector_success", collector="nvlink") == 0.0
    assert _get(v, "gpuhealth_collector_duration_seconds", collector="nvlink") == 10.0
    assert _get(v, "gpuhealth_collector_last_success_timestamp_seconds", collector="ecc") == 1_799_999_999.0
    assert ("gpuhealth_collector_last_success_timestamp_seconds", frozenset({("collector", "nvlink")})) not in v
    assert _get(v, "gpuhealth_collector_errors_total", collector="nvlink") == 3.0
    assert _get(v, "gpuhealth_collector_timeouts_total", collector="nvlink") == 1.0
    assert _get(v, "gpuhealth_build_info", version="0.1.0", simulated="false") == 1.0
    assert _get(v, "gpuhealth_simulated") == 0.0
    assert _get(v, "gpuhealth_gpu_info", gpu="1", uuid="GPU-bbbb") == 1.0


def test_nvml_down_makes_gpu_health_unknown() -> None:
    v = _values(_text(_snapshot(nvml_up=False, findings=(), samples=())))
    assert _get(v, "gpuhealth_gpu_health", gpu="0") == 3.0
    assert _get(v, "gpuhealth_node_health") == 3.0
    assert _get(v, "gpuhealth_nvml_up") == 0.0


def test_label_values_are_escaped_and_extension_labels_cannot_shadow_ours() -> None:
    snap = _snapshot(
        samples=(Sample("x_info", 1.0, "odd\nhelp \\ text", MetricKind.INFO, labels=(("v", 'a"b\\c\nd'),)),
                 Sample("gpu_power_watts", float("nan"), "p", gpu=0)),
        gpu_labels={"GPU-aaaa": {"pod": "p-0", "uuid": "spoof", "9bad": "x", "__name__": "y"}},
    )
    text = _text(snap)
    assert 'gpuhealth_x_info{v="a\\"b\\\\c\\nd"} 1.0' in text
    assert "# HELP gpuhealth_x_info odd\\nhelp \\\\ text" in text
    assert 'model_name="NVIDIA H100 80GB HBM3",pod="p-0"} NaN' in text
    assert "spoof" not in text and "9bad" not in text
    families = {f.name: f for f in parse_text(text)}  # the official parser agrees
    assert families["gpuhealth_x_info"].samples[0].labels["v"] == 'a"b\\c\nd'


def test_openmetrics_negotiation_yields_valid_openmetrics() -> None:
    endpoint = MetricsEndpoint(_snapshot, process_metrics=True)
    body, ctype = endpoint.render("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n")
    fams = {f.name: f for f in parse_openmetrics(text)}  # strict parser: raises on any format error
    assert fams["gpuhealth_gpu_energy_joules"].type == "counter"
    assert fams["gpuhealth_build"].type == "info"
    assert "process_cpu_seconds" in fams
    body, ctype = endpoint.render(None)
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    assert b"# EOF" not in body and b"process_resident_memory_bytes" in body


def test_the_registry_gives_the_same_metrics_to_prometheus_client_tooling() -> None:
    from prometheus_client import generate_latest

    endpoint = MetricsEndpoint(_snapshot, process_metrics=False)
    ours = _values(endpoint.render(None)[0].decode())
    theirs = _values(generate_latest(endpoint.registry).decode())
    assert ours == theirs


def _promtool(text: str) -> str:
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    return (proc.stdout + proc.stderr).decode().strip()


def test_promtool_is_clean_on_the_exporters_own_metrics() -> None:
    assert _promtool(_text(_snapshot())) == ""


def test_promtool_is_clean_on_the_real_recording_through_every_collector(h200_recording: Path) -> None:
    endpoint = MetricsEndpoint(lambda: real_snapshot(h200_recording))
    problems = _promtool(endpoint.render(None)[0].decode())
    assert problems == "", f"promtool check metrics:\n{problems}"


@pytest.mark.parametrize("scenario", ["agent_faulty_node.yaml"])
def test_promtool_with_dcgm_compat_flags_only_dcgm_exporters_own_names(scenario: str) -> None:
    text = encode_text(build_families(real_snapshot(FIXTURES / "scenarios" / scenario), dcgm_compat=True)).decode()
    problems = [p for p in _promtool(text).splitlines() if p]
    # dcgm-exporter's own label modelName is camelCase, its PCIE_REPLAY_COUNTER name says "counter" and its
    # counters have no "_total": kept as they are, since dashboards match them exactly. Nothing else may be flagged.
    inherent = re.compile(r"^DCGM_\w+ (label names should be written in 'snake_case' not 'camelCase'"
                          r"|metric name should not include type 'counter'"
                          r"|counter metrics should have \"_total\" suffix)$")
    unexpected = [p for p in problems if not inherent.match(p)]
    assert problems and not unexpected, unexpected


def test_rendering_follows_each_new_snapshot() -> None:
    current = {"snap": _snapshot()}
    endpoint = MetricsEndpoint(lambda: current["snap"], process_metrics=False)
    first, _ = endpoint.render(None)
    assert endpoint.render(None)[0] == first
    current["snap"] = _snapshot(nvml_up=False)
    changed, _ = endpoint.render(None)
    assert b"gpuhealth_nvml_up 0.0" in changed and b"gpuhealth_nvml_up 1.0" in first
    endpoint.dcgm_compat = True
    current["snap"] = _snapshot(samples=(Sample("gpu_power_watts", 300.0, "p", gpu=0),))
    assert b"DCGM_FI_DEV_BOARD_POWER_WATTS{" in endpoint.render("application/openmetrics-text")[0]
    endpoint.collector.dcgm_schema = "4.8"  # a reload that changes the schema is the next scrape's
    assert b"DCGM_FI_DEV_POWER_USAGE{" in endpoint.render("application/openmetrics-text")[0]
