"""The flight-recorder analyser over the dumps agents sent, in a child process under a memory cap.

Dumps come from jobs, through agents: untrusted input. The analyser bounds what one file may cost
(``flightrec/load.py``, ``flightrec/safe_pickle.py``), but a job of many ranks can still send more
than the coordinator may hold (its pod's limit is 1 Gi), and a 32 MiB pickle triaged in the
coordinator's own process once took it from 63 to 2,474 MiB. So the analyser never runs there:

- one child at a time (``python -c`` that caps itself, then runs :func:`main`: no ``preexec_fn``, the
  coordinator has gRPC threads), with :data:`MEMORY_CAP_BYTES` of address space (RLIMIT_AS) and
  ``oom_score_adj`` 1000 (should the node or the pod run short anyway, the kernel kills the child, not
  the coordinator);
- a file that would take more than the cap is a problem line in the report (the loader catches the
  MemoryError per file); a child that dies, is killed at :data:`TIMEOUT_S`, or prints no report gives an
  ``incomplete`` verdict saying why — the coordinator stays up and keeps the evidence;
- the report comes back as a serialized ``pb.TriageReport`` (the wire type the coordinator returns
  anyway: nothing is lost on the way).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuhealth.coordinator.triage_wire import report_from_pb, report_to_pb
from gpuhealth.flightrec.report import TriageReport

MEMORY_CAP_BYTES = 768 << 20  # the child's address space: with the coordinator's own ~100 MiB, under its 1 Gi
TIMEOUT_S = 300.0
MAX_REPORT_BYTES = 64 << 20
EXIT_OUT_OF_MEMORY = 3
# One child at a time (per event loop): two would share the coordinator's memory limit.
_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()

# The child caps itself before it imports anything of ours, then runs main() below.
_CHILD = ("import resource, sys; cap = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (cap, cap)); "
          "from gpuhealth.coordinator.triage_child import main; sys.exit(main(sys.argv[2:]))")


def run_triage(folder: Path, job: Mapping[str, Any], stacks: Mapping[int, Any] | None = None) -> TriageReport:
    """The analyser in this process (the child's work; tests and the offline CLI path)."""
    from gpuhealth.flightrec.verdict import triage

    return triage(str(folder), job=job, stacks=stacks)


def _stacks(path: str) -> dict[Any, Any] | None:
    if not path:
        return None
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in raw.items()}


def main(argv: list[str]) -> int:
    """In the child: ``DUMP_DIR JOB_JSON [STACKS_JSON_FILE]`` → a serialized pb.TriageReport on stdout."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")  # raising one's own score needs no privilege
    except OSError:
        pass
    try:
        job = json.loads(argv[1])
        report = run_triage(Path(argv[0]), job, _stacks(argv[2] if len(argv) > 2 else ""))
        out = report_to_pb(report).SerializeToString()
    except MemoryError as exc:
        exc.__traceback__ = None
        print(f"triage ran out of memory (cap {MEMORY_CAP_BYTES >> 20} MiB)", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except Exception as exc:  # the analyser's own bug: one line for the verdict, never a traceback
        print(f"triage failed: {type(exc).__name__}: {str(exc)[:500]}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    return 0


async def triage_in_child(dump_dir: Path, job: Mapping[str, Any], stacks_file: Path | None = None, *,
                          memory_bytes: int = MEMORY_CAP_BYTES, timeout_s: float = TIMEOUT_S
                          ) -> tuple[TriageReport | None, str]:
    """(report, "") from a capped child, or (None, why not): what the verdict should say instead."""
    lock = _LOCKS.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    cmd = [sys.executable, "-c", _CHILD, str(memory_bytes), str(dump_dir), json.dumps(dict(job)),
           str(stacks_file or "")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEALTH_")}  # the folder is the input
    async with lock:
        try:
            proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, env=env)
        except OSError as exc:
            return None, f"cannot start the triage child: {exc}"
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return None, f"triage did not finish within {timeout_s:g} s and was stopped (the dumps are kept)"
    why = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
    if proc.returncode == EXIT_OUT_OF_MEMORY:
        return None, (f"evidence too large: triage needed more than its {memory_bytes >> 20} MiB memory cap "
                      "(the dumps are kept)")
    if proc.returncode is not None and proc.returncode < 0:
        return None, (f"triage was killed (signal {-proc.returncode}; over its {memory_bytes >> 20} MiB memory "
                      "cap or the pod's limit?); the dumps are kept")
    if proc.returncode != 0:
        return None, why[0][:500] or f"triage failed (exit {proc.returncode})"
    if len(out) > MAX_REPORT_BYTES:
        return None, "triage printed a report over 64 MiB"
    from gpuhealth.proto import gpuhealth_v1_pb2 as pb

    msg = pb.TriageReport()
    try:
        msg.ParseFromString(out)
    except Exception as exc:  # protobuf's DecodeError: a child that printed something else
        return None, f"triage printed no report ({type(exc).__name__})"
    return report_from_pb(msg), ""


__all__ = ["MEMORY_CAP_BYTES", "TIMEOUT_S", "main", "run_triage", "triage_in_child"]
