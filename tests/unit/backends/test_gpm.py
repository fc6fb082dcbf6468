"""``read_gpm`` drives NVML's GPM calls in the order the API wants (two samples, metrics between them,
the older sample freed, the newer kept for the next call). The stand-in is pynvml-shaped at the
hardware boundary: real ctypes structs from the bindings, counters that the test advances."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.gpm import METRICS, read_gpm


class GpmDriver:
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    locals().update({k: v for k, v in vars(pynvml).items() if k.startswith("NVML_GPM_METRIC_")})

    def __init__(self, supported: bool = True) -> None:
        self.supported = supported
        self.live: set[int] = set()
        self.taken: list[int] = []
        self.busy = 0.0  # what the next metrics call reports, percent

    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        return type("S", (), {"isSupportedDevice": int(self.supported)})()

    def nvmlGpmSampleAlloc(self) -> Any:
        sample = pynvml.c_nvmlGpmSample_t()
        self.live.add(id(sample))
        return sample

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> None:
        self.taken.append(id(sample))

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.live.remove(id(sample))

    def nvmlGpmMetricsGet(self, query: Any) -> Any:
        assert query.version == pynvml.NVML_GPM_METRICS_GET_VERSION and query.numMetrics == len(METRICS)
        for j in range(query.numMetrics):
            query.metrics[j].value = self.busy + j
            query.metrics[j].nvmlReturn = 0 if j < query.numMetrics - 1 else errors.NOT_SUPPORTED
        return query


def test_metrics_between_consecutive_samples_and_no_leak() -> None:
    drv, state = GpmDriver(), {}
    drv.busy = 50.0
    first = read_gpm(drv, "h0", state)
    assert first == {name: 50.0 + j for j, name in enumerate(METRICS[:-1])}  # a failed metric is left out
    assert len(drv.taken) == 2 and len(drv.live) == 1  # two samples; the older one freed
    drv.busy = 10.0
    second = read_gpm(drv, "h0", state)
    assert second["SM_UTIL"] == 10.0
    assert len(drv.taken) == 3 and len(drv.live) == 1  # one new sample per call afterwards


def test_a_gpu_without_gpm_says_not_supported() -> None:
    with pytest.raises(NvmlError) as exc:
        read_gpm(GpmDriver(supported=False), "h0", {})
    assert exc.value.not_supported
