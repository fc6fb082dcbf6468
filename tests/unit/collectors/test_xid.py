"""XIDs from NVML events and the kernel log, judged by the catalog, escalated when they survive a reset."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpuhealth.backends.base import XidEvent
from gpuhealth.backends.kmsg import KmsgLines
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.catalog.xid import CatalogError, load_xid_catalog, xid_info
from gpuhealth.collectors.base import CollectContext, History
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.collectors.xid import XidCollector, XidLedger, recovery_action
from gpuhealth.config import Config
from gpuhealth.model import Action, EntityKind, Severity, health_of


class Harness:
    def __init__(self, tmp_path: Path, clock, collector: XidCollector | None = None, **scenario) -> None:  # type: ignore[no-untyped-def]
        scenario.setdefault("recording", "nvml_h200x2.json")
        path = tmp_path / "s.json"
        path.write_text(json.dumps(scenario))
        self.fake = FakeNvml.from_file(path, clock=clock)
        self.fake.init()
        self.kmsg = KmsgLines(self.fake.kmsg_lines)
        self.collector = collector or XidCollector(event_thread=False)
        self.history = History()
        self.runner = CollectorRunner(timeout_s=None)
        self.gpus = enumerate_gpus(self.fake)

    def run(self, **extras):  # type: ignore[no-untyped-def]
        self.gpus = enumerate_gpus(self.fake, self.gpus)
        ctx = CollectContext(backend=self.fake, config=Config(), gpus=self.gpus, node_name="n1", now=time.time(),
                             kmsg=self.kmsg, extras=extras)
        run = self.runner.run(self.collector, ctx, self.history)
        assert run.success, run.error
        return run


def test_nvml_event_xid79_is_critical_reboot_on_that_gpu(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tmp_path, clock, events=[{"at": 1, "type": "xid", "gpu": 1, "xid": 79}])
    assert h.run().findings == []
    clock.advance(2)
    run = h.run()
    [f] = run.findings
    assert (f.code, f.severity, f.action) == ("xid.79", Severity.CRITICAL, Action.REBOOT)
    assert f.entity.kind is EntityKind.GPU and f.entity.id == h.gpus[1].uuid and f.entity.gpu_index == 1
    assert f.evidence["sources"] == ["nvml"] and f.evidence["hardware"] is True
    assert "fallen off the bus" in f.message
    # It stays a finding on the next sweep (an XID is an event; the GPU is still suspect).
    assert [x.code for x in h.run().findings] == ["xid.79"]
    last = {s.gpu: s.value for s in run.samples if s.name == "gpu_xid_last"}
    assert last == {0: 0.0, 1: 79.0}


def test_kernel_log_xid_maps_bus_id_to_gpu_and_merges_with_nvml_event(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    usec = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1e6)  # logged by the kernel just now
    h = Harness(tmp_path, clock, events=[{"at": 0, "type": "xid", "gpu": 0, "xid": 48}],
                kmsg=[f"6,100,{usec},-;NVRM: Xid (PCI:0000:00:06): 48, pid=4242, name=python3, "
                      "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer."])
    [f] = h.run().findings
    assert (f.code, f.severity, f.action, f.entity.gpu_index) == ("xid.48", Severity.CRITICAL, Action.RESET_GPU, 0)
    assert f.evidence["count"] == 1 and f.evidence["sources"] == ["kmsg", "nvml"]
    assert "pid=4242 name=python3" in f.evidence["detail"]


def test_application_xid_is_info_and_gpu_stays_healthy(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tmp_path, clock, kmsg=["NVRM: Xid (PCI:0000:00:07): 13, pid=77, name=train.py, "
                                       "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address"])
    [f] = h.run().findings
    assert (f.code, f.severity, f.action) == ("xid.13", Severity.INFO, Action.CHECK_JOB)
    assert f.evidence["hardware"] is False and "application" in f.message
    assert str(health_of([f])) == "healthy"


def test_same_xid_after_gpu_reset_escalates(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tmp_path, clock, events=[
        {"at": 1, "type": "xid", "gpu": 0, "xid": 48},
        {"at": 2, "type": "lost", "gpu": 0},
        {"at": 3, "type": "restore", "gpu": 0},  # the operator reset the GPU
        {"at": 4, "type": "xid", "gpu": 0, "xid": 48},
    ])
    clock.advance(1.5)
    [first] = h.run().findings
    assert (first.severity, first.action) == (Severity.CRITICAL, Action.RESET_GPU)
    clock.advance(1)
    assert [f.code for f in h.run().findings] == ["xid.48"]  # lost: still reported
    clock.advance(1)
    assert h.run().findings == []  # back after the reset: the old XID is resolved
    clock.advance(1)
    [again] = h.run().findings
    assert (again.code, again.severity, again.action) == ("xid.48", Severity.CRITICAL, Action.RMA)
    assert again.evidence["repeats_after_reset"] == 1 and "escalated" in again.message


def test_reset_seen_through_volatile_counters_and_note_reset(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tmp_path, clock,
                overrides={"1": {"TotalEccErrors_CORRECTED_VOLATILE": 12}},
                events=[{"at": 1, "type": "xid", "gpu": 1, "xid": 92},
                        {"at": 2, "type": "set", "gpu": 1, "key": "TotalEccErrors_CORRECTED_VOLATILE", "value": 0},
                        {"at": 3, "type": "xid", "gpu": 1, "xid": 92}])
    clock.advance(1.5)
    [f] = h.run().findings
    assert (f.severity, f.action) == (Severity.WARNING, Action.MONITOR)
    clock.advance(1)
    assert h.run().findings == []  # counters went back to zero: the GPU was reset
    clock.advance(1)
    [f2] = h.run().findings
    assert (f2.severity, f2.action) == (Severity.CRITICAL, Action.RESET_GPU)
    h.collector.note_reset(h.gpus[1].uuid)
    assert h.run().findings == []


def test_unknown_xid_gets_default_and_unknown_bus_goes_to_node(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tmp_path, clock, kmsg=["NVRM: Xid (PCI:0000:00:06): 250, something new",
                                       "NVRM: Xid (PCI:0000:9a:00): 79, pid=0, GPU has fallen off the bus."])
    findings = {f.code: f for f in h.run().findings}
    assert (findings["xid.250"].severity, findings["xid.250"].action) == (Severity.WARNING, Action.MONITOR)
    assert findings["xid.250"].entity.gpu_index == 0
    node = findings["xid.79"]
    assert node.entity.kind is EntityKind.NODE and node.evidence["pci"] == "0000:9a:00"


def test_xid154_takes_the_action_the_driver_names() -> None:
    assert recovery_action("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)") \
        is Action.RESET_GPU
    assert recovery_action("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)") \
        is Action.REBOOT
    assert recovery_action("GPU recovery action changed from 0x1 (Reset) to 0x0 (None)") is Action.NONE


def test_event_thread_delivers_nvml_events(tmp_path: Path) -> None:
    h = Harness(tmp_path, time.monotonic, collector=XidCollector(event_thread=True),
                events=[{"at": 0.1, "type": "xid", "gpu": 0, "xid": 74}])
    try:
        deadline = time.time() + 5
        codes: list[str] = []
        while time.time() < deadline and not codes:
            codes = [f.code for f in h.run().findings]
            time.sleep(0.05)
        assert codes == ["xid.74"]
        # One-shot mode (gpuhealth status) polls instead of starting a thread.
        one_shot = XidCollector()
        h.collector = one_shot
        h.run(one_shot=True)
        assert one_shot._pump is None
    finally:
        h.collector.close()


def test_application_xids_expire_hardware_ones_wait_for_reset() -> None:
    ledger = XidLedger(retention_s=1000, app_retention_s=10)
    ledger.add(XidEvent(0, 13, 100.0, "kmsg"), "GPU-a")
    ledger.add(XidEvent(0, 79, 100.0, "kmsg"), "GPU-a")
    ledger.expire(200.0, lambda code: not xid_info(code).hardware)
    assert [e.xid for e in ledger.active()] == [79]
    ledger.add(XidEvent(0, 79, 150.0, "nvml"), "GPU-a")  # late copy of an old event from another source
    ledger.note_reset("GPU-a", 300.0)
    ledger.add(XidEvent(0, 79, 250.0, "kmsg"), "GPU-a")  # older than the reset: not a repeat
    assert ledger.active() == []


def test_catalog_covers_fatal_and_application_xids(tmp_path: Path) -> None:
    cat = load_xid_catalog()
    for code in (48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140):
        assert cat[code].hardware and cat[code].source
    for code in (48, 64, 74, 79, 95, 119, 120, 140):
        assert cat[code].severity is Severity.CRITICAL
    for code in (13, 31, 43, 45):
        assert not cat[code].hardware and cat[code].severity is Severity.INFO
    bad = tmp_path / "xid.csv"
    bad.write_text("code,mnemonic,name,resolution,investigatory,severity,action,repeat_action,hardware,source\n"
                   "79,M,x,RESTART_BM,CONTACT_SUPPORT,fatal,reboot,drain,yes,me\n")
    with pytest.raises(CatalogError, match=r"xid\.csv: data row 1"):
        load_xid_catalog(bad)


def test_unreadable_kernel_log_is_an_info_finding_not_a_failure(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    from gpuhealth.backends.kmsg import DevKmsg

    h = Harness(tmp_path, clock)
    h.kmsg = DevKmsg(str(tmp_path / "no-such-kmsg"))  # type: ignore[assignment]
    run = h.run()
    [f] = run.findings
    assert (f.code, f.severity, f.entity.kind) == ("kmsg.unavailable", Severity.INFO, EntityKind.NODE)
    assert "No such file" in f.message and run.observations is not None and not run.observations.errors


def test_each_occurrence_counts_once_when_both_channels_report_it() -> None:
    """The NVML event and the kernel-log line of one XID are one occurrence, every time, not just the
    first time both channels were seen."""
    from gpuhealth.collectors.xid import XidLedger

    ledger = XidLedger()
    for n, t in enumerate((1000.0, 1100.0, 1200.0)):
        ledger.add(XidEvent(0, 79, t, source="nvml"), "GPU-0")
        entry = ledger.add(XidEvent(0, 79, t + 0.5, source="kmsg"), "GPU-0")
        assert entry.count == n + 1
    # two real occurrences close together, each seen by both channels, are still two
    ledger.add(XidEvent(0, 79, 1300.0, source="nvml"), "GPU-0")
    ledger.add(XidEvent(0, 79, 1301.0, source="nvml"), "GPU-0")
    ledger.add(XidEvent(0, 79, 1300.2, source="kmsg"), "GPU-0")
    entry = ledger.add(XidEvent(0, 79, 1301.2, source="kmsg"), "GPU-0")
    assert entry.count == 5 and entry.sources == {"nvml", "kmsg"}


# -- the ledger survives an agent restart ------------------------------------------------------------


def test_a_restarted_agent_still_reports_an_xid_nvml_will_not_deliver_again(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    state = tmp_path / "state"
    h = Harness(tmp_path, clock, events=[{"at": 1, "type": "xid", "gpu": 1, "xid": 79}])
    clock.advance(2)
    assert [f.code for f in h.run(state_dir=str(state), agent=True).findings] == ["xid.79"]
    assert (state / "xid-ledger.json").exists()
    # A new collector (the restarted agent): NVML's event already went to the old process.
    fresh = Harness(tmp_path, clock, collector=XidCollector(event_thread=False))
    fresh.fake.events = []  # type: ignore[attr-defined]
    [f] = fresh.run(state_dir=str(state), agent=True).findings
    assert (f.code, f.severity, f.entity.gpu_index, f.evidence["count"]) == ("xid.79", Severity.CRITICAL, 1, 1)


def test_reading_the_kernel_log_again_after_a_restart_counts_nothing_twice(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    state = tmp_path / "state"
    usec = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1e6)
    line = f"6,100,{usec},-;NVRM: Xid (PCI:0000:00:06): 48, pid=1, name=python3, DBE"
    h = Harness(tmp_path, clock, kmsg=[line])
    [f] = h.run(state_dir=str(state)).findings
    assert f.evidence["count"] == 1
    again = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=[line])  # whole log re-read
    [f] = again.run(state_dir=str(state)).findings
    assert f.evidence["count"] == 1


def test_an_xid_a_reset_cleared_does_not_come_back_from_the_kernel_log_after_a_restart(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    state = tmp_path / "state"
    usec = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1e6)
    line = f"6,100,{usec},-;NVRM: Xid (PCI:0000:00:06): 48, pid=1, name=python3, DBE"
    h = Harness(tmp_path, clock, kmsg=[line])
    assert [f.code for f in h.run(state_dir=str(state)).findings] == ["xid.48"]
    clock.advance(5)
    h.collector.note_reset(h.gpus[0].uuid, time.time() + 1)
    assert h.run(state_dir=str(state)).findings == []
    again = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=[line])
    assert again.run(state_dir=str(state)).findings == []


def test_a_reboot_resets_every_gpu_and_a_repeat_after_it_escalates() -> None:
    ledger = XidLedger()
    ledger.add(XidEvent(0, 79, 100.0, "nvml"), "GPU-a")
    doc = json.loads(json.dumps(ledger.to_state("boot-1")))
    same_boot = XidLedger()
    same_boot.load_state(doc, "boot-1", booted_at=50.0)
    assert [e.xid for e in same_boot.active()] == [79]
    rebooted = XidLedger()
    rebooted.load_state(doc, "boot-2", booted_at=200.0)
    assert rebooted.active() == []
    entry = rebooted.add(XidEvent(0, 79, 300.0, "nvml"), "GPU-a")
    assert entry.active and entry.repeats_after_reset == 1  # the reboot did not cure it


def test_an_unreadable_ledger_is_set_aside_and_said_not_fatal(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    state = tmp_path / "state"
    state.mkdir()
    (state / "xid-ledger.json").write_text("{not json")
    h = Harness(tmp_path, clock, events=[{"at": 0, "type": "xid", "gpu": 0, "xid": 79}])
    run = h.run(state_dir=str(state))
    assert sorted(f.code for f in run.findings) == ["collector.failed", "xid.79"]  # said once, as a warning
    assert any(e.key == "xid_ledger" for e in run.observations.errors)
    assert [f.code for f in h.run(state_dir=str(state)).findings] == ["xid.79"]
    assert [p.name for p in state.iterdir() if p.name.startswith("xid-ledger.unreadable-")]
    assert json.loads((state / "xid-ledger.json").read_text())["version"] == 1  # a fresh one is kept


def test_status_one_shot_never_writes_a_ledger(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tmp_path, clock, events=[{"at": 0, "type": "xid", "gpu": 0, "xid": 79}])
    h.run(state_dir=str(tmp_path / "state"), one_shot=True)
    assert not (tmp_path / "state").exists()


def test_a_clock_step_between_runs_does_not_count_a_re_read_line_again(tmp_path: Path, clock,  # type: ignore[no-untyped-def]
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # /dev/kmsg times are boot time + offset, and boot time is derived from the wall clock: after NTP
    # steps the clock, the same line comes out at another time. Its sequence number does not change.
    state = tmp_path / "state"
    usec = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1e6)
    line = f"6,100,{usec},-;NVRM: Xid (PCI:0000:00:06): 48, pid=1, name=python3, DBE"
    h = Harness(tmp_path, clock, kmsg=[line])
    assert [f.code for f in h.run(state_dir=str(state)).findings] == ["xid.48"]
    h.collector.note_reset(h.gpus[0].uuid, time.time() + 0.2)
    assert h.run(state_dir=str(state)).findings == []
    import gpuhealth.backends.kmsg as kmsg_mod

    stepped = kmsg_mod.boot_time() + 5.0
    monkeypatch.setattr(kmsg_mod, "boot_time", lambda: stepped)
    again = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=[line])
    assert again.run(state_dir=str(state)).findings == []  # not back, not escalated
    entry = next(iter(again.collector.ledger._entries.values()))
    assert entry.count == 1 and entry.repeats_after_reset == 0


def test_after_a_reboot_with_a_clock_behind_old_xids_are_cleared_and_new_ones_counted() -> None:
    ledger = XidLedger()
    ledger.add(XidEvent(0, 79, 1000.0, "kmsg", seq=5), "GPU-a")
    doc = json.loads(json.dumps(ledger.to_state("boot-1")))
    after = XidLedger()
    assert after.load_state(doc, "boot-2", booted_at=500.0) is False  # the new boot's clock is behind
    assert after.active() == []
    entry = after.add(XidEvent(0, 79, 600.0, "kmsg", seq=3), "GPU-a")
    assert entry.active and entry.count == 2 and entry.repeats_after_reset == 1


def test_a_reset_while_the_agent_was_down_is_seen_from_the_saved_ecc_baseline(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    state = tmp_path / "state"
    h = Harness(tmp_path, clock, overrides={"1": {"TotalEccErrors_CORRECTED_VOLATILE": 12}},
                events=[{"at": 1, "type": "xid", "gpu": 1, "xid": 92}])
    clock.advance(1.5)
    assert [f.code for f in h.run(state_dir=str(state)).findings] == ["xid.92"]
    # The operator stops the agent, resets GPU 1 (volatile counters go back to 0), starts it again.
    after = Harness(tmp_path, clock, collector=XidCollector(event_thread=False),
                    overrides={"1": {"TotalEccErrors_CORRECTED_VOLATILE": 0}})
    after.fake.events = []  # type: ignore[attr-defined]
    run = after.run(state_dir=str(state))
    assert run.findings == []
    assert run.observations.gpu(1).get("reset_seen") is True


def test_without_a_boot_id_an_old_boots_kernel_log_cursor_is_not_trusted(tmp_path: Path, clock,  # type: ignore[no-untyped-def]
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuhealth.collectors.xid as xid_mod

    monkeypatch.setattr(xid_mod, "_boot_id", lambda: "")  # /proc/sys/kernel/random/boot_id unreadable
    state = tmp_path / "state"
    usec = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1e6)
    h = Harness(tmp_path, clock, kmsg=[f"6,900,{usec},-;NVRM: Xid (PCI:0000:00:06): 13, pid=1, name=a, SM"])
    h.run(state_dir=str(state))
    # The node rebooted: boot time moved by an hour; the new boot's first XID has a low sequence number.
    monkeypatch.setattr(xid_mod, "boot_time", lambda: time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + 3600)
    after = Harness(tmp_path, clock, collector=XidCollector(event_thread=False),
                    kmsg=[f"6,12,{usec},-;NVRM: Xid (PCI:0000:00:06): 79, pid=0, name=, fell off the bus"])
    assert [f.code for f in after.run(state_dir=str(state)).findings] == ["xid.79"]


# ------------------------------------------------------------------ XIDs of GPUs this view does not hold (audit 3)
# A pod given GPUs 00:06.0 and 00:07.0 of the recording; the host's kernel log names the node's other GPUs.
_POD = {"environment": {"virtualization": "none", "container": True, "host_pid_namespace": False,
                        "host_network_namespace": False, "nvswitches_visible": 4},
        "other_pci_gpus": [{"bdf": f"0000:{b}:00.0", "driver": "nvidia", "minor": 2 + n, "device_node": "absent"}
                           for n, b in enumerate(("9a", "ab", "b8", "c1", "db", "e4"))]}


def test_xids_of_another_pods_gpus_are_info_naming_the_address(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tmp_path, clock, system=_POD,
                kmsg=["NVRM: Xid (PCI:0000:b8:00): 79, pid=0, GPU has fallen off the bus.",
                      "NVRM: Xid (PCI:0000:c1:00): 48, pid=1234, name=python, An uncorrectable double bit error",
                      "NVRM: Xid (PCI:0000:f0:00): 79, pid=0, GPU has fallen off the bus.",  # no GPU on the bus
                      "NVRM: Xid (PCI:0000:00:07): 48, pid=1, name=python, An uncorrectable double bit error"])
    found = h.run().findings
    foreign = sorted((f.evidence["pci"], f.evidence["xid"], f.severity, f.action, f.entity.kind) for f in found
                     if f.code == "xid.outside_view")
    assert foreign == [("0000:b8:00", 79, Severity.INFO, Action.NONE, EntityKind.NODE),
                       ("0000:c1:00", 48, Severity.INFO, Action.NONE, EntityKind.NODE),
                       ("0000:f0:00", 79, Severity.INFO, Action.NONE, EntityKind.NODE)]
    by_pci = {f.evidence["pci"]: f for f in found if f.code == "xid.outside_view"}
    assert "0000:b8:00" in by_pci["0000:b8:00"].message and "does not watch" in by_pci["0000:b8:00"].message
    assert "6 GPU(s) on the PCI bus are outside it" in by_pci["0000:f0:00"].evidence["why"]
    # The GPU this pod holds keeps the catalog's action.
    [own] = [f for f in found if f.code == "xid.48"]
    assert (own.severity, own.action, own.entity.gpu_index) == (Severity.CRITICAL, Action.RESET_GPU, 1)


def test_an_xid_of_a_bus_gpu_nvml_does_not_list_is_left_to_gpu_missing(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    # Bare metal, every GPU this view's: the driver lists 0000:9a:00.0 and this process may open it, NVML lost it.
    bare = {"environment": {"virtualization": "none", "container": False, "host_pid_namespace": True,
                            "host_network_namespace": True, "nvswitches_visible": 4},
            "other_pci_gpus": [{"bdf": "0000:9a:00.0", "driver": "nvidia", "minor": 2}]}
    h = Harness(tmp_path, clock, system=bare,
                kmsg=["NVRM: Xid (PCI:0000:9a:00): 79, pid=0, GPU has fallen off the bus.",
                      "NVRM: Xid (PCI:0000:f0:00): 79, pid=0, GPU has fallen off the bus."])
    found = {(f.code, f.evidence.get("pci")): f for f in h.run().findings}
    assert found[("xid.outside_view", "0000:9a:00")].evidence["why"].startswith("on the PCI bus but not listed")
    node = found[("xid.79", "0000:f0:00")]  # no GPU outside the view: an unknown address keeps today's action
    assert (node.severity, node.action, node.entity.kind) == (Severity.CRITICAL, Action.REBOOT, EntityKind.NODE)


def test_the_bus_is_read_only_while_an_unmatched_xid_is_active(tmp_path: Path, clock, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import gpuhealth.collectors.xid as xid_mod

    walks: list[float] = []
    real = xid_mod.pci_view
    monkeypatch.setattr(xid_mod, "pci_view", lambda ctx: walks.append(ctx.now) or real(ctx))
    h = Harness(tmp_path, clock, system=_POD, kmsg=["NVRM: Xid (PCI:0000:00:06): 13, pid=1, name=a, SM"])
    h.run()
    assert walks == []  # every XID on this view's GPUs: no PCI walk
    h2 = Harness(tmp_path, clock, system=_POD, kmsg=["NVRM: Xid (PCI:0000:b8:00): 79, pid=0, off the bus"])
    for _ in range(3):
        assert [f.code for f in h2.run().findings] == ["xid.outside_view"]
    assert len(walks) == 1  # cached for VIEW_RESCAN_S


def test_one_shot_status_reads_the_agents_ledger_and_never_writes_it(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    """The Slurm check runs ``gpuhealth status`` while the agent is down: it re-reads the whole kernel log, and an
    XID 48 that a GPU reset cleared (the agent saw the reset) must not drain the node again."""
    state = tmp_path / "state"
    usec = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1e6)
    line = f"6,100,{usec},-;NVRM: Xid (PCI:0000:00:06): 48, pid=1, name=python3, DBE"
    agent = Harness(tmp_path, clock, kmsg=[line])
    assert [f.code for f in agent.run(state_dir=str(state), agent=True).findings] == ["xid.48"]
    clock.advance(5)
    agent.collector.note_reset(agent.gpus[0].uuid, time.time() + 1)
    assert agent.run(state_dir=str(state), agent=True).findings == []
    saved = (state / "xid-ledger.json").read_bytes()
    status = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=[line])
    assert status.run(state_dir=str(state), one_shot=True).findings == []
    without = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=[line])
    assert [f.code for f in without.run(one_shot=True).findings] == ["xid.48"]  # no ledger: the log alone
    assert (state / "xid-ledger.json").read_bytes() == saved
    # A ledger it cannot parse stays where it is for the agent to set aside; the log alone is judged.
    (state / "xid-ledger.json").write_text("{not json")
    broken = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=[line])
    assert [f.code for f in broken.run(state_dir=str(state), one_shot=True).findings] == ["xid.48"]
    assert (state / "xid-ledger.json").read_text() == "{not json" and len(list(state.iterdir())) == 1


def test_one_shot_status_of_a_live_node_is_given_the_agents_state_dir(tmp_path: Path) -> None:
    from gpuhealth.config import AgentConfig
    from gpuhealth.node import collect_once

    seen: list[dict[str, object]] = []

    class Spy(XidCollector):
        def collect(self, ctx: CollectContext):  # type: ignore[no-untyped-def]
            seen.append(dict(ctx.extras))
            return super().collect(ctx)

    class LiveLooking(FakeNvml):  # the hardware boundary as a live driver shows it
        simulated = False  # type: ignore[assignment]

    backend = LiveLooking.from_scenario({"recording": "nvml_h200x2.json"})
    backend.init()
    config = Config(agent=AgentConfig(state_dir=str(tmp_path / "st")))
    collect_once(backend, config, kmsg=KmsgLines([]), collectors=[Spy(event_thread=False)])
    assert seen[0]["state_dir"] == str(tmp_path / "st") and seen[0]["one_shot"] is True
    seen.clear()
    replay = FakeNvml.bundled()
    replay.init()
    collect_once(replay, config, kmsg=KmsgLines([]), collectors=[Spy(event_thread=False)])
    assert "state_dir" not in seen[0]  # a replay has no agent's history here


def test_one_shot_reads_sxids_the_agent_saw_before_its_last_save(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    """SXids live in the agent's memory, not its ledger: a one-shot that skips the records the ledger counted
    must still read the fatal SXid from them (the Slurm check while the agent is down)."""
    state = tmp_path / "state"
    usec = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1e6)
    lines = [f"6,201,{usec},-;nvidia-nvswitch0: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"]
    agent = Harness(tmp_path, clock, kmsg=lines)
    assert [f.code for f in agent.run(state_dir=str(state), agent=True).findings] == ["nvswitch.sxid"]
    status = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=lines)
    assert [f.code for f in status.run(state_dir=str(state), one_shot=True).findings] == ["nvswitch.sxid"]


def test_a_reset_found_across_a_gap_does_not_hide_the_xid_that_came_back(  # type: ignore[no-untyped-def]
        tmp_path: Path, clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent saw XID 48 and saved its ledger 5 min ago; then GPU 0 was reset (its volatile ECC count fell)
    and the DBE came back 1 min ago. The reset happened some time after the save: the recurrence stands (not
    called 'from before the reset'), and it is not escalated either (nobody knows it followed the reset)."""
    import os

    from gpuhealth.backends import kmsg as kmsg_backend
    from gpuhealth.collectors import xid as xid_collector

    # This boot began an hour ago, whatever the machine's uptime: a record 10 min old must exist in it (on a
    # machine booted minutes ago, the test's 'boot − 600 s' was before the boot and its record was dropped).
    booted_at = time.time() - 3600
    monkeypatch.setattr(kmsg_backend, "boot_time", lambda: booted_at)
    monkeypatch.setattr(xid_collector, "boot_time", lambda: booted_at)
    state = tmp_path / "state"
    key = "TotalEccErrors_UNCORRECTED_VOLATILE"
    booted = 3600 * 1_000_000  # microseconds since that boot, now
    old = f"6,100,{booted - 600_000_000},-;NVRM: Xid (PCI:0000:00:06): 48, pid=1, name=python3, DBE"
    agent = Harness(tmp_path, clock, kmsg=[old], overrides={0: {key: 3}})
    assert [f.code for f in agent.run(state_dir=str(state), agent=True).findings] == ["xid.48"]
    saved = time.time() - 300
    os.utime(state / "xid-ledger.json", (saved, saved))
    new = f"6,101,{booted - 60_000_000},-;NVRM: Xid (PCI:0000:00:06): 48, pid=1, name=python3, DBE"
    status = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=[old, new],
                     overrides={0: {key: 1}})
    [f] = status.run(state_dir=str(state), one_shot=True).findings
    assert (f.code, f.severity, f.evidence["repeats_after_reset"]) == ("xid.48", Severity.CRITICAL, 0)
    # Without a recurrence the same reset clears it.
    quiet = Harness(tmp_path, clock, collector=XidCollector(event_thread=False), kmsg=[old], overrides={0: {key: 1}})
    assert quiet.run(state_dir=str(state), one_shot=True).findings == []
