"""node-problem-detector's check on Kubernetes, as NPD runs it: ``/bin/bash <script> <agent URL> 10`` with the script
the chart renders into ConfigMap gpuhealth-npd-monitor (NPD's image has no Python), against a real
``gpuhealth agent`` over loopback — with curl, with wget, and with bash alone (/dev/tcp: what the upstream image
has). It answers in NPD's exit codes with one line for the condition's message, and says "unknown" (2) when the
agent does not answer, as ``gpuhealth status --exit-codes npd`` does (issue 32)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from commands import Agent, run_cli, write_config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRANSPORTS = ["curl", "wget", "bash"]


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The check as the chart ships it (npd.enabled), written out as NPD's ConfigMap mount would."""
    with helm.Chart.load(REPO / "deploy" / "helm" / "gpuhealth") as chart:
        out = chart.render({"npd": {"enabled": True}}, name="gh", namespace="gpu-mon", is_install=True)
    [cm] = [d for d in yaml.safe_load_all(out["gpuhealth/templates/npd.yaml"]) if d]
    path = tmp_path_factory.mktemp("npd") / "gpuhealth-npd-check.sh"
    path.write_text(cm["data"]["gpuhealth-npd-check.sh"])
    return path


def _agent(work: Path, snapshot: str) -> Agent:
    work.mkdir()
    cfg = write_config(work / "agent.yaml", {
        "agent": {"nvml_snapshot": snapshot, "listen": "127.0.0.1:0", "node_name": "n1",
                  "state_dir": str(work / "state"), "socket_path": str(work / "r.sock"),
                  "pod_resources_socket": str(work / "none.sock")},
        "collectors": {"disabled": ["host"]},
        "diag": {"enabled": False}})
    agent = Agent(work / "agent", cfg)
    agent.wait_ready()
    return agent


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Agent]]:
    work = tmp_path_factory.mktemp("agents")
    faulty = work / "xid79.yaml"  # the real 2 x H200 recording, GPU 0 fallen off the bus
    faulty.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json",
                                      "events": [{"at": 0, "type": "xid", "gpu": 0, "xid": 79}]}))
    started: dict[str, Agent] = {}
    try:
        started["healthy"] = _agent(work / "healthy", "nvml_h200x2.json")
        started["xid79"] = _agent(work / "faulty", str(faulty))
        yield started
    finally:
        for agent in started.values():
            agent.stop()


def _run(check: Path, url: str, transport: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", str(check), url, "10"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "GPUHEALTH_NPD_HTTP": transport})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_healthy_node_is_ok(check: Path, agents: dict[str, Agent], transport: str) -> None:
    result = _run(check, agents["healthy"].url, transport)
    assert (result.returncode, result.stdout) == (0, "gpuhealth: no GPU problem found\n"), result.stderr


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_fallen_gpu_is_a_problem_named_in_the_message(check: Path, agents: dict[str, Agent], transport: str) -> None:
    def problem() -> subprocess.CompletedProcess[str] | None:
        result = _run(check, agents["xid79"].url, transport)
        return result if result.returncode == 1 else None

    deadline = time.monotonic() + 30
    result = problem()
    while result is None and time.monotonic() < deadline:  # the XID is read at the agent's first sweeps
        time.sleep(0.5)
        result = problem()
    assert result is not None
    assert result.stdout.startswith("gpuhealth: unhealthy: ") and "xid.79" in result.stdout
    assert result.stdout.count("\n") == 1 and len(result.stdout) <= 200  # NPD's max_output_length
    # the same verdict as gpuhealth status asking the same agent
    status = run_cli("status", "--exit-codes", "npd", "--agent", agents["xid79"].url)
    assert status.returncode == 1 and "xid.79" in status.stdout


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_agent_is_unknown_not_ok(check: Path, transport: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = _run(check, f"http://127.0.0.1:{port}", transport)
    assert result.returncode == 2 and result.stdout.startswith("gpuhealth: unknown: the agent at"), result


def test_a_bad_url_is_one_line_and_unknown(check: Path) -> None:
    result = _run(check, "gpuhealth-local-agent:9502", "bash")
    assert result.returncode == 2 and result.stdout.count("\n") == 1 and "usage" in result.stdout


def test_the_check_needs_no_python(check: Path, agents: dict[str, Agent], tmp_path: Path) -> None:
    """Run with a PATH holding only what the upstream NPD image has for it (bash, coreutils, grep, sed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "head", "tr", "sort", "mktemp", "rm", "timeout", "grep", "sed"):
        found = subprocess.run(["/bin/bash", "-c", f"command -v {tool}"], capture_output=True, text=True)
        (bin_dir / tool).symlink_to(found.stdout.strip())
    result = subprocess.run(["/bin/bash", str(check), agents["healthy"].url, "10"], capture_output=True, text=True,
                            timeout=60, env={"PATH": str(bin_dir)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert not any(p.name.startswith(("python", "curl", "wget")) for p in bin_dir.iterdir())
