"""--dcgm-compat: dcgm-exporter's names, units and labels, from the same readings."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from exporter_testing import GPU0, GPU1, real_snapshot
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuhealth.exporters import ExportSnapshot
from gpuhealth.exporters.dcgm import DCGM_LABELS, FIELDS
from gpuhealth.exporters.prometheus import build_families, encode_text
from gpuhealth.model import MetricKind, Sample

# What the standard dcgm-exporter dashboard (grafana.com 12239) and common alerts query.
DASHBOARD = ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_UTIL",
             "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP",
             "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_XID_ERRORS",
             "DCGM_FI_DEV_PCIE_REPLAY_COUNTER")


def _dcgm(snap: ExportSnapshot, **kw: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = encode_text(build_families(snap, dcgm_compat=True, **kw)).decode()  # type: ignore[arg-type]
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in parse_text(text):
        for s in fam.samples:
            if s.name.startswith("DCGM_"):
                # prometheus-client's parser calls a counter's samples <name>_total; dcgm-exporter's have none
                out.setdefault(fam.name, []).append((s.labels, s.value))
    return out


def _one(series: dict, name: str, gpu: str, **labels: str) -> float:
    hits = [v for ls, v in series[name] if ls["gpu"] == gpu and all(ls.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, gpu, labels, series.get(name))
    return hits[0]


def _snap(samples: tuple[Sample, ...], **kw: object) -> ExportSnapshot:
    base = ExportSnapshot(node_name="node-a", generated_at=0.0, driver_version="580.159.04", gpus=(GPU0, GPU1),
                          samples=samples)
    return replace(base, **kw)  # type: ignore[arg-type]


_UNITS_SAMPLES = (
    Sample("gpu_memory_used_bytes", 3 * 2**20, "", gpu=0),
    Sample("gpu_power_watts", 512.25, "", gpu=0),
    Sample("gpu_energy_joules", 12.5, "", MetricKind.COUNTER, gpu=0),
    Sample("gpu_clock_hertz", 1_980e6, "", gpu=0, labels=(("clock", "sm"),)),
    Sample("gpu_clock_hertz", 2_619e6, "", gpu=0, labels=(("clock", "memory"),)),
    Sample("gpu_utilization_ratio", 0.87, "", gpu=0),
    Sample("gpu_throttle_violation_seconds", 1.5, "", MetricKind.COUNTER, gpu=0, labels=(("reason", "power"),)),
)


def test_units_are_converted_to_dcgm_exporters() -> None:
    s = _dcgm(_snap(_UNITS_SAMPLES), dcgm_schema="4.8")
    assert _one(s, "DCGM_FI_DEV_FB_USED", "0") == 3.0  # MiB
    assert _one(s, "DCGM_FI_DEV_POWER_USAGE", "0") == 512.25  # W
    assert _one(s, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "0") == 12_500.0  # mJ
    assert _one(s, "DCGM_FI_DEV_SM_CLOCK", "0") == 1980.0  # MHz
    assert _one(s, "DCGM_FI_DEV_MEM_CLOCK", "0") == 2619.0
    assert abs(_one(s, "DCGM_FI_DEV_GPU_UTIL", "0") - 87.0) < 1e-9  # %
    # ns, as NVML counts and today's dcgm-exporter CSV says (1000x more than the µs we once wrote)
    assert _one(s, "DCGM_FI_DEV_POWER_VIOLATION", "0") == 1.5e9


def test_the_4_10_schema_names_base_units_in_the_field_name() -> None:
    # dcgm-exporter 4.9+: DCGM's renamed fields, in Hz, J, bytes and 0-1 ratios; the old names are gone
    s = _dcgm(_snap(_UNITS_SAMPLES))
    assert _one(s, "DCGM_FI_DEV_FB_USED_BYTES", "0") == 3 * 2**20
    assert _one(s, "DCGM_FI_DEV_BOARD_POWER_WATTS", "0") == 512.25
    assert _one(s, "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", "0") == 12.5
    assert _one(s, "DCGM_FI_DEV_SM_CLOCK_HERTZ", "0") == 1_980e6
    assert _one(s, "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ", "0") == 2_619e6
    assert _one(s, "DCGM_FI_DEV_GPU_UTIL_RATIO", "0") == 0.87
    assert _one(s, "DCGM_FI_DEV_POWER_VIOLATION", "0") == 1.5e9  # not renamed by DCGM 4.6
    assert not {"DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_UTIL"} & set(s)
    both = _dcgm(_snap(_UNITS_SAMPLES), dcgm_schema="both")
    assert _one(both, "DCGM_FI_DEV_SM_CLOCK", "0") == 1980.0
    assert _one(both, "DCGM_FI_DEV_SM_CLOCK_HERTZ", "0") == 1_980e6


def test_labels_are_dcgm_exporters_plus_pod_and_job_labels() -> None:
    temp = (Sample("gpu_temperature_celsius", 40.0, "", gpu=1, labels=(("sensor", "gpu"),)),)
    holder = {"GPU-bbbb": {"pod": "p", "namespace": "n", "container": "c", "slurm_job_id": "77"}}
    [(labels, value)] = _dcgm(_snap(temp, gpu_labels=holder), dcgm_schema="4.8")["DCGM_FI_DEV_GPU_TEMP"]
    assert value == 40.0
    # the Slurm job as dcgm-exporter's HPC job mapping names it
    assert labels == {"gpu": "1", "UUID": "GPU-bbbb", "pci_bus_id": "00000000:2A:00.0", "device": "nvidia1",
                      "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-a",
                      "DCGM_FI_DRIVER_VERSION": "580.159.04", "pod": "p", "namespace": "n", "container": "c",
                      "hpc_job": "77"}
    [(new, _)] = _dcgm(_snap(temp, gpu_labels=holder))["DCGM_FI_DEV_GPU_TEMP_CELSIUS"]
    assert new["hostname"] == "node-a" and new["DCGM_FI_SYSTEM_DRIVER_VERSION"] == "580.159.04"
    assert not {"Hostname", "DCGM_FI_DRIVER_VERSION", "slurm_job_id"} & set(new) and new["hpc_job"] == "77"


def test_the_node_label_is_named_as_each_release_names_it_or_as_asked() -> None:
    # dcgm-exporter 4.5.0-4.8.2 write Hostname, 4.8.3 and later hostname; agent.dcgm_hostname_label overrides
    temp = (Sample("gpu_temperature_celsius", 40.0, "", gpu=0, labels=(("sensor", "gpu"),)),)
    [(old, _), *_] = _dcgm(_snap(temp), dcgm_schema="4.8")["DCGM_FI_DEV_GPU_TEMP"]
    assert old["Hostname"] == "node-a" and "hostname" not in old
    [(new, _), *_] = _dcgm(_snap(temp))["DCGM_FI_DEV_GPU_TEMP_CELSIUS"]
    assert new["hostname"] == "node-a" and "Hostname" not in new
    [(asked, _), *_] = _dcgm(_snap(temp), dcgm_schema="4.8", dcgm_hostname_label="hostname")["DCGM_FI_DEV_GPU_TEMP"]
    assert asked["hostname"] == "node-a" and "Hostname" not in asked


def test_xids_nvlink_sums_and_clock_event_bitmask() -> None:
    s = _dcgm(_snap((
        Sample("gpu_xid_last", 79.0, "", gpu=1),
        Sample("gpu_xid_last", 0.0, "", gpu=0),
        Sample("gpu_xid_errors", 2.0, "", MetricKind.COUNTER, gpu=1, labels=(("xid", "79"),)),
        Sample("gpu_xid_errors", 1.0, "", MetricKind.COUNTER, gpu=1, labels=(("xid", "48"),)),
        *(Sample("gpu_nvlink_errors", float(link), "", MetricKind.COUNTER, gpu=0,
                 labels=(("link", str(link)), ("counter", "crc"))) for link in range(18)),
        Sample("gpu_throttle_reason_active", 1.0, "", gpu=0, labels=(("reason", "hw_slowdown"),)),
        Sample("gpu_throttle_reason_active", 1.0, "", gpu=0, labels=(("reason", "gpu_idle"),)),
        Sample("gpu_throttle_reason_active", 0.0, "", gpu=0, labels=(("reason", "hw_thermal"),)),
    )), dcgm_schema="4.8")
    # dcgm-exporter's own XID series: the last code, named by err_code/err_msg; no invented counter
    assert _one(s, "DCGM_FI_DEV_XID_ERRORS", "1", err_code="79") == 79.0
    [(labels, _)] = [x for x in s["DCGM_FI_DEV_XID_ERRORS"] if x[0]["gpu"] == "1"]
    assert labels["err_msg"] == "GPU has fallen off the bus"
    assert _one(s, "DCGM_FI_DEV_XID_ERRORS", "0", err_code="0", err_msg="No Error") == 0.0
    assert not [n for n in s if n.startswith("DCGM_EXP_")]
    assert _one(s, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "0") == float(sum(range(18)))
    assert _one(s, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "0") == float(0x8 | 0x1)
    assert _one(s, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "0") == float(0x8 | 0x1)


def test_off_by_default_and_counters_keep_dcgm_names_without_total_typed_counter() -> None:
    # as dcgm-exporter writes them: "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter" and the exact name
    snap = _snap((Sample("gpu_pcie_replay", 7.0, "", MetricKind.COUNTER, gpu=0),))
    assert b"DCGM_" not in encode_text(build_families(snap))
    for schema, name in (("4.8", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"), ("4.10", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL")):
        text = encode_text(build_families(snap, dcgm_compat=True, dcgm_schema=schema)).decode()
        assert f"# TYPE {name} counter" in text
        assert f"{name}_total" not in text
        assert text.count(f"{name}{{") == 1
        [fam] = [f for f in parse_text(text) if f.name == name]  # prometheus-client's parser agrees
        assert fam.type == "counter" and fam.samples[0].value == 7.0


def test_real_recording_gives_the_dashboards_series_with_raw_nvml_values(h200_recording: Path) -> None:
    s = _dcgm(real_snapshot(h200_recording, node_name="gpu-node-7"), dcgm_schema="4.8")
    missing = [n for n in DASHBOARD if n not in s]
    assert not missing, missing
    rec = json.loads(h200_recording.read_text())
    for i, dev in enumerate(rec["devices"]):
        g = str(i)
        assert _one(s, "DCGM_FI_DEV_GPU_TEMP", g) == dev["Temperature_GPU"]["value"]
        assert _one(s, "DCGM_FI_DEV_POWER_USAGE", g) == dev["PowerUsage"]["value"] / 1000  # NVML mW → W
        assert _one(s, "DCGM_FI_DEV_SM_CLOCK", g) == dev["ClockInfo_SM"]["value"]
        assert _one(s, "DCGM_FI_DEV_FB_USED", g) == dev["MemoryInfo"]["value"]["used"] / 2**20
        assert _one(s, "DCGM_FI_DEV_FB_FREE", g) == dev["MemoryInfo"]["value"]["free"] / 2**20
        assert _one(s, "DCGM_FI_DEV_GPU_UTIL", g) == dev["UtilizationRates"]["value"]["gpu"]
        assert _one(s, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", g) == dev["PcieReplayCounter"]["value"]
    for name, series in s.items():
        for labels, _ in series:
            extra = set(labels) - set(DCGM_LABELS) - {"hostname", "DCGM_FI_SYSTEM_DRIVER_VERSION"}
            assert extra <= ({"err_code", "err_msg"} if name == "DCGM_FI_DEV_XID_ERRORS" else set()), (name, extra)
            assert labels["Hostname"] == "gpu-node-7" and labels["DCGM_FI_DRIVER_VERSION"] == "580.159.04"
            assert labels["device"] == f"nvidia{labels['gpu']}"


def test_every_mapped_source_is_a_sample_some_collector_emits(h200_recording: Path) -> None:
    """A renamed collector metric must not silently empty a dcgm series."""
    import ast

    src = Path(__file__).parents[3] / "src" / "gpuhealth" / "collectors"
    emitted: set[str] = set()
    for py in src.glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("Sample", "add") and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    emitted.add(first.value)
    unmapped = sorted({f.source for f in FIELDS} - emitted)
    assert not unmapped, f"dcgm mapping reads samples no collector emits: {unmapped}"


def test_dcgm_compat_output_is_valid_openmetrics() -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    from gpuhealth.exporters.prometheus import MetricsEndpoint

    scenario = Path(__file__).parents[2] / "fixtures" / "scenarios" / "agent_faulty_node.yaml"
    snap = real_snapshot(scenario)
    body, _ = MetricsEndpoint(lambda: snap, dcgm_compat=True, dcgm_schema="both").render("application/openmetrics-text")
    fams = {f.name: f for f in parse_openmetrics(body.decode())}  # strict: raises on any format error
    # OpenMetrics requires _total on a counter: dcgm-exporter's exact names are unknown-typed there
    assert fams["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"].type == "unknown"
    assert fams["DCGM_FI_DEV_PCIE_REPLAY_TOTAL"].type == "unknown"
    assert len(fams["DCGM_FI_DEV_GPU_TEMP"].samples) == 8
