"""MIG: mode and instances per GPU, MIG UUIDs attributed to their parent GPU for pod labels, and
no collector fails on a MIG GPU. The H100 recording replayed as a MIG-partitioned GPU: MIG on,
two instances, and the calls NVML refuses on a MIG-enabled GPU answering as the driver does."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parents[1] / "exporters"))
from exporter_testing import real_snapshot
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuhealth.exporters.prometheus import build_families, encode_text

DATA = Path(__file__).parents[3] / "src" / "gpuhealth" / "data"
MIG_A = "MIG-2f5c1a8e-6d3b-5b7e-9a1f-0c4d2e8b7a61"
MIG_B = "MIG-7e1b4c2d-1a9f-5e3c-8b6d-4f2a9c0e1d35"
NOT_SUPPORTED = {"error": "Not Supported", "code": 3}


def _mig_scenario(tmp_path: Path) -> Path:
    path = tmp_path / "h100_mig.yaml"
    path.write_text(yaml.safe_dump({"recording": "nvml_h100x1.json", "overrides": {"0": {
        "MigMode": [1, 1],
        "MigDevices": [
            {"slot": 0, "uuid": MIG_A, "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "gpu_instance_id": 1,
             "compute_instance_id": 0, "memory_total": 42_949_672_960},
            {"slot": 1, "uuid": MIG_B, "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "gpu_instance_id": 9,
             "compute_instance_id": 0, "memory_total": 10_737_418_240},
        ],
        # what a MIG-enabled GPU refuses as a whole device
        "UtilizationRates": NOT_SUPPORTED, "EncoderUtilization": NOT_SUPPORTED, "DecoderUtilization": NOT_SUPPORTED,
        "GpmMetrics": NOT_SUPPORTED, "ComputeRunningProcesses": {"error": "Insufficient Permissions", "code": 4},
    }}}))
    return path


def _series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in parse_text(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_no_collector_fails_on_a_mig_gpu_and_mig_is_reported(tmp_path: Path) -> None:
    snap = real_snapshot(_mig_scenario(tmp_path))
    failed = {c.name: c.error for c in snap.collectors if not c.success}
    assert failed == {}
    # refusals a MIG GPU gives are "not supported" answers, not failures of the GPU or the agent
    assert [f.to_dict() for f in snap.findings if f.code == "collector.failed"] == []
    s = _series(encode_text(build_families(snap)).decode())
    assert {ls["which"]: v for ls, v in s["gpuhealth_gpu_mig_mode"]} == {"current": 1.0, "pending": 1.0}
    instances = {ls["mig_uuid"]: ls for ls, _ in s["gpuhealth_gpu_mig_instance_info"]}
    assert set(instances) == {MIG_A, MIG_B}
    assert instances[MIG_B]["profile"] == "1g.10gb" and instances[MIG_B]["gpu_instance_id"] == "9"
    assert instances[MIG_A]["gpu"] == "0"  # on the parent GPU


def test_pods_on_mig_slices_label_their_parent_gpu(tmp_path: Path) -> None:
    # what the kubelet's PodResources answer gives the agent: the device plugin's MIG UUIDs
    labels = {MIG_A: {"pod": "train-a", "namespace": "ml", "container": "t"},
              MIG_B: {"pod": "infer-b", "namespace": "serve", "container": "s"}}
    snap = real_snapshot(_mig_scenario(tmp_path), gpu_labels=labels)
    s = _series(encode_text(build_families(snap, dcgm_compat=True)).decode())
    [(info, _)] = s["gpuhealth_gpu_info"]
    assert info["pod"] == "infer-b,train-a" and info["namespace"] == "ml,serve" and info["container"] == "s,t"
    [(temp, _)] = [x for x in s["DCGM_FI_DEV_GPU_TEMP_CELSIUS"]]
    assert temp["pod"] == "infer-b,train-a"
    # a GPU without MIG keeps labels keyed by its own UUID only
    plain = real_snapshot(DATA / "nvml_h100x1.json", gpu_labels=labels)
    [(info, _)] = _series(encode_text(build_families(plain)).decode())["gpuhealth_gpu_info"]
    assert "pod" not in info


def test_a_gpu_without_mig_reports_mode_off_and_no_instances() -> None:
    s = _series(encode_text(build_families(real_snapshot(DATA / "nvml_h200x2.json"))).decode())
    assert {(ls["gpu"], ls["which"]): v for ls, v in s["gpuhealth_gpu_mig_mode"]} == {
        ("0", "current"): 0.0, ("0", "pending"): 0.0, ("1", "current"): 0.0, ("1", "pending"): 0.0}
    assert "gpuhealth_gpu_mig_instance_info" not in s
