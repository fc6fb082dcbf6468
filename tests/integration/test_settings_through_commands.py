"""Every configuration key, through the command that uses it — generated from the config dataclasses.

For each key of ``gpuhealth.config.Config``: either a line in ``OBSERVED`` (the run that observes it, the
side — agent, coordinator or CLI — whose config carries it, and the value set) or a line in ``EXEMPT`` (why
it is not observed here). ``test_every_key_is_observed_or_exempt`` fails for a key in neither, so a new
key cannot land without one.

Each run starts the real commands as subprocesses (``gpuhealth agent``, ``gpuhealth coordinator``,
``gpuhealth jobs/fleet/triage/diag``) twice: once with the observed keys in the config file, once with
the same values only in their ``GPUHEALTH_<SECTION>_<KEY>`` variables (the file then holds only what the
run needs besides: the support settings). Then it looks at what the command did — what it serves, logs,
refuses, writes or answers — never at the parsed config. Every observed value differs from its default
in a way the check can tell apart.

This suite found (before its fixes, issue 23): the coordinator ignoring node_secret_file, token_review
and every key around them; the agent's link ignoring token_file, node_secret_file, spool_commit_s and
max_inflight; jobs/fleet ignoring coordinator.token_file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from commands import (
    SCENARIO,
    Agent,
    Coordinator,
    Ranks,
    http_get,
    make_pki,
    metric_value,
    proc_limit,
    proc_status,
    rank_process_of,
    run_cli,
    until,
    write_config,
    write_secret,
)
from simagent import SimAgent, step_batch_message
from tokenreview_standin import ServiceAccountToken, StandIn

from gpuhealth.config import Config
from gpuhealth.runtime.credentials import node_token
from gpuhealth.runtime.tls import token_metadata

pytestmark = pytest.mark.integration

KEYS = sorted(f"{section.name}.{key.name}" for section in dataclasses.fields(Config())
              for key in dataclasses.fields(getattr(Config(), section.name)))
Value = Any | Callable[[Path], Any]  # a value, or how to make one in the run's work folder


@dataclass(frozen=True)
class Observed:
    run: str
    side: str  # "agent", "coordinator" or "cli": whose config (file or environment) carries the key
    value: Value


def _file(name: str, text: str) -> Callable[[Path], str]:
    def make(work: Path) -> str:
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)

    return make


def _dir(name: str) -> Callable[[Path], str]:
    def make(work: Path) -> str:
        (work / name).mkdir(parents=True, exist_ok=True)
        return str(work / name)

    return make


def _path(name: str) -> Callable[[Path], str]:
    def make(work: Path) -> str:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        return str(work / name)

    return make


def _secret(work: Path) -> str:
    write_secret(work / "cluster.secret")
    return str(work / "cluster.secret")


def _victim_token(work: Path) -> str:
    (work / "victim.token").write_text(node_token(write_secret(work / "cluster.secret"), "victim") + "\n")
    return str(work / "victim.token")


def _pki(work: Path) -> dict[str, tuple[str, str]]:
    if not (work / "pki" / "ca.crt").exists():
        make_pki(work / "pki", {"server": "coordinator", "node": "tls-node", "operator": "alice", "other": "bob"})
    return {n: (str(work / "pki" / f"{n}.crt"), str(work / "pki" / f"{n}.key"))
            for n in ("server", "node", "operator", "other")}


# GPU 3 of the scenario is at 0000:48:00; XID 48 (a double-bit ECC error) names it in the kernel log.
_KMSG = "NVRM: Xid (PCI:0000:48:00): 48, pid=1, name=settings, An uncorrectable double bit error\n"
_THRESHOLDS = "pcie:\n  width_degraded_severity: warning\n"
_SA_ACCOUNT = "system:serviceaccount:settings:custom-agent"

OBSERVED: dict[str, Observed] = {
    # -- the agent on its own (a scenario backend) -------------------------------------------------------
    "agent.listen": Observed("agent", "agent", "127.0.0.2:0"),
    "agent.node_name": Observed("agent", "agent", "settings-node"),
    "agent.json_logs": Observed("agent", "agent", True),
    "agent.log_level": Observed("agent", "agent", "debug"),
    "agent.dcgm_compat": Observed("agent", "agent", True),
    "agent.dcgm_schema": Observed("agent", "agent", "4.8"),
    "agent.dcgm_hostname_label": Observed("agent", "agent", "hostname"),
    "agent.nvlink_per_link": Observed("agent", "agent", True),
    "agent.nvml_snapshot": Observed("agent", "agent", str(SCENARIO)),
    "agent.socket_path": Observed("agent", "agent", _path("sock/ranks.sock")),
    "agent.rank_process_user": Observed("agent", "agent", "65533"),
    "agent.rank_process_memory_mib": Observed("agent", "agent", 300),
    "agent.rank_process_cpu_seconds": Observed("agent", "agent", 1200),
    "agent.rank_process": Observed("link", "agent", False),
    "agent.slurm_job_dir": Observed("agent", "agent", _dir("slurm-jobs")),
    "collectors.fast_interval_s": Observed("agent", "agent", 2.5),
    "collectors.slow_interval_s": Observed("agent", "agent", 45.0),
    "collectors.expected_gpus": Observed("agent", "agent", 9),
    "collectors.disabled": Observed("agent", "agent", ["numa"]),
    "collectors.thresholds_file": Observed("agent", "agent", _file("thresholds.yaml", _THRESHOLDS)),
    "collectors.kmsg_path": Observed("agent", "agent", _file("kmsg.log", _KMSG)),
    "zerocode.enabled": Observed("agent", "agent", False),
    # (from 2 s on its GPU 0 answers each NVML call 2 s late: past this timeout, well within the default of 10 s)
    "collectors.timeout_s": Observed("agent-timeout", "agent", 0.5),
    # -- the agent's link to a coordinator ---------------------------------------------------------------
    "agent.coordinator": Observed("link", "agent", "127.0.0.1:{grpc_port}"),
    "agent.state_dir": Observed("link", "agent", _dir("agent-state")),
    "coordinator.spool_commit_s": Observed("link", "agent", 30.0),
    "coordinator.spool_max_records": Observed("spool", "agent", 3),
    "coordinator.link_batch_interval_s": Observed("spool", "agent", 0.1),
    # -- the coordinator with node tokens; the agents and the CLI against it -----------------------------
    "coordinator.listen": Observed("node-tokens", "coordinator", "127.0.0.2:0"),
    "coordinator.metrics_listen": Observed("node-tokens", "coordinator", "127.0.0.3:0"),
    "coordinator.db_path": Observed("node-tokens", "coordinator", _path("db/state.db")),
    "coordinator.node_secret_file": Observed("node-tokens", "coordinator", _secret),
    "coordinator.operator_token": Observed("node-tokens", "coordinator", "settings-operator-token"),
    "coordinator.token_file": Observed("node-tokens", "agent", _victim_token),
    "coordinator.shared_token": Observed("shared", "coordinator", True),
    "coordinator.token": Observed("shared", "coordinator", "settings-shared-token"),
    "coordinator.allow_unauthenticated": Observed("open", "coordinator", True),
    # -- TokenReview against a stand-in API server -------------------------------------------------------
    "coordinator.token_review": Observed("token-review", "coordinator", "{api_url}"),
    "coordinator.token_review_ca": Observed("token-review", "coordinator", "{api_ca}"),
    "coordinator.token_review_credential_file": Observed("token-review", "coordinator", "{api_credential}"),
    "coordinator.token_review_audience": Observed("token-review", "coordinator", "gh-settings"),
    "coordinator.agent_service_accounts": Observed("token-review", "coordinator", _SA_ACCOUNT),
    # -- mutual TLS ---------------------------------------------------------------------------------------
    "coordinator.tls_cert": Observed("mtls", "coordinator", lambda w: _pki(w)["server"][0]),
    "coordinator.tls_key": Observed("mtls", "coordinator", lambda w: _pki(w)["server"][1]),
    "coordinator.tls_ca": Observed("mtls", "coordinator", lambda w: str(w / "pki" / "ca.crt")),
    "coordinator.operator_names": Observed("mtls", "coordinator", "alice"),
    "coordinator.client_tls_cert": Observed("mtls", "agent", lambda w: _pki(w)["node"][0]),
    "coordinator.client_tls_key": Observed("mtls", "agent", lambda w: _pki(w)["node"][1]),
    # -- detection and what agents are told ----------------------------------------------------------------
    "coordinator.hang_k": Observed("detection", "coordinator", 100.0),
    "coordinator.hang_floor_s": Observed("detection", "coordinator", 2.0),
    "coordinator.evidence_dir": Observed("detection", "coordinator", _dir("evidence-here")),
    "coordinator.heartbeat_interval_s": Observed("detection", "coordinator", 0.75),
    "coordinator.max_inflight": Observed("detection", "coordinator", 7),
    # -- the fleet view ----------------------------------------------------------------------------------
    "coordinator.screen_window_s": Observed("fleet", "coordinator", 3600.0),
    "coordinator.screen_turn_s": Observed("fleet", "coordinator", 120.0),
    "coordinator.screen_concurrency": Observed("fleet", "coordinator", 1.0),
    "coordinator.forget_job_after_s": Observed("fleet", "coordinator", 1.0),
    "coordinator.screen_rotation": Observed("no-rotation", "coordinator", False),
    # -- gpuhealth diag ------------------------------------------------------------------------------------
    "diag.golden_dir": Observed("diag", "cli", _dir("golden-here")),
    "diag.timeout_s": Observed("diag-timeout", "cli", 0.3),
}

EXEMPT: dict[str, str] = {
    "collectors.history_len": "bounds each collector's in-memory history; its effect (how far back a rate looks) "
                              "shows only after that many sweeps; tests/unit/collectors drive it",
    "collectors.expected_nvlinks": "judged only on GPUs whose NVLink count NVML reports lower than expected; the "
                                   "recordings' GPUs report theirs in full and a scenario cannot lower it",
    "collectors.sysfs_root": "a recording or scenario replays its own recorded GPU sysfs; its NICs are read from "
                             "sysfs_root: tests/integration/test_nic_health_commands.py drives it through "
                             "gpuhealth status and agent",
    "collectors.net_interfaces": "tests/integration/test_nic_health_commands.py: the agent's /metrics serve the "
                                 "NICs named (a veth) and not the others",
    "collectors.expected_net_speed_mbps": "judged against a NIC tree: tests/unit/collectors/test_nic_health.py",
    "collectors.expected_ib_rate_gbps": "judged against a NIC tree: tests/unit/collectors/test_nic_health.py",
    "agent.pod_resources_socket": "needs the kubelet's PodResources gRPC service; tests/unit/agent/test_attribution* "
                                  "run the agent's provider against a real gRPC stand-in of it",
    "agent.web_config_file": "turns the agent's HTTP into HTTPS, which this run's checks do not speak; "
                             "tests/integration/test_web_tls.py starts gpuhealth agent with it from the config file, "
                             "GPUHEALTH_AGENT_WEB_CONFIG_FILE and --web.config.file",
    "coordinator.metrics_web_config_file": "turns the coordinator's /metrics into HTTPS, which this run's checks do "
                                           "not speak; tests/integration/test_web_tls.py starts gpuhealth "
                                           "coordinator with it (config file and --web.config.file)",
    "diag.enabled": "the agent never screens a simulated backend (no GPU here): screening has no effect to observe",
    "diag.interval_s": "screening schedule: no screening on a simulated backend",
    "diag.gpu_seconds_per_hour": "the per-GPU budget: a CPU run of a diagnostic has no GPU to charge",
    "diag.run_on_busy_gpus": "decides on GPUs with compute processes: none here",
    "diag.state_dir": "budget ledger and per-GPU locks: a CPU run takes neither",
    "diag.busbw_thresholds_file": "judges busbw on a GPU topology; a CPU (Gloo) run has none to look up",
    "diag.busbw_min_fraction": "judges busbw against a GPU reference curve: none on CPU",
    "diag.busbw_judge_min_bytes": "judges busbw against a GPU reference curve: none on CPU",
    "diag.bandwidth_hbm_fraction": "judges HBM copy bandwidth: no GPU here",
    "diag.bandwidth_pcie_fraction": "judges PCIe copy bandwidth: no GPU here",
    "diag.screen_block_dir": "holds off screens, which never run on a simulated backend",
    "zerocode.poll_interval_s": "zero-code keys act on PyTorch/NCCL jobs found by discovery from NVML's process "
                                "list: a scenario backend lists none; tests/integration/test_zerocode_gloo.py runs "
                                "the watcher (ZeroCodeSettings, built from this section) on real Gloo jobs",
    "zerocode.hang_threshold_s": "as zerocode.poll_interval_s",
    "zerocode.dump_on_hang": "as zerocode.poll_interval_s",
    "zerocode.periodic_dump_s": "as zerocode.poll_interval_s",
    "zerocode.stacks": "as zerocode.poll_interval_s",
    "zerocode.stacks_native": "as zerocode.poll_interval_s",
    "zerocode.keep_evidence": "as zerocode.poll_interval_s",
    "zerocode.simulated_processes": "observed through gpuhealth agent by tests/integration/test_zerocode_simulated.py "
                                    "(a scenario listing this machine's processes: watched only with the key on)",
    "coordinator.retention_days": "days: retention runs hourly over rows that old",
    "coordinator.step_retention_hours": "hours: retention runs hourly over raw step batches that old",
    "coordinator.warm_start_s": "replays step batches after a restart; the difference shows only for jobs older "
                                "than the default window (10 min)",
    "coordinator.straggler_budget_records_s": "a rate of 50,000 records/s per job before sampling sets in: "
                                              "benchmarks/coordinator_load.py drives it",
    "coordinator.screen_history": "keeps the last N screens per GPU beside the newest of each kind: no query shows "
                                  "the history's length",
    "coordinator.tick_s": "the detection period: only latency, inside the slack of any timing check "
                          "(the detection run uses 0.2 s as a support setting)",
    "coordinator.evidence_timeout_s": "how long an investigation waits for ranks' dumps; the detection run's jobs "
                                      "have no ranks to wait for",
}


# ----------------------------------------------------------------------------------------------- plumbing
def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


@dataclass
class Setup:
    """One run: the observed keys' values, and per side the config file and environment to start with."""

    work: Path
    source: str  # "file" or "env"
    values: dict[str, Any]  # observed key → value
    sides: dict[str, str]  # observed key → side
    subst: dict[str, str]

    def value(self, key: str) -> Any:
        v = self.values[key]
        return v.format(**self.subst) if isinstance(v, str) else v

    def config(self, side: str, support: dict[str, dict[str, Any]] | None = None,
               name: str | None = None) -> tuple[Path, dict[str, str]]:
        """The side's config file (support settings, and the observed keys when the source is the file) and
        environment (the observed keys when the source is the environment)."""
        sections: dict[str, dict[str, Any]] = {s: dict(v) for s, v in (support or {}).items()}
        env: dict[str, str] = {}
        for key in self.values:
            if self.sides[key] != side:
                continue
            section, field = key.split(".")
            if self.source == "file":
                sections.setdefault(section, {})[field] = self.value(key)
            else:
                env[f"GPUHEALTH_{section.upper()}_{field.upper()}"] = _env_value(self.value(key))
        path = write_config(self.work / f"{name or side}.yaml", sections)
        return path, env


