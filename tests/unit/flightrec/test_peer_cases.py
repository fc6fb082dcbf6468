"""PyTorch's own flight-recorder analyser cases (``test/distributed/flight_recorder/test_fr_analysis.py``,
``FlightRecorderE2ETest.testBuildDB``), rebuilt as dump files in the shape that suite writes: version 2.8,
every ``collective_seq_id`` the string "0", dtypes as a bare string, ``time_created_ns`` 0, a one-rank
subgroup per rank under the same name, slow-path coalesced groups closed by a ``coalesced`` marker. Its
answers are ours to meet: matched cases are healthy, the uneven ``_broadcast_oop`` is a mismatch — a tie
between two ranks, so both are named — and a coalesced call that recorded nothing on one rank is not a
fault. Written here from the suite's description; no code of it is used."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.flightrec.verdict import triage


def _entry(record_id: int, op: str, sizes: list[list[int]], group: tuple[str, str] = ("0", "default")
           ) -> dict[str, Any]:
    return {"record_id": record_id, "profiling_name": f"nccl:{op}", "state": "completed",
            "process_group": list(group), "input_sizes": sizes, "output_sizes": sizes, "input_dtypes": "float32",
            "output_dtypes": "float32", "collective_seq_id": "0", "p2p_seq_id": "0", "time_created_ns": 0,
            "frames": [], "is_p2p": False}


def _write(tmp_path: Path, per_rank: dict[int, list[tuple[str, list[list[int]]]]]) -> Path:
    """Ops named ``sub:<op>`` run in the rank's own one-rank subgroup "1"."""
    for rank, ops in per_rank.items():
        entries = [_entry(i, op.removeprefix("sub:"), sizes,
                          ("1", "sub_pg") if op.startswith("sub:") else ("0", "default"))
                   for i, (op, sizes) in enumerate(ops)]
        doc = {"version": "2.8", "rank": rank, "entries": entries,
               "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
                             "1": {"name": "1", "desc": "sub_pg", "ranks": f"[{rank}]"}}}
        (tmp_path / f"dump_file_rank_{rank}").write_text(json.dumps(doc))
    return tmp_path


BOTH = (0, 1)
A4, A5 = [[4, 4]], [[5, 5]]


@pytest.mark.parametrize("ops", [
    [("all_reduce", A4), ("sub:all_reduce", A5)],  # matched all_reduce, and one in each rank's own subgroup
    [("allreduce_coalesced", A4)],
    [("broadcast", A4), ("broadcast", A4), ("coalesced", [[]])],  # slow-path coalesced broadcasts
    [("_reduce_oop", A4), ("_reduce_oop", A4), ("REDUCE_SCATTER_coalesced", [[]])],  # uneven reduce_scatter
], ids=["all_reduce", "allreduce_coalesced", "broadcast_coalesced", "reduce_scatter_coalesced"])
def test_matched_cases_are_healthy(tmp_path: Path, ops: list[tuple[str, list[list[int]]]]) -> None:
    rep = triage(_write(tmp_path, {r: ops for r in BOTH}))
    assert rep.verdict.value == "healthy", rep.summary
    assert rep.culprits == []


def test_an_uneven_broadcast_inside_a_coalesced_all_gather_is_a_tied_mismatch(tmp_path: Path) -> None:
    tail = ("ALLGATHER_coalesced", [[]])
    rep = triage(_write(tmp_path, {0: [("_broadcast_oop", A4), ("_broadcast_oop", A5), tail],
                                   1: [("_broadcast_oop", A4), ("_broadcast_oop", A4), tail]}))
    assert rep.verdict.value == "mismatch", rep.summary
    assert rep.culprits == [0, 1]  # two ranks, two answers: nothing tells which side is wrong
    assert rep.headline is not None and rep.headline.code == "collective.size_mismatch"


def test_a_coalesced_call_that_recorded_nothing_on_one_rank_is_not_a_fault(tmp_path: Path) -> None:
    rep = triage(_write(tmp_path, {0: [("all_reduce", A4)],
                                   1: [("all_reduce", A4), ("_reduce_oop", A4), ("_reduce_oop", A4),
                                       ("REDUCE_SCATTER_coalesced", [[]])]}))
    assert rep.verdict.value == "healthy", rep.summary


def test_an_empty_pickled_dump_without_a_rank_field_is_read_but_proves_nothing(tmp_path: Path) -> None:
    # No entries and no progress: the flight recorder was off (its buffer size unset or 0), and "healthy"
    # would clear a job nobody looked at.
    (tmp_path / "dump0").write_bytes(pickle.dumps({"entries": [], "version": "2.8", "pg_config": {}}))
    rep = triage(tmp_path)
    assert rep.ranks_seen == [0] and rep.culprits == []
    assert rep.verdict.value == "incomplete", rep.summary
    assert any("TORCH_FR_BUFFER_SIZE" in n for n in rep.notes)
