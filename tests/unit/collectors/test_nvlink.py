"""NVLink state and error rates (batched field values), NVSwitch fabric state."""

from __future__ import annotations

from typing import Any

import pytest
from collector_kit import Sweeper, by_code, context, inline, problems, recording, sample_values, scenario

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError
from gpuhealth.collectors import nvlink
from gpuhealth.config import Config
from gpuhealth.model import Action, EntityKind, Severity


def test_h200_all_18_links_up_is_healthy(clock):
    s = Sweeper(nvlink.create(), recording("nvml_h200x2.json", clock), clock)
    assert problems(s.sweep()) == []
    assert problems(s.after(60)) == []
    rec = s.last_obs.per_gpu[0]
    assert rec["link_count"] == 18 and rec["nvswitch_links"] == 18
    assert len(rec["link_states"]) == 18 and set(rec["link_states"].values()) == {1}
    assert sample_values(s.last_samples, "gpu_nvlink_links", 0, which="active") == [18.0]
    assert sample_values(s.last_samples, "gpu_nvlink_state", 1, link="17") == [1.0]
    assert sample_values(s.last_samples, "gpu_nvlink_errors", 0, link="4", counter="crc") == [0.0]


def test_h100_without_nvlink_is_not_18_links_down(clock):
    s = Sweeper(nvlink.create(), recording("nvml_h100x1.json", clock), clock)
    assert s.sweep() == []
    assert s.last_obs.per_gpu[0]["link_states"] == {}
    assert s.last_obs.errors == []  # every NVLink answer was "Not Supported": normal
    assert not [x for x in s.last_samples if x.name == "gpu_nvlink_state"]


def test_h100_when_config_expects_links_is_reported(clock):
    cfg = Config()
    cfg.collectors.expected_nvlinks = 18
    (f,) = Sweeper(nvlink.create(), recording("nvml_h100x1.json", clock), clock, config=cfg).sweep()
    assert (f.code, f.severity, f.entity.kind) == ("nvlink.link_down", Severity.CRITICAL, EntityKind.GPU)
    assert f.evidence == {"expected": 18, "up": 0}


def test_one_link_down_on_an_18_link_gpu(clock):
    b = scenario("nvlink_down.yaml", clock)
    s = Sweeper(nvlink.create(), b, clock)
    (f,) = problems(s.sweep())
    assert (f.code, f.severity, f.action) == ("nvlink.link_down", Severity.CRITICAL, Action.REBOOT)
    assert f.entity.kind is EntityKind.LINK and f.entity.id == f"{b.query(0, 'UUID')}/nvlink/5"
    assert f.entity.gpu_index == 0
    assert f.evidence == {"link": 5, "state": 0, "expected": 18, "up": 17}
    assert sample_values(s.last_samples, "gpu_nvlink_links", 0, which="active") == [17.0]
    assert sample_values(s.last_samples, "gpu_nvlink_state", 0, link="5") == [0.0]


def test_one_batch_per_gpu_with_rotating_counter_links(clock):
    b = recording("nvml_h200x2.json", clock)
    batches: list[int] = []
    singles: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(b, name)

        def field_values(self, index: int, requests: list[tuple[str, int]]) -> list[Any]:
            batches.append(len(requests))
            return b.field_values(index, requests)

        def nvlink(self, index: int, link: int, key: str) -> Any:
            singles.append(key)
            return b.nvlink(index, link, key)

    c = nvlink.NvlinkCollector(counter_links_per_sweep=6)
    read: list[list[int]] = []
    for _ in range(4):
        obs = c.collect(context(Counting(), clock))
        read.append(obs.per_gpu[0]["counter_links_read"])
        assert len(obs.per_gpu[0]["link_states"]) == 18  # every link's state, every sweep
    assert singles == []  # never the ~1 ms-per-call per-link getters
    # First look: link count (cached after), then 18 states + every link's 3 counters + the two
    # all-link traffic counters, per GPU; afterwards 18 states + 6 links × 3 counters + traffic.
    assert batches == [2, 74, 2, 74] + [38, 38] * 3
    assert read == [list(range(18)), list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]
    assert all(f"link{n}.crc" in obs.per_gpu[1] for n in range(18))
    # the recorded NVLink traffic counters (KiB) become bytes, per direction
    traffic = {dict(s.labels)["direction"]: s.value for s in c.samples(obs, context(b, clock))
               if s.name == "gpu_nvlink_traffic_bytes" and s.gpu == 0}
    fields = b.field_values(0, [("NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX", 0),
                                ("NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX", 0)])
    assert traffic == {"tx": fields[0] * 1024.0, "rx": fields[1] * 1024.0}


def test_default_rotation_reads_every_link_within_five_sweeps(clock):
    c = nvlink.create()
    b = recording("nvml_h200x2.json", clock)
    chunks = [c.collect(context(b, clock)).per_gpu[0]["counter_links_read"] for _ in range(7)]
    assert [len(x) for x in chunks] == [18, 4, 4, 4, 4, 4, 4]
    assert set().union(*chunks[1:6]) == set(range(18))
    assert chunks[5] == [16, 17, 0, 1] and chunks[6] == [2, 3, 4, 5]