def _setup(run: str, source: str, work: Path, subst: dict[str, str] | None = None) -> Setup:
    keys = {k: o for k, o in OBSERVED.items() if o.run == run}
    values = {k: (o.value(work) if callable(o.value) else o.value) for k, o in keys.items()}
    return Setup(work, source, values, {k: o.side for k, o in keys.items()}, dict(subst or {}))


class Cleanup:
    def __init__(self) -> None:
        self.procs: list[Any] = []

    def add(self, proc: Any) -> Any:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture
def cleanup() -> Any:
    c = Cleanup()
    yield c
    c.stop()


def _open_coordinator(work: Path, cleanup: Cleanup, **extra: Any) -> Coordinator:
    path = write_config(work / "open-coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": str(work / "open.db"), **extra}})
    coord = cleanup.add(Coordinator(work / "open-coordinator", path))
    coord.wait()
    return coord


def _fleet(address: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    res = run_cli("fleet", "--coordinator", address, "--json", env=env)
    assert res.returncode in (0, 1, 3), res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    assert res.returncode != 3 or doc["nodes"] == []  # 3 with a view: no node has registered yet
    return doc


def _connected(address: str, node: str, env: dict[str, str] | None = None) -> bool:
    return any(n["name"] == node and n["connected"] for n in _fleet(address, env)["nodes"])


async def _register_code(address: str, node: str, metadata: tuple[tuple[str, str], ...],
                         credentials: grpc.ChannelCredentials | None = None) -> grpc.StatusCode | None:
    agent = SimAgent(address, node, metadata=metadata, incarnation=f"probe-{time.monotonic_ns()}",
                     credentials=credentials)
    try:
        await agent.register()
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await agent.close()
    return None


# ----------------------------------------------------------------------------------------------- the runs
def run_agent(s: Setup, cleanup: Cleanup) -> None:
    (s.work / "slurm-jobs" / "0").write_text("4711\n")  # the prolog's file: GPU 0 runs job 4711
    path, env = s.config("agent", {"agent": {"state_dir": str(s.work / "state")}, "diag": {"enabled": False}})
    (s.work / "state").mkdir(exist_ok=True)
    agent = cleanup.add(Agent(s.work / "agent", path, env))
    assert agent.url.startswith("http://127.0.0.2:"), agent.url  # agent.listen
    agent.wait_ready()
    health = agent.health()
    assert health["node"]["name"] == "settings-node"  # agent.node_name
    assert health["node"]["gpu_count"] == 8 and health["node"]["simulated"]  # agent.nvml_snapshot
    lines = [ln for ln in agent.log().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # agent.json_logs: every line is a JSON record
    assert any(r["level"] == "debug" for r in records), lines[:5]  # agent.log_level
    metrics = agent.get("/metrics")
    assert "DCGM_FI_DEV_GPU_TEMP{" in metrics  # agent.dcgm_compat
    assert "DCGM_FI_DEV_GPU_TEMP_CELSIUS" not in metrics and "DCGM_FI_DRIVER_VERSION=" in metrics  # agent.dcgm_schema
    temp = next(ln for ln in metrics.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_TEMP{"))
    assert 'hostname="settings-node"' in temp and "Hostname=" not in temp  # agent.dcgm_hostname_label
    assert any('link="' in ln for ln in metrics.splitlines() if ln.startswith("gpuhealth_gpu_nvlink_")), \
        "agent.nvlink_per_link: no per-link NVLink series"
    assert Path(s.value("agent.socket_path")).exists()  # agent.socket_path
    child = until(lambda: rank_process_of(agent.proc.pid), 10, "the agent's rank process")
    until(lambda: proc_status(child)["NoNewPrivs"].strip() == "1", 10, "the rank process sandboxed")
    want = "65533" if os.geteuid() == 0 else str(os.geteuid())  # a non-root agent cannot change uid
    assert proc_status(child)["Uid"].split() == [want] * 4  # agent.rank_process_user
    assert proc_limit(child, "Max address space") == str(300 << 20)  # agent.rank_process_memory_mib
    assert proc_limit(child, "Max cpu time") == "1200"  # agent.rank_process_cpu_seconds
    # agent.slurm_job_dir: the job map is read on a scrape and kept for its TTL (one read may precede the GPU list)
    until(lambda: metric_value(agent.get("/metrics"), "gpuhealth_gpu_health", gpu="0", slurm_job_id="4711")
          is not None, 30, "GPU 0's series labelled with the Slurm job in agent.slurm_job_dir")
    assert metric_value(metrics, "gpuhealth_collector_interval_seconds", collector="xid") == 2.5
    assert metric_value(metrics, "gpuhealth_collector_interval_seconds", collector="pcie") == 45.0
    assert metric_value(metrics, "gpuhealth_collector_interval_seconds", collector="numa") is None  # disabled
    assert "gpuhealth_agent_ras_queries_total" not in metrics  # zerocode.enabled: no watcher
    codes = {f["code"]: f for f in health["findings"]}
    assert "gpu.missing" in codes, sorted(codes)  # collectors.expected_gpus: 9 expected, 8 there
    gpu3 = {f["code"]: f for f in health["gpus"][3]["findings"]}
    assert gpu3["pcie.link_degraded"]["severity"] == "warning"  # collectors.thresholds_file (default: critical)

    def xid_48() -> bool:
        return any(f["code"] == "xid.48" for f in agent.health()["gpus"][3]["findings"])

    until(xid_48, 20, "XID 48 from collectors.kmsg_path on GPU 3")


def run_agent_timeout(s: Setup, cleanup: Cleanup) -> None:
    slow_gpu = s.work / "slow_gpu.yaml"
    slow_gpu.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json",
                                        "events": [{"at": 2, "type": "slow", "gpu": 0, "seconds": 2}]}))
    path, env = s.config("agent", {"agent": {"nvml_snapshot": str(slow_gpu), "listen": "127.0.0.1:0",
                                             "state_dir": str(s.work), "socket_path": str(s.work / "r.sock")},
                                   "diag": {"enabled": False}})
    agent = cleanup.add(Agent(s.work / "agent", path, env))

    def timed_out() -> bool:
        metrics = agent.get("/metrics")
        counted = any(line.startswith("gpuhealth_collector_timeouts_total{") and float(line.rsplit(" ", 1)[1]) > 0
                      for line in metrics.splitlines())
        # the finding names the limit it ran past: this key's value, not the default's
        said = [f["message"] for f in agent.health()["findings"] if "timed out after" in f.get("message", "")]
        return counted and bool(said) and all("timed out after 0.5 s" in m for m in said)

    until(timed_out, 30, "a collector run past collectors.timeout_s (0.5 s) counted and named as timed out")


def run_link(s: Setup, cleanup: Cleanup) -> None:
    coord = _open_coordinator(s.work, cleanup)
    s.subst["grpc_port"] = str(coord.wait()["grpc_port"])
    path, env = s.config("agent", {"agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0",
                                             "node_name": "link-node", "socket_path": str(s.work / "r.sock")},
                                   "coordinator": {"link_batch_interval_s": 60.0}, "diag": {"enabled": False}})
    agent = cleanup.add(Agent(s.work / "agent", path, env))
    until(lambda: _connected(coord.address(), "link-node"), 30, "agent.coordinator: the agent's stream")
    spool = Path(s.value("agent.state_dir")) / "coordinator-spool.db"
    assert spool.exists()  # agent.state_dir holds the spool
    assert rank_process_of(agent.proc.pid) is None  # agent.rank_process: false, the socket in the agent's process
    ranks = cleanup.add(Ranks(s.work, str(s.work / "r.sock"), "link-job", steps=10))
    ranks.wait_sent()
    until(lambda: metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_step_records_total") == 20, 10,
          "the agent took the ranks' 20 step records")
    time.sleep(1.0)  # 20 x the default commit interval (50 ms)
    journal = spool.with_name("coordinator-spool-steps.db")  # the step journal beside the spool
    with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as db:
        on_disk = db.execute("SELECT COALESCE(SUM(n), 0) FROM steps").fetchone()[0]
    assert on_disk == 0, f"{journal}: {on_disk} step records committed within 1 s (coordinator.spool_commit_s: 30)"


