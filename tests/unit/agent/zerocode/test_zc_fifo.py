"""The FIFO trigger against a stand-in that behaves like an NCCL rank, what stops a dump (said in words),
and paths that never leave the rank's own root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.agent.zerocode.discovery import DiscoveredProcess, inspect_process
from gpuhealth.agent.zerocode.environ import launch_variables
from gpuhealth.agent.zerocode.fifo import DumpError, poke, request_dump
from gpuhealth.agent.zerocode.rootfs import PathError, open_path

# NCCL's DumpPipe + dumpDebuggingInfo in a few lines: mkfifo 0666, O_RDONLY|O_NONBLOCK, read about once a second
# (here 0.2 s), and on any byte write the dump in place — in two parts, as a large write lands.
STAND_IN = r"""
import os, pickle, sys, time
env = os.environ
prefix, out, rank = env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"], env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"], env["RANK"]
path = prefix + rank + ".pipe"
os.mkfifo(path, 0o666)
fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
print("up", flush=True)
n = 0
while True:
    time.sleep(0.2)
    try:
        data = os.read(fd, 128)
    except BlockingIOError:
        continue
    if data:
        n += 1
        entries = [{"record_id": i} for i in range(2000)]
        doc = pickle.dumps({"version": "2.10", "pg_config": {}, "entries": entries, "n": n})
        with open(out + rank, "wb") as fh:
            fh.write(doc[: len(doc) // 2]); fh.flush(); time.sleep(0.3); fh.write(doc[len(doc) // 2:])
"""


def _rank_env(folder: str, rank: int = 0) -> dict[str, str]:
    return {**launch_variables("t", folder=folder), "RANK": str(rank), "WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "job-f", "MASTER_ADDR": "h", "PATH": os.environ.get("PATH", "")}


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder other users can reach (pytest's own tmp folders are 0700)."""
    d = Path("/tmp") / f"gpuhealth-zc-test-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o755)
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _inspect(pid: int) -> DiscoveredProcess:
    p = inspect_process(pid, [(0, "GPU-0")])
    assert p is not None
    return p


def test_a_rank_that_reads_its_pipe_writes_its_dump_and_keeps_running(shared_dir: Path) -> None:
    rank = subprocess.Popen([sys.executable, "-c", STAND_IN], env=_rank_env(str(shared_dir)), stdout=subprocess.PIPE)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"up\n"
        proc = _inspect(rank.pid)
        first = request_dump(proc, timeout_s=10, poll_s=0.05)
        assert first.rank == 0 and first.data[:1] == b"\x80" and first.path.endswith("gpuhealth-t-fr-0")
        import pickle

        assert pickle.loads(first.data)["n"] == 1  # the whole file, not its first half
        second = request_dump(proc, timeout_s=10, poll_s=0.05)
        assert pickle.loads(second.data)["n"] == 2  # a new dump, not the old file again
        assert rank.poll() is None
    finally:
        rank.kill()
        rank.wait()


def test_what_stops_a_dump_is_said(shared_dir: Path) -> None:
    bare = subprocess.Popen(["sleep", "60"], env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"})
    ready = subprocess.Popen(["sleep", "60"], env=_rank_env(str(shared_dir)))
    try:
        with pytest.raises(DumpError, match="TORCH_NCCL_DEBUG_INFO_PIPE_FILE") as no_vars:
            poke(_inspect(bare.pid))
        assert "gpuhealth env" in str(no_vars.value)
        with pytest.raises(DumpError, match="has no pipe"):
            poke(_inspect(ready.pid))  # the process group has not made its FIFO (yet)
        pipe = shared_dir / "gpuhealth-t-pipe-0.pipe"
        os.mkfifo(pipe)
        with pytest.raises(DumpError, match="nobody reads"):
            poke(_inspect(ready.pid))
        pipe.unlink()
        pipe.write_text("precious")
        with pytest.raises(DumpError, match="is not a FIFO"):
            poke(_inspect(ready.pid))
        assert pipe.read_text() == "precious"  # nothing was written into it
    finally:
        for p in (bare, ready):
            p.kill()
            p.wait()


def _as_user(uid: int, fn: Any) -> Any:
    """``fn()`` in a forked child that dropped to ``uid``; its answer (or error text) comes back as JSON."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                answer: Any = fn()
            except Exception as exc:
                answer = f"{type(exc).__name__}: {exc}"
            os.write(w, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_the_permission_that_is_missing_is_named(shared_dir: Path) -> None:
    if os.getuid() != 0:
        pytest.fail("this test plays an unprivileged agent from root; run the suite as root (scripts/test.sh does)")
    # a root rank: an unprivileged agent may not even look into its files
    root_rank = subprocess.Popen(["sleep", "60"], env=_rank_env(str(shared_dir)))
    # a rank of uid 65534 whose FIFO root made (mode 0644): the agent of uid 65534 may look, not write
    user_rank = subprocess.Popen(["sleep", "60"], env=_rank_env(str(shared_dir), rank=1), user=65534, group=65534,
                                 extra_groups=[])
    try:
        os.mkfifo(shared_dir / "gpuhealth-t-pipe-1.pipe", 0o644)
        as_root = _inspect(root_rank.pid)
        as_user = _inspect(user_rank.pid)
        said = _as_user(65534, lambda: poke(as_root))
        assert "cannot look into process" in said and "CAP_SYS_PTRACE" in said and "uid 0" in said
        said = _as_user(65534, lambda: poke(as_user))
        assert "could not write" in said and "mode 644" in said and "uid 0" in said
    finally:
        for p in (root_rank, user_rank):
            p.kill()
            p.wait()


def test_paths_are_resolved_inside_the_process_root(tmp_path: Path) -> None:
    # a fake /proc: process 100's root is a container's filesystem
    container = tmp_path / "proc" / "100" / "root"
    (container / "etc").mkdir(parents=True)
    (container / "etc" / "hostname").write_text("the container's own")
    (container / "data").mkdir()
    (container / "data" / "fr_0").symlink_to("/etc/hostname")  # absolute: means the container's /etc
    (tmp_path / "proc" / "100" / "cwd").symlink_to(container / "data")

    def read(path: str) -> str:
        fd = open_path(100, path, proc=tmp_path / "proc")
        try:
            with open(f"/proc/self/fd/{fd}") as fh:
                return fh.read()
        finally:
            os.close(fd)

    assert read("/data/fr_0") == "the container's own"
    assert read("/data/../../../../etc/hostname") == "the container's own"  # '..' stops at its root
    assert read("fr_0") == "the container's own"  # relative: from its working folder
    with pytest.raises(PathError, match=r"relative path with '\.\.'"):
        open_path(100, "../etc/hostname", proc=tmp_path / "proc")
    with pytest.raises(PathError, match="no such file"):
        open_path(100, "/nope", proc=tmp_path / "proc")


def test_root_never_writes_a_fifo_the_ranks_own_user_could_not(shared_dir: Path) -> None:
    """A confused deputy: the agent runs as root; a job's FIFO that another user owns (mode 0644) is one its rank
    could not write, so the agent does not either. The rank's own FIFO (0600) is written as before."""
    if os.getuid() != 0:
        pytest.fail("this test needs root (scripts/test.sh runs as root)")
    rank = subprocess.Popen(["sleep", "60"], env=_rank_env(str(shared_dir), rank=1), user=65534, group=65534,
                            extra_groups=[])
    fifo = shared_dir / "gpuhealth-t-pipe-1.pipe"
    try:
        os.mkfifo(fifo, 0o644)
        os.chown(fifo, 1234, 1234)  # another user's FIFO: uid 65534 may not write it
        said = str(_catch(lambda: poke(_inspect(rank.pid))))
        assert "belongs to uid 1234" in said and "could not write" in said
        os.chown(fifo, 65534, 65534)
        os.chmod(fifo, 0o600)  # the rank's own: allowed (here nobody reads it, which is what is said)
        said = str(_catch(lambda: poke(_inspect(rank.pid))))
        assert "nobody reads" in said
    finally:
        rank.kill()
        rank.wait()


def _catch(fn: Any) -> Exception | None:
    try:
        fn()
    except Exception as exc:
        return exc
    return None
