"""Answers to the agent's requests, run on the hook's background thread.

- ``dump_fr``: the process's flight recorder as JSON (``_dump_nccl_trace_json`` for NCCL,
  ``_dump_fr_trace_json`` for Gloo and the rest; the wrong one returns an empty trace,
  docs/reference/FLIGHT_RECORDER.md), sent back inline over the socket in chunks — or, for an agent that only
  gives a ``dir``, written to ``<dir>/rank<N>.json``. Works while the main thread waits in a
  collective (torch releases the GIL there).
- ``python_stacks``: every thread's Python stack (``sys._current_frames``), as text and as frames.

The dump file holds the recorder's own bytes unchanged; the rank is in the file name (the JSON
dump carries no rank of its own).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity


class DumpError(RuntimeError):
    """The flight recorder could not be read or written."""


def dump_file_name(rank: int) -> str:
    return f"rank{rank}.json"


def _backend_name() -> str:
    torch: Any = sys.modules.get("torch")
    try:
        dist = torch.distributed if torch is not None else None
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except Exception:
        pass
    return ""


def flight_recorder_json() -> tuple[bytes, str]:
    """(JSON bytes of this process's flight recorder, name of the torch function that made it)."""
    try:
        c10d: Any = importlib.import_module("torch._C._distributed_c10d")
    except ImportError as exc:
        raise DumpError(f"torch.distributed is not available: {exc}") from exc
    names = ["_dump_fr_trace_json"]
    if "nccl" in _backend_name():
        names.insert(0, "_dump_nccl_trace_json")
    last_error: Exception | None = None
    for name in names:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data = fn(True, False)  # includeCollectives, onlyActive
        except Exception as exc:  # e.g. an NCCL build without the recorder
            last_error = exc
            continue
        return (data if isinstance(data, bytes) else str(data).encode()), name
    raise DumpError(f"no flight recorder dump function worked in this torch build (last error: {last_error!r})")


def dump_flight_recorder(out_dir: str, rank: int) -> dict[str, Any]:
    """Write the dump atomically (temp file + rename: a reader never sees half a file)."""
    data, source = flight_recorder_json()
    folder = Path(out_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".rank{rank}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            final = folder / dump_file_name(rank)
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise DumpError(f"cannot write the dump into {out_dir}: {exc.strerror or exc}") from exc
    return {"path": str(final.resolve()), "bytes": len(data), "source": source}


def python_stacks() -> dict[str, Any]:
    """All threads' stacks, innermost frame last (traceback order)."""
    names = {t.ident: t for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    threads: list[dict[str, Any]] = []
    text: list[str] = []
    for tid, frame in sorted(sys._current_frames().items()):
        thread = names.get(tid)
        name = thread.name if thread is not None else f"thread-{tid}"
        summary = traceback.extract_stack(frame)
        frames = [
            {"file": fs.filename, "line": fs.lineno, "function": fs.name, "code": fs.line or ""} for fs in summary
        ]
        threads.append({
            "thread_id": tid,
            "name": name,
            "daemon": bool(thread.daemon) if thread is not None else None,
            "main": tid == main_id,
            "frames": frames,
        })
        text.append(f"Thread {tid} ({name}){' [main]' if tid == main_id else ''}:\n")
        text.extend(traceback.format_list(summary))
    return {"pid": os.getpid(), "threads": threads, "text": "".join(text)}


def handle_request(message: Mapping[str, Any], identity: RankIdentity) -> list[dict[str, Any]]:
    """The messages that answer one agent request, in order (the reply last); none for messages
    that need no answer (unknown types, no request id)."""
    kind = message.get("type")
    if kind not in (protocol.DUMP_FR, protocol.STACKS):
        return []
    try:
        rid = protocol.request_id_of(message)
    except protocol.ProtocolError:
        return []  # nothing to answer to
    try:
        if kind == protocol.DUMP_FR:
            if message.get("inline") is True:
                data, source = flight_recorder_json()
                chunks = protocol.dump_chunks(rid, data)
                return [*chunks, protocol.inline_dump_reply(rid, data, len(chunks), source=source)]
            out_dir = message.get("dir")
            if not isinstance(out_dir, str) or not out_dir:
                return [protocol.reply_error(rid, "dump_fr needs 'inline' or a 'dir'")]
            return [protocol.reply_ok(rid, **dump_flight_recorder(out_dir, identity.rank))]
        return [protocol.reply_ok(rid, stacks=python_stacks())]
    except Exception as exc:  # an answer, never a crash of the training process
        return [protocol.reply_error(rid, f"{type(exc).__name__}: {exc}")]
