"""NIC health on the node (issue 31 item 4) over fake sysfs trees: InfiniBand/RoCE ports that trained
down or wait for credits against their peers of the same model; Ethernet speed, duplex, flaps,
errors and drops for the NICs that matter."""

from __future__ import annotations

import os
from pathlib import Path

from collector_kit import Sweeper, by_code, problems, recording
from test_infiniband import write_port

from gpuhealth.backends.sysfs import RealSysfs
from gpuhealth.collectors import ethernet, infiniband
from gpuhealth.config import Config
from gpuhealth.model import MetricKind, Severity


def hca(root: Path, dev: str, model: str = "MT4129") -> None:
    d = root / "sys" / "class" / "infiniband" / dev
    d.mkdir(parents=True, exist_ok=True)
    (d / "hca_type").write_text(model + "\n")


def test_a_port_that_trained_down_against_its_peers_of_the_same_model(clock, tmp_path):
    for dev in ("mlx5_0", "mlx5_1", "mlx5_2"):
        hca(tmp_path, dev)
        write_port(tmp_path, dev, 1)
    write_port(tmp_path, "mlx5_2", 1, rate="200 Gb/sec (2X NDR)")  # two of four lanes trained
    hca(tmp_path, "mlx5_9", model="MT4123")  # another model, slower: not its peer
    write_port(tmp_path, "mlx5_9", 1, rate="200 Gb/sec (4X HDR)")
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    (f,) = problems(s.sweep())
    assert (f.code, f.entity.id, f.severity) == ("ib.link_degraded", "node-a/ib/mlx5_2/1", Severity.WARNING)
    assert f.evidence["expected_gbps"] == 400.0 and f.evidence["width"] == 2 and "MT4129" in f.message
    widths = {dict(x.labels)["device"]: x.value for x in s.last_samples if x.name == "ib_port_width"}
    assert widths == {"mlx5_0": 4.0, "mlx5_1": 4.0, "mlx5_2": 2.0, "mlx5_9": 4.0}


def test_a_port_alone_is_not_judged_unless_a_rate_is_configured(clock, tmp_path):
    hca(tmp_path, "mlx5_0")
    write_port(tmp_path, "mlx5_0", 1, rate="200 Gb/sec (2X NDR)")
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    assert problems(s.sweep()) == []
    cfg = Config()
    cfg.collectors.expected_ib_rate_gbps = 400.0
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, config=cfg,
                sysfs=RealSysfs(tmp_path))
    (f,) = problems(s.sweep())
    assert f.code == "ib.link_degraded" and "configured" in f.message


