"""Folders other users may drop files into, made and used by a root process without following links.

The agent runs as root; a training rank runs as the job's user and, for hooks older than inline dumps,
writes its flight-recorder dump into a folder the agent makes. That folder lives where tenants can
write (beside the rank socket, which Kubernetes pods mount read-write), so every path there may be a
link planted to turn the agent's ``mkdir``/``chmod``/read/remove onto a host folder. Here nothing is done
by path below the agent's own folder: the agent's folder is opened with ``O_NOFOLLOW`` and must be the
agent's (owner, not writable by others), the drop box is created in it under an unguessable name with
``mkdirat`` (which never follows or reuses), its mode set through its descriptor, files read with
``openat(O_NOFOLLOW)`` and the whole removed with ``rmtree(dir_fd=…)`` (which does not follow links).
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path
from types import TracebackType

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DROP_MODE = 0o1733  # others may create files, not list the folder nor remove or rename others' files


class UnsafeFolderError(OSError):
    """A folder the agent would write in is a link or belongs to someone else."""


def open_own_dir(path: str | os.PathLike[str], mode: int = 0o711) -> int:
    """A descriptor of folder ``path``, made (``mode``) if absent. Refused (UnsafeFolderError) when
    ``path`` is a link, not a folder, not owned by this process's user, or writable by group/others:
    then someone else controls what is inside. The folders above ``path`` come from the configuration
    and are trusted; they are made with ``mode`` when missing."""
    path = os.fspath(path)
    parent = os.path.dirname(path.rstrip("/")) or "/"
    os.makedirs(parent, mode=mode, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise UnsafeFolderError(f"{path}: not a folder the agent can trust (a link?): {exc.strerror}") from exc
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise UnsafeFolderError(f"{path}: owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; "
                                f"the agent writes only in a folder of its own (uid {os.geteuid()}) that "
                                "nobody else may write")
    return fd


class DropBox:
    """A fresh folder in ``parent`` (the agent's own, see ``open_own_dir``) that other users may drop
    files into. ``path`` is what to tell them; the agent itself only uses descriptors: ``read``
    and ``close`` (which removes the folder and whatever was dropped in it)."""

    def __init__(self, parent: str | os.PathLike[str], prefix: str = "") -> None:
        self._parent_fd = open_own_dir(parent)
        try:
            for _ in range(16):
                name = f"{prefix}{secrets.token_hex(8)}"
                try:
                    os.mkdir(name, 0o700, dir_fd=self._parent_fd)
                except FileExistsError:
                    continue
                self.name = name
                break
            else:
                raise UnsafeFolderError(f"{parent}: no fresh folder name after 16 tries")
            self._fd = os.open(self.name, _DIR_FLAGS, dir_fd=self._parent_fd)
            os.fchmod(self._fd, DROP_MODE)
        except BaseException:
            os.close(self._parent_fd)
            raise
        self.path = Path(os.fspath(parent)) / self.name

    def read(self, name: str, max_bytes: int) -> bytes:
        """The regular file ``name`` in the box (no link, at most ``max_bytes``: ValueError beyond)."""
        if "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r}: not a file name")
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{self.path / name}: not a regular file")
            if st.st_size > max_bytes:
                raise ValueError(f"{self.path / name}: {st.st_size} bytes is over the {max_bytes} limit")
            with os.fdopen(fd, "rb", closefd=False) as fh:
                data = fh.read(max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > max_bytes:
            raise ValueError(f"{self.path / name}: over the {max_bytes} limit")
        return data

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        try:
            shutil.rmtree(self.name, dir_fd=self._parent_fd, ignore_errors=True)
        finally:
            os.close(self._parent_fd)

    def __enter__(self) -> DropBox:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


__all__ = ["DROP_MODE", "DropBox", "UnsafeFolderError", "open_own_dir"]
