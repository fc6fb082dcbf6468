"""Test helpers: a fake NCCL RAS server that replays transcripts, and replies written as NCCL writes them.

``FakeRas`` speaks the server side of the ``ncclras`` protocol (NCCL ``src/ras/client_support.cc``:
``CLIENT PROTOCOL`` → ``SERVER PROTOCOL 2``, ``TIMEOUT``/``SET FORMAT`` → ``OK`` or ``ERROR: …``,
``[VERBOSE ]STATUS`` → the report, then it closes) over a real TCP socket; each connection gets the next
reply of its list (the last one repeats). ``json_reply`` prints a report with NCCL 2.28.9's own format
strings (``jsonWriteHeader`` … ``jsonWriteFooter``), including its missing comma after a missing rank's
``nvml_dev``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

OPS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")


@dataclass
class Rank:
    rank: int
    pid: int
    gpu: int
    counts: dict[str, int]
    host: str = "10.0.0.1"


@dataclass
class Comm:
    hash: int
    ranks: list[Rank]
    missing: list[Rank] = field(default_factory=list)


def json_reply(comms: Sequence[Comm], version: str = "2.28.9+cuda13.0") -> str:
    out = ["{\n", f'  "nccl_version": "{version}",\n', '  "cuda_runtime_version": 13000,\n',
           '  "cuda_driver_version": 13000,\n', '  "timestamp": "2026-11-26 10:00:00",\n',
           f'  "communicators_count": {len(comms)},\n', '  "communicators": [\n']
    for ci, c in enumerate(comms):
        if ci:
            out.append(",\n")
        out += ["    {\n", f'      "hash": "0x{c.hash:x}",\n', '      "secondary_hash": "0x1:0x2",\n',
                f'      "size": {len(c.ranks) + len(c.missing)},\n', f'      "ranks_count": {len(c.ranks)},\n',
                f'      "missing_ranks_count": {len(c.missing)},\n', '      "ranks": [\n']
        for ri, r in enumerate(c.ranks):
            if ri:
                out.append(",\n")
            out += ["        {\n", f'          "rank": {r.rank},\n', f'          "host": "{r.host}",\n',
                    f'          "pid": {r.pid},\n', f'          "cuda_dev": {r.gpu},\n',
                    f'          "nvml_dev": {r.gpu},\n',
                    '          "status": {\n', '            "init_state": 0,\n', '            "async_error": 0,\n',
                    '            "finalize_called": false,\n', '            "destroy_flag": false,\n',
                    '            "abort_flag": false\n', "          },\n", '          "collective_counts": {\n']
            for oi, op in enumerate(OPS):
                out.append(f'            "{op}": {r.counts.get(op, 0)}' + ("," if oi < len(OPS) - 1 else "") + "\n")
            out += ["          }\n", "        }"]
        out += ["\n      ],\n", '      "missing_ranks": [\n']
        for mi, m in enumerate(c.missing):
            if mi:
                out.append(",\n")
            out += ["        {\n", f'          "rank": {m.rank},\n', f'          "host": "{m.host}",\n',
                    f'          "pid": {m.pid},\n', f'          "cuda_dev": {m.gpu},\n',
                    f'          "nvml_dev": {m.gpu}\n',  # NCCL 2.28.9 writes no comma here
                    '          "status": {\n', '            "unresponsive": true,\n',
                    '            "considered_dead": false\n', "          }\n", "        }"]
        out += ["\n      ]\n", "    }"]
    out += ["\n  ],\n", '  "ras": {\n', '    "collection_time_sec": 0.002,\n', '    "timeouts_count": 0\n', "  }\n",
            "}\n"]
    return "".join(out)


class FakeRas:
    """A RAS server on 127.0.0.1 replaying ``replies`` ({"json": text} / {"text": text} per connection)."""

    def __init__(self, replies: Sequence[dict[str, str]], *, json_supported: bool = True, greeting: str | None = None
                 ) -> None:
        self.replies = list(replies)
        self.json_supported = json_supported
        self.greeting = greeting  # a server that is not RAS answers something else
        self.commands: list[list[str]] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._served = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        reply = self.replies[min(self._served, len(self.replies) - 1)]
        self._served += 1
        fmt = "text"
        seen: list[str] = []
        self.commands.append(seen)
        buf = b""
        conn.settimeout(5)
        while True:
            while b"\n" not in buf:
                data = conn.recv(4096)
                if not data:
                    return
                buf += data
            line, _, buf = buf.partition(b"\n")
            cmd = line.decode().strip()
            seen.append(cmd)
            low = cmd.lower()
            if low.startswith("client protocol "):
                conn.sendall((self.greeting or "SERVER PROTOCOL 2\n").encode())
            elif low.startswith("timeout "):
                conn.sendall(b"OK\n")
            elif low == "set format json" and self.json_supported:
                fmt = "json"
                conn.sendall(b"OK\n")
            elif low in ("status", "verbose status"):
                conn.sendall(reply[fmt].encode())
                return  # the server closes after the report
            else:
                conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())

    def close(self) -> None:
        self._stop = True
        self.sock.close()
