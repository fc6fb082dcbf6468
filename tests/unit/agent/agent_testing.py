"""Small collectors implementing the collector protocol, and a polling helper, for agent tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from gpuhealth.collectors.base import CollectContext, History, Lane, Observations
from gpuhealth.config import Config
from gpuhealth.model import Finding, MetricKind, Sample


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def fast_config(**collectors: object) -> Config:
    cfg = Config()
    cfg.collectors.fast_interval_s = 0.1
    cfg.collectors.slow_interval_s = 0.3
    cfg.collectors.timeout_s = 0.5
    cfg.agent.listen = "127.0.0.1:0"
    cfg.agent.node_name = "testnode"
    cfg.agent.pod_resources_socket = "/nonexistent/kubelet.sock"
    for k, v in collectors.items():
        setattr(cfg.collectors, k, v)
    return cfg


class TempCollector:
    """Reads the GPU temperature of every GPU (a real backend call per GPU)."""

    name = "temp"
    lane = Lane.FAST

    def __init__(self) -> None:
        self.runs = 0

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        self.runs += 1
        obs = Observations(self.name, ctx.now)
        for g in ctx.gpus:
            obs.read(ctx.backend, g.index, "Temperature_GPU")
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        return []

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        for i, rec in obs.per_gpu.items():
            if "Temperature_GPU" in rec:
                yield Sample("test_temperature_celsius", float(rec["Temperature_GPU"]), "test", MetricKind.GAUGE, i)


class RaisingCollector:
    name = "boom"
    lane = Lane.FAST

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        raise RuntimeError("sensor exploded")

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        return []

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        return []


class HangingCollector:
    """Hangs in ``collect`` until ``release`` is set (only on its first call)."""

    name = "hang"
    lane = Lane.FAST

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        self.calls += 1
        if self.calls == 1:
            self.release.wait(30)
        return Observations(self.name, ctx.now)

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        return []

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        return [Sample("test_hang_alive", 1.0, "test")]
