"""The Slurm scripts with the REAL ``gpuhealth qualify`` / ``gpuhealth status`` (replaying the
bundled H200 recording, with and without a fault) and a stub ``scontrol`` that records calls and
keeps node state: the drain reason is built from the real JSON report, and the health check
resumes the node once the fault is gone."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from slurm_standin import install_scontrol

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "deploy" / "slurm"
BIN = Path(sys.executable).parent
NODE = "gpu-node-01"



@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    stub_dir, _state = install_scontrol(tmp_path)
    faulty = tmp_path / "xid79.yaml"
    faulty.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json",
                                      "events": [{"at": 0, "type": "xid", "gpu": 1, "xid": 79}]}))
    return {
        "PATH": f"{stub_dir}:{BIN}:/usr/bin:/bin",
        "STUB_STATE": str(tmp_path / "state.json"),
        "STUB_LOG": str(tmp_path / "scontrol.log"),
        "SLURMD_NODENAME": NODE,
        "GPUHEALTH_SLURM_ENV": str(tmp_path / "none.env"),
        "GPUHEALTH_SLURM_JOB_DIR": str(tmp_path / "jobs"),
        "GPUHEALTH_SCREEN_BLOCK_DIR": str(tmp_path / "screen-block"),
        "GPUHEALTH_DIAG_LOCK_DIR": str(tmp_path / "diag-locks"),
        "TMPDIR": str(tmp_path),
        "NVIDIA_SMI": "absent-nvidia-smi",
        "HEALTHY": str(REPO / "src/gpuhealth/data/nvml_h200x2.json"),
        "FAULTY": str(faulty),
    }


def run(script: str, env: dict[str, str], snapshot: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run a script with its default check arguments plus --nvml-snapshot (the only change)."""
    defaults = {
        "gpuhealth-prolog.sh": ("GPUHEALTH_PROLOG_ARGS", "qualify --level quick --exit-codes slurm --json"),
        "gpuhealth-epilog.sh": ("GPUHEALTH_EPILOG_ARGS", "status --exit-codes slurm --json"),
        "gpuhealth-healthcheck.sh": ("GPUHEALTH_HEALTHCHECK_ARGS", "status --exit-codes slurm --json"),
    }
    var, args = defaults[script]
    text = (SLURM / script).read_text()
    assert args in text, f"{script}'s default check changed; update this test"
    full = {**env, var: f"{args} --nvml-snapshot {env[snapshot]}", **extra}
    if script == "gpuhealth-prolog.sh":  # its first check, what the agent knows, on the same recording
        full["GPUHEALTH_PROLOG_STATUS_ARGS"] = f"status --exit-codes slurm --json --nvml-snapshot {env[snapshot]}"
    return subprocess.run(["bash", str(SLURM / script)], env=full, capture_output=True, text=True, timeout=120)


def node(env: dict[str, str]) -> dict[str, str]:
    data: dict[str, str] = json.loads(Path(env["STUB_STATE"]).read_text())
    return data


def test_prolog_on_a_healthy_node_passes_and_maps_gpus(env: dict[str, str]) -> None:
    result = run("gpuhealth-prolog.sh", env, "HEALTHY", SLURM_JOB_ID="88", SLURM_JOB_GPUS="0,1")
    assert result.returncode == 0, result.stderr
    assert node(env) == {"state": "IDLE"}
    assert sorted(p.name for p in Path(env["GPUHEALTH_SLURM_JOB_DIR"]).iterdir()) == ["0", "1"]


def test_prolog_on_a_faulty_node_drains_with_the_real_finding_code(env: dict[str, str]) -> None:
    result = run("gpuhealth-prolog.sh", env, "FAULTY", SLURM_JOB_ID="88", SLURM_JOB_GPUS="0,1")
    assert result.returncode == 1
    assert node(env) == {"state": "IDLE+DRAIN", "reason": "gpuhealth: xid.79"}


def test_health_check_drains_then_resumes_when_the_fault_is_gone(env: dict[str, str]) -> None:
    run("gpuhealth-healthcheck.sh", env, "FAULTY")
    assert node(env) == {"state": "IDLE+DRAIN", "reason": "gpuhealth: xid.79"}
    run("gpuhealth-healthcheck.sh", env, "HEALTHY")
    assert node(env) == {"state": "IDLE"}


