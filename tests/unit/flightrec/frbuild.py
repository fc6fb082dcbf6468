"""Builders for flight-recorder dumps in the real format (version 2.10, as torch 2.11–2.14 write it)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "flightrec"


def entry(seq: int, *, record_id: int | None = None, group: str = "0", desc: str = "default_pg", pg_id: int = 0,
          op: str = "all_reduce", backend: str = "nccl", sizes: Iterable[Iterable[int]] = ((1024,),),
          out_sizes: Iterable[Iterable[int]] | None = None, dtype: str = "Float", state: str = "completed",
          retired: bool | None = None, duration_ms: float | None = None, created_ns: int | None = None,
          frames: list[dict[str, Any]] | None = None, json_style: bool = True, p2p: str = "") -> dict[str, Any]:
    sizes_l = [list(s) for s in sizes]
    out_l = [list(s) for s in out_sizes] if out_sizes is not None else sizes_l
    started = state in ("started", "completed")
    t0 = created_ns if created_ns is not None else 1_700_000_000_000_000_000 + seq * 1_000_000
    zero: Any = 0 if json_style else None
    e: dict[str, Any] = {
        "collective_seq_id": 0 if p2p else seq, "input_dtypes": [dtype] * len(sizes_l), "input_sizes": sizes_l,
        "is_p2p": bool(p2p), "op_id": seq, "output_dtypes": [dtype] * len(out_l), "output_sizes": out_l,
        "p2p_seq_id": seq if p2p else 0, "pg_id": pg_id,
        "process_group": [group, desc] if json_style else (group, desc),
        "profiling_name": f"{backend}:{op}" + (f" {p2p}" if p2p else ""),
        "record_id": seq if record_id is None else record_id,
        "retired": state == "completed" if retired is None else retired, "state": state,
        "thread_id": "1", "thread_name": "python", "time_created_ns": t0,
        "time_discovered_completed_ns": t0 + 10 if state == "completed" else zero,
        "time_discovered_started_ns": t0 + 5 if started else zero, "timeout_ms": 600000,
    }
    if duration_ms is not None:
        e["duration_ms"] = duration_ms
    if frames is not None:
        e["frames"] = frames
    return e


def dump(entries: list[dict[str, Any]], *, status: dict[str, tuple[int, int, int]] | None = None,
         pg_config: dict[str, Any] | None = None, version: str = "2.10", json_style: bool = True,
         comm: str = "2.28.9", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    if status is None:
        status = {}
        for e in entries:
            pid = str(e["pg_id"])
            enq, start, done = status.get(pid, (0, 0, 0))
            s = e["collective_seq_id"]
            status[pid] = (max(enq, s), max(start, s if e["state"] in ("started", "completed") else 0),
                           max(done, s if e["state"] == "completed" else 0))
    conv = str if json_style else int
    d: dict[str, Any] = {
        "version": version, "comm_lib_version": comm,
        "pg_config": pg_config if pg_config is not None else {"0": {"name": "0", "desc": "default_pg", "ranks": "[]"}},
        "pg_status": {k: {"last_enqueued_collective": conv(a), "last_started_collective": conv(b),
                          "last_completed_collective": conv(c)} for k, (a, b, c) in status.items()},
        "entries": entries,
    }
    if json_style:
        d["nccl_comm_state"] = {}
    if extra:
        d.update(extra)
    return d


def write_json(folder: Path, name: str, d: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    # torch writes compact JSON with sorted keys (nlohmann/std::map): the tail reader relies on it.
    p.write_text(json.dumps(d, separators=(",", ":"), sort_keys=True))
    return p


def write_pickle(folder: Path, name: str, d: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_bytes(pickle.dumps(d))
    return p


def training(n_steps: int, *, state_last: str = "completed", **kw: Any) -> list[dict[str, Any]]:
    """n_steps all_reduces in the default group; the last one in ``state_last``."""
    return [entry(s, state=state_last if s == n_steps else "completed", **kw) for s in range(1, n_steps + 1)]