def run_spool(s: Setup, cleanup: Cleanup) -> None:
    # No coordinator answers at this address: everything stays in the spool.
    path, env = s.config("agent", {"agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0",
                                             "coordinator": "127.0.0.1:9", "state_dir": str(s.work),
                                             "socket_path": str(s.work / "r.sock")}, "diag": {"enabled": False}})
    agent = cleanup.add(Agent(s.work / "agent", path, env))
    agent.wait_ready()
    ranks = cleanup.add(Ranks(s.work, str(s.work / "r.sock"), "spool-job", steps=40, period=0.05))
    ranks.wait_sent()

    def spooled() -> tuple[float, float] | None:
        metrics = agent.get("/metrics")  # refreshed every sweep (5 s)
        if metric_value(metrics, "gpuhealth_agent_rank_step_records_total") != 80:
            return None
        return (metric_value(metrics, "gpuhealth_agent_coordinator_spool_records") or 0.0,
                metric_value(metrics, "gpuhealth_agent_coordinator_spool_dropped_records_total") or 0.0)

    depth, dropped = until(spooled, 20, "the agent's metrics after the ranks' 80 step records")
    assert depth <= 3, depth  # coordinator.spool_max_records
    assert dropped > 0, (depth, dropped)
    # 2 s of steps packed every 0.1 s: some 20 batches (every 1 s, the default: 2 or 3)
    assert depth + dropped >= 12, (depth, dropped)  # coordinator.link_batch_interval_s


