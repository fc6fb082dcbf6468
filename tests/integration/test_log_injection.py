"""Issue 30, item 10: a tenant's string cannot forge a line of the coordinator's text log.

Job ids come from training ranks (any uid on a node). Before, a job id holding U+2028, U+0085 (NEL),
``\\x9b`` (CSI) or DEL was written raw: a reader that splits lines (Python's ``splitlines``, many log
shippers, a terminal) saw a second record that the coordinator never wrote — here a forged
``NVRM Xid 79 … (action drain)`` line. Through the real ``gpuhealth coordinator``: every line of its log
starts with a timestamp (a record) or is indented (a traceback's continuation), and the job id's
characters arrive escaped."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from commands import Coordinator, until, write_config
from simagent import SimAgent, step_batch_message

FORGED = "2026-12-08T00:00:00Z error   NVRM Xid 79 GPU has fallen off the bus (action drain)"
# What the wire lets through (it refuses C0 controls in names): line and paragraph separators, NEL and CSI
# (C1), DEL, a bidi override.
SEPARATORS = ["\u2028", "\u2029", "\x85", "\x9b", "\x7f", "\u202e"]
RECORD = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")


def test_hostile_job_id_cannot_forge_a_log_line(tmp_path: Path) -> None:
    jobs = [f"job{i}{sep}{FORGED}" for i, sep in enumerate(SEPARATORS)]
    cfg = write_config(tmp_path / "coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": str(tmp_path / "coord.db"),
        "hang_floor_s": 1.0, "hang_k": 1.0, "tick_s": 0.1, "evidence_timeout_s": 1.0}})
    coord = Coordinator(tmp_path, cfg)
    try:
        address = coord.address()

        async def feed() -> None:
            agent = SimAgent(address, "n1", gpus=1)
            await agent.register()
            await agent.connect()
            now, seq = time.time(), 0
            for step in range(5):
                for job in jobs:
                    seq += 1
                    await agent.send(step_batch_message(seq, job, [0, 1], step, wall_s=0.05, start_time=now + step))
            await agent.wait_acked(seq)
            # Then silence: the coordinator's hang check logs each job id (no rank progressed).
            until(lambda: coord.log().count("no rank progressed") >= len(jobs), 30, "the hang check to log the jobs")
            await agent.channel.close() if agent.channel else None

        asyncio.run(feed())
        text = coord.log()
        lines = text.splitlines()  # splits on every separator a reader might honour
        for line in lines:
            assert RECORD.match(line) or line.startswith("    "), f"a line the coordinator did not start: {line!r}"
        assert not any(line.startswith("2026-12-08T00:00:00Z") for line in lines), "a forged record"
        hangs = "\n".join(line for line in lines if "no rank progressed" in line)
        for escaped in ("\\u2028", "\\u2029", "\\x85", "\\x9b", "\\x7f", "\\u202e"):
            assert escaped in hangs, (escaped, hangs)
    finally:
        coord.stop()
