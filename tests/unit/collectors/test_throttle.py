"""Clock-event reasons and violation counters."""

from __future__ import annotations

import pytest
from collector_kit import Sweeper, inline, problems, recording, sample_values, scenario

from gpuhealth.collectors import throttle
from gpuhealth.model import Action, EntityKind, Severity


@pytest.mark.parametrize("rec", ["nvml_h200x2.json", "nvml_h100x1.json"])
def test_real_recordings_idle_reason_is_healthy(clock, rec):
    s = Sweeper(throttle.create(), recording(rec, clock), clock)
    assert s.sweep() == []
    assert s.after(60) == []
    assert s.last_obs.per_gpu[0]["reasons"] == 1  # GPU idle
    assert sample_values(s.last_samples, "gpu_throttle_reason_active", 0, reason="gpu_idle") == [1.0]
    assert sample_values(s.last_samples, "gpu_throttle_reason_active", 0, reason="hw_slowdown") == [0.0]
    # The low-utilization violation counter is recorded as seconds (counter).
    (low,) = sample_values(s.last_samples, "gpu_throttle_violation_seconds", 0, reason="low_utilization")
    assert low > 1.0


def test_decode_and_problem_reasons():
    assert [r.name for r in throttle.decode(0x1 | 0x2 | 0x100)] == ["gpu_idle", "applications_clocks",
                                                                     "display_clocks"]
    assert throttle.problem_reasons(0x1 | 0x2 | 0x10 | 0x100) == []
    assert [r.name for r in throttle.problem_reasons(0x8)] == ["hw_slowdown"]
    # HW slowdown is the umbrella bit: fold it into the specific reason.
    assert [r.name for r in throttle.problem_reasons(0x8 | 0x40)] == ["hw_thermal"]
    assert [r.name for r in throttle.problem_reasons(0x8 | 0x80 | 0x20)] == ["sw_thermal", "hw_power_brake"]


def test_hw_slowdown_is_a_warning_on_that_gpu(clock):
    b = scenario("hw_slowdown.yaml", clock)
    f = Sweeper(throttle.create(), b, clock).sweep()
    (hw,) = problems(f)
    assert (hw.code, hw.severity, hw.action) == ("throttle.hw_slowdown", Severity.WARNING, Action.MONITOR)
    assert hw.entity.kind is EntityKind.GPU and hw.entity.gpu_index == 1
    assert hw.entity.id == b.query(1, "UUID")
    assert hw.evidence["reasons"] == ["hw_slowdown"]


def test_power_brake_named_once_and_sustained_means_drain(clock):
    b = scenario("hw_power_brake.yaml", clock)
    s = Sweeper(throttle.create(), b, clock)
    (first,) = problems(s.sweep())  # one sweep: a BMC capping power looks just like this — a warning only
    assert (first.code, first.severity, first.action, first.evidence["sustained"]) == (
        "throttle.hw_power_brake", Severity.WARNING, Action.MONITOR, False)
    (later,) = problems(s.after(30))  # counter grew 15 s in 30 s: 50 % of wall time
    assert later.code == "throttle.hw_power_brake" and later.evidence["sustained"] is True
    assert later.action is Action.DRAIN
    assert later.evidence["violation_share"] == pytest.approx(0.5)


