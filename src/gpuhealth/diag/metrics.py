"""What the agent's periodic diagnostics export to Prometheus, from their latest outcomes (pure).

Findings (``sdc.mismatch``, ``busbw.low``, ``bandwidth.low`` …) already reach ``gpuhealth_findings``;
these are the measured numbers behind them, for trends per node and GPU in Grafana:

- ``gpuhealth_diag_success{diag}``: 1 if the last run finished, 0 if it failed or timed out (none
  while a run is skipped, e.g. every GPU busy with a job);
- ``gpuhealth_diag_last_run_timestamp_seconds{diag}``;
- ``gpuhealth_diag_gpu_seconds{diag}`` per GPU: GPU time the last run used (what the budget charges);
- ``gpuhealth_diag_busbw_bytes_per_second{collective, size_bytes, ranks}``: bus bandwidth per collective and size;
- ``gpuhealth_diag_memory_bandwidth_bytes_per_second{direction}`` per GPU: device copy, pinned host↔device;
- ``gpuhealth_gpu_screen_last_timestamp_seconds{level, result}`` per GPU: when its latest screen ended
  (one series per GPU: the latest screen's level and result are its labels).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuhealth.model import Sample

GB = 1e9  # the probes report GB/s (10^9 bytes, as nccl-tests); /metrics speaks base units
_BANDWIDTH_DIRECTIONS = (("d2d_gbps", "device_to_device"), ("h2d_gbps", "host_to_device"),
                         ("d2h_gbps", "device_to_host"))


def diag_samples(latest: Mapping[str, Any], finished_at: Mapping[str, float],
                 gpu_index: Mapping[str, int]) -> list[Sample]:
    """``latest``: diag name → DiagOutcome; ``gpu_index``: GPU UUID → the agent's GPU index."""
    out: list[Sample] = []
    for diag, outcome in sorted(latest.items()):
        labels = (("diag", diag),)
        if outcome.status != "skipped":
            out.append(Sample("diag_success", 1.0 if outcome.status == "ok" else 0.0,
                              "1 if the diagnostic's last periodic run finished, 0 if it failed or timed out",
                              labels=labels))
        if diag in finished_at:
            out.append(Sample("diag_last_run_timestamp_seconds", finished_at[diag],
                              "When the diagnostic last ran (seconds since the epoch)", labels=labels))
        for uuid, seconds in sorted(outcome.gpu_seconds.items()):
            if uuid in gpu_index:
                out.append(Sample("diag_gpu_seconds", float(seconds),
                                  "GPU time the diagnostic's last run used on this GPU", gpu=gpu_index[uuid],
                                  labels=labels))
        if outcome.status != "ok" or not isinstance(outcome.result, Mapping):
            continue
        if diag == "busbw":
            out += _busbw(outcome.result)
        elif diag == "bandwidth":
            out += _bandwidth(outcome.result, gpu_index)
    return out


def screen_samples(screens: Mapping[str, Any], gpu_index: Mapping[str, int]) -> list[Sample]:
    """``screens``: GPU UUID → its latest ``ScreenResult``; GPUs the agent no longer lists are left out."""
    out = []
    for uuid, r in sorted(screens.items()):
        if uuid not in gpu_index:
            continue
        out.append(Sample("gpu_screen_last_timestamp_seconds", float(r.finished_at),
                          "When the GPU's latest screen ended (seconds since the epoch); labels: its level and "
                          "result (pass, fail, aborted, error)", gpu=gpu_index[uuid],
                          labels=(("level", r.level), ("result", r.result))))
    return out


def _busbw(result: Mapping[str, Any]) -> list[Sample]:
    out = []
    for p in result.get("points", []):
        try:
            labels = (("collective", str(p["collective"])), ("size_bytes", str(int(p["size_bytes"]))),
                      ("ranks", str(int(p["world"]))))
            out.append(Sample("diag_busbw_bytes_per_second", float(p["busbw_gbps"]) * GB,
                              "Bus bandwidth (nccl-tests formula) the last periodic probe measured", labels=labels))
        except (KeyError, TypeError, ValueError):
            continue  # a malformed point is not exported; the others are
    return out


def _bandwidth(result: Mapping[str, Any], gpu_index: Mapping[str, int]) -> list[Sample]:
    out = []
    for g in result.get("gpus", []):
        index = gpu_index.get(str(g.get("uuid", "")))
        if index is None:
            continue
        for key, direction in _BANDWIDTH_DIRECTIONS:
            value = g.get(key)
            if isinstance(value, int | float):
                out.append(Sample("diag_memory_bandwidth_bytes_per_second", float(value) * GB,
                                  "Memory bandwidth the last periodic probe measured on this GPU", gpu=index,
                                  labels=(("direction", direction),)))
    return out