def run_node_tokens(s: Setup, cleanup: Cleanup) -> None:
    secret_file = s.work / "cluster.secret"
    secret = write_secret(secret_file)
    path, env = s.config("coordinator", {"coordinator": {}})
    coord = cleanup.add(Coordinator(s.work / "coordinator", path, env))
    ports = coord.wait()
    address = f"127.0.0.2:{ports['grpc_port']}"  # coordinator.listen
    assert Path(s.value("coordinator.db_path")).exists()  # coordinator.db_path
    code, body = http_get(f"http://127.0.0.3:{ports['metrics_port']}/metrics")  # coordinator.metrics_listen
    assert code == 200 and "gpuhealth_coordinator_nodes" in body
    operator = {"GPUHEALTH_TOKEN": s.value("coordinator.operator_token")}
    agent_cfg, agent_env = s.config("agent", {"agent": {
        "nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "node_name": "victim", "coordinator": address,
        "state_dir": str(s.work / "victim"), "socket_path": str(s.work / "victim.sock")}, "diag": {"enabled": False}})
    (s.work / "victim").mkdir()
    victim = cleanup.add(Agent(s.work / "victim-agent", agent_cfg, agent_env))
    until(lambda: _connected(address, "victim", operator), 30, "coordinator.token_file: the victim's stream")
    # An agent deriving its token from the secret (coordinator.node_secret_file, agent side) joins as itself.
    derived_cfg = write_config(s.work / "derived.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "node_name": "derived",
                  "coordinator": address, "state_dir": str(s.work / "derived"),
                  "socket_path": str(s.work / "derived.sock")},
        "coordinator": {"node_secret_file": str(secret_file)}, "diag": {"enabled": False}})
    (s.work / "derived").mkdir()
    cleanup.add(Agent(s.work / "derived-agent", derived_cfg))
    until(lambda: _connected(address, "derived", operator), 30, "the agent that derives its token")
    # Another node's token claiming the victim: refused; no token: refused; the victim keeps its stream.
    codes = asyncio.run(_node_token_probes(address, secret))
    assert codes == [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, None], codes
    time.sleep(1.0)
    assert _connected(address, "victim", operator)
    assert "ABORTED" not in victim.log() and "register again" not in victim.log(), victim.log()
    # coordinator.operator_token: live triage passes authorisation (no such job) — a node token does not.
    res = run_cli("triage", "--job", "no-such-job", "--coordinator", address, env=operator)
    assert "no job 'no-such-job'" in res.stderr, res.stderr
    res = run_cli("triage", "--job", "no-such-job", "--coordinator", address,
                  env={"GPUHEALTH_TOKEN": node_token(secret, "victim")})
    assert "PERMISSION_DENIED" in res.stderr and "operator" in res.stderr, res.stderr


