"""The scheduler hooks act on the agent's *action*, not only its severity: a warning that means drain (the chassis
power brake, HW thermal slowdown) drains through the shipped Slurm health check and prolog, and is a problem for
node-problem-detector — each driven by a live ``gpuhealth agent`` on a scenario. A check that could not judge (no
driver) says so in the reason and follows GPUHEALTH_ON_ERROR."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from slurm_standin import install_scontrol

from gpuhealth.catalog.findings import finding_codes
from gpuhealth.cli.exitcodes import exit_code
from gpuhealth.model import Entity, Finding, Severity, health_of, takes_node_out

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "deploy" / "slurm"
NPD_PLUGIN = REPO / "deploy" / "npd" / "gpuhealth-monitor.json"
BIN = Path(sys.executable).parent
NODE = "gpu-node-07"

# GPU 0's clocks held by the chassis power brake (0x80 + the HW slowdown bit 0x8 it implies), or by the GPU's
# hardware thermal protection (0x40 + 0x8): warnings whose catalog action is drain, active from the start.
SCENARIOS = {"throttle.hw_power_brake": 0x88, "throttle.hw_thermal": 0x48}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    stub_dir, _ = install_scontrol(tmp_path)
    return {
        "PATH": f"{stub_dir}:{BIN}:/usr/bin:/bin",
        "STUB_STATE": str(tmp_path / "state.json"),
        "SLURMD_NODENAME": NODE,
        "GPUHEALTH_SLURM_ENV": str(tmp_path / "none.env"),
        "GPUHEALTH_SLURM_JOB_DIR": str(tmp_path / "jobs"),
        "GPUHEALTH_SCREEN_BLOCK_DIR": str(tmp_path / "screen-block"),
        "GPUHEALTH_DIAG_LOCK_DIR": str(tmp_path / "diag-locks"),
        "TMPDIR": str(tmp_path),
        "NVIDIA_SMI": "absent-nvidia-smi",
    }


def node(env: dict[str, str]) -> dict[str, str]:
    state: dict[str, str] = json.loads(Path(env["STUB_STATE"]).read_text())
    return state


@pytest.fixture(params=sorted(SCENARIOS))
def throttled_agent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, object]]:
    from agent_process import AgentProcess

    code: str = request.param
    scenario = tmp_path / "throttled.yaml"
    scenario.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json", "overrides": {
        "0": {"CurrentClocksEventReasons": SCENARIOS[code], "CurrentClocksThrottleReasons": SCENARIOS[code]}}}))
    # the power brake means drain once held (a BMC capping power asserts it for a moment): 3 s here, not 30
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text(yaml.safe_dump({"throttle": {"violation_min_window_s": 3.0}}))
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "collectors": {"fast_interval_s": 1.0, "slow_interval_s": 1.0, "thresholds_file": str(thresholds)},
        "agent": {"node_name": NODE, "socket_path": str(tmp_path / "agent.sock"), "state_dir": str(tmp_path / "st"),
                  "pod_resources_socket": str(tmp_path / "none.sock")}}))
    work = tmp_path / "agent"
    work.mkdir()
    agent = AgentProcess(work, ["--config", str(cfg), "--scenario", str(scenario)])
    try:
        agent.wait_ready()
        deadline = time.monotonic() + 30
        while not any(f["code"] == code and f["action"] == "drain" for g in agent.health()["gpus"]
                      for f in g["findings"]):
            assert time.monotonic() < deadline, agent.log()[-3000:]
            time.sleep(0.2)
        yield code, agent
    finally:
        agent.stop()


def test_a_warning_that_means_drain_drains_through_every_hook(env: dict[str, str],
                                                              throttled_agent: tuple[str, object]) -> None:
    code, agent = throttled_agent
    url: str = agent.url  # type: ignore[attr-defined]
    health = agent.health()  # type: ignore[attr-defined]
    assert health["node"]["health"] == "degraded"  # a warning: the node is only degraded ...
    [f] = [f for g in health["gpus"] for f in g["findings"] if f["code"] == code]
    assert (f["severity"], f["action"]) == ("warning", "drain")  # ... but the action is drain
    asked = {**env, "GPUHEALTH_AGENT_URL": url}

    # Slurm health check
    check = subprocess.run(["bash", str(SLURM / "gpuhealth-healthcheck.sh")], env=asked, capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert node(env) == {"state": "IDLE+DRAIN", "reason": f"gpuhealth: {code}"}

    # Slurm prolog: the job is refused on the agent's word before any diagnostic runs
    Path(env["STUB_STATE"]).write_text(json.dumps({"state": "IDLE"}))
    prolog = subprocess.run(["bash", str(SLURM / "gpuhealth-prolog.sh")],
                            env={**asked, "SLURM_JOB_ID": "41", "SLURM_JOB_GPUS": "0,1"},
                            capture_output=True, text=True, timeout=120)
    assert prolog.returncode == 1, prolog.stderr
    assert node(env) == {"state": "IDLE+DRAIN", "reason": f"gpuhealth: {code}"}
    assert not Path(env["GPUHEALTH_SLURM_JOB_DIR"]).exists()

    # node-problem-detector's plugin, its own arguments on this agent's port: a problem
    args = list(json.loads(NPD_PLUGIN.read_text())["rules"][0]["args"])
    args[args.index("--agent") + 1] = url
    npd = subprocess.run([str(BIN / "gpuhealth"), *args], capture_output=True, text=True, timeout=60, env=env)
    assert npd.returncode == 1
    assert npd.stdout.startswith(f"gpuhealth: degraded: GPU 0 {code} (drain)")


def test_every_catalog_finding_that_asks_for_a_drain_makes_the_node_unfit() -> None:
    # Whatever severity a code is emitted with, an action of reset_gpu/reboot/drain is "not fit" for the Slurm and
    # node-problem-detector profiles; an RMA alone (spare rows running low) is planned and leaves the node in service.
    checked = 0
    for info in finding_codes().values():
        for severity in info.severities:
            for action in info.actions:
                f = Finding(info.code, severity, Entity.node("n"), "m", action, {}, "test")
                want_unfit = action.takes_node_out or severity is Severity.CRITICAL
                for profile in ("slurm", "npd"):
                    code = exit_code(health_of([f]), profile, takes_node_out=takes_node_out([f]))
                    assert (code != 0) == (want_unfit or (profile == "npd" and severity is Severity.WARNING)), \
                        (info.code, severity, action, profile)
                checked += action.takes_node_out
    assert checked >= 10  # power brake, HW thermal, fabric, NVLink, GPU lost, DBE, ...


def test_without_nvml_the_hooks_say_so_and_follow_on_error(env: dict[str, str]) -> None:
    no_agent = {**env, "GPUHEALTH_AGENT_URL": ""}  # no agent to ask, no NVIDIA driver on this machine
    check = subprocess.run(["bash", str(SLURM / "gpuhealth-healthcheck.sh")], env=no_agent, capture_output=True,
                           text=True, timeout=120)
    assert node(env) == {"state": "IDLE"}  # GPUHEALTH_ON_ERROR=ignore (the default): the node stays in service
    assert "could not check" in check.stderr and "nvml.unavailable" in check.stderr
    prolog = subprocess.run(["bash", str(SLURM / "gpuhealth-prolog.sh")],
                            env={**no_agent, "SLURM_JOB_ID": "42", "GPUHEALTH_ON_ERROR": "drain"},
                            capture_output=True, text=True, timeout=120)
    assert prolog.returncode == 1
    state = node(env)
    assert state["state"] == "IDLE+DRAIN"
    assert state["reason"].startswith("gpuhealth: could not check: nvml.unavailable")
    assert len(state["reason"]) <= 120
