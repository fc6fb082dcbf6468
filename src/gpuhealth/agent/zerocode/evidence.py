"""Evidence from a live, unmodified job: every local rank's flight-recorder dump (through its FIFO), its
Python stacks (py-spy), and the triage verdict over them.

The evidence folder has the layout a coordinator's evidence folder has — ``fr/rank<N>.pkl`` and
``stacks.json`` — so ``gpuhealth triage <folder>`` reads it as it is. Triage runs in a child process
(``gpuhealth triage … --json``) under a memory cap and a time limit, like the
agent's diagnostics: the agent process never loads the analyser (nor torch), and a hostile dump costs
the child, not the agent.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.agent.zerocode.discovery import DiscoveredJob
from gpuhealth.agent.zerocode.fifo import DumpError, request_dump
from gpuhealth.agent.zerocode.stacks import pyspy_stacks

# The analyser's per-file budgets keep one dump's triage near 0.5 GiB (BENCHMARKS "Hardening, round two"); the
# child runs in the agent's cgroup (the pod's 256 Mi limit on Kubernetes), so it also marks itself the one the
# kernel kills first: the agent survives a triage that runs the pod out of memory.
TRIAGE_MEMORY_BYTES = 768 << 20
MAX_TRIAGE_OUTPUT = 64 * 1024 * 1024


@dataclass
class Evidence:
    folder: str
    dumps: dict[int, str] = field(default_factory=dict)  # rank -> file in the folder
    dump_errors: dict[int, str] = field(default_factory=dict)
    dump_seconds: dict[int, float] = field(default_factory=dict)
    stack_errors: dict[int, str] = field(default_factory=dict)
    report: dict[str, Any] | None = None  # `gpuhealth triage --json` over the folder
    triage_error: str = ""
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        rep = self.report or {}
        return {
            "folder": self.folder, "dumps": sorted(self.dumps),
            "dump_errors": {str(k): v for k, v in self.dump_errors.items()},
            "stack_errors": {str(k): v for k, v in self.stack_errors.items()},
            "triage_verdict": rep.get("verdict"), "triage_summary": rep.get("summary"),
            "triage_culprits": rep.get("culprits"), "triage_error": self.triage_error or None,
            "seconds": round(self.seconds, 3),
        }


# The child volunteers for the OOM killer, then takes the rank process's sandbox (tenant_proc.sandbox: address
# space, CPU time = the triage's timeout, no core, no capabilities, no_new_privs, dies with the agent) before it reads
# a byte of the dumps (tenants' pickles and JSON), then runs the command (no preexec_fn: the agent has threads).
# It keeps the agent's uid: the evidence folder is the agent's own (0700).
_CHILD = ("import runpy, sys\n"
          "from gpuhealth.agent.tenant_proc import sandbox\n"
          "cap, cpu = int(sys.argv.pop(1)), int(sys.argv.pop(1)); sys.argv[0] = 'gpuhealth'\n"
          "try:\n    open('/proc/self/oom_score_adj', 'w').write('1000')\nexcept OSError:\n    pass\n"
          "sandbox(None, None, cap, cpu)\n"
          "runpy.run_module('gpuhealth.cli.main', run_name='__main__')")


def run_triage(folder: str | Path, *, world_size: int | None = None, timeout_s: float = 120.0
               ) -> tuple[dict[str, Any] | None, str]:
    """``gpuhealth triage FOLDER --json`` in a child: (report, "") or (None, why not)."""
    cmd = [sys.executable, "-c", _CHILD, str(TRIAGE_MEMORY_BYTES), str(max(1, math.ceil(timeout_s))), "triage",
           str(folder), "--json"]
    if world_size:
        cmd += ["--world-size", str(world_size)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEALTH_")}  # the folder is the input
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False, env=env)
    except subprocess.TimeoutExpired:
        return None, f"triage did not finish within {timeout_s:g} s"
    except OSError as exc:
        return None, f"cannot run triage: {exc}"
    if len(proc.stdout) > MAX_TRIAGE_OUTPUT:
        return None, "triage printed more than 64 MiB"
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        err = proc.stderr.decode(errors="replace").strip()[-400:]
        if proc.returncode == -signal.SIGXCPU:
            return None, f"triage used its CPU-time budget ({math.ceil(timeout_s)} s) and was stopped"
        return None, f"triage failed (exit {proc.returncode}): {err or 'no output'}"
    return (report, "") if isinstance(report, dict) else (None, "triage printed no report")


def collect(job: DiscoveredJob, folder: str | Path, *, dump_timeout_s: float = 15.0, stacks: bool = True,
            native: bool = False, triage: bool = True, triage_timeout_s: float = 120.0,
            proc: Path = Path("/proc"), on_dump: Callable[[int, bool], None] | None = None) -> Evidence:
    """Dump every local rank of ``job`` at once (a rank's dump does not wait for another's), take their
    stacks, and triage. ``on_dump(rank, ok)`` is told about each dump (for counters)."""
    started = time.monotonic()
    out = Path(folder)
    (out / "fr").mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)  # dumps and stacks show the job's code and arguments
    ev = Evidence(str(out))
    ranks = dict(job.ranks)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, max(1, 2 * len(ranks))),
                                               thread_name_prefix="gpuhealth-zc-evidence") as pool:
        dumps = {r: pool.submit(request_dump, p, timeout_s=dump_timeout_s, proc=proc) for r, p in ranks.items()}
        spies = {r: pool.submit(pyspy_stacks, p.pid, native=native, timeout_s=min(dump_timeout_s, 15.0))
                 for r, p in ranks.items()} if stacks else {}
        for rank, fut in sorted(dumps.items()):
            try:
                dump = fut.result()
            except DumpError as exc:
                ev.dump_errors[rank] = str(exc)
            except Exception as exc:  # one rank's failure never loses the others' dumps
                ev.dump_errors[rank] = f"{type(exc).__name__}: {exc}"
            else:
                name = f"rank{rank}.pkl" if dump.data[:1] == b"\x80" else f"rank{rank}.json"
                path = out / "fr" / name
                path.write_bytes(dump.data)
                ev.dumps[rank] = str(path)
                ev.dump_seconds[rank] = round(dump.seconds, 3)
            if on_dump is not None:
                on_dump(rank, rank in ev.dumps)
        captured: dict[str, Any] = {}
        for rank, spy in sorted(spies.items()):
            answer = spy.result()
            if "py_spy" in answer:
                captured[str(rank)] = answer
            else:
                ev.stack_errors[rank] = str(answer.get("py_spy_error"))
    (out / "stacks.json").write_text(json.dumps(captured))
    if triage and ev.dumps:
        # The job's size only when all its ranks are here: otherwise the other nodes' ranks would be "missing".
        world = job.world_size if len(ranks) == job.world_size else None
        ev.report, ev.triage_error = run_triage(out, world_size=world, timeout_s=triage_timeout_s)
        if ev.report is not None:
            (out / "triage.json").write_text(json.dumps(ev.report, indent=1, default=str))
    elif triage:
        ev.triage_error = "no dump to triage"
    ev.seconds = time.monotonic() - started
    return ev


__all__ = ["Evidence", "collect", "run_triage"]