def test_rotating_reads_keep_rates_and_findings_steady(clock):
    b = inline(clock, events=[{"at": 30, "type": "set", "gpu": 0, "key": "nvlink",
                               "value": {"8": {"err_DL_CRC_FLIT": 60}}}])
    s = Sweeper(nvlink.NvlinkCollector(counter_links_per_sweep=6), b, clock)
    assert problems(s.sweep()) == []  # t=0: every link read (link 8 = 0)
    assert problems(s.after(60)) == []  # t=60: links 0-5
    (f,) = problems(s.after(60))  # t=120: links 6-11: link 8 +60 since its read at t=0
    assert f.entity.id.endswith("/nvlink/8") and f.severity is Severity.WARNING
    assert f.evidence["crc_increase"] == 60 and f.evidence["window_s"] == 120.0
    (again,) = problems(s.after(60))  # t=180: links 12-17; link 8's last reading still stands
    assert again.evidence == f.evidence
    assert problems(s.after(60))
    assert problems(s.after(60)) == []  # t=300: link 8 re-read, no growth since t=120: quiet


def test_crc_growth_warns_then_critical_at_100_per_second_and_replay_is_critical(clock):
    b = scenario("nvlink_crc_ramp.yaml", clock)
    s = Sweeper(nvlink.NvlinkCollector(counter_links_per_sweep=None), b, clock)  # every link, every sweep
    assert problems(s.sweep()) == []
    found = {x.entity.id.rsplit("/", 1)[1]: x for x in problems(s.after(20))}
    uuid = b.query(1, "UUID")
    assert set(found) == {"3", "7"}
    crc, replay = found["3"], found["7"]
    assert crc.entity.id == f"{uuid}/nvlink/3" and crc.entity.gpu_index == 1
    assert (crc.code, crc.severity, crc.action) == ("nvlink.errors", Severity.WARNING, Action.MONITOR)
    assert crc.evidence["crc_increase"] == 100 and crc.evidence["crc_per_second"] == pytest.approx(5.0)
    assert (replay.severity, replay.action, replay.evidence["replay_increase"]) == (Severity.CRITICAL,
                                                                                    Action.DRAIN, 2)
    (crc2,) = [x for x in problems(s.after(20)) if x.entity.id.endswith("/nvlink/3")]
    assert crc2.severity is Severity.CRITICAL  # +30000 in the 20 s since the last read: 1500/s ≥ 100/s
    assert crc2.evidence["crc_per_second"] == pytest.approx(1500.0)


def test_error_counters_that_do_not_move_are_quiet(clock):
    # The H200 recording has non-zero (old) CRC data/ECC counts; only growth matters.
    s = Sweeper(nvlink.create(), recording("nvml_h200x2.json", clock), clock)
    s.sweep()
    assert by_code(s.after(600), "nvlink.errors") == []


def test_fabric_completed_with_error_is_critical(clock):
    b = scenario("fabric_degraded.yaml", clock)
    (f,) = problems(Sweeper(nvlink.create(), b, clock).sweep())
    assert (f.code, f.severity, f.entity.gpu_index) == ("fabric.degraded", Severity.CRITICAL, 0)
    assert f.evidence["state"] == "completed" and f.evidence["status"] == 999


@pytest.mark.parametrize(("state", "severity"), [(1, Severity.CRITICAL), (2, Severity.WARNING)])
def test_fabric_not_finished(clock, state, severity):
    b = inline(clock, {"1": {"GpuFabricInfo": {"state": state, "status": 0, "cliqueId": 0}}})
    (f,) = problems(Sweeper(nvlink.create(), b, clock).sweep())
    assert (f.code, f.severity, f.entity.gpu_index) == ("fabric.degraded", severity, 1)


def test_fabric_healthy_and_not_supported_are_quiet(clock):
    b = inline(clock, {"0": {"GpuFabricInfo": {"state": 3, "status": 0, "cliqueId": 1}}})
    assert problems(Sweeper(nvlink.create(), b, clock).sweep()) == []
    h100 = recording("nvml_h100x1.json", clock)  # state NOT_SUPPORTED
    assert problems(Sweeper(nvlink.create(), h100, clock).sweep()) == []


def test_a_lost_gpu_is_not_reported_as_all_links_down(clock):
    b = inline(clock, events=[{"at": 60, "type": "lost", "gpu": 1}])
    s = Sweeper(nvlink.create(), b, clock)
    assert problems(s.sweep()) == []  # link count learnt and cached while the GPU answered
    assert problems(s.after(60)) == []  # GPU 1 fell off the bus: presence reports gpu.lost, not 18 links down
    assert s.last_obs.per_gpu[1] == {"link_count": 18, "nvswitch_links": 18, "unreadable": True}
    assert {e.gpu for e in s.last_obs.errors} == {1}
    assert len(s.last_obs.per_gpu[0]["link_states"]) == 18  # the other GPU is still read


