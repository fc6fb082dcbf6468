"""A Slurm-shaped cgroup for test processes: kernel evidence that a process is job J's.

slurmd puts each job's processes in ``…/slurm/uid_<uid>/job_<id>/step_<n>`` (cgroup v1) or
``…/job_<id>/step_<n>/…`` (v2); only root can move a process there. Tests run as root: ``SlurmCgroup``
makes such a folder under a controller it can write, ``enter`` (a ``preexec_fn``) moves the child into it
before it drops to its uid, and ``remove`` takes the folders away when the processes are gone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

# cgroup v1 "pids" (this box: every v1 controller is writable by root), else the v2 hierarchy.
_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def _root() -> Path:
    for root in _ROOTS:
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            return root
    raise AssertionError("no writable cgroup hierarchy: the test needs root and /sys/fs/cgroup")


class SlurmCgroup:
    def __init__(self, job_id: str, uid: int) -> None:
        self.top = _root() / f"gpuhealth-test-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.step = self.top / "slurm" / f"uid_{uid}" / f"job_{job_id}" / "step_0"
        self.step.mkdir(parents=True)

    def enter(self, uid: int | None = None, gid: int | None = None) -> Callable[[], None]:
        """A ``preexec_fn``: join the job's cgroup (as root), then become ``uid``/``gid``."""
        procs = str(self.step / "cgroup.procs")

        def run() -> None:
            with open(procs, "w") as fh:
                fh.write(str(os.getpid()))
            if gid is not None:
                os.setgroups([])
                os.setgid(gid)
            if uid is not None:
                os.setuid(uid)

        return run

    def remove(self) -> None:
        """Remove the folders, deepest first (the processes in them must have exited)."""
        deadline = time.monotonic() + 10
        for d in (self.step, *self.step.parents):
            if d == self.top.parent:
                break
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
