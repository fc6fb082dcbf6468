"""A stand-in ``scontrol`` for the Slurm hook tests: ``show node`` and ``update … state=drain|resume`` against
a JSON file (``STUB_STATE``), every call logged to ``STUB_LOG`` when that is set."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCONTROL = """#!{python}
import json, os, sys
path = os.environ["STUB_STATE"]
state = json.load(open(path))
args = sys.argv[1:]
if os.environ.get("STUB_LOG"):
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(json.dumps(args) + "\\n")
if args[:2] == ["show", "node"]:
    print(f"NodeName={{args[2]}} Arch=x86_64\\n   State={{state['state']}} ThreadsPerCore=2")
    if state.get("reason"):
        print(f"   Reason={{state['reason']}} [root@2026-11-26T01:00:00]")
elif args[0] == "update":
    kv = dict(a.split("=", 1) for a in args[1:])
    base = state["state"].split("+")[0]
    state = {{"state": base + "+DRAIN", "reason": kv["reason"]}} if kv["state"] == "drain" else {{"state": base}}
    json.dump(state, open(path, "w"))
"""


def install_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """``tmp_path/bin/scontrol`` and an IDLE node in ``tmp_path/state.json``: (the folder for PATH, the state)."""
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    (stub_dir / "scontrol").write_text(SCONTROL.format(python=sys.executable))
    (stub_dir / "scontrol").chmod(0o755)
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"state": "IDLE"}))
    return stub_dir, state