def test_a_power_brake_blip_is_a_warning_and_never_drains(clock):
    # the bit in one sweep, then clear; its counter grew 3 s in 30 s (10 %, under the 20 % rule)
    b = inline(clock, {"0": {"CurrentClocksEventReasons": 0x88}},
               events=[{"at": 5, "type": "set", "gpu": 0, "key": "CurrentClocksEventReasons", "value": 0x1},
                       {"at": 30, "type": "set", "gpu": 0, "key": "field_values",
                        "value": {"NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 3_000_000_000}}])
    s = Sweeper(throttle.create(), b, clock)
    seen = [problems(s.sweep()), *(problems(s.after(5)) for _ in range(12))]
    brakes = [f for found in seen for f in found if f.code == "throttle.hw_power_brake"]
    assert brakes and all((f.severity, f.action) == (Severity.WARNING, Action.MONITOR) for f in brakes)


def test_a_power_brake_held_in_every_sweep_for_the_window_drains_without_counters(clock):
    # drivers without the violation counter: the bit held sweep after sweep for 30 s is sustained
    b = inline(clock, {"0": {"CurrentClocksEventReasons": 0x88}})
    s = Sweeper(throttle.create(), b, clock)
    actions = [problems(s.sweep())[0].action, *(problems(s.after(5))[0].action for _ in range(6))]
    assert actions == [Action.MONITOR] * 6 + [Action.DRAIN]  # t = 0 … 25 s: a warning; t = 30 s: drain
    (held,) = problems(s.after(5))
    assert held.evidence["sustained"] is True and held.evidence["held_s"] == pytest.approx(35.0)


def test_sw_power_cap_is_info_only(clock):
    b = inline(clock, {"0": {"CurrentClocksEventReasons": 0x4}})
    f = Sweeper(throttle.create(), b, clock).sweep()
    assert problems(f) == []
    assert [(x.code, x.severity) for x in f] == [("throttle.sw_power_cap", Severity.INFO)]


def test_thermal_throttling_between_polls_found_from_counter(clock):
    b = inline(clock, events=[{"at": 30, "type": "set", "gpu": 0, "key": "field_values",
                               "value": {"NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 3_000_000_000}}])
    s = Sweeper(throttle.create(), b, clock)
    assert s.sweep() == []
    (f,) = problems(s.after(30))  # bit clear now, but 3 s of HW thermal slowdown in the last 30 s
    assert f.code == "throttle.hw_thermal" and f.entity.gpu_index == 0
    assert "between polls" in f.message
    assert f.evidence["violation_share"] == pytest.approx(0.1) and f.evidence["sustained"] is False
    # The costly counters are not re-read for 30 s; the finding stays steady meanwhile.
    (same,) = problems(s.after(5))
    assert same.evidence == f.evidence
    assert [x.code for x in problems(s.after(25))] == ["throttle.hw_thermal"]  # t=60: grew within the minute
    assert [x.code for x in problems(s.after(30))] == []  # t=90: nothing in the last minute


def test_older_driver_without_event_reasons_uses_throttle_reasons(clock):
    b = inline(clock, {"0": {"CurrentClocksEventReasons": {"error": "Function Not Found", "code": 13},
                             "CurrentClocksThrottleReasons": 0x40}})
    s = Sweeper(throttle.create(), b, clock)
    (f,) = problems(s.sweep())
    assert f.code == "throttle.hw_thermal"
    assert s.last_obs.errors == []  # "Function Not Found" is unsupported, not an error


def test_costly_violation_reads_are_spread_over_sweeps_on_a_big_node(clock):
    b = scenario("faulty_node.yaml", clock)  # 8 GPUs
    per_sweep: list[int] = []
    current: list[int] = []

    class Counting:
        def __getattr__(self, name: str):
            return getattr(b, name)

        def field_values(self, index: int, requests):
            current.append(index)
            return b.field_values(index, requests)

    s = Sweeper(throttle.create(), Counting(), clock)
    for _ in range(18):  # t = 0, 5, … 85
        current.clear()
        s.sweep()
        per_sweep.append(len(current))
        clock.advance(5)
    assert per_sweep[0] == 8  # first look: every GPU
    assert max(per_sweep[1:]) <= 2  # afterwards ~8 GPUs / 6 sweeps, never all at once
    # Second reads fall between 30 s and 60 s (spread by GPU), then every 30 s: in 85 s that is
    # two more reads for GPUs 0-6 and one for GPU 7 (second read at 60 s, third due at 90 s).
    assert sum(per_sweep[1:]) == 15
    assert per_sweep[:6] == [8, 0, 0, 0, 0, 0]
