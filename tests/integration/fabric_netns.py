"""A few nodes made of network namespaces on one bridge, for the fabric probe's tests (root only).

Namespaces ``gh31b<pid>n<i>`` (nodes) and ``gh31b<pid>sw`` (the switch: a bridge); node i's ``eth0`` is a
veth whose peer ``p<i>`` sits on the bridge, address 10.31.0.<i+1>/24. No interface is made in the
host's namespace and nothing is routed out: traffic stays inside. ``tc`` shapes one node's link (both
ways: its ``eth0`` egress and the switch port's egress), one direction of a node's NIC, or one
direction of one pair (a rate-limited htb class, a u32 filter on the peer's address). ``close`` deletes every
namespace it made (their veths go with them), whatever happened.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

SUBNET = "10.31.0"
SWITCH_IP = f"{SUBNET}.254"  # the bridge's own address, in the switch's namespace: where a coordinator listens


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return f"missing {', '.join(missing)} (apt-get install iproute2)" if missing else None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


class NetnsCluster:
    def __init__(self, n: int, prefix: str | None = None) -> None:
        self.n = n
        self.prefix = prefix or f"gh31b{os.getpid()}"
        self.switch = f"{self.prefix}sw"
        self.made: list[str] = []

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> NetnsCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        _sh("ip", "-n", self.switch, "addr", "add", f"{SWITCH_IP}/24", "dev", "br0")
        _sh("ip", "-n", self.switch, "link", "set", "lo", "up")
        for i in range(self.n):
            ns = self.node_ns(i)
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
            _sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _sh("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", f"p{i}", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        self.made.clear()

    @staticmethod
    def _tbf(rate: str) -> list[str]:
        return ["tbf", "rate", rate, "burst", "16kb", "latency", "2s"]

    def slow_sends(self, i: int, rate: str) -> None:
        """Node i's NIC sends slowly (its eth0 egress)."""
        _sh("tc", "-n", self.node_ns(i), "qdisc", "add", "dev", "eth0", "root", *self._tbf(rate))

    def slow_receives(self, i: int, rate: str) -> None:
        """Node i's NIC receives slowly (the switch port's egress towards it)."""
        _sh("tc", "-n", self.switch, "qdisc", "add", "dev", f"p{i}", "root", *self._tbf(rate))

    def slow_node(self, i: int, rate: str) -> None:
        self.slow_sends(i, rate)
        self.slow_receives(i, rate)

    def slow_pair(self, src: int, dst: int, rate: str) -> None:
        """Only src → dst is slow: src's egress towards dst's address goes through a shaped htb class (this
        kernel has htb, tbf and u32; no prio or netem)."""
        ns = self.node_ns(src)
        _sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10")
        _sh("tc", "-n", ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", "40gbit")
        _sh("tc", "-n", ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:30", "htb", "rate", rate,
            "ceil", rate)
        _sh("tc", "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "dst", f"{self.ip(dst)}/32", "flowid", "1:30")

    def exec_args(self, i: int | None) -> list[str]:
        """``ip netns exec`` into node i's namespace (None: the switch's)."""
        return ["ip", "netns", "exec", self.switch if i is None else self.node_ns(i)]

    def leftovers(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(self.prefix)]


def run_probe(cluster: NetnsCluster, work: Path, cli: list[str], extra: list[str], *, port: int = 29531,
              timeout: float = 300.0, per_rank: dict[int, list[str]] | None = None
              ) -> tuple[int, dict[str, Any], list[str]]:
    """Every node runs the shipped command ``gpuhealth diag fabric --from-env`` in its namespace, as torchrun
    or srun would start it (RANK, WORLD_SIZE, MASTER_ADDR/PORT; Gloo on eth0). Returns rank 0's exit code,
    its --json output, and every rank's stderr tail."""
    import json

    procs = []
    for i in range(cluster.n):
        env = {**os.environ, "RANK": str(i), "WORLD_SIZE": str(cluster.n), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": cluster.ip(0), "MASTER_PORT": str(port),
               "GLOO_SOCKET_IFNAME": "eth0"}
        cmd = [*cluster.exec_args(i), *cli, "diag", "fabric", "--from-env", "--node", f"n{i}", "--json", *extra,
               *(per_rank or {}).get(i, [])]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=work))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = [f"rank {i} rc={p.returncode}: {out[1][-800:]}" for i, (p, out) in enumerate(zip(procs, outs, strict=True))]
    text = outs[0][0].strip()
    return procs[0].returncode, json.loads(text) if text else {}, tails