def test_growth_is_judged_with_a_fast_slow_lane(clock):
    """With the slow lane at 1 s, a link's previous read (one rotation, ~5 s ago) is younger than
    min_window_s: its growth must be judged against an older read, not skipped and then lost."""
    b = inline(clock, events=[{"at": 3, "type": "set", "gpu": 1, "key": "nvlink",
                               "value": {"7": {"err_DL_REPLAY": 5}}}])
    s = Sweeper(nvlink.create(), b, clock)
    s.sweep()
    found, seconds = [], 0
    while not found and seconds < 30:
        seconds += 1
        found = problems(s.after(1.0))
    [f] = found
    assert f.code == "nvlink.errors" and f.severity is Severity.CRITICAL and f.entity.id.endswith("/nvlink/7")
    assert seconds <= 10 + 5  # min_window_s, then at most one rotation of the link reads


# --- False drains where the link state is unknown or the links never trained (audit 2026-11-28, items 1) ---

class _StateFieldUnserved:
    """A driver that answers INVALID_ARGUMENT to NVML's per-link state field (ids newer than it serves), while
    the per-link getter answers from the recording as the driver would."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.getter_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def field_values(self, index: int, requests: list[tuple[str, int]]) -> list[Any]:
        got = self.backend.field_values(index, requests)
        return [NvmlError(errors.INVALID_ARGUMENT, "Invalid Argument") if name == nvlink.STATE_FIELD else v
                for (name, _), v in zip(requests, got, strict=True)]

    def nvlink(self, index: int, link: int, key: str) -> Any:
        self.getter_calls += 1
        return self.backend.nvlink(index, link, key)


def test_an_unserved_state_field_falls_back_to_the_per_link_query(clock):
    b = _StateFieldUnserved(recording("nvml_h200x2.json", clock))
    s = Sweeper(nvlink.create(), b, clock)
    found = s.sweep()
    assert problems(found) == [] and by_code(found, "nvlink.state_unknown") == []
    assert s.last_obs.per_gpu[0]["link_states"] == dict.fromkeys(range(18), 1)
    assert s.last_obs.per_gpu[0]["state_source"] == "nvmlDeviceGetNvLinkState"
    assert b.getter_calls == 2 * 18


def test_a_down_link_is_still_found_through_the_per_link_query(clock):
    b = _StateFieldUnserved(scenario("nvlink_down.yaml", clock))
    (f,) = problems(Sweeper(nvlink.create(), b, clock).sweep())
    assert (f.code, f.severity, f.action) == ("nvlink.link_down", Severity.CRITICAL, Action.REBOOT)
    assert f.evidence == {"link": 5, "state": 0, "expected": 18, "up": 17}


def test_links_whose_state_nobody_can_read_are_not_down(clock):
    s = Sweeper(nvlink.create(), scenario("nvlink_state_field_unserved.yaml", clock), clock)
    found = s.sweep()
    assert by_code(found, "nvlink.link_down") == []
    unknown = by_code(found, "nvlink.state_unknown")
    assert [(f.entity.gpu_index, f.severity, f.action) for f in unknown] == [(0, Severity.INFO, Action.NONE),
                                                                             (1, Severity.INFO, Action.NONE)]
    assert s.last_obs.errors == []  # INVALID_ARGUMENT from field and getter: unsupported, not a failing GPU


def test_a_vm_slice_whose_links_never_trained_is_info_not_18_links_down(clock):
    s = Sweeper(nvlink.create(), scenario("nvlink_vm_1gpu_untrained.yaml", clock), clock)
    (f,) = [x for x in s.sweep() if x.code.startswith("nvlink.")]
    assert (f.code, f.severity, f.action, f.entity.gpu_index) == ("nvlink.untrained", Severity.INFO, Action.NONE, 0)
    assert f.evidence["links_inactive"] == list(range(18)) and "never trained" in f.message
    assert [x.code for x in s.after(60) if x.code.startswith("nvlink.")] == ["nvlink.untrained"]


def test_links_seen_active_that_all_go_inactive_are_down(clock):
    """Every link of GPU 0 drops at once: no other link is up, but this agent saw them active."""
    b = inline(clock, events=[{"at": 30, "type": "set", "gpu": 0, "key": "nvlink",
                               "value": {str(n): {"state": 0} for n in range(18)}}])
    s = Sweeper(nvlink.create(), b, clock)
    assert problems(s.sweep()) == []
    down = by_code(s.after(60), "nvlink.link_down")
    assert len(down) == 18 and {f.severity for f in down} == {Severity.CRITICAL}
    assert down[0].evidence == {"link": 0, "state": 0, "expected": 18, "up": 0}
    assert "it was active earlier" in down[0].message


def test_an_untrained_gpu_beside_a_trained_one_is_judged_on_its_own(clock):
    """GPU 1 never trained; GPU 0 has 17 of 18 up: only GPU 0's inactive link is down."""
    b = inline(clock, {"0": {"nvlink": {"5": {"state": 0}}},
                       "1": {"nvlink": {str(n): {"state": 0} for n in range(18)}}})
    found = Sweeper(nvlink.create(), b, clock).sweep()
    assert [(f.code, f.entity.gpu_index) for f in found if f.code.startswith("nvlink.")] == [
        ("nvlink.link_down", 0), ("nvlink.untrained", 1)]
