"""Python thread names in the kernel, so ``top -H``, ``ps -L`` and ``/proc/<pid>/task/<tid>/comm`` tell a
daemon's threads apart (Python 3.11 leaves every thread called ``python``).

``install()`` asks ``threading`` to run a one-shot profile hook in each thread it starts from then on
(``threading.setprofile``, a public API): on the thread's first event the hook sets the thread's kernel name
(``prctl(PR_SET_NAME)``, at most 15 bytes) from its Python name and removes itself, so the thread runs
unprofiled from its first call on. ``kernel_name`` shortens the names: ``gpuhealth-collector-telemetry`` is
``gh-c-telemetry``, ``gpuhealth-http-0`` is ``gh-http-0``. Linux only; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from types import FrameType
from typing import Any

PR_SET_NAME = 15
COMM_BYTES = 15  # TASK_COMM_LEN 16, with its NUL
_SHORTER = (("gpuhealth-", "gh-"), ("collector-", "c-"), ("ThreadPoolExecutor-", "pool-"))

_prctl: Any = None


def kernel_name(name: str) -> str:
    """The name a thread gets in the kernel: the Python name with its long prefixes shortened, cut to 15 bytes."""
    for long, short in _SHORTER:
        name = name.replace(long, short)
    return name.encode("utf-8", "replace")[:COMM_BYTES].decode("utf-8", "ignore")


def set_current(name: str) -> bool:
    """Name the calling thread in the kernel; False where that is not possible (not Linux, no libc)."""
    if _prctl is None:
        return False
    try:
        return int(_prctl(PR_SET_NAME, kernel_name(name).encode(), 0, 0, 0)) == 0
    except Exception:  # a name is a convenience, never a failure
        return False


def _first_event(_frame: FrameType, _event: str, _arg: Any) -> None:
    sys.setprofile(None)  # once per thread: it runs unprofiled from here on
    set_current(threading.current_thread().name)


def install() -> bool:
    """Name every thread ``threading`` starts from now on; False where unsupported. The main thread keeps its
    name: it is the process's name (``ps``, ``pgrep``)."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return False
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
        except (OSError, AttributeError):
            return False
    threading.setprofile(_first_event)
    return True


__all__ = ["install", "kernel_name", "set_current"]
