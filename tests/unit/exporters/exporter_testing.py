"""Snapshots for exporter tests: synthetic ones, and real ones from the collectors on a recording."""

from __future__ import annotations

import time
from pathlib import Path

from gpuhealth.agent.cache import Cache
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import CollectContext, GpuIdentity
from gpuhealth.collectors.registry import all_collectors
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.config import Config
from gpuhealth.exporters import ExportSnapshot, NodeFacts

GPU0 = GpuIdentity(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", "00000000:18:00.0", 0)
GPU1 = GpuIdentity(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", "00000000:2A:00.0", 1)


def real_snapshot(source: str | Path, *, node_name: str = "node-a", gpu_labels: dict | None = None) -> ExportSnapshot:
    """Every registered collector run once over ``source`` (a recording or scenario), cached as the
    agent caches it. ``generated_at`` and collector durations/timestamps are fixed so text is stable."""
    from gpuhealth.backends.sysfs import sysfs_for
    from gpuhealth.node import default_kmsg

    backend = FakeNvml.from_file(source)
    backend.init()
    cfg = Config()
    cfg.agent.node_name = node_name
    gpus = tuple(enumerate_gpus(backend))
    cache = Cache(NodeFacts(node_name=node_name, simulated=True, backend="simulated from test", version="0.1.0",
                            driver_version=str(backend.system("driver")),
                            cuda_driver_version=str(backend.system("cuda_driver")), nvml_up=True, gpus=gpus,
                            gpu_labels=gpu_labels or {}), clock=lambda: 1_800_000_000.0)
    ctx = CollectContext(backend=backend, config=cfg, gpus=gpus, node_name=node_name, now=time.time(),
                         sysfs=sysfs_for(backend, "/"), kmsg=default_kmsg(backend, cfg), extras={"one_shot": True})
    runner = CollectorRunner(timeout_s=None)
    collectors = all_collectors(cfg)
    try:
        for col in collectors:
            history = cache.register(col.name, str(col.lane), 5.0)
            run = runner.run(col, ctx, history)
            run.started, run.duration_s = 1_800_000_000.0, 0.001
            cache.record(run)
    finally:
        for col in collectors:
            close = getattr(col, "close", None)
            if callable(close):
                close()
    return cache.snapshot()
