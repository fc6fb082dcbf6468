"""`gpuhealth triage` of Gloo jobs whose hang is in a send/recv the flight recorder does not record (issue 33,
item 8): when the dumps cannot tell the rank stuck outside any recorded op from the peer that went on without
its side, both are named (docs/triage.md); live stacks settle it. Real dumps (tests/fixtures/flightrec)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from commands import CLI, REPO

GLOO = REPO / "tests" / "fixtures" / "flightrec" / "gloo_4rank"


def triage(*args: str | Path) -> tuple[int, dict]:
    res = subprocess.run([*CLI, "triage", *map(str, args), "--json"], capture_output=True, text=True, timeout=120,
                         check=False)
    return res.returncode, json.loads(res.stdout)


def named(doc: dict) -> set[int]:
    return {f["evidence"]["rank"] for f in doc["findings"] if f["severity"] in ("warning", "critical")}


def test_recv_from_any_source_names_the_receiver_and_the_sender_that_went_on() -> None:
    # Rank 1 recv()s from any source every step; rank 0 skipped its send at step 3 and waits in all_reduce #4.
    code, doc = triage(GLOO / "recv_any_source" / "dumps")
    assert code == 2 and doc["verdict"] == "hang"
    assert named(doc) == {0, 1} and doc["roots"][0]["ranks"] == [0, 1], doc["summary"]
    assert doc["roots"][0]["decided_by"] == "undecided"
    assert "waiting_ranks" in doc["roots"][0] and 0 not in doc["roots"][0]["waiting_ranks"]
    sender = next(f for f in doc["findings"] if f["evidence"]["rank"] == 0)
    assert "without the send/recv it ran before each earlier one" in sender["message"]


def test_a_batched_pipeline_names_the_stage_that_left_out_its_send() -> None:
    # The same class: rank 2 waits in a batch_isend_irecv for rank 1, which posted only its irecv.
    code, doc = triage(GLOO / "pipeline_batch_hang" / "dumps")
    assert code == 2 and named(doc) == {1, 2}, doc["summary"]


def test_jobs_without_unrecorded_traffic_keep_one_culprit() -> None:
    for case in ("hang_sleep", "hang_skip"):
        want = json.loads((GLOO / case / "expected.json").read_text())["root_ranks"]
        code, doc = triage(GLOO / case / "dumps")
        assert code == 2 and named(doc) == set(want), doc["summary"]


def _stack(fn: str, file: str) -> dict:
    return {"hook": {"threads": [{"main": True, "frames": [
        {"file": "/job/train.py", "line": 10, "function": "main"}, {"file": file, "line": 20, "function": fn}]}]}}


def test_live_stacks_settle_which_one(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    shutil.copytree(GLOO / "recv_any_source" / "dumps", dumps)
    in_recv = {"0": _stack("all_reduce", "/site-packages/torch/distributed/distributed_c10d.py"),
               "1": _stack("recv", "/site-packages/torch/distributed/distributed_c10d.py")}
    (tmp_path / "recv.json").write_text(json.dumps(in_recv))
    code, doc = triage(dumps, "--stacks", tmp_path / "recv.json")
    assert code == 2 and named(doc) == {0} and doc["roots"][0]["decided_by"] == "stacks", doc["summary"]
    asleep = {**in_recv, "1": _stack("sleep", "/job/data.py")}
    (tmp_path / "sleep.json").write_text(json.dumps(asleep))
    code, doc = triage(dumps, "--stacks", tmp_path / "sleep.json")
    assert code == 2 and named(doc) == {1} and doc["roots"][0]["decided_by"] == "stacks", doc["summary"]
