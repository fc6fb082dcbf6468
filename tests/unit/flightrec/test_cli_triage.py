"""The `gpuhealth triage` command: output people act on, JSON shape, exit codes, clean errors."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from frbuild import FIXTURES, dump, training, write_json

from gpuhealth.cli.main import cli

NCCL = FIXTURES / "nccl_2gpu"


def _run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, ["triage", *args])
    return res.exit_code, res.stdout, res.stderr


def test_human_verdict_names_rank_collective_and_call_site() -> None:
    code, out, _ = _run(str(NCCL / "type_mismatch" / "dumps"))
    assert code == 2
    first = out.splitlines()[0]
    assert first.startswith("MISMATCH: culprit rank(s) 1")
    assert "collective: group 0 (default_pg), seq #11" in out
    assert "ranks 1: all_gather [[1024]]→[[2, 1024]]" in out
    assert "call site:" in out and "job.py" in out
    assert "no errors found" not in out.lower()


def test_json_shape_and_exit_code_profiles() -> None:
    code, out, _ = _run(str(NCCL / "hang_sleep" / "dumps"), "--json", "--exit-codes", "npd")
    assert code == 1
    doc = json.loads(out)
    assert {"verdict", "findings", "ranks_seen", "ranks_missing", "groups", "culprits", "problems"} <= set(doc)
    assert doc["verdict"] == "hang" and doc["culprits"] == [1]
    assert all("rank" in f["evidence"] for f in doc["findings"] if f["entity"]["kind"] == "rank")
    code, out, _ = _run(str(NCCL / "healthy" / "dumps"), "--exit-codes", "nagios")
    assert code == 0 and out.startswith("HEALTHY")


def test_steps_folder_and_straggler_exit_code() -> None:
    code, out, _ = _run(str(NCCL / "straggler" / "dumps"), "--steps", str(NCCL / "straggler"))
    assert code == 1 and out.startswith("STRAGGLER: culprit rank(s) 1")


def test_world_size_and_groups_options(tmp_path: Path) -> None:
    for r in range(3):
        write_json(tmp_path, f"rank{r}.json", dump(training(3)))
    code, out, _ = _run(str(tmp_path), "--world-size", "4", "--group", "7=0,1", "--json")
    doc = json.loads(out)
    assert code == 3 and doc["verdict"] == "incomplete" and doc["ranks_missing"] == [3]
    code, _, err = _run(str(tmp_path), "--group", "nonsense")
    assert code == 2 and "expected NAME=R,R" in err  # a usage error: click's 2 here, 64 through gpuhealth


def test_bad_input_is_one_clear_line_not_a_traceback(tmp_path: Path) -> None:
    code, _, err = _run(str(tmp_path / "nope"))  # usage errors: click's 2 here, 64 through the gpuhealth command
    assert code == 2 and "no such file or folder" in err and "Traceback" not in err
    (tmp_path / "rank0.json").write_bytes(b"\x00garbage")
    code, out, _ = _run(str(tmp_path))
    assert code == 3 and out.startswith("INCOMPLETE") and "rank0.json: not a flight-recorder dump" in out
    code, _, err = _run("--coordinator", "127.0.0.1:1")
    assert code == 2 and "live mode needs --job ID" in err
    code, _, err = _run("--job", "j1")  # no --coordinator and none in the config
    assert code == 2 and "live mode needs a coordinator" in err and "Traceback" not in err


def test_live_mode_reports_an_unreachable_coordinator_cleanly() -> None:
    code, _, err = _run("--job", "j1", "--coordinator", "127.0.0.1:1")
    assert code == 3
    assert err.startswith("gpuhealth triage: ") and "Traceback" not in err


def test_steps_only() -> None:
    code, out, _ = _run("--steps", str(NCCL / "straggler" / "steps_rank0.jsonl"),
                        "--steps", str(NCCL / "straggler" / "steps_rank1.jsonl"))
    assert code == 1 and "rank 1 is a straggler" in out and "since step 10" in out
    code, out, _ = _run("--steps", str(NCCL / "healthy"))
    assert code == 0 and out.startswith("HEALTHY: 2 rank(s)")


def test_live_mode_without_the_coordinator_extra_says_what_to_install() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['grpc'] = None\n"  # as if gpuhealth[coordinator] were not installed
            "from gpuhealth.cli.main import cli\n"
            "cli(['triage', '--job', 'j1', '--coordinator', '127.0.0.1:1'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    assert "install gpuhealth[coordinator]" in res.stderr and "Traceback" not in res.stderr


def test_absurd_rank_numbers_in_options_are_one_clear_line() -> None:
    # A world size or a group rank past MAX_RANKS would size per-rank tables: refused before any work.
    code, _, err = _run(str(NCCL / "healthy" / "dumps"), "--world-size", "1000000000000")
    assert code == 2 and "--world-size" in err and "Traceback" not in err
    code, _, err = _run(str(NCCL / "healthy" / "dumps"), "--group", "1=0,1,1000000000000")
    assert code == 2 and "ranks must be 0" in err and "Traceback" not in err
