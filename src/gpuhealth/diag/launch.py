"""Start one diagnostic rank process per GPU on this host and collect rank 0's answer.

``python -m gpuhealth.diag <subcommand>`` ranks rendezvous through a file in a private temporary
directory (torch's ``file://`` init method): no port to pick, nothing left behind. Used by the bus
bandwidth probe (``busbw-rank``) and quick qualification (``quick-rank``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class LaunchError(RuntimeError):
    """A rank failed or timed out; the message carries the end of its output."""


def run_local_ranks(world: int, subcommand: str, args: Sequence[str], *, what: str, timeout_s: float = 300.0,
                    python: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """Run ``world`` ranks of ``python -m gpuhealth.diag SUBCOMMAND --init-method … ARGS`` and return
    rank 0's stdout. ``what`` names them in errors ("busbw", "quick qualification"). Every rank is
    killed on the way out, whatever happened."""
    with tempfile.TemporaryDirectory(prefix="gpuhealth-ranks-") as tmp:
        init = f"file://{tmp}/rendezvous"
        procs: list[subprocess.Popen[str]] = []
        logs: list[Any] = []
        try:
            for rank in range(world):
                child_env = dict(os.environ if env is None else env)
                child_env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                 LOCAL_WORLD_SIZE=str(world))
                log = open(Path(tmp) / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
                logs.append(log)
                cmd = [python or sys.executable, "-m", "gpuhealth.diag", subcommand, "--init-method", init, *args]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                              stderr=log, text=True, env=child_env))
            deadline = time.monotonic() + timeout_s
            try:
                out0, _ = procs[0].communicate(timeout=timeout_s)
                for p in procs[1:]:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise LaunchError(f"{what} ranks did not finish within {timeout_s:.0f} s") from exc
            failed = [r for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                log = logs[failed[0]]
                log.seek(0)
                raise LaunchError(f"{what} rank {failed[0]} exited with {procs[failed[0]].returncode}: "
                                  f"{log.read()[-2000:]}")
            return out0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()


__all__ = ["LaunchError", "run_local_ranks"]
