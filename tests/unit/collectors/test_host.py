"""Host basics: samples from a real reader, memory pressure judged from injected facts."""

from __future__ import annotations

import time

from collector_kit import Sweeper, recording

from gpuhealth.collectors import host
from gpuhealth.model import Action, EntityKind, MetricKind, Severity


class FixedReader:
    def __init__(self, facts: host.HostFacts) -> None:
        self.facts = facts

    def read(self) -> host.HostFacts:
        return self.facts


def facts(**kw) -> host.HostFacts:
    base = dict(load=(1.0, 0.5, 0.25), memory_total=64 << 30, memory_available=32 << 30, swap_used=0,
                boot_time=time.time() - 3600, cpu_count=32, kernel="6.8.0-test", memory_psi_some_avg60=0.0)
    base.update(kw)
    return host.HostFacts(**base)


def test_real_host_reader_gives_samples_and_no_false_alarm(clock, tmp_path):
    s = Sweeper(host.HostCollector(host.SystemHostReader(proc_root=tmp_path)), recording("nvml_h100x1.json", clock),
                clock)
    findings = s.sweep()
    names = {x.name for x in s.last_samples}
    assert {"host_load_average", "host_memory_total_bytes", "host_memory_available_bytes", "host_uptime_seconds",
            "host_cpus", "host_kernel_info"} <= names
    assert all(x.gpu is None for x in s.last_samples)
    (kernel,) = [x for x in s.last_samples if x.name == "host_kernel_info"]
    assert kernel.kind is MetricKind.INFO and dict(kernel.labels)["release"]
    assert s.last_obs.node["memory_psi_some_avg60"] is None  # no pressure file in this proc tree
    node = s.last_obs.node
    short = node["memory_available"] / node["memory_total"] < 0.05
    assert [f.code for f in findings] == (["host.memory_pressure"] if short else [])


def test_low_available_memory_is_pressure(clock):
    s = Sweeper(host.HostCollector(FixedReader(facts(memory_available=1 << 30))), recording("nvml_h100x1.json", clock),
                clock)
    (f,) = s.sweep()
    assert (f.code, f.severity, f.action, f.entity.kind) == ("host.memory_pressure", Severity.WARNING,
                                                             Action.CHECK_JOB, EntityKind.NODE)
    assert f.evidence["available_share"] == round(1 / 64, 4)


def test_psi_stall_is_pressure_and_calm_host_is_not(clock):
    hot = Sweeper(host.HostCollector(FixedReader(facts(memory_psi_some_avg60=35.0))),
                  recording("nvml_h100x1.json", clock), clock)
    (f,) = hot.sweep()
    assert "PSI" in f.message and f.evidence["psi_some_avg60"] == 35.0
    calm = Sweeper(host.HostCollector(FixedReader(facts(load=(90.0, 90.0, 90.0)))),
                   recording("nvml_h100x1.json", clock), clock)
    assert calm.sweep() == []  # a busy data loader is not a problem


def test_psi_parsing():
    text = "some avg10=1.50 avg60=22.25 avg300=3.00 total=123\nfull avg10=0.00 avg60=5.00 avg300=0.00 total=9\n"
    assert host.parse_psi_some_avg60(text) == 22.25
    assert host.parse_psi_some_avg60("garbage") is None