def test_epilog_cleans_the_map_and_drains_a_node_left_broken(env: dict[str, str]) -> None:
    jobs = Path(env["GPUHEALTH_SLURM_JOB_DIR"])
    jobs.mkdir()
    (jobs / "1").write_text("88\n")
    result = run("gpuhealth-epilog.sh", env, "FAULTY", SLURM_JOB_ID="88")
    assert result.returncode == 0
    assert list(jobs.iterdir()) == []
    assert node(env)["reason"] == "gpuhealth: xid.79"


# --- against a live agent: what only the agent knows reaches the scheduler ---------------------

REPLAY_RAMP = {  # NVLink 7 of GPU 1 starts replaying 3 s in (DCGM: any replay is a failure)
    "recording": "nvml_h200x2.json",
    "events": [{"at": 3, "type": "set", "gpu": 1, "key": "nvlink", "value": {"7": {"err_DL_REPLAY": 5}}}],
}
NPD_PLUGIN = REPO / "deploy" / "npd" / "gpuhealth-monitor.json"


@pytest.fixture
def live_agent(tmp_path: Path) -> Any:
    from agent_process import AgentProcess

    scenario = tmp_path / "replay_ramp.yaml"
    scenario.write_text(yaml.safe_dump(REPLAY_RAMP))
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "collectors": {"fast_interval_s": 1.0, "slow_interval_s": 1.0},
        "agent": {"node_name": NODE, "socket_path": str(tmp_path / "agent.sock"), "state_dir": str(tmp_path / "st"),
                  "pod_resources_socket": str(tmp_path / "none.sock")}}))
    work = tmp_path / "agent"
    work.mkdir()
    agent = AgentProcess(work, ["--config", str(cfg), "--scenario", str(scenario)])
    try:
        agent.wait_ready()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the slow lane needs its window of history after t = 3 s
            if any(f["code"] == "nvlink.errors" and f["severity"] == "critical"
                   for g in agent.health()["gpus"] for f in g["findings"]):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the agent never judged the replay ramp:\n{agent.log()[-3000:]}")
        yield agent
    finally:
        agent.stop()


