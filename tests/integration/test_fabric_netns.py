"""The fabric probe for real: four nodes made of network namespaces (``fabric_netns.py``), one link
shaped with ``tc``, every node running the shipped ``gpuhealth diag fabric --from-env`` in its
namespace as torchrun/srun would. The probe must name exactly what was slowed, and nothing when
nothing was. Shaped links run at ~5 Mb/s against ~10 Gb/s of healthy veth; the slow line is 0.3 so
this busy 2-core box's own noise (a healthy direction seen at 0.5× when its process was descheduled)
is not mistaken for a fault (the default 0.6 is for real fabrics).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from commands import _SERVING, CLI, Proc, metric_value, until, write_config
from fabric_netns import SWITCH_IP, NetnsCluster, available, run_probe

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
# The shipped command's options, sized for CI: 1 MiB messages, best of 4. Latency faults are not shaped here (this
# kernel has no netem) and a descheduled rank on this box adds milliseconds to a round trip: a 20 ms floor.
ARGS = ["--size-bytes", str(1 << 20), "--iters", "4", "--slow-fraction", "0.3", "--latency-floor-us", "20000"]
RATE = "100mbit"  # ~12 MB/s against ~1.5 GB/s of healthy veth here: well under 1/10


def _probe(c: NetnsCluster, tmp_path: Path, port: int, per_rank: dict[int, list[str]] | None = None
           ) -> tuple[int, dict[str, Any]]:
    heat, out = tmp_path / "fabric.png", tmp_path / "fabric.json"
    rc, doc, tails = run_probe(c, tmp_path, CLI, [*ARGS, "--heatmap", str(heat), "--out", str(out)], port=port,
                               per_rank=per_rank)
    assert doc.get("status") == "ok", "\n".join(tails)
    assert heat.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text())["findings"] == doc["findings"]
    return rc, doc


def _named(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((f["code"], f["entity"]["id"]) for f in doc["findings"])


def test_healthy_fabric_names_nothing(tmp_path: Path) -> None:
    with NetnsCluster(4) as c:
        rc, doc = _probe(c, tmp_path, 29611)
    assert c.leftovers() == []  # every namespace it made is gone
    assert _named(doc) == [] and rc == 0
    r = doc["result"]
    assert len(r["round_s"]) == 3 and r["world"] == 4 and r["backend"] == "gloo"  # N-1 rounds
    assert r["measurements"]["names"] == ["n0", "n1", "n2", "n3"]
    assert len(r["measurements"]["bandwidth"]) == 12  # every ordered pair


class _InNamespace(Proc):
    """A shipped daemon started with ``ip netns exec`` (its log as commands.Proc keeps it)."""

    def __init__(self, prefix: list[str], args: list[str], work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        super().__init__([*prefix, *CLI, *args], work / "daemon.log")


def _in_ns(c: NetnsCluster, i: int | None, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*c.exec_args(i), *args], capture_output=True, text=True, timeout=60)


def test_a_slow_node_a_slow_nic_direction_and_a_slow_pair_direction_are_each_named(tmp_path: Path) -> None:
    """Three faults at once on six nodes (one probe keeps CI short): n5's link both ways, n3's sends only,
    and n1 -> n2 only. Each is named as what it is; the reverse n2 -> n1 and everyone else are not. n5 runs
    its own agent linked to a coordinator on the switch: n5's rank tells its agent (--agent), the coordinator
    hears it as n5's finding, and gpuhealth fleet and the coordinator's /metrics show it."""
    with NetnsCluster(6) as c:
        coord_cfg = write_config(tmp_path / "coordinator.yaml", {"coordinator": {
            "listen": f"{SWITCH_IP}:0", "metrics_listen": f"{SWITCH_IP}:0", "db_path": str(tmp_path / "c.db"),
            "allow_unauthenticated": True}})
        ready = tmp_path / "coordinator.ready.json"
        coord = _InNamespace(c.exec_args(None), ["coordinator", "--config", str(coord_cfg), "--ready-file",
                                                 str(ready)], tmp_path / "coordinator")
        agent = None
        try:
            ports = until(lambda: json.loads(ready.read_text()) if ready.exists() else None, 60, "coordinator")
            agent_cfg = write_config(tmp_path / "agent.yaml", {
                "agent": {"nvml_snapshot": "nvml_h200x2.json", "listen": "127.0.0.1:0", "node_name": "n5",
                          "coordinator": f"{SWITCH_IP}:{ports['grpc_port']}", "state_dir": str(tmp_path / "a"),
                          "socket_path": str(tmp_path / "a" / "r.sock")},
                "coordinator": {"link_batch_interval_s": 0.2}, "diag": {"enabled": False}})
            agent = _InNamespace(c.exec_args(5), ["agent", "--config", str(agent_cfg)], tmp_path / "agent")
            url = until(lambda: _SERVING.search(agent.log()), 60, "the agent's address")
            agent_url = f"http://{url.group(1)}:{url.group(2)}"
            c.slow_node(5, RATE)
            c.slow_sends(3, RATE)
            c.slow_pair(1, 2, RATE)
            rc, doc = _probe(c, tmp_path, 29612, per_rank={5: ["--agent", agent_url]})
            assert _named(doc) == [("netprobe.link_slow", "n1->n2"), ("netprobe.nic_send_slow", "n3"),
                                   ("netprobe.node_slow", "n5")]
            link = next(f for f in doc["findings"] if f["code"] == "netprobe.link_slow")
            assert link["evidence"]["ratio"] < 0.1 and link["evidence"]["reverse_ratio"] > 0.3
            assert len(doc["result"]["round_s"]) == 5
            assert rc == 1  # degraded

            def fleet() -> dict[str, Any] | None:
                res = _in_ns(c, None, *CLI, "fleet", "--coordinator", f"{SWITCH_IP}:{ports['grpc_port']}", "--json")
                got = json.loads(res.stdout) if res.stdout.strip() else {}
                return got if got.get("fabric") else None

            view = until(fleet, 60, "the probe's finding in gpuhealth fleet", interval=1.0)
            assert [(f["node"], f["code"], f["entity"]["id"]) for f in view["fabric"]] == [
                ("n5", "netprobe.node_slow", "n5")]
            text = _in_ns(c, None, *CLI, "fleet", "--coordinator", f"{SWITCH_IP}:{ports['grpc_port']}")
            assert "netprobe.node_slow n5" in text.stdout and text.returncode == 1

            def scraped() -> str | None:
                res = _in_ns(c, None, sys.executable, "-c", "import urllib.request as u; print(u.urlopen("
                             f"'http://{SWITCH_IP}:{ports['metrics_port']}/metrics').read().decode())")
                return res.stdout if "gpuhealth_fleet_netprobe_findings{" in res.stdout else None

            metrics = until(scraped, 30, "gpuhealth_fleet_netprobe_findings", interval=1.0)
            assert metric_value(metrics, "gpuhealth_fleet_netprobe_findings", node="n5",
                                code="netprobe.node_slow") == 1.0

            def agent_scraped() -> str | None:
                # The agent exports its extensions' samples on its fast lane (every 5 s): wait for the one after
                # the probe's report, which /health and the coordinator had at once (as findings).
                text: str = _in_ns(c, 5, sys.executable, "-c", "import urllib.request as u; print(u.urlopen("
                                   f"'{agent_url}/metrics').read().decode())").stdout
                return text if metric_value(text, "gpuhealth_netprobe_slow", probe_name="n5") is not None else None

            agent_metrics = until(agent_scraped, 30, "gpuhealth_netprobe_slow on the agent", interval=1.0)
            assert metric_value(agent_metrics, "gpuhealth_netprobe_slow", probe_name="n5") == 1.0
            assert metric_value(agent_metrics, "gpuhealth_netprobe_bandwidth_ratio", probe_name="n5",
                                direction="send") < 0.1
        finally:
            if agent is not None:
                agent.stop()
            coord.stop()
    assert c.leftovers() == []


def test_cleanup_even_when_the_body_fails() -> None:
    c = NetnsCluster(2, prefix=f"{NetnsCluster(1).prefix}x")
    with pytest.raises(RuntimeError), c:
        assert len(c.leftovers()) == 3
        raise RuntimeError("a failing test")
    assert c.leftovers() == []
