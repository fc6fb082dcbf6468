"""InfiniBand / RoCE ports from a sysfs tree: state and error counter growth."""

from __future__ import annotations

from pathlib import Path

from collector_kit import Sweeper, problems, recording

from gpuhealth.backends.sysfs import RealSysfs
from gpuhealth.collectors import infiniband
from gpuhealth.model import Action, EntityKind, MetricKind, Severity


def write_port(root: Path, dev: str, port: int, *, state: str = "4: ACTIVE", phys: str = "5: LinkUp",
               rate: str = "400 Gb/sec (4X NDR)", layer: str = "InfiniBand", **counters: int) -> None:
    p = root / "sys" / "class" / "infiniband" / dev / "ports" / str(port)
    (p / "counters").mkdir(parents=True, exist_ok=True)
    for name, text in (("state", state), ("phys_state", phys), ("rate", rate), ("link_layer", layer)):
        (p / name).write_text(text + "\n")
    base = {"symbol_error": 0, "link_downed": 0, "port_rcv_errors": 0, "link_error_recovery": 0,
            "port_rcv_data": 123456, "port_xmit_data": 654321}
    base.update(counters)
    for name, value in base.items():
        (p / "counters" / name).write_text(f"{value}\n")


def test_host_without_infiniband_has_nothing(clock, tmp_path):
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    assert s.sweep() == [] and s.last_samples == []
    # A recording carries no IB ports either.
    assert Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock).sweep() == []


def test_healthy_ports_and_samples(clock, tmp_path):
    write_port(tmp_path, "mlx5_0", 1)
    write_port(tmp_path, "mlx5_1", 1, layer="Ethernet", rate="200 Gb/sec (4X HDR)")
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    assert s.sweep() == []
    assert s.after(120) == []
    ports = s.last_obs.node["ports"]
    assert set(ports) == {"mlx5_0/1", "mlx5_1/1"} and ports["mlx5_1/1"]["link_layer"] == "Ethernet"
    up = {dict(x.labels)["device"]: x.value for x in s.last_samples if x.name == "ib_port_up"}
    assert up == {"mlx5_0": 1.0, "mlx5_1": 1.0}
    rate = [x.value for x in s.last_samples if x.name == "ib_port_rate_bits_per_second"]
    assert sorted(rate) == [200e9, 400e9]
    errs = [x for x in s.last_samples if x.name == "ib_port_errors"]
    assert errs and all(x.kind is MetricKind.COUNTER and x.gpu is None for x in errs)
    assert not any(dict(x.labels)["counter"] == "port_rcv_data" for x in errs)  # traffic is not an error


def test_port_that_went_down_is_critical_one_never_up_is_info(clock, tmp_path):
    write_port(tmp_path, "mlx5_0", 1)
    write_port(tmp_path, "mlx5_2", 1, state="1: DOWN", phys="2: Polling")  # no cable / peer
    write_port(tmp_path, "mlx5_3", 1, state="1: DOWN", phys="3: Disabled")
    write_port(tmp_path, "mlx5_4", 1, state="2: INIT", phys="5: LinkUp")  # cabled, SM has not activated it
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    first = {f.entity.id: f for f in s.sweep()}
    assert first["node-a/ib/mlx5_2/1"].severity is Severity.INFO
    assert first["node-a/ib/mlx5_3/1"].severity is Severity.INFO  # administratively disabled
    assert first["node-a/ib/mlx5_4/1"].severity is Severity.WARNING
    assert "node-a/ib/mlx5_0/1" not in first
    write_port(tmp_path, "mlx5_0", 1, state="1: DOWN", phys="2: Polling")
    later = {f.entity.id: f for f in s.after(60)}
    down = later["node-a/ib/mlx5_0/1"]
    assert (down.code, down.severity, down.action) == ("ib.port_down", Severity.CRITICAL, Action.DRAIN)
    assert down.entity.kind is EntityKind.LINK and down.evidence["state"] == "DOWN"
    assert "went down" in down.message
    for _ in range(80):  # well past the history window (64 slow sweeps): still critical
        later = {f.entity.id: f for f in s.after(60)}
    assert later["node-a/ib/mlx5_0/1"].severity is Severity.CRITICAL


def test_a_port_an_administrator_disabled_after_it_was_up_is_info_a_link_that_fell_is_critical(clock, tmp_path):
    write_port(tmp_path, "mlx5_0", 1)
    write_port(tmp_path, "mlx5_1", 1)
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    assert s.sweep() == []
    write_port(tmp_path, "mlx5_0", 1, state="1: DOWN", phys="3: Disabled")  # ibportstate … disable
    write_port(tmp_path, "mlx5_1", 1, state="1: DOWN", phys="2: Polling")  # the link fell: no peer
    later = {f.entity.id: f for f in s.after(60)}
    off = later["node-a/ib/mlx5_0/1"]
    assert (off.code, off.severity, off.action) == ("ib.port_down", Severity.INFO, Action.NONE)
    assert "administratively disabled" in off.message and off.evidence["was_up"] is True
    fell = later["node-a/ib/mlx5_1/1"]
    assert (fell.severity, fell.action) == (Severity.CRITICAL, Action.DRAIN) and "went down" in fell.message
    write_port(tmp_path, "mlx5_1", 1, state="1: DOWN", phys="4: PortConfigurationTraining")
    assert {f.entity.id: f for f in s.after(60)}["node-a/ib/mlx5_1/1"].severity is Severity.CRITICAL


def test_error_counters_growing(clock, tmp_path):
    write_port(tmp_path, "mlx5_0", 1)
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    s.sweep()
    write_port(tmp_path, "mlx5_0", 1, symbol_error=1, link_downed=1)  # 1 symbol error/min = 60/h
    (f,) = problems(s.after(60))
    assert (f.code, f.severity, f.action) == ("ib.errors", Severity.WARNING, Action.MONITOR)
    assert f.evidence["increase"] == {"symbol_error": 1, "link_downed": 1}
    # A single symbol error over a day is tolerated (< 10/h); link_downed never is.
    write_port(tmp_path, "mlx5_0", 1, symbol_error=1, link_downed=1)
    s2 = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    s2.sweep()
    write_port(tmp_path, "mlx5_0", 1, symbol_error=2, link_downed=1)
    assert problems(s2.after(3600)) == []