@pytest.mark.slow
def test_a_rate_fault_only_the_agent_sees_drains_through_health_check_and_prolog(
        env: dict[str, str], live_agent: Any, tmp_path: Path) -> None:
    # The same scenario checked once from its start is healthy: the errors come later, and a rate
    # needs history. This is what the scripts used to run, and why they missed it.
    once = subprocess.run([str(BIN / "gpuhealth"), "status", "--exit-codes", "slurm", "--json", "--nvml-snapshot",
                           str(tmp_path / "replay_ramp.yaml")], capture_output=True, text=True, timeout=120, env=env)
    assert once.returncode == 0 and json.loads(once.stdout)["node"]["health"] == "healthy"
    asked = {**env, "GPUHEALTH_AGENT_URL": live_agent.url}
    result = subprocess.run(["bash", str(SLURM / "gpuhealth-healthcheck.sh")], env=asked, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert node(env) == {"state": "IDLE+DRAIN", "reason": "gpuhealth: nvlink.errors"}
    # the prolog refuses the job on the agent's word, before spending time on diagnostics
    Path(env["STUB_STATE"]).write_text(json.dumps({"state": "IDLE"}))
    result = subprocess.run(["bash", str(SLURM / "gpuhealth-prolog.sh")], env={**asked, "SLURM_JOB_ID": "9"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert node(env) == {"state": "IDLE+DRAIN", "reason": "gpuhealth: nvlink.errors"}
    assert not Path(env["GPUHEALTH_SLURM_JOB_DIR"]).exists()


def test_the_npd_plugin_asks_the_agent(env: dict[str, str], live_agent: Any) -> None:
    rule = json.loads(NPD_PLUGIN.read_text())["rules"][0]
    args = list(rule["args"])
    args[args.index("--agent") + 1] = live_agent.url  # the plugin's own arguments, this agent's port
    result = subprocess.run([str(BIN / "gpuhealth"), *args], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1  # npd: problem
    assert result.stdout.startswith("gpuhealth: unhealthy: GPU 1 nvlink.errors (drain)")
    assert len(result.stdout) <= json.loads(NPD_PLUGIN.read_text())["pluginConfig"]["max_output_length"]


def test_when_the_agent_is_down_the_check_runs_once_and_the_reason_says_so(env: dict[str, str]) -> None:
    # nothing listens on this port; the node is checked once (here: the XID 79 recording) and the
    # drain reason tells the admin that the agent was not there to ask
    down = {**env, "GPUHEALTH_AGENT_URL": "http://127.0.0.1:9", "GPUHEALTH_AGENT_TIMEOUT_S": "2",
            "GPUHEALTH_AGENT_NVML_SNAPSHOT": env["FAULTY"]}
    result = subprocess.run(["bash", str(SLURM / "gpuhealth-healthcheck.sh")], env=down, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert node(env) == {"state": "IDLE+DRAIN", "reason": "gpuhealth: agent down, one-shot check: xid.79"}
    assert "the agent did not answer" in result.stderr


def test_without_nvml_the_reason_names_it(env: dict[str, str]) -> None:
    # no agent asked, no driver on this machine: the check could not judge, so GPUHEALTH_ON_ERROR decides
    down = {**env, "GPUHEALTH_AGENT_URL": "", "GPUHEALTH_ON_ERROR": "drain"}
    subprocess.run(["bash", str(SLURM / "gpuhealth-healthcheck.sh")], env=down, capture_output=True, text=True,
                   timeout=120)
    assert node(env)["reason"].startswith("gpuhealth: could not check: nvml.unavailable,NVIDIA driver not available")


# --- every rate fault the issue named, not only NVLink: SBE and PCIe-replay ramps ---------------

SCENARIOS = REPO / "tests" / "fixtures" / "scenarios"
# Rates need a window of history; the agent judges them over a shorter one here so the test takes
# seconds, not the bundled minute (the same keys a site sets in collectors.thresholds_file).
SHORT_WINDOWS = {"ecc": {"sbe_rate_min_window_s": 4.0}, "pcie": {"replay_window_s": 8.0}}


@pytest.mark.parametrize(("scenario", "code", "gpu"), [("sbe_ramp.yaml", "ecc.sbe_rate", 1),
                                                       ("pcie_replay_ramp.yaml", "pcie.replay_rate", 0)])
def test_rate_warnings_only_the_agent_sees_reach_npd_and_leave_slurm_in_service(
        env: dict[str, str], tmp_path: Path, scenario: str, code: str, gpu: int) -> None:
    from agent_process import AgentProcess

    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text(yaml.safe_dump(SHORT_WINDOWS))
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "collectors": {"fast_interval_s": 1.0, "slow_interval_s": 1.0, "thresholds_file": str(thresholds)},
        "agent": {"node_name": NODE, "socket_path": str(tmp_path / "agent.sock"), "state_dir": str(tmp_path / "st"),
                  "pod_resources_socket": str(tmp_path / "none.sock")}}))
    work = tmp_path / "agent"
    work.mkdir()
    agent = AgentProcess(work, ["--config", str(cfg), "--scenario", str(SCENARIOS / scenario)])
    try:
        agent.wait_ready()
        deadline = time.monotonic() + 60
        while not any(f["code"] == code for g in agent.health()["gpus"] for f in g["findings"]):
            assert time.monotonic() < deadline, f"the agent never judged {scenario}:\n{agent.log()[-3000:]}"
            time.sleep(0.5)
        # checked once, the same scenario is healthy: a rate needs history
        once = subprocess.run([str(BIN / "gpuhealth"), "status", "--exit-codes", "npd", "--json", "--nvml-snapshot",
                               str(SCENARIOS / scenario)], capture_output=True, text=True, timeout=120, env=env)
        assert once.returncode == 0 and json.loads(once.stdout)["node"]["health"] == "healthy"
        # node-problem-detector's plugin, with its own arguments on this agent's port: a problem
        args = list(json.loads(NPD_PLUGIN.read_text())["rules"][0]["args"])
        args[args.index("--agent") + 1] = agent.url
        npd = subprocess.run([str(BIN / "gpuhealth"), *args], capture_output=True, text=True, timeout=60, env=env)
        assert npd.returncode == 1 and npd.stdout.startswith(f"gpuhealth: degraded: GPU {gpu} {code}"), npd.stdout
        # Slurm: a degraded node is fit (exit-code profile slurm), so the health check drains nothing
        check = subprocess.run(["bash", str(SLURM / "gpuhealth-healthcheck.sh")],
                               env={**env, "GPUHEALTH_AGENT_URL": agent.url}, capture_output=True, text=True,
                               timeout=120)
        assert check.returncode == 0, check.stderr
        assert node(env) == {"state": "IDLE"}
        asked = [json.loads(line) for line in Path(env["STUB_LOG"]).read_text().splitlines()]
        assert asked and all(a[0] == "show" for a in asked)  # it looked, and changed nothing
    finally:
        agent.stop()
