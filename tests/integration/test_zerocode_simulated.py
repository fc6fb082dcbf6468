"""``zerocode.simulated_processes``: a simulated agent (``gpuhealth agent --scenario``) watches the processes its
scenario lists in NVML's process list as this machine's — how benchmarks/agent_footprint.py measures zero-code
watching on a machine with no GPU. Off (the default), a recording's pids are another machine's: not read."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from agent_process import AgentProcess

pytestmark = pytest.mark.integration


def _discovered(agent: AgentProcess) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^gpuhealth_agent_discovered_ranks\{job_id="([^"]+)"[^}]*\} (\S+)$', agent.metrics(), re.M)}


@pytest.mark.parametrize("on", [True, False])
def test_a_simulated_agent_watches_the_listed_processes_only_when_asked(tmp_path: Path, on: bool) -> None:
    env = {"PATH": os.environ.get("PATH", ""), "TORCHELASTIC_RUN_ID": "simjob", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    ranks = [subprocess.Popen(["sleep", "120"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        scenario = tmp_path / "two.yaml"
        procs = {str(r): {"ComputeRunningProcesses": [{"pid": p.pid, "usedGpuMemory": 1 << 30}]}
                 for r, p in enumerate(ranks)}
        scenario.write_text(json.dumps({"recording": "nvml_h200x2.json", "overrides": procs}))
        cfg = tmp_path / "agent.yaml"
        cfg.write_text(f"agent:\n  pod_resources_socket: {tmp_path / 'none.sock'}\n"
                       f"  socket_path: {tmp_path / 'a.sock'}\n"
                       f"zerocode:\n  poll_interval_s: 0.5\n  simulated_processes: {str(on).lower()}\n")
        agent = AgentProcess(tmp_path, ["--config", str(cfg), "--scenario", str(scenario)])
        try:
            agent.wait_ready(timeout=90)
            deadline = time.monotonic() + 30
            while on and not _discovered(agent) and time.monotonic() < deadline:
                time.sleep(0.3)
            if on:
                assert _discovered(agent) == {"simjob": 2.0}
            else:
                time.sleep(2.0)  # four polls' worth
                assert _discovered(agent) == {} and "zero-code discovery off: the GPUs are simulated" in agent.log()
        finally:
            agent.stop()
    finally:
        for p in ranks:
            p.kill()
            p.wait()
