"""A live rank's flight-recorder dump through its FIFO — the job keeps running.

With ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<p>`` (and a flight-recorder buffer) set at launch, each NCCL
rank creates the FIFO ``<p><rank>.pipe`` (mode 0666 less its umask) and its watchdog reads it about
once a second; any byte written there makes the rank write its dump to
``<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>`` (a pickle, written in place, not renamed). Measured on
H200 (torch 2.11): the dump appeared within 4 s while the job stayed hung.

Both paths are the rank's own (a container's files are reached through ``/proc/<pid>/root``, without
leaving it: ``rootfs``). What stops a dump is said in words: the launch did not set the variables,
nobody reads the pipe, the agent may not write it (another user's FIFO, mode 0644), or the rank did
not answer in time.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from gpuhealth.agent.zerocode.discovery import DiscoveredProcess
from gpuhealth.agent.zerocode.rootfs import PathError, open_path, reopen

MAX_DUMP_BYTES = 32 * 1024 * 1024  # as the rank hub's cap: a 2000-entry NCCL dump is ~1 MB


class DumpError(Exception):
    """No dump from this rank; the message says why and what is missing."""


@dataclass(frozen=True, slots=True)
class Dump:
    rank: int
    data: bytes
    path: str  # where the rank wrote it, in its own view
    seconds: float  # from the trigger to a complete file


def _stat(pid: int, path: str, uid: int | None, proc: Path) -> os.stat_result | None:
    try:
        fd = open_path(pid, path, uid=uid, proc=proc)
    except PathError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise DumpError(str(exc)) from exc
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _complete(data: bytes) -> bool:
    """A whole dump: a pickle ends with STOP ('.'), a JSON document with '}'."""
    tail = data.rstrip()
    pickle = tail.endswith(b".") and data[:1] == b"\x80"
    return pickle or (tail.endswith(b"}") and data.lstrip()[:1] == b"{")


def _read(pid: int, path: str, uid: int | None, proc: Path) -> bytes:
    try:
        pfd = open_path(pid, path, uid=uid, proc=proc)
    except PathError as exc:
        raise DumpError(str(exc)) from exc
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            raise DumpError(f"{path} is not a regular file; not read")
        if uid is not None and st.st_uid != uid:
            raise DumpError(f"{path} belongs to uid {st.st_uid}, not to the job (uid {uid}); not read")
        if st.st_size > MAX_DUMP_BYTES:
            raise DumpError(f"{path}: {st.st_size} bytes is over the {MAX_DUMP_BYTES}-byte limit")
        fd = reopen(pfd, os.O_RDONLY)
        try:
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read(MAX_DUMP_BYTES + 1)
        finally:
            os.close(fd)
    finally:
        os.close(pfd)


def poke(proc_info: DiscoveredProcess, *, proc: Path = Path("/proc")) -> tuple[str, str]:
    """Write one byte into the rank's FIFO; returns (fifo path, dump path) in the rank's view."""
    li = proc_info.launch
    if li is None:
        raise DumpError(f"process {proc_info.pid}: its environment could not be read ({proc_info.error})")
    if li.rank is None:
        raise DumpError(f"process {proc_info.pid} is not a torch rank (no RANK in its environment)")
    missing = li.dump_ready
    if missing:
        raise DumpError(f"rank {li.rank}: no live dump: {missing} (launch with `export $(gpuhealth env)`)")
    assert li.pipe_prefix and li.dump_prefix
    fifo, dump = f"{li.pipe_prefix}{li.rank}.pipe", f"{li.dump_prefix}{li.rank}"
    try:
        pfd = open_path(proc_info.pid, fifo, uid=proc_info.uid, proc=proc)
    except PathError as exc:
        if exc.errno == errno.ENOENT:
            raise DumpError(f"rank {li.rank} has no pipe {fifo}: its NCCL process group has not started, the job "
                            "does not use NCCL, or its flight recorder is off (TORCH_FR_BUFFER_SIZE=0)") from exc
        raise DumpError(f"rank {li.rank}: {exc}") from exc
    try:
        st = os.fstat(pfd)
        if not stat.S_ISFIFO(st.st_mode):
            raise DumpError(f"rank {li.rank}: {fifo} is not a FIFO; nothing written to it")
        if not _owner_may_write(st, proc_info):
            raise DumpError(f"rank {li.rank}: {fifo} belongs to uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):o}): "
                            f"the rank's own user (uid {proc_info.uid}) could not write it, so the agent does not "
                            "either (it never acts for a process beyond what the process itself may do)")
        try:
            fd = reopen(pfd, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise DumpError(f"rank {li.rank}: nobody reads {fifo} (the rank's NCCL watchdog is not running: "
                                "its process group was destroyed, or it is not an NCCL job)") from exc
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise DumpError(f"rank {li.rank}: no permission to write {fifo} (mode {stat.S_IMODE(st.st_mode):o}, "
                                f"owner uid {st.st_uid}): run the agent as root or as the job's user") from exc
            raise DumpError(f"rank {li.rank}: cannot open {fifo}: {exc.strerror or exc}") from exc
        try:
            os.write(fd, b"1")
        except BlockingIOError as exc:  # the pipe is full: a trigger is already waiting to be read
            raise DumpError(f"rank {li.rank}: its pipe is full; a dump is already pending") from exc
        finally:
            os.close(fd)
    finally:
        os.close(pfd)
    return fifo, dump


def _owner_may_write(st: os.stat_result, p: DiscoveredProcess) -> bool:
    """Could the process's own user write this FIFO? (The agent runs as root: without this, a job could make it
    write another user's FIFO — a confused deputy forcing that job to dump.)"""
    if p.uid is None:
        return False
    if p.uid == 0:
        return True
    mode = st.st_mode
    if st.st_uid == p.uid:
        return bool(mode & stat.S_IWUSR)
    if st.st_gid in p.gids:
        return bool(mode & stat.S_IWGRP)
    return bool(mode & stat.S_IWOTH)


def request_dump(proc_info: DiscoveredProcess, *, timeout_s: float = 15.0, poll_s: float = 0.1,
                 proc: Path = Path("/proc")) -> Dump:
    """Trigger the rank's dump and wait for the complete file (its size stable and a whole document)."""
    li = proc_info.launch
    rank = li.rank if li is not None and li.rank is not None else -1
    before = None
    if li is not None and li.dump_prefix and li.rank is not None:
        before = _stat(proc_info.pid, f"{li.dump_prefix}{li.rank}", proc_info.uid, proc)
    started = time.monotonic()
    _fifo, dump = poke(proc_info, proc=proc)
    last: tuple[int, int] | None = None
    while time.monotonic() - started < timeout_s:
        time.sleep(poll_s)
        st = _stat(proc_info.pid, dump, proc_info.uid, proc)
        if st is None or (before is not None and (st.st_mtime_ns, st.st_size, st.st_ino) ==
                          (before.st_mtime_ns, before.st_size, before.st_ino)):
            continue  # not written yet
        now = (st.st_mtime_ns, st.st_size)
        if now != last:
            last = now  # still growing: look again
            continue
        data = _read(proc_info.pid, dump, proc_info.uid, proc)
        if _complete(data):
            return Dump(rank, data, dump, time.monotonic() - started)
    raise DumpError(f"rank {rank} did not write {dump} within {timeout_s:g} s (its watchdog reads the pipe about "
                    "once a second; a first dump with stack traces takes 1-4 s; a rank whose watchdog is itself "
                    "stuck never answers)")


__all__ = ["MAX_DUMP_BYTES", "Dump", "DumpError", "poke", "request_dump"]
