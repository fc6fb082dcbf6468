"""How many step records an agent killed with SIGKILL loses: a real coordinator, a real agent process
with its coordinator link, and a process of ranks that streams step records into the agent's socket
at a fixed rate and notes every record the socket took. The agent is SIGKILLed and restarted
``kills`` times; at the end the coordinator's database says which records arrived.

Used by ``test_step_records_survive_sigkill`` and ``benchmarks/hardening.py`` (which runs it on the
code before the journal too: ``source`` puts another tree's ``src`` first on the path).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "tests" / "fixtures" / "scenarios" / "faulty_node.yaml"

RANKS_SCRIPT = r"""
import json, os, socket, sys, time
from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord
path, job, ranks, rate = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
sent = {r: [] for r in range(ranks)}   # steps each rank's socket took
conns = {}
next_step = {r: 0 for r in range(ranks)}
def connect(r):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall(protocol.encode(protocol.hello(RankIdentity(job, r, ranks, "bench", os.getpid()))))
    except OSError:
        s.close()
        return None
    return s
os.set_blocking(sys.stdin.fileno(), False)
period = 1.0 / rate
t_next = time.monotonic()
while True:
    try:
        if sys.stdin.read(): break
    except (TypeError, BlockingIOError):
        pass
    for r in range(ranks):
        if conns.get(r) is None:
            conns[r] = connect(r)
            if conns[r] is None:
                continue
        step = next_step[r]
        rec = StepRecord(job, r, step, 1.7e9 + step * period, period, period * 0.8, period * 0.2)
        next_step[r] += 1  # a step the agent did not take is not resent: ranks move on
        try:
            conns[r].sendall(protocol.encode(protocol.steps([rec])))
            sent[r].append(step)
        except OSError:
            conns[r].close()
            conns[r] = None
    t_next += period
    time.sleep(max(0.0, t_next - time.monotonic()))
print(json.dumps({str(r): steps for r, steps in sent.items()}), flush=True)
"""


def _until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


@dataclass(frozen=True, slots=True)
class LossResult:
    sent: int  # records the agent's socket took
    stored: int  # distinct records the coordinator stored
    duplicates: int  # records the coordinator stored more than once
    kills: int
    rate: float  # records per second, all ranks together

    @property
    def lost(self) -> int:
        return self.sent - self.stored

    @property
    def lost_per_kill(self) -> float:
        return self.lost / max(1, self.kills)

    @property
    def lost_ms_per_kill(self) -> float:
        """Loss per kill as milliseconds of the ranks' records."""
        return 1000.0 * self.lost_per_kill / self.rate

    def to_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "stored": self.stored, "lost": self.lost, "duplicates": self.duplicates,
                "kills": self.kills, "rate": self.rate, "lost_per_kill": round(self.lost_per_kill, 1),
                "lost_ms_per_kill": round(self.lost_ms_per_kill, 1)}


def _env(source: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = str(source / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def measure(work: Path, *, ranks: int = 4, rate_per_rank: float = 200.0, kills: int = 3, every_s: float = 2.5,
            source: Path | None = None, batch_interval_s: float = 1.0) -> LossResult:
    """Stream, SIGKILL the agent ``kills`` times ``every_s`` apart (restarting it), drain, count."""
    work.mkdir(parents=True, exist_ok=True)
    env = _env(source)
    db, ready = work / "coordinator.db", work / "ready.json"
    coordinator = subprocess.Popen(  # port 0: the kernel picks a free one, the ready file says which
        [sys.executable, "-m", "gpuhealth.cli.main", "coordinator", "--listen", "127.0.0.1:0",
         "--metrics-listen", "off", "--db", str(db), "--ready-file", str(ready), "--hang-floor", "3600"],
        env=env, stdout=(work / "coordinator.log").open("wb"), stderr=subprocess.STDOUT)
    sock = Path(f"/tmp/gh-loss-{os.getpid()}-{time.monotonic_ns() % 10**8}.sock")
    cfg = work / "agent.yaml"
    agent_log = (work / "agent.log").open("ab")

    def start_agent() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "gpuhealth.cli.main", "agent", "--config", str(cfg)],
                                env=env, stdout=agent_log, stderr=subprocess.STDOUT)

    agent = ranks_proc = None
    try:
        _until(ready.exists, 60, "the coordinator")
        port = json.loads(ready.read_text())["grpc_port"]
        cfg.write_text(json.dumps({
            "agent": {"coordinator": f"127.0.0.1:{port}", "state_dir": str(work / "state"), "socket_path": str(sock),
                      "pod_resources_socket": str(work / "no-kubelet.sock"), "listen": "127.0.0.1:0",
                      "nvml_snapshot": str(SCENARIO)},
            "coordinator": {"link_batch_interval_s": batch_interval_s},
        }))
        agent = start_agent()
        _until(sock.exists, 60, "the agent's rank socket")
        ranks_proc = subprocess.Popen([sys.executable, "-c", RANKS_SCRIPT, str(sock), "loss-job", str(ranks),
                                       str(rate_per_rank)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        time.sleep(every_s)
        for _ in range(kills):
            agent.send_signal(signal.SIGKILL)
            agent.wait(10)
            sock.unlink(missing_ok=True)  # a dead agent leaves its socket file; the ranks see no listener
            agent = start_agent()
            _until(sock.exists, 60, "the restarted agent's rank socket")
            time.sleep(every_s)
        out, _ = ranks_proc.communicate("stop\n", timeout=30)
        sent = {(int(r), s) for r, steps in json.loads(out).items() for s in steps}

        def stored() -> list[tuple[int, int]]:
            return _stored(db)

        # Drain: the agent sends what it spooled; wait until the coordinator's count stops moving.
        last, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            n = len(stored())
            if n != last:
                last, stable_since = n, time.monotonic()
            elif time.monotonic() - stable_since > 3 * batch_interval_s + 2:
                break
            time.sleep(0.3)
        rows = stored()
        distinct = set(rows)
        return LossResult(sent=len(sent), stored=len(distinct & sent), duplicates=len(rows) - len(distinct),
                          kills=kills, rate=ranks * rate_per_rank)
    finally:
        for proc in (ranks_proc, agent, coordinator):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        agent_log.close()
        sock.unlink(missing_ok=True)


def _stored(db: Path) -> list[tuple[int, int]]:
    """(rank, step) of every step record in the coordinator's database, duplicates included."""
    from gpuhealth.proto import gpuhealth_v1_pb2 as pb

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        rows = con.execute("SELECT payload FROM step_batches").fetchall()
        con.close()
    except sqlite3.Error:
        return []
    out: list[tuple[int, int]] = []
    for (payload,) in rows:
        batch = pb.AgentMessage.FromString(bytes(payload)).record.steps
        out += list(zip(batch.rank, batch.step, strict=True))
    return out
