"""Test support for the hardware collectors: real recordings and scenario files through the fake
NVML backend, contexts built the way the runner builds them, and a sweep loop on a step clock.

(Not a conftest: the module name is unique so it can sit beside other helpers' tests.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import CollectContext, Collector, History, Observations
from gpuhealth.collectors.runner import enumerate_gpus
from gpuhealth.config import Config
from gpuhealth.model import Finding, Sample, Severity

SCENARIOS = Path(__file__).resolve().parents[2] / "fixtures" / "scenarios"
NODE = "node-a"


def scenario(name: str, clock: Any) -> FakeNvml:
    b = FakeNvml.from_file(SCENARIOS / name, clock=clock)
    b.init()
    return b


def recording(name: str, clock: Any) -> FakeNvml:
    b = FakeNvml.bundled(name, clock=clock)
    b.init()
    return b


def inline(clock: Any, overrides: Mapping[str, Any] | None = None, *, rec: str = "nvml_h200x2.json",
           **extra: Any) -> FakeNvml:
    """A scenario written in the test itself (same format as the YAML files)."""
    data: dict[str, Any] = {"recording": rec, "overrides": dict(overrides or {}), **extra}
    b = FakeNvml.from_scenario(data, clock=clock)
    b.init()
    return b


def context(backend: Any, clock: Any, *, config: Config | None = None, sysfs: Any = None,
            extras: Mapping[str, Any] | None = None, previous: Any = ()) -> CollectContext:
    """A context as the agent builds one; ``previous`` (the last sweep's GPUs) keeps the identity
    of a GPU that stopped answering."""
    return CollectContext(
        backend=backend, config=config or Config(), gpus=enumerate_gpus(backend, previous), node_name=NODE,
        now=float(clock()), sysfs=sysfs, extras=dict(extras or {}),
    )


@dataclass
class Sweeper:
    """Runs one collector repeatedly as the runner does: collect → evaluate → samples → history."""

    collector: Collector
    backend: Any
    clock: Any
    config: Config | None = None
    sysfs: Any = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    history: History = field(default_factory=History)
    last_obs: Observations | None = None
    last_samples: list[Sample] = field(default_factory=list)
    gpus: list[Any] = field(default_factory=list)

    def sweep(self) -> list[Finding]:
        ctx = context(self.backend, self.clock, config=self.config, sysfs=self.sysfs, extras=self.extras,
                      previous=self.gpus)
        self.gpus = list(ctx.gpus)
        obs = self.collector.collect(ctx)
        findings = list(self.collector.evaluate(obs, self.history, ctx))
        self.last_samples = list(self.collector.samples(obs, ctx))
        self.history.append(obs)
        self.last_obs = obs
        return findings

    def after(self, seconds: float) -> list[Finding]:
        self.clock.advance(seconds)
        return self.sweep()


def problems(findings: list[Finding]) -> list[Finding]:
    """Warning and critical findings (info never changes health)."""
    return [f for f in findings if f.severity >= Severity.WARNING]


def by_code(findings: list[Finding], code: str) -> list[Finding]:
    return [f for f in findings if f.code == code]


def sample_values(samples: list[Sample], name: str, gpu: int | None = None,
                  **labels: str) -> list[float]:
    out = []
    for s in samples:
        if s.name != name or (gpu is not None and s.gpu != gpu):
            continue
        have = dict(s.labels)
        if all(have.get(k) == v for k, v in labels.items()):
            out.append(s.value)
    return out
