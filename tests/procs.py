"""Process checks the tests share (``tests/`` is on ``sys.path`` under pytest)."""

from __future__ import annotations


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its parent (init in a container may never reap
    one, and a killed child stays a zombie until its parent waits)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
