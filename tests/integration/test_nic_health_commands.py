"""NIC health through the shipped commands (issue 31 item 4): ``gpuhealth status --json`` and ``gpuhealth agent``'s
/metrics on a replayed GPU node whose ``collectors.sysfs_root`` is a fixture tree of NICs — one InfiniBand port of
two that trained down to 2X, one Ethernet NIC of two of one driver negotiated at a quarter of the speed, a veth
left out unless named."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from commands import CLI, Agent, http_get, metric_value, until


def _tree(root: Path) -> None:
    for dev, rate in (("mlx5_0", "400 Gb/sec (4X NDR)"), ("mlx5_1", "200 Gb/sec (2X NDR)")):
        d = root / "sys" / "class" / "infiniband" / dev
        (d / "ports" / "1" / "counters").mkdir(parents=True)
        (d / "hca_type").write_text("MT4129\n")
        for name, text in (("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"), ("rate", rate),
                           ("link_layer", "InfiniBand")):
            (d / "ports" / "1" / name).write_text(text + "\n")
        (d / "ports" / "1" / "counters" / "port_xmit_wait").write_text("0\n")
    drv = root / "sys" / "bus" / "pci" / "drivers" / "ice"
    drv.mkdir(parents=True)
    for name, speed, physical in (("ens1", 100000, True), ("ens2", 25000, True), ("veth0", 10000, False)):
        d = root / "sys" / "class" / "net" / name
        (d / "statistics").mkdir(parents=True)
        if physical:
            dev = root / "sys" / "devices" / name
            dev.mkdir(parents=True)
            os.symlink(drv, dev / "driver")
            os.symlink(dev, d / "device")
        for key, value in (("speed", speed), ("duplex", "full"), ("operstate", "up"), ("carrier_changes", 2)):
            (d / key).write_text(f"{value}\n")
        (d / "statistics" / "rx_errors").write_text("0\n")


def _config(tmp_path: Path, extra: str = "") -> Path:
    root = tmp_path / "root"
    _tree(root)
    cfg = tmp_path / "gpuhealth.yaml"
    cfg.write_text(f"agent: {{node_name: nic-node, state_dir: {tmp_path / 'state'}, listen: '127.0.0.1:0', "
                   f"nvml_snapshot: nvml_h200x2.json, socket_path: {tmp_path / 'sock' / 'a.sock'}}}\n"
                   f"collectors: {{disabled: [host], sysfs_root: {root}{extra}}}\n"
                   "diag: {enabled: false}\n")
    return cfg


def test_status_names_the_link_that_trained_down_and_the_slow_nic(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    out = subprocess.run([*CLI, "status", "--json", "--config", str(cfg), "--nvml-snapshot", "nvml_h200x2.json"],
                         capture_output=True, text=True, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    doc = json.loads(out.stdout)
    found = {(f["code"], f["entity"]["id"]) for f in doc["findings"]}
    assert ("ib.link_degraded", "nic-node/ib/mlx5_1/1") in found
    assert ("net.speed_degraded", "nic-node/net/ens2") in found
    assert not any("veth0" in eid or "ens1" in eid or "mlx5_0" in eid for _, eid in found)
    assert doc["node"]["health"] == "degraded" and out.returncode == 1


def test_agent_metrics_carry_nic_speed_width_and_a_named_veth(tmp_path: Path) -> None:
    cfg = _config(tmp_path, extra=", net_interfaces: [veth0, ens2]")
    agent = Agent(tmp_path / "agent", cfg)
    try:
        def scraped() -> str | None:
            code, text = http_get(agent.url + "/metrics")
            return text if code == 200 and "gpuhealth_net_up" in text else None

        text = until(scraped, 60, "NIC series on /metrics")
    finally:
        agent.stop()
    assert metric_value(text, "gpuhealth_ib_port_width", device="mlx5_1") == 2.0
    assert metric_value(text, "gpuhealth_ib_port_width", device="mlx5_0") == 4.0
    assert metric_value(text, "gpuhealth_net_speed_bits_per_second", interface="veth0") == 10e9
    assert metric_value(text, "gpuhealth_net_up", interface="ens2") == 1.0
    assert metric_value(text, "gpuhealth_net_up", interface="ens1") is None  # not in the configured list
    assert metric_value(text, "gpuhealth_ib_port_xmit_wait_total", device="mlx5_0") == 0.0
