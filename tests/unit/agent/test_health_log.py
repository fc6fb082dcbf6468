"""The agent's health-change log (agent/health_log.py): one line per change of a GPU's or the node's
health or action, with the finding that made it; nothing when only a message's numbers move."""

from __future__ import annotations

import logging

from gpuhealth.agent.health_log import HealthLog
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.model import Action, Entity, Finding, Severity
from gpuhealth.node import assemble_report

GPUS = [GpuIdentity(i, f"GPU-{i}", "NVIDIA H200", f"00000000:{0x18 + i:02x}:00.0") for i in range(2)]


def _report(*findings: Finding):  # type: ignore[no-untyped-def]
    return assemble_report(node="n1", simulated=True, backend="test", time=0.0, gpus=GPUS, findings=findings,
                           versions={}, collectors=[])


def _hot(gpu: int, celsius: int) -> Finding:
    return Finding("thermal.gpu_hot", Severity.WARNING, Entity.gpu(f"GPU-{gpu}", gpu),
                   f"GPU {gpu} at {celsius} °C, above its slowdown threshold", Action.MONITOR, {"temp": celsius})


def _xid79(gpu: int) -> Finding:
    return Finding("xid.79", Severity.CRITICAL, Entity.gpu(f"GPU-{gpu}", gpu),
                   f"XID 79 on GPU {gpu}: GPU has fallen off the bus", Action.REBOOT, {"xid": 79})


def test_a_healthy_start_logs_nothing_and_a_faulty_start_names_the_finding() -> None:
    assert HealthLog().observe(_report()) == []
    [gpu, node] = HealthLog().observe(_report(_hot(1, 91)))
    assert gpu.level == logging.WARNING and gpu.text.startswith("GPU 1 (GPU-1) degraded at start (action monitor)")
    assert "thermal.gpu_hot [warning] on gpu GPU-1: GPU 1 at 91 °C" in gpu.text
    assert node.text.startswith("node n1 degraded at start") and node.extra["codes"] == ["thermal.gpu_hot"]


def test_each_change_is_one_line_with_its_finding_and_recovery_says_what_cleared() -> None:
    log = HealthLog()
    log.observe(_report())
    [gpu, node] = log.observe(_report(_xid79(0)))
    assert gpu.level == logging.WARNING
    assert gpu.text.startswith("GPU 0 (GPU-0) unhealthy (action reboot), was healthy: xid.79 [critical] on gpu GPU-0")
    assert "fallen off the bus (action reboot)" in gpu.text
    assert gpu.extra == {"event": "health_change", "subject": "GPU-0", "health": "unhealthy", "was": "healthy",
                         "action": "reboot", "codes": ["xid.79"]}
    assert node.text.startswith("node n1 unhealthy (action reboot), was healthy: xid.79")
    assert log.observe(_report(_xid79(0))) == []  # nothing changed: no line
    [gpu, node] = log.observe(_report())
    assert gpu.level == logging.INFO and node.level == logging.INFO
    assert gpu.text.startswith("GPU 0 (GPU-0) healthy, was unhealthy (action reboot): recovered; cleared xid.79")


def test_numbers_in_a_message_do_not_make_lines_but_a_worse_action_does() -> None:
    log = HealthLog()
    log.observe(_report(_hot(1, 91)))
    for celsius in range(92, 100):
        assert log.observe(_report(_hot(1, celsius))) == []
    # the GPU stays degraded, but what it needs is now a drain: that is news
    drain = Finding("power.brake", Severity.WARNING, Entity.gpu("GPU-1", 1), "GPU 1: power brake asserted",
                    Action.DRAIN)
    [gpu, node] = log.observe(_report(_hot(1, 99), drain))
    assert gpu.level == logging.WARNING
    assert gpu.text.startswith("GPU 1 (GPU-1) degraded (action drain), was degraded (action monitor)")
    assert "power.brake" in gpu.text and "n1" in node.text


def test_a_node_finding_changes_the_node_only() -> None:
    log = HealthLog()
    log.observe(_report())
    down = Finding("nvlink.fabric_degraded", Severity.CRITICAL, Entity.node("n1"), "fabric degraded", Action.DRAIN)
    [node] = log.observe(_report(down))
    assert node.extra["subject"] == "node" and "nvlink.fabric_degraded" in node.text
