"""Open a path as another process sees it, without leaving its root.

``/proc/<pid>/root/<path>`` reaches a container's own files from the host, but the kernel resolves a
symbolic link met on the way against the *agent's* root: a job could point its "dump file" at a host
file and have the agent (root) read it, or its "FIFO" at a device and have the agent open it for
writing. So each component is opened here with ``O_NOFOLLOW`` and links are followed by hand, inside
the process's root; the caller gets an ``O_PATH`` descriptor and checks what the file is before it
opens it for real (``reopen``).

Opening ``/proc/<pid>/root`` needs ptrace access to the process (root, CAP_SYS_PTRACE, or its own
user): without it the error says so.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MAX_LINKS = 40  # as the kernel's own limit


class PathError(OSError):
    """The path cannot be reached in the process's root; the message says why, in words."""


def _open_dir(path: Path, pid: int, uid: int | None) -> int:
    try:
        return os.open(path, os.O_PATH | os.O_DIRECTORY)
    except PermissionError as exc:
        owner = f" (it runs as uid {uid})" if uid is not None else ""
        raise PathError(exc.errno, f"cannot look into process {pid}'s files{owner}: permission denied — the agent "
                                   "needs root or CAP_SYS_PTRACE, or to run as the job's user") from exc
    except FileNotFoundError as exc:
        raise PathError(exc.errno, f"process {pid} has gone") from exc


def open_path(pid: int, path: str, *, uid: int | None = None, proc: Path = Path("/proc")) -> int:
    """An ``O_PATH`` descriptor of ``path`` as process ``pid`` sees it (absolute: from its root; relative:
    from its working directory, without ``..``). The caller closes it."""
    base = proc / str(pid)
    root = _open_dir(base / "root", pid, uid)
    absolute = path.startswith("/")
    if not absolute and ".." in Path(path).parts:
        os.close(root)
        raise PathError(errno.EINVAL, f"{path}: a relative path with '..' is not followed (use an absolute path)")
    stack = [root] if absolute else [root, _open_dir(base / "cwd", pid, uid)]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    links = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=stack[-1])
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                os.close(fd)
                links += 1
                if links > MAX_LINKS:
                    raise PathError(errno.ELOOP, f"{path}: too many symbolic links")
                target = os.readlink(name, dir_fd=stack[-1])
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            elif parts and not stat.S_ISDIR(st.st_mode):
                os.close(fd)
                raise PathError(errno.ENOTDIR, f"{path}: {name} is not a folder")
            else:
                stack.append(fd)
        if len(stack) == (1 if absolute else 2):
            raise PathError(errno.EISDIR, f"{path}: names a folder, not a file")
        return os.dup(stack[-1])
    except PathError:
        raise
    except FileNotFoundError as exc:
        raise PathError(exc.errno, f"{path}: no such file in process {pid}'s view") from exc
    except PermissionError as exc:
        raise PathError(exc.errno, f"{path}: permission denied in process {pid}'s view") from exc
    finally:
        for fd in stack:
            os.close(fd)


def reopen(path_fd: int, flags: int) -> int:
    """Open for real the file an ``O_PATH`` descriptor names (the same inode, no second lookup)."""
    return os.open(f"/proc/self/fd/{path_fd}", flags)


__all__ = ["PathError", "open_path", "reopen"]