def test_xmit_wait_rate_against_peers_of_the_same_model(clock, tmp_path):
    for dev in ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"):
        hca(tmp_path, dev)
        write_port(tmp_path, dev, 1, port_xmit_wait=1000)
    s = Sweeper(infiniband.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    assert problems(s.sweep()) == []
    for dev in ("mlx5_0", "mlx5_1", "mlx5_2"):
        write_port(tmp_path, dev, 1, port_xmit_wait=1000 + 60 * 50_000)  # 50k ticks/s: busy but ordinary
    write_port(tmp_path, "mlx5_3", 1, port_xmit_wait=1000 + 60 * 5_000_000)  # 100x its peers
    (f,) = problems(s.after(60))
    assert (f.code, f.entity.id) == ("ib.congestion", "node-a/ib/mlx5_3/1")
    assert f.evidence["xmit_wait_per_second"] == 5_000_000 and f.evidence["peers_median_per_second"] == 50_000
    waits = [x for x in s.last_samples if x.name == "ib_port_xmit_wait"]
    assert len(waits) == 4 and all(x.kind is MetricKind.COUNTER for x in waits)
    # everyone equally busy: congestion on the fabric, not this port's
    for dev in ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"):
        write_port(tmp_path, dev, 1, port_xmit_wait=1000 + 60 * 5_000_000 + 120 * 5_000_000)
    assert problems(s.after(60)) == []


def nic(root: Path, name: str, *, speed: int | None = 100000, duplex: str = "full", operstate: str = "up",
        carrier_changes: int = 2, driver: str | None = "mlx5_core", **stats: int) -> None:
    d = root / "sys" / "class" / "net" / name
    (d / "statistics").mkdir(parents=True, exist_ok=True)
    if driver:
        dev = root / "sys" / "devices" / "pci0000:00" / name
        (dev / "drv").mkdir(parents=True, exist_ok=True)
        drv = root / "sys" / "bus" / "pci" / "drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        if not (dev / "driver").is_symlink():
            os.symlink(drv, dev / "driver")
        if not (d / "device").is_symlink():
            os.symlink(dev, d / "device")
    for key, value in (("speed", -1 if speed is None else speed), ("duplex", duplex), ("operstate", operstate),
                       ("carrier_changes", carrier_changes)):
        (d / key).write_text(f"{value}\n")
    base = {"rx_bytes": 10, "tx_bytes": 10, "rx_errors": 0, "tx_errors": 0, "rx_dropped": 0, "tx_dropped": 0}
    base.update(stats)
    for key, value in base.items():
        (d / "statistics" / key).write_text(f"{value}\n")


def test_ethernet_physical_nics_by_default_virtual_ones_left_out(clock, tmp_path):
    nic(tmp_path, "ens1", speed=100000)
    nic(tmp_path, "ens2", speed=25000)  # same driver, a quarter of the speed: negotiated down
    nic(tmp_path, "veth1a", speed=10000, driver=None)  # no device: a veth
    nic(tmp_path, "lo", speed=None, driver=None, operstate="unknown")
    s = Sweeper(ethernet.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    (f,) = problems(s.sweep())
    assert (f.code, f.entity.id) == ("net.speed_degraded", "node-a/net/ens2")
    assert f.evidence["expected_mbps"] == 100000 and "mlx5_core" in f.message
    assert set(s.last_obs.node["nics"]) == {"ens1", "ens2"}
    speeds = {dict(x.labels)["interface"]: x.value for x in s.last_samples if x.name == "net_speed_bits_per_second"}
    assert speeds == {"ens1": 100e9, "ens2": 25e9}


def test_ethernet_configured_list_half_duplex_flaps_errors_and_down(clock, tmp_path):
    nic(tmp_path, "veth1a", speed=10000, driver=None)
    nic(tmp_path, "veth2a", speed=10000, driver=None)
    nic(tmp_path, "ens1")  # not in the list: not judged
    cfg = Config()
    cfg.collectors.net_interfaces = ["veth1a", "veth2a"]
    s = Sweeper(ethernet.create(), recording("nvml_h200x2.json", clock), clock, config=cfg,
                sysfs=RealSysfs(tmp_path))
    assert s.sweep() == [] and set(s.last_obs.node["nics"]) == {"veth1a", "veth2a"}
    nic(tmp_path, "veth1a", speed=10000, driver=None, duplex="half", carrier_changes=4, rx_errors=100)
    nic(tmp_path, "veth2a", speed=10000, driver=None, operstate="down", carrier_changes=3)
    got = {(f.code, f.entity.id) for f in problems(s.after(120))}
    assert got == {("net.half_duplex", "node-a/net/veth1a"), ("net.link_flaps", "node-a/net/veth1a"),
                   ("net.errors", "node-a/net/veth1a"), ("net.link_down", "node-a/net/veth2a")}
    (err,) = by_code(problems(s.after(0)), "net.errors")
    assert err.evidence["per_hour"]["rx_errors"] == 3000.0  # 100 in 120 s
    errs = [x for x in s.last_samples if x.name == "net_errors"]
    assert errs and all(x.kind is MetricKind.COUNTER for x in errs)


def test_a_few_errors_a_day_and_a_nic_never_up_are_not_findings(clock, tmp_path):
    nic(tmp_path, "ens1")
    nic(tmp_path, "ens2", operstate="down")  # never up: possibly not cabled
    s = Sweeper(ethernet.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    assert s.sweep() == []
    nic(tmp_path, "ens1", rx_errors=2)
    assert problems(s.after(3600)) == []


def test_a_configured_ethernet_speed_judges_a_nic_alone(clock, tmp_path):
    nic(tmp_path, "ens1", speed=25000)
    s = Sweeper(ethernet.create(), recording("nvml_h200x2.json", clock), clock, sysfs=RealSysfs(tmp_path))
    assert problems(s.sweep()) == []  # alone with its driver: nothing to compare with
    cfg = Config()
    cfg.collectors.expected_net_speed_mbps = 100000
    s = Sweeper(ethernet.create(), recording("nvml_h200x2.json", clock), clock, config=cfg,
                sysfs=RealSysfs(tmp_path))
    (f,) = problems(s.sweep())
    assert f.code == "net.speed_degraded" and "configured" in f.message and f.evidence["expected_mbps"] == 100000
