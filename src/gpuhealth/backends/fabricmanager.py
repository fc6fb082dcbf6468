"""Is the NVIDIA Fabric Manager running? On NVSwitch systems (HGX) it trains the NVLink fabric and
handles its errors; when it dies after the GPUs registered, their fabric state still says
"completed" — nothing in NVML tells, and a node ran for days without it in a peer's tracker.

The answer is read from ``/proc``: a process whose command is ``nv-fabricmanager`` (its ``comm`` is
cut to 15 characters by the kernel, so the command line is read too). A recording says what the
recorder saw under the system key ``fabric_manager`` ("running" / "stopped").
"""

from __future__ import annotations

import os
from pathlib import Path

RUNNING, STOPPED = "running", "stopped"
FM_BINARY = "nv-fabricmanager"


def fabric_manager_state(proc_root: str | os.PathLike[str] = "/proc") -> str | None:
    """"running", "stopped", or None when ``/proc`` cannot be read (unknown, not "stopped")."""
    root = Path(proc_root)
    try:
        entries = list(root.iterdir())
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if comm and FM_BINARY.startswith(comm) and len(comm) >= 14:
                return RUNNING
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue  # the process ended while we looked, or is not ours to read
        if os.path.basename(argv0) == FM_BINARY:
            return RUNNING
    return STOPPED


__all__ = ["RUNNING", "STOPPED", "fabric_manager_state"]