async def _node_token_probes(address: str, secret: bytes) -> list[grpc.StatusCode | None]:
    return [await _register_code(address, "victim", token_metadata(node_token(secret, "attacker"))),
            await _register_code(address, "victim", ()),
            await _register_code(address, "attacker", token_metadata(node_token(secret, "attacker")))]


def run_shared(s: Setup, cleanup: Cleanup) -> None:
    path, env = s.config("coordinator", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                         "db_path": str(s.work / "c.db")}})
    coord = cleanup.add(Coordinator(s.work / "coordinator", path, env))
    address = coord.address()
    assert "any holder can report as any node" in coord.log()  # shared_token: kept, and warned
    tok = token_metadata("settings-shared-token")
    codes = asyncio.run(_codes(address, [("n1", tok), ("n2", tok), ("n3", token_metadata("wrong"))]))
    assert codes == [None, None, grpc.StatusCode.UNAUTHENTICATED], codes  # coordinator.token


async def _codes(address: str, probes: list[tuple[str, tuple[tuple[str, str], ...]]],
                 credentials: grpc.ChannelCredentials | None = None) -> list[grpc.StatusCode | None]:
    return [await _register_code(address, node, md, credentials) for node, md in probes]


def run_open(s: Setup, cleanup: Cleanup) -> None:
    path, env = s.config("coordinator", {"coordinator": {"listen": "0.0.0.0:0", "metrics_listen": "off",
                                                         "db_path": str(s.work / "c.db")}})
    coord = cleanup.add(Coordinator(s.work / "coordinator", path, env))
    address = coord.address()  # starts (without the key: refuses, see test_security_through_commands.py)
    assert "WITHOUT authentication on 0.0.0.0:0 (coordinator.allow_unauthenticated)" in coord.log()
    assert asyncio.run(_codes(address, [("n1", ())])) == [None]


