"""Run a command under address-space and CPU caps without ``preexec_fn``.

A test helper, not part of the installed package (``tests/`` is on ``sys.path`` under pytest).
``preexec_fn`` forks and runs Python in the child before exec; when the pytest process has gRPC threads
(other tests made channels), gRPC's fork handlers can start a poller in that child whose epoll fd the
child then closes, and the child aborts (SIGABRT, "epoll_wait error: Bad file descriptor") — seen in
CI. Instead a fresh interpreter sets its own limits and execs the command: limits survive exec.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

_APPLY_AND_EXEC = (
    "import os, resource, sys\n"
    "mem, cpu = int(sys.argv[1]), int(sys.argv[2])\n"
    "if mem > 0: resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "if cpu > 0: resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)


def run_capped(cmd: list[str], *, mem_bytes: int = 0, cpu_s: int = 0,
               **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, **kwargs)`` with RLIMIT_AS=mem_bytes and RLIMIT_CPU=cpu_s (0 = unchanged).
    ``cmd[0]`` must be a path (execv does not search PATH)."""
    wrapped = [sys.executable, "-c", _APPLY_AND_EXEC, str(mem_bytes), str(cpu_s), *cmd]
    result: subprocess.CompletedProcess[str] = subprocess.run(wrapped, **kwargs)
    return result
