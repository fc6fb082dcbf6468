"""The Slurm hooks as shipped honour the node's own settings: the real scripts under bash, the real ``gpuhealth``,
a stand-in ``scontrol``. The agent's config file (GPUHEALTH_CONFIG, /etc/gpuhealth/agent.yaml by default) reaches
every check that runs on the node itself, a node without that file is checked as before, and an agent URL written
as host:port (as the docs allow) reaches the agent for the epilog's screen too."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from slurm_standin import install_scontrol

from gpuhealth.backends.nvml_fake import bundled_recording_path

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "deploy" / "slurm"
BIN = Path(sys.executable).parent
NODE = "gpu-node-11"


@pytest.fixture
def refusing_url() -> Iterator[str]:
    """An agent that is down: a port bound here but never listening refuses every connection (no guess about
    which ports are free)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def env(tmp_path: Path, refusing_url: str) -> dict[str, str]:
    stub_dir, _ = install_scontrol(tmp_path)
    return {
        "PATH": f"{stub_dir}:{BIN}:/usr/bin:/bin",
        "STUB_STATE": str(tmp_path / "state.json"),
        "SLURMD_NODENAME": NODE,
        "GPUHEALTH_SLURM_ENV": str(tmp_path / "none.env"),
        "GPUHEALTH_SLURM_JOB_DIR": str(tmp_path / "jobs"),
        "GPUHEALTH_SCREEN_BLOCK_DIR": str(tmp_path / "screen-block"),
        "GPUHEALTH_DIAG_LOCK_DIR": str(tmp_path / "diag-locks"),
        "GPUHEALTH_AGENT_URL": refusing_url,
        "GPUHEALTH_AGENT_TIMEOUT_S": "2",
        "TMPDIR": str(tmp_path),
        "NVIDIA_SMI": "absent-nvidia-smi",
    }


def node(env: dict[str, str]) -> dict[str, str]:
    state: dict[str, str] = json.loads(Path(env["STUB_STATE"]).read_text())
    return state


def hook(script: str, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SLURM / script)], env={**env, **extra}, capture_output=True, text=True,
                          timeout=180)


def node_config(tmp_path: Path, **collectors: object) -> Path:
    """The node's agent.yaml: its GPUs are the bundled 2-GPU recording (simulated), plus ``collectors``."""
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"collectors": dict(collectors),
                                    "agent": {"nvml_snapshot": str(bundled_recording_path("nvml_h200x2.json"))}}))
    return path


def test_the_prolog_judges_by_the_nodes_config_file_when_the_agent_is_down(env: dict[str, str],
                                                                            tmp_path: Path) -> None:
    # No file at the configured path: no --config (a missing one would be an error), so the check runs as it always
    # did — here, without NVML, it cannot judge, which the default on-error policy logs and lets the job start.
    result = hook("gpuhealth-prolog.sh", env, GPUHEALTH_CONFIG=str(tmp_path / "agent.yaml"), SLURM_JOB_ID="70")
    assert result.returncode == 0, result.stderr
    assert node(env) == {"state": "IDLE"}
    assert "could not check" in result.stderr and "agent.yaml" not in result.stderr
    # The node's config says 8 GPUs; 2 answer. With the agent down, the prolog's own check must say so and drain.
    config = node_config(tmp_path, expected_gpus=8)
    result = hook("gpuhealth-prolog.sh", env, GPUHEALTH_CONFIG=str(config), SLURM_JOB_ID="71", SLURM_JOB_GPUS="0,1")
    assert result.returncode == 1, result.stderr
    state = node(env)
    assert state["state"] == "IDLE+DRAIN"
    assert state["reason"].startswith("gpuhealth: agent down, one-shot check: "), state
    assert "gpu.missing" in state["reason"]
    assert not Path(env["GPUHEALTH_SLURM_JOB_DIR"]).exists()  # no job was let onto the node


def test_the_health_check_judges_by_the_same_file_and_arguments_may_name_their_own(env: dict[str, str],
                                                                                  tmp_path: Path) -> None:
    config = node_config(tmp_path, expected_gpus=8)
    assert hook("gpuhealth-healthcheck.sh", env, GPUHEALTH_CONFIG=str(config)).returncode == 0
    assert node(env)["state"] == "IDLE+DRAIN"
    # the health check's own arguments name another file (this node's 2 GPUs are all it should have): theirs wins,
    # the node is fit, and the drain (ours) is lifted
    fit = tmp_path / "fit"
    fit.mkdir()
    result = hook("gpuhealth-healthcheck.sh", env, GPUHEALTH_CONFIG=str(config),
                  GPUHEALTH_HEALTHCHECK_ARGS=f"status --exit-codes slurm --json --config {node_config(fit)}")
    assert result.returncode == 0
    assert node(env) == {"state": "IDLE"}, result.stderr


def test_an_agent_url_without_a_scheme_reaches_the_agent_for_the_screen(env: dict[str, str], tmp_path: Path) -> None:
    from agent_process import AgentProcess

    cfg = tmp_path / "running-agent.yaml"
    cfg.write_text(yaml.safe_dump({"agent": {"node_name": NODE, "socket_path": str(tmp_path / "agent.sock"),
                                             "state_dir": str(tmp_path / "st"),
                                             "pod_resources_socket": str(tmp_path / "none.sock")}}))
    work = tmp_path / "agent"
    work.mkdir()
    agent = AgentProcess(work, ["--config", str(cfg), "--nvml-snapshot",
                                str(bundled_recording_path("nvml_h200x2.json"))])
    try:
        agent.wait_ready()
        host_port = agent.url.split("://", 1)[1]
        result = hook("gpuhealth-epilog.sh", env, GPUHEALTH_AGENT_URL=host_port, SLURM_JOB_ID="73",
                      GPUHEALTH_CONFIG="")
    finally:
        agent.stop()
    assert result.returncode == 0, result.stderr
    # the status check asked the agent (no "agent down" one-shot), and so did the screen request: an HTTP answer
    assert "did not answer" not in result.stderr, result.stderr
    [line] = [x for x in result.stderr.splitlines() if "screen (quick) asked of the agent:" in x]
    answer = line.split("asked of the agent: ", 1)[1]
    assert answer[:3].isdigit() and not answer.startswith("agent down"), line