def run_token_review(s: Setup, cleanup: Cleanup) -> None:
    api = StandIn(s.work)
    api.start()
    cleanup.add(_Stopper(api.stop))
    api.tokens = {
        "aaa.bbb.ccc": ServiceAccountToken(_SA_ACCOUNT, ["gh-settings"], "agent-a", "uid-a", node="sa-node"),
        "aaa.bbb.ddd": ServiceAccountToken(_SA_ACCOUNT, ["gpuhealth"], "agent-b", "uid-b", node="sa-b"),
        "aaa.bbb.eee": ServiceAccountToken("system:serviceaccount:gpuhealth:gpuhealth-agent", ["gh-settings"],
                                           "agent-c", "uid-c", node="sa-c"),
    }
    s.subst.update(api_url=api.url, api_ca=api.ca_file, api_credential=str(api.credential_file))
    path, env = s.config("coordinator", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                         "db_path": str(s.work / "c.db")}})
    coord = cleanup.add(Coordinator(s.work / "coordinator", path, env))
    address = coord.address()
    (s.work / "sa.token").write_text("aaa.bbb.ccc\n")
    agent_cfg = write_config(s.work / "agent.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "node_name": "sa-node",
                  "coordinator": address, "state_dir": str(s.work), "socket_path": str(s.work / "r.sock")},
        "coordinator": {"token_file": str(s.work / "sa.token")}, "diag": {"enabled": False}})
    cleanup.add(Agent(s.work / "agent", agent_cfg))
    until(lambda: _connected(address, "sa-node", {"GPUHEALTH_TOKEN": "aaa.bbb.ccc"}), 30,
          "the agent's ServiceAccount token reviewed (token_review, _ca, _credential_file)")
    codes = asyncio.run(_codes(address, [("sa-b", token_metadata("aaa.bbb.ddd")),     # another audience
                                         ("sa-c", token_metadata("aaa.bbb.eee")),     # another account
                                         ("other", token_metadata("aaa.bbb.ccc"))]))  # not its pod's node
    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED,
                     grpc.StatusCode.PERMISSION_DENIED], codes
    assert any(c.startswith("POST /apis/authentication.k8s.io/v1/tokenreviews") for c in api.calls)


