"""``gpuhealth demo``: the main job on one machine — a coordinator and a node agent linked to it.

With an NVIDIA driver the agent reads the live GPUs. Without one it replays the bundled real H200
recording, and every line it prints says SIMULATED. Runs until Ctrl-C (or ``--duration``).

Stopping: Ctrl-C reaches the whole foreground process group — the demo, the agent, the coordinator and
the job's ranks at once — so a child that exits a moment before the demo hears the signal is the same
stop, not a failure. The demo handles SIGINT even where its parent left it ignored (a background job of
a script), stops whatever is still running (its whole process tree), exits 0 and removes its temporary
folder (``--keep`` keeps it; a ``--state-dir`` is never removed; a failure keeps the logs).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
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
from gpuhealth.config import split_address


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


# The agent's own word on where it listens (it binds port 0 and the kernel picks: no port race).
_SERVING = re.compile(r"serving /metrics, /health, /ready on http://(\S+)")
CHILD_EXIT_GRACE_S = 1.0  # how long a child's exit waits for the stop signal that probably caused it


def _get_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


class DemoFailed(click.ClickException):
    """A part of the demo could not run (a child exited early, a wait timed out): exit 3, the logs kept."""

    exit_code = 3


# pid → (what the child is, its log): an early exit names the child, its log and what the log says
_CHILD_LOGS: dict[int, tuple[str, Path]] = {}


def _log_says(log: Path, limit: int = 300) -> str:
    """What a child's log says about why it stopped: its first line (a command that cannot start says why in one
    line: a missing extra, a bad setting), and the last one too when they differ (a traceback's error)."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    if not lines:
        return "its log is empty"
    said = lines[0] if len(lines) == 1 or lines[-1] == lines[0] else f"{lines[0]} … {lines[-1]}"
    return said[:limit]


def _check_children(procs: list[subprocess.Popen[bytes]], what: str) -> None:
    """A child that exited is a failure — unless a stop signal is on its way to us too: Ctrl-C reaches
    the whole process group, and a child may exit before our handler runs (the handler then raises
    KeyboardInterrupt out of this sleep)."""
    for p in procs:
        if p.poll() is not None:
            time.sleep(CHILD_EXIT_GRACE_S)
            name, log = _CHILD_LOGS.get(p.pid, ("a process", None))
            if log is None:
                raise DemoFailed(f"{what}: {name} exited (code {p.returncode})")
            raise DemoFailed(f"{what}: the {name} exited (code {p.returncode}): {_log_says(log)} — its log: {log}")


def _wait(predicate: Any, timeout_s: float, what: str, procs: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _check_children(procs, f"{what}: stopped early")
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise DemoFailed(f"timed out waiting for {what}")


def _interrupt(signum: int, frame: Any) -> None:
    # From here on a second signal only stops us again, never halfway through the cleanup.
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _stop_tree() -> None:
    """Whatever this process started and is still running (a rank, a ``gpuhealth jobs`` call): TERM,
    then KILL what is left after 5 s. Nothing the demo started outlives it."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.terminate()
    _, alive = psutil.wait_procs(children, timeout=5)
    for c in alive:
        with contextlib.suppress(psutil.Error):
            c.kill()
    psutil.wait_procs(alive, timeout=5)


def _check_listen(value: str | None) -> str | None:
    """A usage error now, not an agent that exits early: the same check the agent makes of agent.listen."""
    if value is not None and split_address(value) is None:
        raise click.BadParameter(f"{value[:80]!r} is not host:port (a port from 0 to 65535)")
    return value


def _agent_address(log: Path) -> str | None:
    try:
        m = _SERVING.search(log.read_text(errors="replace"))
    except OSError:
        return None
    return m.group(1) if m else None


@click.command(name="demo")
@click.option("--duration", type=click.FloatRange(min=0.0), default=0.0,
              help="Stop after this many seconds (0: until Ctrl-C).")
@click.option("--agent-listen", default=None, callback=lambda _c, _p, v: _check_listen(v),
              help="Agent /metrics address (default 127.0.0.1:<free port>).")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where the coordinator database, spool and logs go (default: a temp folder, removed at exit).")
@click.option("--keep", is_flag=True, help="Keep the temp folder (logs, database) after the demo stops.")
@click.option("--simulate/--auto", default=False,
              help="Replay the bundled recording even when a driver is present.")
@click.option("--job/--no-job", default=True, show_default=True,
              help="Also run a real 4-rank PyTorch Gloo job (CPU) with one slow rank and show what the "
                   "coordinator makes of it (needs torch: gpuhealth[diag]).")
def command(duration: float, agent_listen: str | None, state_dir: str | None, keep: bool, simulate: bool,
            job: bool) -> None:
    """Run agent + coordinator on this machine; simulated on the bundled real recording without a GPU."""
    # Ctrl-C, SIGTERM (systemd, kill, a CI runner's timeout) and SIGHUP (a closed terminal) stop the demo
    # the same way: through ``finally``, which stops everything it started. SIGINT is set here even when
    # inherited as ignored (a script's background job): the children set theirs, and would otherwise
    # stop on Ctrl-C while the demo went on and reported them dead.
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    state: Path | None = None
    remove = state_dir is None and not keep
    try:
        gpus = 0 if simulate else _live_gpus()
        state = Path(state_dir or tempfile.mkdtemp(prefix="gpuhealth-demo-"))
        state.mkdir(parents=True, exist_ok=True)
        _run(state, duration, agent_listen, gpus == 0, gpus, job, removed=remove)
    except KeyboardInterrupt:
        pass  # stopped before (or after) the part that says so: nothing more to say
    except click.ClickException:
        remove = False  # the logs say what went wrong: keep them (the message names the folder)
        raise
    finally:
        for sig in _STOP_SIGNALS:  # the cleanup runs to its end
            signal.signal(sig, signal.SIG_IGN)
        _stop_tree()
        if remove and state is not None:
            shutil.rmtree(state, ignore_errors=True)


def _run(state: Path, duration: float, agent_listen: str | None, simulated: bool, gpus: int, job: bool, *,
         removed: bool) -> None:
    recording = bundled_recording_path(DEFAULT_RECORDING)
    tag = "SIMULATED" if simulated else "LIVE"
    if simulated:
        click.secho(f"[{tag}] no NVIDIA driver here: the agent replays the real recording {recording.name} "
                    "(2 × H200, driver 580.159.04). Readings are real but not from this machine.", fg="yellow")
    else:
        click.secho(f"[{tag}] NVIDIA driver found: {gpus} GPU(s).", fg="green")

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
        _CHILD_LOGS[coord.pid] = ("coordinator", state / "coordinator.log")
        _wait(ready_file.exists, 30, "the coordinator", procs)
        ports = json.loads(ready_file.read_text())
        coord_addr = f"127.0.0.1:{ports['grpc_port']}"
        env = dict(os.environ,
                   GPUHEALTH_AGENT_COORDINATOR=coord_addr,
                   GPUHEALTH_AGENT_STATE_DIR=str(state / "agent"),
                   GPUHEALTH_AGENT_SOCKET_PATH=str(state / "agent.sock"),
                   GPUHEALTH_AGENT_NODE_NAME=os.environ.get("GPUHEALTH_AGENT_NODE_NAME", "demo-node"))
        agent_cmd = [*base, "agent", "--listen", agent_listen or "127.0.0.1:0"]
        if simulated:
            agent_cmd += ["--nvml-snapshot", str(recording)]
        agent = subprocess.Popen(agent_cmd, env=env, stdout=logs["agent"], stderr=subprocess.STDOUT)
        procs.append(agent)
        _CHILD_LOGS[agent.pid] = ("agent", state / "agent.log")
        agent_addr = _wait(lambda: _agent_address(state / "agent.log"), 60, "the agent's HTTP server", procs)
        _wait(lambda: _get_json(f"http://{agent_addr}/ready")[0] == 200, 60, "the agent's first sweep", procs)
        _, health = _get_json(f"http://{agent_addr}/health")
        _print_health(health or {}, tag)
        click.echo(f"[{tag}] agent        http://{agent_addr}/metrics  /health  /ready")
        click.echo(f"[{tag}] coordinator  grpc {coord_addr}   metrics http://127.0.0.1:{ports['metrics_port']}/metrics")
        click.echo(f"[{tag}] rank socket  {state / 'agent.sock'}  (GPUHEALTH_SOCKET for gpuhealth.instrument.Tracker)")
        me = self_command()
        click.echo(f"[{tag}] try:  {me} fleet --coordinator {coord_addr}   |   "
                   f"{me} jobs --coordinator {coord_addr}")
        click.echo(f"[{tag}] logs and database in {state}"
                   + (" (removed at exit; --keep keeps it)" if removed else ""))
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
            _check_children(procs, "the demo stopped")
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        _stop(procs)
        for f in logs.values():
            f.close()
    click.echo(f"[{tag}] stopped" + (f"; removing {state}" if removed else ""))


def self_command() -> str:
    """``gpuhealth`` as the user can type it now: the bare name when it is on PATH and is this installation, else
    the full path of this installation's script (a venv whose bin folder is not on PATH), else this Python with
    ``-m gpuhealth.cli.main`` (run from a source tree)."""
    script = Path(sys.executable).parent / "gpuhealth"  # not resolved: a venv's python is a symlink out of it
    if not (script.is_file() and os.access(script, os.X_OK)):
        return f"{shlex.quote(sys.executable)} -m gpuhealth.cli.main"
    found = shutil.which("gpuhealth")
    if found is not None and Path(found).resolve() == script.resolve():
        return "gpuhealth"
    return shlex.quote(str(script))


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
    rendezvous = state / f"{job_id}.rendezvous"  # a file, not a port that someone may take first
    rendezvous.unlink(missing_ok=True)
    on = f", rank r on recorded GPU r mod {len(gpus)}" if gpus else ""
    click.echo(f"[{tag}] job {job_id}: {world} ranks (PyTorch Gloo on CPU{on}), rank {straggler} does 2× compute, "
               f"{steps} steps …")
    ranks = []
    for rank in range(world):
        rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "GPUHEALTH_DEMO_INIT": f"file://{rendezvous}", "GPUHEALTH_JOB_ID": job_id,
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
