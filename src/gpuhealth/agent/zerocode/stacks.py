"""Python stacks of a process from outside it: ``py-spy dump --json`` (optionally ``--native``).

The answer has the shape the triage analyser reads as live-stack evidence (``flightrec/stacks.py``):
``{"py_spy": [threads]}``, or ``{"py_spy_error": "why"}``. py-spy needs ptrace permission on the
process: root or CAP_SYS_PTRACE (the DaemonSet and the systemd unit grant it), or the same user with
``kernel.yama.ptrace_scope`` 0.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def pyspy_exe() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"  # installed into the agent's own environment
    return str(beside) if beside.exists() else None


def pyspy_stacks(pid: int, *, native: bool = False, timeout_s: float = 10.0, exe: str | None = None) -> dict[str, Any]:
    exe = exe or pyspy_exe()
    if exe is None:
        return {"py_spy_error": "py-spy is not installed (pip install py-spy, or put it on the agent's PATH)"}
    cmd = [exe, "dump", "--pid", str(pid), "--json", *(["--native"] if native else [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"py_spy_error": f"py-spy did not finish within {timeout_s:g} s"}
    except OSError as exc:
        return {"py_spy_error": f"cannot run py-spy: {exc}"}
    if proc.returncode != 0:
        text = proc.stderr.decode(errors="replace").strip()[-500:] or f"exit {proc.returncode}"
        if "Permission" in text or "ptrace" in text.lower():
            text += " (py-spy needs root or CAP_SYS_PTRACE on the job's processes)"
        return {"py_spy_error": text}
    try:
        return {"py_spy": json.loads(proc.stdout)}
    except ValueError as exc:
        return {"py_spy_error": f"py-spy output is not JSON: {exc}"}


__all__ = ["pyspy_exe", "pyspy_stacks"]
