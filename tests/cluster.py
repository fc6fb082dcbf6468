"""A cluster in one box: N nodes made of network namespaces on one Linux bridge, for tests and benchmarks.

Each node is a network namespace with one veth pair to the bridge (inside it is called ``eth0``), its own
address on a private /24 and no route beyond it, and its own real ``gpuhealth agent`` (node name
``node<i>``, a node token derived from the coordinator's node secret, its own state folder and rank socket,
a recorded GPU node through ``agent.nvml_snapshot``). One ``gpuhealth coordinator`` with node-token auth
listens on the bridge's address in the root namespace. Jobs are real PyTorch Gloo ranks
(``tests/cluster_job.py``), each started in its node's namespace with ``ip netns exec`` and timed by the
``Tracker`` over its node's rank socket.

A node's link is shaped with ``tc`` (HTB rate, netem delay and loss), both directions or one (``out``: what
the node sends, on ``eth0`` inside it; ``in``: what it receives, on the bridge side of its pair), for all its
traffic or towards one peer; ``cut`` takes its link down (``ip link``), ``restore`` brings it back.

Everything it makes carries the prefix ``gh31a<pid base 36>-<n>`` (parallel runs and other users of this box
never collide; a later instance removes what a dead process left behind) and is removed by ``close`` —
also at interpreter exit (``atexit``), so a failing test leaves nothing; the processes it starts get SIGTERM
when it dies (PR_SET_PDEATHSIG), even by SIGKILL. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuhealth.runtime.credentials import node_token

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "gpuhealth.cli.main"]
RECORDING = REPO / "tests" / "fixtures" / "recordings" / "nvml_h200x2_live.json"
JOB_SCRIPT = REPO / "tests" / "cluster_job.py"
PREFIX = "gh31a"
OPERATOR_TOKEN = "cluster-operator-token"
_counter = itertools.count()


def available() -> str | None:
    """Why a cluster cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return f"needs {' and '.join(missing)} (iproute2)" if missing else None


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def sh(*args: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {res.returncode}: {res.stderr.strip()}")
    return res


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Namespaces and links of this prefix whose owning process is gone (a run killed before ``close``)."""
    owner = re.compile(re.escape(prefix) + r"([0-9a-z]+)-")
    removed: list[str] = []

    def dead(name: str) -> bool:
        m = owner.match(name)
        if m is None:
            return False
        try:
            os.kill(int(m.group(1), 36), 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(prefix) and dead(name):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)  # an agent or rank a killed run of this harness started
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+: ([^:@]+)", line)
        if m and m.group(1).startswith(prefix) and dead(m.group(1)):
            sh("ip", "link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


def _free_subnet() -> str:
    """A 10.231.x.0/24 no interface or route of the root namespace uses yet: ``10.231.x``."""
    used = sh("ip", "-o", "-4", "addr", "show", check=False).stdout + sh("ip", "-4", "route", check=False).stdout
    start = (os.getpid() * 7 + next(_counter) * 13) % 250
    for k in range(250):
        net = f"10.231.{(start + k) % 250 + 1}"
        if f"{net}." not in used:
            return net
    raise RuntimeError("no free 10.231.x.0/24 for the cluster's bridge")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (a test run killed with SIGKILL
    runs no atexit; its agents, ranks and coordinator must not outlive it). Kept across ``ip netns exec``."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Process:
    """A process this cluster started (in a namespace or not), its output in a log file."""

    def __init__(self, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                 ns: str | None = None) -> None:
        self.log_path = log
        self._log = log.open("ab")
        cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=_die_with_parent)

    def log(self) -> str:
        with contextlib.suppress(ValueError):  # closed once stopped: the file is all there is
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)  # its own session: the process and what it started

    def stop(self, timeout: float = 10.0) -> int | None:
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        with contextlib.suppress(OSError):
            self._log.close()
        return self.proc.returncode


@dataclass
class Node:
    index: int
    name: str  # the agent's node name
    ns: str  # network namespace
    host_if: str  # the bridge side of its veth pair (shapes what the node receives)
    ip: str
    work: Path
    agent: Process | None = None
    socket_path: str = ""


@dataclass
class Job:
    """One multi-node job: ``ranks_per_node`` Gloo ranks on each of its nodes."""

    job_id: str
    nodes: list[Node]
    ranks_per_node: int
    stop_file: Path
    ranks: dict[int, Process] = field(default_factory=dict)

    def placement(self) -> dict[int, str]:
        return {r: self.nodes[r // self.ranks_per_node].name for r in self.ranks}

    def stop(self, timeout: float = 60.0) -> None:
        """Ask every rank to leave (they leave after the same step), then make sure they did."""
        self.stop_file.touch()
        deadline = time.monotonic() + timeout
        for p in self.ranks.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.ranks.values():
            p.stop(timeout=2.0)

    def alive(self) -> bool:
        return all(p.alive() for p in self.ranks.values())

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}\n{p.log()[-2000:]}" for r, p in sorted(self.ranks.items()))


class Cluster:
    """``with Cluster(work, nodes=4) as c:`` — nodes, agents and coordinator up; everything gone after.

    ``link_rate``: every node link's rate in both directions (tc HTB, e.g. "400mbit"), so that "a tenth of its
    rate" means one thing; None leaves the veths unshaped. ``coordinator``/``agent``: extra settings of those
    sections (YAML keys, as in the shipped config file)."""

    def __init__(self, work: Path, nodes: int = 4, *, link_rate: str | None = "400mbit",
                 recording: Path = RECORDING, coordinator: Mapping[str, Any] | None = None,
                 agent: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(f"the cluster in one box {why}")
        if not 1 <= nodes <= 200:
            raise ValueError("nodes: 1 to 200")
        self.work = Path(work)
        self.prefix = f"{PREFIX}{_b36(os.getpid())}-{_b36(next(_counter) % 1296)}"
        self.bridge = f"{self.prefix}b"
        if len(self.prefix) + 3 > 15:
            raise RuntimeError(f"prefix {self.prefix} too long for interface names")
        self.n = nodes
        self.link_rate = link_rate
        self.recording = recording
        self.coordinator_settings = dict(coordinator or {})
        self.agent_settings = dict(agent or {})
        self.env = dict(env or {})
        self.net = ""
        self.nodes: list[Node] = []
        self.coordinator: Process | None = None
        self.address = ""  # the coordinator's gRPC address on the bridge
        self.metrics_url = ""
        self.secret = os.urandom(32).hex().encode()
        self.jobs: list[Job] = []
        self._closed = False
        self._made_bridge = False

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, wait_s: float = 90.0) -> None:
        atexit.register(self.close)
        remove_stale()
        self.work.mkdir(parents=True, exist_ok=True)
        self.net = _free_subnet()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        sh("ip", "addr", "add", f"{self.net}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i in range(self.n):
            self.nodes.append(self._make_node(i))
        self._start_coordinator()
        for node in self.nodes:
            self._start_agent(node)
        self.wait_connected(wait_s)

    def _make_node(self, i: int) -> Node:
        ns = f"{self.prefix}n{i}"
        host_if = f"{self.prefix}h{_b36(i)}"
        work = self.work / f"node{i}"
        work.mkdir(parents=True, exist_ok=True)
        node = Node(i, f"node{i}", ns, host_if, f"{self.net}.{10 + i}", work)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", f"{self.prefix}p{_b36(i)}", "netns", ns)
        sh("ip", "link", "set", host_if, "master", self.bridge, "up")
        sh("ip", "link", "set", "lo", "up", ns=ns)
        sh("ip", "link", "set", f"{self.prefix}p{_b36(i)}", "name", "eth0", ns=ns)
        sh("ip", "addr", "add", f"{node.ip}/24", "dev", "eth0", ns=ns)
        sh("ip", "link", "set", "eth0", "up", ns=ns)  # no default route: nothing leaves the bridge's /24
        self._base_qdisc(node)
        return node

    def close(self) -> None:
        """Stop every process it started, then remove its namespaces, links and bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for job in self.jobs:
            job.kill()
        for node in self.nodes:
            if node.agent is not None:
                node.agent.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
        for node in self.nodes:
            sh("ip", "link", "del", node.host_if, check=False)
            sh("ip", "netns", "del", node.ns, check=False)
        if self._made_bridge:
            sh("ip", "link", "del", self.bridge, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    # -- the coordinator and the agents -------------------------------------------------------------

    def _start_coordinator(self) -> None:
        secret_file = self.work / "cluster.secret"
        secret_file.write_bytes(self.secret + b"\n")
        os.chmod(secret_file, 0o600)
        work = self.work / "coordinator"
        work.mkdir(exist_ok=True)
        settings = {"listen": f"{self.net}.1:0", "metrics_listen": f"{self.net}.1:0",
                    "db_path": str(work / "coordinator.db"), "node_secret_file": str(secret_file),
                    "operator_token": OPERATOR_TOKEN, **self.coordinator_settings}
        cfg = work / "coordinator.yaml"
        cfg.write_text(yaml.safe_dump({"coordinator": settings}))
        ready = work / "ready.json"
        ready.unlink(missing_ok=True)  # a previous run's file names a port nobody listens on
        self.coordinator = Process([*CLI, "coordinator", "--config", str(cfg), "--ready-file", str(ready)],
                                   work / "coordinator.log", self.env)
        doc = self._until(lambda: json.loads(ready.read_text()) if ready.exists() else None, 60,
                          "the coordinator's ready file", self.coordinator)
        self.address = f"{self.net}.1:{doc['grpc_port']}"
        self.metrics_url = f"http://{self.net}.1:{doc['metrics_port']}/metrics" if doc.get("metrics_port") else ""

    def _start_agent(self, node: Node) -> None:
        token_file = node.work / "node.token"
        token_file.write_text(node_token(self.secret, node.name) + "\n")
        node.socket_path = str(node.work / "ranks.sock")
        cfg = node.work / "agent.yaml"
        cfg.write_text(yaml.safe_dump({
            "agent": {"nvml_snapshot": str(self.recording), "listen": "127.0.0.1:0", "node_name": node.name,
                      "coordinator": self.address, "state_dir": str(node.work / "state"),
                      "socket_path": node.socket_path, **self.agent_settings},
            "coordinator": {"token_file": str(token_file)},
            "diag": {"enabled": False}, "zerocode": {"enabled": False}}))
        node.agent = Process([*CLI, "agent", "--config", str(cfg)], node.work / "agent.log", self.env, ns=node.ns)

    def wait_connected(self, timeout: float = 90.0) -> None:
        names = {n.name for n in self.nodes}

        def connected() -> bool:
            for node in self.nodes:
                if node.agent is not None and not node.agent.alive():
                    raise AssertionError(f"agent of {node.name} exited:\n{node.agent.log()[-3000:]}")
            doc = self.query("fleet")
            return doc is not None and names <= {n["name"] for n in doc["nodes"] if n["connected"]}

        self._until(connected, timeout, "every agent connected", self.coordinator, interval=0.5)

    def query(self, what: str, *args: str, timeout: float = 60) -> dict[str, Any] | None:
        """``gpuhealth <what> --json`` against the coordinator (the operator's token); None when it failed."""
        res = subprocess.run([*CLI, what, *args, "--coordinator", self.address, "--json"], capture_output=True,
                             text=True, timeout=timeout, env={**os.environ, **self.env,
                                                              "GPUHEALTH_TOKEN": OPERATOR_TOKEN})
        if res.returncode not in (0, 1) or not res.stdout.strip():
            return None
        doc: dict[str, Any] = json.loads(res.stdout)
        return doc

    def job_doc(self, job_id: str) -> dict[str, Any] | None:
        doc = self.query("jobs", job_id)
        jobs = (doc or {}).get("jobs") or []
        return jobs[0] if jobs else None

    def verdicts(self, job_id: str) -> list[dict[str, Any]]:
        return list((self.job_doc(job_id) or {}).get("verdicts") or [])

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            return str(resp.read().decode())

    # -- jobs ------------------------------------------------------------------------------------

    def start_job(self, job_id: str, *, nodes: Sequence[int] | None = None, ranks_per_node: int = 2,
                  compute_s: float = 0.05, numel: int = 256 * 1024, max_s: float = 600.0,
                  timeout_s: float = 300.0) -> Job:
        """Ranks ``ranks_per_node`` per node (rank r on node r // ranks_per_node), master on the first node."""
        chosen = [self.nodes[i] for i in (nodes if nodes is not None else range(self.n))]
        world = len(chosen) * ranks_per_node
        stop_file = self.work / f"{job_id}.stop"
        stop_file.unlink(missing_ok=True)
        job = Job(job_id, chosen, ranks_per_node, stop_file)
        port = 29500 + next(_counter) % 400
        for r in range(world):
            node = chosen[r // ranks_per_node]
            env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r % ranks_per_node),
                   "LOCAL_WORLD_SIZE": str(ranks_per_node), "MASTER_ADDR": chosen[0].ip, "MASTER_PORT": str(port),
                   "GLOO_SOCKET_IFNAME": "eth0", "GPUHEALTH_SOCKET": node.socket_path, "GPUHEALTH_JOB_ID": job_id,
                   "CLUSTER_JOB_TIMEOUT_S": str(timeout_s), "OMP_NUM_THREADS": "1", "HOSTNAME": node.name,
                   "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO / "src"))}
            job.ranks[r] = Process([sys.executable, str(JOB_SCRIPT), str(stop_file), str(compute_s), str(numel),
                                    str(max_s)], node.work / f"{job_id}-rank{r}.log", {**self.env, **env}, ns=node.ns)
        self.jobs.append(job)
        return job

    # -- faults ----------------------------------------------------------------------------------

    def _devices(self, node: Node, direction: str) -> list[tuple[str, str | None, str]]:
        """(device, namespace, which end of a packet names the peer) for ``out``, ``in`` or ``both``."""
        if direction not in ("out", "in", "both"):
            raise ValueError("direction: out, in or both")
        out = [("eth0", node.ns, "dst")] if direction in ("out", "both") else []
        return out + ([(node.host_if, None, "src")] if direction in ("in", "both") else [])

    def _base_qdisc(self, node: Node) -> None:
        for dev, ns, _ in self._devices(node, "both"):
            sh("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
            if self.link_rate is None:
                continue
            sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", ns=ns)
            sh("tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", self.link_rate,
               "ceil", self.link_rate, ns=ns)

    def shape(self, i: int, *, rate: str | None = None, delay_ms: float | None = None, loss_pct: float | None = None,
              direction: str = "both", peer: int | None = None) -> None:
        """Slow node ``i``'s link: a rate (tc units, "40mbit"), added delay and loss, in ``direction``, for all its
        traffic or only what it exchanges with node ``peer``."""
        node = self.nodes[i]
        if self.link_rate is None and (rate is None or peer is not None):
            raise ValueError("shape needs the cluster's link_rate (an HTB root) for a peer or a delay alone")
        for dev, ns, end in self._devices(node, direction):
            if self.link_rate is None:
                sh("tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10", ns=ns)
                sh("tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", str(rate),
                   "ceil", str(rate), ns=ns)
                cls = "1:10"
            elif peer is None:
                r = rate or self.link_rate
                sh("tc", "class", "change", "dev", dev, "classid", "1:10", "htb", "rate", r, "ceil", r, ns=ns)
                cls = "1:10"
            else:
                r = rate or self.link_rate
                sh("tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", r,
                   "ceil", r, ns=ns)
                sh("tc", "filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                   "match", "ip", end, f"{self.nodes[peer].ip}/32", "flowid", "1:20", ns=ns)
                cls = "1:20"
            netem = [*(["delay", f"{delay_ms}ms"] if delay_ms else []), *(["loss", f"{loss_pct}%"] if loss_pct else [])]
            if netem:
                sh("tc", "qdisc", "replace", "dev", dev, "parent", cls, "handle", f"{cls.split(':')[1]}:", "netem",
                   "limit", "10000", *netem, ns=ns)

    def unshape(self, i: int) -> None:
        self._base_qdisc(self.nodes[i])

    def cut(self, i: int) -> None:
        """Node ``i`` loses its network: its link goes down (its agent and ranks keep running)."""
        sh("ip", "link", "set", self.nodes[i].host_if, "down")

    def restore(self, i: int) -> None:
        sh("ip", "link", "set", self.nodes[i].host_if, "up")

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _until(cond: Any, timeout: float, what: str, proc: Process | None, interval: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = cond()
            if value:
                return value
            if proc is not None and not proc.alive():
                raise AssertionError(f"{what}: the process exited {proc.proc.returncode}:\n{proc.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(interval)
