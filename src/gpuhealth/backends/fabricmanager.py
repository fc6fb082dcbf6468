"""Is the NVIDIA Fabric Manager running? On NVSwitch systems (HGX) it trains the NVLink fabric and
handles its errors; when it dies after the GPUs registered, their fabric state still says
"completed" — nothing in NVML tells, and a node ran for days without it in a peer's tracker.

The answer is read from ``/proc``: a process whose command is ``nv-fabricmanager`` (its ``comm`` is
cut to 15 characters by the kernel, so the command line is read too). A recording says what the
recorder saw under the system key ``fabric_manager`` ("running" / "stopped"; absent when it could not tell).
"Stopped" needs a ``/proc`` that shows other users' processes: an unprivileged agent (the unit's
``DynamicUser``) under ``/proc`` mounted ``hidepid`` sees only its own, and the answer is None (unknown).
"""

from __future__ import annotations

import os
from pathlib import Path

RUNNING, STOPPED = "running", "stopped"
FM_BINARY = "nv-fabricmanager"


def _others_visible(proc_root: str | os.PathLike[str] = "/proc") -> bool:
    """Whether this process sees other users' processes in ``/proc``. PID 1 exists in every PID namespace and
    is root's; ``/proc`` mounted ``hidepid=1`` (``noaccess``) lets an unprivileged reader list it but not read
    it, ``hidepid=2`` (``invisible``) hides it. Either way root's ``nv-fabricmanager`` would be hidden too."""
    try:
        (Path(proc_root) / "1" / "comm").read_bytes()
    except OSError:
        return False
    return True


def fabric_manager_state(proc_root: str | os.PathLike[str] = "/proc") -> str | None:
    """"running", "stopped", or None when it cannot be told: ``/proc`` unreadable, or other users'
    processes hidden from this one (an unprivileged agent under ``hidepid``) — unknown, not "stopped"."""
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
    return STOPPED if _others_visible(root) else None


__all__ = ["RUNNING", "STOPPED", "fabric_manager_state"]
