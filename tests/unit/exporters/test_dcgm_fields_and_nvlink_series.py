"""The fields issue 16 found missing or wrong in ``--dcgm-compat``, read through the real collectors
from a scenario on the real H200 recording (the fake backend stands in for the driver only), and the
per-GPU NVLink view that keeps an 8-GPU scrape small."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from exporter_testing import real_snapshot
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuhealth.exporters.dcgm import CLOCK_REASON_FAMILIES, FIELDS
from gpuhealth.exporters.prometheus import MetricsEndpoint, build_families, encode_text

MIB = 2**20


def _scenario(tmp_path: Path, gpu_count: int = 2) -> Path:
    # What a Hopper GPU's driver answers where the bundled recording has nothing (a newer driver,
    # a video engine in use, GPM): the values a real H200 under load gives, as NVML shapes them.
    path = tmp_path / "busy.yaml"
    path.write_text(yaml.safe_dump({
        "recording": "nvml_h200x2.json", "gpu_count": gpu_count,
        "overrides": {"0": {
            "EncoderUtilization": [12, 167000], "DecoderUtilization": [40, 167000],
            "MemoryInfo_v2": {"version": 33554472, "total": 150754820096, "reserved": 671088640,
                              "free": 149000000000, "used": 1083731456},
            "GpmMetrics": {"SM_UTIL": 91.5, "SM_OCCUPANCY": 47.5, "ANY_TENSOR_UTIL": 63.0, "DRAM_BW_UTIL": 71.0,
                           "GRAPHICS_UTIL": 98.0, "PCIE_TX_PER_SEC": 2048.0, "PCIE_RX_PER_SEC": 512.5},
        }},
    }))
    return path


def _series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in parse_text(text):
        for s in fam.samples:
            # prometheus-client's parser calls a counter's samples <name>_total; dcgm-exporter's have none
            out.setdefault(fam.name if fam.name.startswith("DCGM_") else s.name, []).append((s.labels, s.value))
    return out


def _gpu(series: dict, name: str, gpu: str) -> float:
    [value] = [v for labels, v in series[name] if labels["gpu"] == gpu]
    return value


def test_profiling_enc_dec_and_reserved_reach_dcgm_names_in_dcgm_units(tmp_path: Path) -> None:
    text = encode_text(build_families(real_snapshot(_scenario(tmp_path)), dcgm_compat=True, dcgm_schema="4.8")).decode()
    s = _series(text)
    # dashboard 12239's Tensor Core panel reads this one: a ratio, as DCGM reports it
    expected = {"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.63, "DCGM_FI_PROF_SM_ACTIVE": 0.915,
                "DCGM_FI_PROF_SM_OCCUPANCY": 0.475, "DCGM_FI_PROF_DRAM_ACTIVE": 0.71,
                "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.98}
    for name, ratio in expected.items():
        assert abs(_gpu(s, name, "0") - ratio) < 1e-12, name
    assert _gpu(s, "DCGM_FI_DEV_ENC_UTIL", "0") == 12.0 and _gpu(s, "DCGM_FI_DEV_DEC_UTIL", "0") == 40.0  # %
    assert _gpu(s, "DCGM_FI_DEV_FB_RESERVED", "0") == 671088640 / MIB  # MiB
    assert abs(_gpu(s, "gpuhealth_gpu_tensor_active_ratio", "0") - 0.63) < 1e-12  # and ours, in base units
    # PCIe traffic: GPM's MiB/s as bytes per second, under DCGM's names and ours
    assert _gpu(s, "DCGM_FI_PROF_PCIE_TX_BYTES", "0") == 2048.0 * MIB
    assert _gpu(s, "DCGM_FI_PROF_PCIE_RX_BYTES", "0") == 512.5 * MIB
    pcie = {ls["direction"]: v for ls, v in s["gpuhealth_gpu_pcie_throughput_bytes_per_second"] if ls["gpu"] == "0"}
    assert pcie == {"tx": 2048.0 * MIB, "rx": 512.5 * MIB}
    # GPU 1 answers "not supported" (the recording): no series rather than a made-up zero
    assert [labels["gpu"] for labels, _ in s["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"]] == ["0"]
    # NVLink traffic: both directions summed, in KiB as DCGM sums NVML's counters
    tx = [v for ls, v in s["gpuhealth_gpu_nvlink_traffic_bytes_total"] if ls["gpu"] == "1"]
    assert _gpu(s, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "1") == sum(tx) / 1024 > 0


def test_a_gpm_answer_over_an_empty_interval_is_no_series(tmp_path: Path) -> None:
    # GPM divides by the time between its two samples: NaN (or garbage) is no reading, never a 0
    path = tmp_path / "nan.yaml"
    path.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json", "overrides": {"0": {"GpmMetrics": {
        "SM_UTIL": float("nan"), "ANY_TENSOR_UTIL": 12.0, "PCIE_TX_PER_SEC": -1.0, "PCIE_RX_PER_SEC": float("inf")}}}}))
    s = _series(encode_text(build_families(real_snapshot(path), dcgm_compat=True, dcgm_schema="4.8")).decode())
    assert abs(_gpu(s, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "0") - 0.12) < 1e-12
    for name in ("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES",
                 "gpuhealth_gpu_sm_active_ratio", "gpuhealth_gpu_pcie_throughput_bytes_per_second"):
        assert name not in s, name


# --- against dcgm-exporter's own counters file -------------------------------------------------

COUNTERS_CSV = Path(__file__).resolve().parents[2] / "fixtures" / "dcgm_exporter" / "default-counters.csv"
# Fields we export that dcgm-exporter's file has no row for: real DCGM fields (id in go-dcgm's
# dcgm_fields.h), which an operator adds to the CSV by hand; dashboards and alerts use them.
NOT_IN_THE_CSV = {
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": 160, "DCGM_FI_DEV_PCIE_LINK_GEN": 237, "DCGM_FI_DEV_PCIE_LINK_WIDTH": 238,
    "DCGM_FI_DEV_FB_TOTAL": 250, "DCGM_FI_DEV_ROW_REMAP_PENDING": 396,
    "DCGM_FI_PROF_NVLINK_TX_BYTES": 1011, "DCGM_FI_PROF_NVLINK_RX_BYTES": 1012,
}
# The file's active rows we do not serve, and why.
NOT_SERVED = {
    "DCGM_FI_DRIVER_VERSION": "declared 'label': it is a label on every DCGM_* series (test_labels_are_...)",
}
_UNITS = {"MHz": "MHz", "C": "°C", "W": "W", "mJ": "mJ", "%": "%", "MiB": "MiB", "ns": "ns"}


def counters_csv() -> dict[str, tuple[str, str, bool]]:
    """dcgm-exporter's rows: field -> (type, help, active). Commented-out rows count (operators
    uncomment them), marked inactive; the file's prose comments do not parse as rows."""
    rows: dict[str, tuple[str, str, bool]] = {}
    for line in COUNTERS_CSV.read_text().splitlines():
        text = line.strip()
        active = not text.startswith("#")
        parts = [p.strip() for p in text.lstrip("#").split(",", 2)]
        if len(parts) == 3 and parts[0].startswith("DCGM_") and parts[1] in ("gauge", "counter", "label"):
            rows[parts[0]] = (parts[1], parts[2], active)
    return rows


