"""The fabric probe for real: four nodes made of network namespaces (``fabric_netns.py``), one link
shaped with ``tc``, every node running the shipped ``gpuhealth diag fabric --from-env`` in its
namespace as torchrun/srun would. The probe must name exactly what was slowed, and nothing when
nothing was. Shaped links run at ~5 Mb/s against ~10 Gb/s of healthy veth; the slow line is 0.3 so
this busy 2-core box's own noise (a healthy direction seen at 0.5× when its process was descheduled)
is not mistaken for a fault (the default 0.6 is for real fabrics).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from commands import CLI
from fabric_netns import NetnsCluster, available, run_probe

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
# The shipped command's options, sized for CI: 1 MiB messages, best of 4. Latency faults are not shaped here (this
# kernel has no netem) and a descheduled rank on this box adds milliseconds to a round trip: a 20 ms floor.
ARGS = ["--size-bytes", str(1 << 20), "--iters", "4", "--slow-fraction", "0.3", "--latency-floor-us", "20000"]
RATE = "100mbit"  # ~12 MB/s against ~1.5 GB/s of healthy veth here: well under 1/10


def _probe(c: NetnsCluster, tmp_path: Path, port: int) -> tuple[int, dict[str, Any]]:
    heat, out = tmp_path / "fabric.png", tmp_path / "fabric.json"
    rc, doc, tails = run_probe(c, tmp_path, CLI, [*ARGS, "--heatmap", str(heat), "--out", str(out)], port=port)
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


def test_a_slow_node_a_slow_nic_direction_and_a_slow_pair_direction_are_each_named(tmp_path: Path) -> None:
    """Three faults at once on six nodes (one probe keeps CI short): n5's link both ways, n3's sends only,
    and n1 -> n2 only. Each is named as what it is; the reverse n2 -> n1 and everyone else are not."""
    with NetnsCluster(6) as c:
        c.slow_node(5, RATE)
        c.slow_sends(3, RATE)
        c.slow_pair(1, 2, RATE)
        rc, doc = _probe(c, tmp_path, 29612)
    assert c.leftovers() == []
    assert _named(doc) == [("netprobe.link_slow", "n1->n2"), ("netprobe.nic_send_slow", "n3"),
                           ("netprobe.node_slow", "n5")]
    link = next(f for f in doc["findings"] if f["code"] == "netprobe.link_slow")
    assert link["evidence"]["ratio"] < 0.1 and link["evidence"]["reverse_ratio"] > 0.3
    assert len(doc["result"]["round_s"]) == 5
    assert rc == 1  # degraded


def test_cleanup_even_when_the_body_fails() -> None:
    c = NetnsCluster(2, prefix=f"{NetnsCluster(1).prefix}x")
    with pytest.raises(RuntimeError), c:
        assert len(c.leftovers()) == 3
        raise RuntimeError("a failing test")
    assert c.leftovers() == []
