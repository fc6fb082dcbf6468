"""NVML's GPU Performance Monitoring (``nvmlGpmMetricsGet``, Hopper and later): the profiling ratios
DCGM's profiling module reports as ``DCGM_FI_PROF_*``, read from NVML alone.

GPM compares two samples of the GPU's counters. ``read_gpm`` keeps the previous sample per GPU in
``state`` and answers the metrics over the time since then (the first call of a GPU takes two
samples ``FIRST_GAP_S`` apart). Values are NVML's units (percent; MiB/s for PCIe and NVLink traffic), keyed by
the metric's name without ``NVML_GPM_METRIC_`` (recording key ``GpmMetrics``).
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError

# Percentages, then PCIe and NVLink (all links) traffic from (TX) and to (RX) the GPU in MiB/s
# (DCGM_FI_PROF_PCIE_*_BYTES, DCGM_FI_PROF_NVLINK_*_BYTES).
METRICS = ("SM_UTIL", "SM_OCCUPANCY", "ANY_TENSOR_UTIL", "DRAM_BW_UTIL", "GRAPHICS_UTIL", "PCIE_TX_PER_SEC",
           "PCIE_RX_PER_SEC", "NVLINK_TOTAL_TX_PER_SEC", "NVLINK_TOTAL_RX_PER_SEC")
FIRST_GAP_S = 0.1


def read_gpm(n: Any, handle: Any, state: MutableMapping[int, Any]) -> dict[str, float]:
    """The GPM metrics of one GPU since the previous call (``state``: GPU handle id → last sample).
    Raises ``NvmlError(NOT_SUPPORTED)`` when the GPU or these bindings have no GPM."""
    ids = [(name, getattr(n, "NVML_GPM_METRIC_" + name, None)) for name in METRICS]
    wanted = [(name, mid) for name, mid in ids if isinstance(mid, int)]
    if not wanted or not hasattr(n, "nvmlGpmMetricsGet"):
        raise NvmlError(errors.FUNCTION_NOT_FOUND, "these NVML bindings have no GPM")
    if not n.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
        raise NvmlError(errors.NOT_SUPPORTED, "GPM not supported on this GPU")
    key = id(handle)
    previous = state.get(key)
    if previous is None:
        previous = n.nvmlGpmSampleAlloc()
        n.nvmlGpmSampleGet(handle, previous)
        time.sleep(FIRST_GAP_S)
    current = n.nvmlGpmSampleAlloc()
    n.nvmlGpmSampleGet(handle, current)
    query = n.c_nvmlGpmMetricsGet_t()
    query.version = n.NVML_GPM_METRICS_GET_VERSION
    query.numMetrics = len(wanted)
    query.sample1 = previous
    query.sample2 = current
    for j, (_, mid) in enumerate(wanted):
        query.metrics[j].metricId = mid
    try:
        n.nvmlGpmMetricsGet(query)
    finally:
        n.nvmlGpmSampleFree(previous)
        state[key] = current  # the next call measures from here
    return {name: float(query.metrics[j].value) for j, (name, _) in enumerate(wanted)
            if int(query.metrics[j].nvmlReturn) == 0}


__all__ = ["METRICS", "read_gpm"]
