"""A rank that skips a world collective in a TP × DP job, told from its TP peer by the other TP groups.

In a TP pair the only other member cannot outvote the candidate: rank 1 never posted all_reduce #2 of the
world group and went on to its TP group's #3, while rank 0 waits in world #2 — or did rank 0 skip TP #3?
The other TP groups run the same program: ranks 2 and 3 posted world #2 before their TP #3, so rank 1 is
the one that went past (measured on the synthetic corpus: benchmarks/triage_quality.py, class skip).
"""

from __future__ import annotations

from pathlib import Path

from frbuild import dump, entry, write_json

from gpuhealth.flightrec.verdict import triage


def _ops(rank: int, plan: list[tuple[str, int, bool]]) -> list[dict[str, object]]:
    out = []
    for rid, (group, seq, done) in enumerate(plan):
        out.append(entry(seq, record_id=rid, group=group, desc="undefined" if group != "0" else "default_pg",
                         pg_id=0 if group == "0" else 1, backend="gloo", state="scheduled", retired=done,
                         created_ns=1_700_000_000_000_000_000 + rid * 1_000_000))
    return out


def test_a_skipped_world_collective_is_blamed_on_the_rank_that_went_past_it(tmp_path: Path) -> None:
    tp = "1"  # ranks 0, 1
    tp2 = "2"  # ranks 2, 3
    normal = [(tp, 1, True), ("0", 1, True), (tp, 2, True), ("0", 2, False)]
    plans = {
        0: normal,
        1: [(tp, 1, True), ("0", 1, True), (tp, 2, True), (tp, 3, False)],  # no world #2: on to TP #3
        2: [(tp2, g_seq, done) if g == tp else (g, g_seq, done) for g, g_seq, done in normal],
        3: [(tp2, g_seq, done) if g == tp else (g, g_seq, done) for g, g_seq, done in normal],
    }
    gloo_config = {"": {"name": "", "desc": "", "ranks": "[]"}}
    for rank, plan in plans.items():
        write_json(tmp_path, f"rank{rank}.json", dump(_ops(rank, plan), pg_config=gloo_config, comm=""))
    rep = triage(tmp_path, job={"world_size": 4})
    assert rep.verdict.value == "hang", rep.summary
    assert rep.roots[0].ranks == (1,), rep.summary
    assert rep.headline is not None and rep.headline.evidence["rank"] == 1, rep.summary
