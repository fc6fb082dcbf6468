"""The fields issue 16 found missing or wrong in ``--dcgm-compat``, read through the real collectors
from a scenario on the real H200 recording (the fake backend stands in for the driver only), and the
per-GPU NVLink view that keeps an 8-GPU scrape small."""

from __future__ import annotations

from pathlib import Path

import yaml
from exporter_testing import real_snapshot
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuhealth.exporters.dcgm import FIELDS
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
                           "GRAPHICS_UTIL": 98.0},
        }},
    }))
    return path


def _series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in parse_text(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _gpu(series: dict, name: str, gpu: str) -> float:
    [value] = [v for labels, v in series[name] if labels["gpu"] == gpu]
    return value


def test_profiling_enc_dec_and_reserved_reach_dcgm_names_in_dcgm_units(tmp_path: Path) -> None:
    text = encode_text(build_families(real_snapshot(_scenario(tmp_path)), dcgm_compat=True)).decode()
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
    # GPU 1 answers "not supported" (the recording): no series rather than a made-up zero
    assert [labels["gpu"] for labels, _ in s["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"]] == ["0"]
    # NVLink traffic: both directions summed, in bytes
    tx = [v for ls, v in s["gpuhealth_gpu_nvlink_traffic_bytes_total"] if ls["gpu"] == "1"]
    assert _gpu(s, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "1") == sum(tx) > 0


def test_every_field_is_named_as_dcgm_exporters_counters_csv() -> None:
    # dcgm-exporter's etc/default-counters.csv and dcp-metrics-included.csv (names as they ship; our
    # extras are its commented-out rows, which operators uncomment)
    known = {
        "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_POWER_MGMT_LIMIT", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_LINK_GEN", "DCGM_FI_DEV_PCIE_LINK_WIDTH",
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "DCGM_FI_DEV_RETIRED_SBE",
        "DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_RETIRED_PENDING", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "DCGM_FI_DEV_POWER_VIOLATION", "DCGM_FI_DEV_THERMAL_VIOLATION", "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
        "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", "DCGM_FI_DEV_LOW_UTIL_VIOLATION", "DCGM_FI_DEV_RELIABILITY_VIOLATION",
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
    }
    assert {f.name for f in FIELDS} <= known
    for f in FIELDS:
        if f.name.endswith("_VIOLATION"):
            assert f.unit == "ns" and f.scale == 1e9 and "(in ns)" in f.help


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
