"""``gpuhealth demo``: the main job on one machine — a coordinator and a node agent linked to it.

With an NVIDIA driver the agent reads the live GPUs. Without one it replays the bundled real H200
recording, and every line it prints says SIMULATED. Runs until Ctrl-C (or ``--duration``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import click

from gpuhealth.backends.errors import BackendUnavailable, NvmlError
from gpuhealth.backends.nvml_fake import DEFAULT_RECORDING, bundled_recording_path
from gpuhealth.backends.nvml_real import RealNvml


def _live_gpus() -> int:
    """Number of GPUs the driver shows, 0 when there is no usable driver."""
    nvml = RealNvml()
    try:
        nvml.init()
        return nvml.device_count()
    except (BackendUnavailable, NvmlError):
        return 0
    finally:
        with contextlib.suppress(Exception):
            nvml.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


def _wait(predicate: Any, timeout_s: float, what: str, procs: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise click.ClickException(f"{what}: a process exited early (code {p.returncode}); see its log")
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise click.ClickException(f"timed out waiting for {what}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


@click.command(name="demo")
@click.option("--duration", type=float, default=0.0, help="Stop after this many seconds (0: until Ctrl-C).")
@click.option("--agent-listen", default=None, help="Agent /metrics address (default 127.0.0.1:<free port>).")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where the coordinator database, spool and logs go (default: a temp folder).")
@click.option("--simulate/--auto", default=False,
              help="Replay the bundled recording even when a driver is present.")
@click.option("--job/--no-job", default=True, show_default=True,
              help="Also run a real 4-rank PyTorch Gloo job (CPU) with one slow rank and show what the "
                   "coordinator makes of it (needs torch: gpuhealth[diag]).")
def command(duration: float, agent_listen: str | None, state_dir: str | None, simulate: bool, job: bool) -> None:
    """Run agent + coordinator on this machine; simulated on the bundled real recording without a GPU."""
    # SIGTERM (systemd, kill, a CI runner's timeout) and SIGHUP (a closed terminal) stop the demo as
    # Ctrl-C does: through ``finally``, which stops the agent and the coordinator it started.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    gpus = 0 if simulate else _live_gpus()
    simulated = gpus == 0
    state = Path(state_dir or tempfile.mkdtemp(prefix="gpuhealth-demo-"))
    state.mkdir(parents=True, exist_ok=True)
    recording = bundled_recording_path(DEFAULT_RECORDING)
    tag = "SIMULATED" if simulated else "LIVE"
    if simulated:
        click.secho(f"[{tag}] no NVIDIA driver here: the agent replays the real recording {recording.name} "
                    "(2 × H200, driver 580.159.04). Readings are real but not from this machine.", fg="yellow")
    else:
        click.secho(f"[{tag}] NVIDIA driver found: {gpus} GPU(s).", fg="green")

    agent_addr = agent_listen or f"127.0.0.1:{_free_port()}"
    ready_file = state / "coordinator.ready.json"
    ready_file.unlink(missing_ok=True)
    base = [sys.executable, "-m", "gpuhealth.cli.main"]
    logs = {name: open(state / f"{name}.log", "wb") for name in ("coordinator", "agent")}  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
    try:
        coord = subprocess.Popen(
            [*base, "coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             "--db", str(state / "coordinator.db"), "--evidence-dir", str(state / "evidence"),
             "--ready-file", str(ready_file)],
            stdout=logs["coordinator"], stderr=subprocess.STDOUT)
        procs.append(coord)
        _wait(ready_file.exists, 30, "the coordinator", procs)
        ports = json.loads(ready_file.read_text())
        coord_addr = f"127.0.0.1:{ports['grpc_port']}"
        env = dict(os.environ,
                   GPUHEALTH_AGENT_COORDINATOR=coord_addr,
                   GPUHEALTH_AGENT_STATE_DIR=str(state / "agent"),
                   GPUHEALTH_AGENT_SOCKET_PATH=str(state / "agent.sock"),
                   GPUHEALTH_AGENT_NODE_NAME=os.environ.get("GPUHEALTH_AGENT_NODE_NAME", "demo-node"))
        agent_cmd = [*base, "agent", "--listen", agent_addr]
        if simulated:
            agent_cmd += ["--nvml-snapshot", str(recording)]
        agent = subprocess.Popen(agent_cmd, env=env, stdout=logs["agent"], stderr=subprocess.STDOUT)
        procs.append(agent)
        _wait(lambda: _get_json(f"http://{agent_addr}/ready")[0] == 200, 60, "the agent's first sweep", procs)
        _, health = _get_json(f"http://{agent_addr}/health")
        _print_health(health or {}, tag)
        click.echo(f"[{tag}] agent        http://{agent_addr}/metrics  /health  /ready")
        click.echo(f"[{tag}] coordinator  grpc {coord_addr}   metrics http://127.0.0.1:{ports['metrics_port']}/metrics")
        click.echo(f"[{tag}] rank socket  {state / 'agent.sock'}  (GPUHEALTH_SOCKET for gpuhealth.instrument.Tracker)")
        click.echo(f"[{tag}] try:  gpuhealth fleet --coordinator {coord_addr}   |   "
                   f"gpuhealth jobs --coordinator {coord_addr}")
        click.echo(f"[{tag}] logs and database in {state}")
        _wait(lambda: _fleet_has_node(coord_addr), 30, "the agent to register with the coordinator", procs)
        click.echo(f"[{tag}] agent registered with the coordinator; running "
                   + (f"for {duration:g} s" if duration else "until Ctrl-C"))
        if job:
            # Simulated: the CPU ranks stand in for ranks on the recorded GPUs (rank r on GPU r mod n),
            # so the coordinator can join a straggler with its GPU's health, as on a real node.
            gpus_seen = [g for g in (health or {}).get("gpus", []) if g.get("uuid")] if simulated else []
            _run_demo_job(env, state, coord_addr, tag, procs, gpus_seen)
        deadline = time.monotonic() + duration if duration else None
        while deadline is None or time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise click.ClickException(f"a process exited (code {p.returncode}); logs in {state}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        _stop(procs)
        for f in logs.values():
            f.close()
    click.echo(f"[{tag}] stopped")


def _run_demo_job(env: dict[str, str], state: Path, coord_addr: str, tag: str,
                  procs: list[subprocess.Popen[bytes]], gpus: list[dict[str, Any]]) -> None:
    """4 ranks on this node's rank socket; rank 2 computes twice as long. Prints the coordinator's view."""
    try:
        import torch  # noqa: F401 - only to say clearly when it is missing
    except ImportError:
        click.secho(f"[{tag}] demo job skipped: torch is not installed (pip install 'gpuhealth[diag]')", fg="yellow")
        return
    world, straggler, steps = 4, 2, 80
    job_id = f"demo-{int(time.time())}"
    port = _free_port()
    on = f", rank r on recorded GPU r mod {len(gpus)}" if gpus else ""
    click.echo(f"[{tag}] job {job_id}: {world} ranks (PyTorch Gloo on CPU{on}), rank {straggler} does 2× compute, "
               f"{steps} steps …")
    ranks = []
    for rank in range(world):
        rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GPUHEALTH_JOB_ID": job_id,
                    "GPUHEALTH_SOCKET": env["GPUHEALTH_AGENT_SOCKET_PATH"]}
        if gpus:
            gpu = gpus[rank % len(gpus)]
            rank_env.update(GPUHEALTH_GPU_UUID=str(gpu["uuid"]), GPUHEALTH_GPU_INDEX=str(gpu["index"]))
        log = open(state / f"{job_id}-rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        ranks.append(subprocess.Popen([sys.executable, "-m", "gpuhealth.demo_job", str(steps), str(straggler)],
                                      env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in ranks:
            p.wait(300)
    finally:
        _stop(ranks)
    failed = [r for r, p in enumerate(ranks) if p.returncode != 0]
    if failed:
        click.secho(f"[{tag}] demo job: ranks {failed} failed; logs in {state}", fg="red")
        return
    time.sleep(2.0)  # the agent link batches step records every 0.25 s
    out = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "jobs", job_id, "--coordinator", coord_addr],
                         capture_output=True, text=True, timeout=60, check=False)
    click.echo(f"[{tag}] the coordinator's view of {job_id} (gpuhealth jobs {job_id}):")
    click.echo(out.stdout.rstrip() or out.stderr.rstrip())


def _fleet_has_node(coord_addr: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "fleet", "--coordinator", coord_addr, "--json"],
                         capture_output=True, timeout=30, check=False)
    try:
        view = json.loads(out.stdout or b"{}")
    except ValueError:
        return False
    return bool(view.get("nodes"))


def _print_health(health: dict[str, Any], tag: str) -> None:
    node = health.get("node", {})
    click.echo(f"[{tag}] node {node.get('name', '?')}: {node.get('health', '?')}")
    for gpu in health.get("gpus", []):
        codes = ", ".join(f"{f['code']} ({f['severity']})" for f in gpu.get("findings", [])) or "no findings"
        click.echo(f"[{tag}]   GPU {gpu.get('index')} {gpu.get('name', '')} {gpu.get('uuid', '')}: "
                   f"{gpu.get('health')} — {codes}")


__all__ = ["command"]