def test_every_field_is_dcgm_exporters_row_with_its_type_help_and_unit() -> None:
    rows = counters_csv()
    assert len(rows) >= 50 and sum(active for _, _, active in rows.values()) >= 25  # the parser read the file
    for f in (f for f in FIELDS if "4.8" in f.schemas):
        if f.name not in rows:
            assert f.name in NOT_IN_THE_CSV, f"{f.name} is in no row of dcgm-exporter's default-counters.csv"
            continue
        kind, help_, _ = rows[f.name]
        assert (f.type, f.help) == (kind, help_), f.name
        unit = re.search(r"\(in ([^)]+)\)", help_)
        if unit:  # the unit the file states is the unit we convert to
            assert f.unit == _UNITS[unit.group(1)], f.name
    served = {f.name for f in FIELDS if "4.8" in f.schemas} | set(CLOCK_REASON_FAMILIES)
    unserved = {name for name, (_, _, active) in rows.items() if active and name not in served}
    assert unserved == set(NOT_SERVED), "dcgm-exporter exports these by default; serve them or say why not"


def test_the_file_parser_tells_rows_from_prose() -> None:
    rows = counters_csv()
    assert rows["DCGM_FI_DEV_DEC_UTIL"] == ("gauge", "Decoder utilization (in %).", True)  # "DEC_UTIL ," as shipped
    assert rows["DCGM_FI_DEV_POWER_VIOLATION"][2] is False and rows["DCGM_FI_DEV_POWER_VIOLATION"][0] == "counter"
    assert not any("Format" in name or " " in name for name in rows)


def test_nvlink_series_are_per_gpu_by_default_and_per_link_on_demand(tmp_path: Path) -> None:
    snap = real_snapshot(_scenario(tmp_path, gpu_count=8))
    per_gpu = _series(encode_text(build_families(snap)).decode())
    per_link = _series(encode_text(build_families(snap, nvlink_per_link=True)).decode())
    # the per-GPU sums equal the per-link series summed
    for counter in ("crc", "replay", "recovery"):
        for gpu in map(str, range(8)):
            links = [v for ls, v in per_link["gpuhealth_gpu_nvlink_errors_total"]
                     if ls["gpu"] == gpu and ls["counter"] == counter]
            [total] = [v for ls, v in per_gpu["gpuhealth_gpu_nvlink_errors_total"]
                       if ls["gpu"] == gpu and ls["counter"] == counter]
            assert len(links) == 18 and total == sum(links)
    assert all("link" not in ls for ls, _ in per_gpu["gpuhealth_gpu_nvlink_errors_total"])
    assert "gpuhealth_gpu_nvlink_state" not in per_gpu and len(per_link["gpuhealth_gpu_nvlink_state"]) == 8 * 18
    n_gpu = sum(map(len, per_gpu.values()))
    n_link = sum(map(len, per_link.values()))
    assert n_link - n_gpu == 8 * (18 * 4 - 3)  # 72 per-link series per GPU become 3 sums
    # the endpoint serves either view; the switch takes effect on the next scrape
    endpoint = MetricsEndpoint(lambda: snap, process_metrics=False)
    assert b'link="3"' not in endpoint.render()[0]
    endpoint.nvlink_per_link = True
    assert b'gpuhealth_gpu_nvlink_state{' in endpoint.render()[0]
