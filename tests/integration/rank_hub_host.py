"""Run one ``RankHub`` in its own process, for tests and benchmarks that measure what an attack on the
rank socket costs the agent (its memory is this process's memory).

    python rank_hub_host.py SOCKET [JSON_KWARGS]

Prints ``ready`` once listening, then answers each line on stdin: ``stats`` → one JSON line with the
hub's counters, the connected ranks and this process's ``VmRSS``/``VmHWM`` (KiB) and thread count;
``quit`` (or end of input) → stops. Works with a hub from before the hardening too (for the
before/after benchmark): unknown keyword arguments are dropped.
"""

from __future__ import annotations

import inspect
import json
import sys
import threading
from pathlib import Path
from typing import Any


def proc_status() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    out["threads"] = threading.active_count()
    return out


def main() -> None:
    from gpuhealth.agent.ranks import RankHub

    kwargs: dict[str, Any] = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    known = inspect.signature(RankHub).parameters
    hub = RankHub(sys.argv[1], mode=0o666, **{k: v for k, v in kwargs.items() if k in known})
    steps: list[int] = [0]
    hub.add_listener(on_steps=lambda ident, records: steps.__setitem__(0, steps[0] + len(records)))
    hub.start(None)
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "stats":
            ranks = [{"job_id": i.job_id, "rank": i.rank, "pid": i.pid} for i in hub.ranks()]
            print(json.dumps({**hub.stats(), **proc_status(), "ranks_list": ranks, "step_records_heard": steps[0]}),
                  flush=True)
        elif command == "quit":
            break
    hub.stop()


if __name__ == "__main__":
    main()