class _Stopper:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def stop(self) -> None:
        self.fn()


def run_mtls(s: Setup, cleanup: Cleanup) -> None:
    pki = _pki(s.work)
    ca = str(s.work / "pki" / "ca.crt")
    path, env = s.config("coordinator", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                         "db_path": str(s.work / "c.db")}})
    coord = cleanup.add(Coordinator(s.work / "coordinator", path, env))
    address = coord.address("localhost")
    agent_cfg, agent_env = s.config("agent", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "node_name": "tls-node",
                  "coordinator": address, "state_dir": str(s.work), "socket_path": str(s.work / "r.sock")},
        "coordinator": {"tls_ca": ca}, "diag": {"enabled": False}})
    cleanup.add(Agent(s.work / "agent", agent_cfg, agent_env))
    as_operator = ["--tls-cert", pki["operator"][0], "--tls-key", pki["operator"][1], "--tls-ca", ca]

    def connected() -> bool:
        res = run_cli("fleet", "--coordinator", address, "--json", *as_operator)
        return res.returncode in (0, 1) and any(n["name"] == "tls-node" and n["connected"]
                                                for n in json.loads(res.stdout)["nodes"])

    until(connected, 30, "the agent's client certificate (client_tls_cert/_key) accepted")
    res = run_cli("triage", "--job", "no-such-job", "--coordinator", address, *as_operator)
    assert "no job 'no-such-job'" in res.stderr, res.stderr  # operator_names: alice acts on nodes
    res = run_cli("triage", "--job", "no-such-job", "--coordinator", address, "--tls-cert", pki["other"][0],
                  "--tls-key", pki["other"][1], "--tls-ca", ca)
    assert "PERMISSION_DENIED" in res.stderr, res.stderr  # bob does not


def run_detection(s: Setup, cleanup: Cleanup) -> None:
    path, env = s.config("coordinator", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                         "db_path": str(s.work / "c.db"), "tick_s": 0.2}})
    coord = cleanup.add(Coordinator(s.work / "coordinator", path, env))
    address = coord.address()
    reply = asyncio.run(_steps(address))
    assert reply.heartbeat_interval_s == 0.75  # coordinator.heartbeat_interval_s, told to agents
    assert reply.max_inflight == 7  # coordinator.max_inflight, told to agents

    def hang(job: str) -> dict[str, Any] | None:
        res = run_cli("jobs", job, "--coordinator", address, "--json")
        doc = json.loads(res.stdout) if res.stdout else {"jobs": []}
        verdicts = [v for j in doc["jobs"] for v in j.get("verdicts") or [] if v.get("kind") == "hang"]
        return verdicts[0] if verdicts else None

    slow = until(lambda: hang("steps-50ms"), 30, "the hang verdict of the 50 ms job")
    fast = until(lambda: hang("steps-1ms"), 30, "the hang verdict of the 1 ms job")
    # max(hang_k x typical step, hang_floor_s): 100 x 50 ms = 5 s (default k 10: the 2 s floor); 1 ms: the floor
    assert slow["hang"]["threshold_s"] == pytest.approx(5.0, rel=0.05), slow["hang"]
    assert fast["hang"]["threshold_s"] == pytest.approx(2.0, rel=0.05), fast["hang"]
    evidence = Path(slow["evidence"]["dir"])
    assert evidence.is_relative_to(s.value("coordinator.evidence_dir")) and evidence.is_dir(), evidence


