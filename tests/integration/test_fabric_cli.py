"""``gpuhealth diag fabric`` on this host (local Gloo ranks): too few nodes to judge is said, never healthy;
bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

from commands import run_cli


def test_three_ranks_are_not_judged_and_exit_unknown(tmp_path: Path) -> None:
    res = run_cli("diag", "fabric", "--ranks", "3", "--size-bytes", "65536", "--json", "--heatmap",
                  str(tmp_path / "m.png"), timeout=240)
    doc = json.loads(res.stdout)
    assert doc["status"] == "ok" and res.returncode == 3  # unknown, not healthy
    assert {f["code"] for f in doc["findings"]} == {"netprobe.unjudged"}
    assert len(doc["result"]["round_s"]) == 3  # odd N: N rounds, one rank idle in each
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_from_env_without_a_launcher_is_one_line() -> None:
    res = run_cli("diag", "fabric", "--from-env", env={"RANK": "", "WORLD_SIZE": ""})
    assert res.returncode == 3 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "--from-env needs RANK" in res.stderr