async def _steps(address: str) -> Any:
    agent = SimAgent(address, "detect-node")
    reply = await agent.register()
    await agent.connect()
    seq = 0
    for job, wall in (("steps-50ms", 0.05), ("steps-1ms", 0.001)):
        for step in range(5):
            seq += 1
            await agent.send(step_batch_message(seq, job, [0, 1], step, wall_s=wall))
    await agent.wait_acked(seq)
    await agent.close()
    return reply


def run_fleet(s: Setup, cleanup: Cleanup) -> None:
    path, env = s.config("coordinator", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                         "db_path": str(s.work / "c.db")}})
    coord = cleanup.add(Coordinator(s.work / "coordinator", path, env))
    address = coord.address()

    async def three_nodes() -> None:
        agents = [SimAgent(address, f"f{i}", gpus=2) for i in range(3)]
        for a in agents:
            await a.register()
            await a.connect()
        await agents[0].send(step_batch_message(1, "short-job", [0], 1))
        await agents[0].wait_acked(1)
        doc = await asyncio.to_thread(_fleet, address)
        rotation = doc["screening"]["rotation"]
        assert doc["screening"]["window_s"] == 3600.0  # coordinator.screen_window_s
        assert rotation["turn_s"] == 120.0  # coordinator.screen_turn_s
        assert rotation["slots"] == 3  # coordinator.screen_concurrency 1.0 of 3 nodes (default 0.1: 1)
        for a in agents:
            await a.close()

    asyncio.run(three_nodes())
    # coordinator.forget_job_after_s: a job quiet for 1 s with no ranks placed leaves the coordinator's memory
    until(lambda: run_cli("jobs", "short-job", "--coordinator", address).returncode == 3, 15,
          "the quiet job forgotten")


def run_no_rotation(s: Setup, cleanup: Cleanup) -> None:
    path, env = s.config("coordinator", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                         "db_path": str(s.work / "c.db")}})
    coord = cleanup.add(Coordinator(s.work / "coordinator", path, env))
    assert _fleet(coord.address())["screening"]["rotation"]["enabled"] is False


def run_diag(s: Setup, cleanup: Cleanup) -> None:
    path, env = s.config("cli")
    res = run_cli("diag", "sdc", "--device", "cpu", "--peers", "2", "--record-golden", "--json", "--config", str(path),
                  env=env, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(Path(s.value("diag.golden_dir")).iterdir()), "diag.golden_dir: no golden recorded there"


def run_diag_timeout(s: Setup, cleanup: Cleanup) -> None:
    path, env = s.config("cli")
    res = run_cli("diag", "sdc", "--device", "cpu", "--json", "--config", str(path), env=env, timeout=180)
    doc = json.loads(res.stdout)
    assert doc["status"] == "timeout" and "killed" in doc["reason"], doc  # past diag.timeout_s (default 600 s)


RUNS: dict[str, Callable[[Setup, Cleanup], None]] = {
    "agent": run_agent, "agent-timeout": run_agent_timeout, "link": run_link, "spool": run_spool,
    "node-tokens": run_node_tokens, "shared": run_shared, "open": run_open, "token-review": run_token_review,
    "mtls": run_mtls, "detection": run_detection, "fleet": run_fleet, "no-rotation": run_no_rotation,
    "diag": run_diag, "diag-timeout": run_diag_timeout,
}


# ---------------------------------------------------------------------------------------------- the tests
def test_every_key_is_observed_or_exempt() -> None:
    observed, exempt = set(OBSERVED), set(EXEMPT)
    assert not observed & exempt, observed & exempt
    assert sorted(observed | exempt) == KEYS, {"neither observed nor exempt": sorted(set(KEYS) - observed - exempt),
                                               "no such key": sorted((observed | exempt) - set(KEYS))}
    assert all(len(reason) > 20 for reason in EXEMPT.values())
    assert {o.run for o in OBSERVED.values()} == set(RUNS)
    assert all(o.side in ("agent", "coordinator", "cli") for o in OBSERVED.values())


def test_every_observed_value_differs_from_its_default() -> None:
    cfg = Config()
    for key, o in OBSERVED.items():
        section, field = key.split(".")
        if not callable(o.value) and "{" not in str(o.value):
            assert getattr(getattr(cfg, section), field) != o.value, key


@pytest.mark.slow
@pytest.mark.parametrize("source", ["file", "env"])
@pytest.mark.parametrize("run", sorted(RUNS))
def test_settings_take_effect_through_the_command(run: str, source: str, tmp_path: Path, cleanup: Cleanup) -> None:
    setup = _setup(run, source, tmp_path)
    RUNS[run](setup, cleanup)


@pytest.fixture(autouse=True)
def _no_inherited_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands see only what each run sets: no GPUHEALTH_ variable of the shell running the tests."""
    for name in list(os.environ):
        if name.startswith("GPUHEALTH_"):
            monkeypatch.delenv(name)
