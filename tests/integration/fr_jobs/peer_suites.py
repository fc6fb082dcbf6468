"""The peer suites' cases, rebuilt as triage cases with a known answer (issue 25, item 4).

Two suites judge tools like ours, and each of their cases is a class of real fault (or of a record that is
no fault at all). They are rebuilt here as dump folders and step records in the shapes those suites produce,
laid out as tests/integration/fr_jobs/corpus.py reads them (``<case>/dumps/``, ``<case>/expected.json``,
``<case>/steps_rank*.jsonl``), so ``benchmarks/triage_quality.py --peer-suites`` and
``tests/unit/flightrec/test_peer_suites.py`` judge them by the same rules as every other corpus. Written from
the suites' descriptions; no code of them is used.

* **PyTorch's flight-recorder analyser tests** (``test/distributed/flight_recorder/test_fr_analysis.py``:
  ``test_match_one_event``, ``test_all_events``, ``test_collective_variants_are_distinct_types``,
  ``test_all_gather_base_numel_is_checked``, ``test_all_to_all_single_uneven_splits_are_not_a_mismatch``,
  ``test_recv_any_source_has_no_peer``, ``FlightRecorderOpBackendTest``, ``FlightRecorderHookShapeTest``,
  ``testBuildDB``; ``test_loader.py``). Their events compare two ranks: each pair becomes a 2-rank job whose
  rank 0 recorded one event and rank 1 the other, in that suite's dump shape — version 2.8, sequence ids as
  strings, dtypes as one bare string, ``time_created_ns`` 0, ``is_p2p`` false even for send/recv (the suite's
  entry builder sets it so), a one-rank subgroup per rank. Their "matched" is our healthy (nothing named);
  their "mismatch" is our mismatch naming the rank whose record is wrong — both ranks when nothing tells them
  apart.
* **NVIDIA's straggler tests** (nvidia-resiliency-ext ``tests/straggler/unit/test_sections.py``,
  ``test_relative_gpu_scores.py``, ``test_individual_gpu_scores.py``, ``tests/straggler/func/ddp_test.py``):
  per-rank timings become step records (``steps_rank<R>.jsonl``; a record with a ``section`` is one code
  section of that step). Their "straggler GPU/section" is our ``rank.straggler`` naming that rank (and that
  section).

Left out, with the reason: FlightMatchInfoTest (a message format), the missing-colon and unknown-prefix
refusals (an API's exception, not a verdict: our loader reads the rest of the dump), test_loader's gc cases
and its missing-folder case (a CLI error, tested in test_peer_suites.py), NVIDIA's CUPTI, name-mapper,
interval-tracker, wrap-callables and reporting-option tests (plumbing of their library), its NaN-score cases
(ranks without common kernels: a reporting artefact, no fault) and its one-rank individual-score sequence
(scores against a rank's own history; a single-rank job has nobody to wait for it).

    python tests/integration/fr_jobs/peer_suites.py OUT_DIR     # write every case (a corpus anyone can re-run)
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MADE_BY = "python tests/integration/fr_jobs/peer_suites.py OUT_DIR"
TORCH_SUITE = "pytorch test_fr_analysis.py"
NVIDIA_SUITE = "nvidia-resiliency-ext tests/straggler"
# The suite's own two-rank template: world group "0" of ranks 0 and 1, and a one-rank "sub_pg" per rank.
WORLD2 = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}


@dataclass
class PeerCase:
    name: str
    suite: str
    source: str  # the suite's test (and sub-case) it rebuilds
    expected: dict[str, Any]
    dumps: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> dump document (JSON)
    steps: list[dict[str, Any]] = field(default_factory=list)  # step records (one JSONL per rank)


# ------------------------------------------------------------------------------------ the suite's shapes


def event(name: str, in_sizes: list[list[int]], out_sizes: list[list[int]], *, state: str = "scheduled",
          seq: int = 1, p2p_seq: int = 0, record_id: int = 0, group: tuple[str, str] = ("0", "default"),
          in_dtypes: Any = "float32", out_dtypes: Any = "float32", backend: str = "nccl") -> dict[str, Any]:
    """One entry as PyTorch's analyser tests write it (their event plus the E2E test's record id)."""
    return {"profiling_name": f"{backend}:{name}", "state": state, "process_group": list(group),
            "input_sizes": in_sizes, "output_sizes": out_sizes, "input_dtypes": in_dtypes,
            "output_dtypes": out_dtypes, "collective_seq_id": str(seq), "p2p_seq_id": str(p2p_seq),
            "time_created_ns": 0, "frames": [], "record_id": record_id, "is_p2p": False}


def suite_dump(rank: int, entries: list[dict[str, Any]], pg_config: dict[str, Any] | None = None) -> dict[str, Any]:
    config = dict(pg_config if pg_config is not None else WORLD2)
    config.setdefault("1", {"name": "1", "desc": "sub_pg", "ranks": f"[{rank}]"})
    return {"version": "2.8", "rank": rank, "entries": [dict(e, record_id=i) for i, e in enumerate(entries)],
            "pg_config": config}


def pair(a: dict[str, Any], b: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Rank 0 recorded ``a``, rank 1 recorded ``b`` (the suite's match_one_event(a, b))."""
    return {0: suite_dump(0, [a]), 1: suite_dump(1, [b])}


def both(entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Both ranks recorded the same thing (the suite's symmetric checks)."""
    return {0: suite_dump(0, [dict(e) for e in entries]), 1: suite_dump(1, [dict(e) for e in entries])}


def healthy(why: str) -> dict[str, Any]:
    return {"verdict": "healthy", "root_ranks": [], "why": why, "made_by": MADE_BY, "backend": "nccl"}


def fault(verdict: str, roots: Sequence[int], why: str, *, code: str = "", acceptable: Sequence[int] = (),
          section: str = "") -> dict[str, Any]:
    doc: dict[str, Any] = {"verdict": verdict, "root_ranks": sorted(roots), "why": why, "made_by": MADE_BY,
                           "backend": "nccl"}
    if code:
        doc["root_code"] = code
    if acceptable:
        doc["also_acceptable"] = sorted(acceptable)
        doc["acceptable_why"] = "the records cannot tell these ranks apart"
    if section:
        doc["section"] = section
    return doc


# --------------------------------------------------------------------------------- PyTorch: the analyser


# The suite's COLLECTIVES (torch.distributed.flight_recorder.components.types), each run once on both ranks.
COLLECTIVES = ("ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced", "_all_gather_base", "_broadcast_oop",
               "_reduce_oop", "_reduce_scatter_base", "all_gather", "all_gather_into_tensor_coalesced",
               "all_gather_single", "all_gather_v", "all_reduce", "all_reduce_barrier", "all_to_all",
               "all_to_all_single", "all_to_all_v_single", "allreduce_coalesced", "barrier", "broadcast", "gather",
               "new_window", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
               "reduce_scatter_v", "scatter", "split")


def torch_cases() -> list[PeerCase]:
    cases: list[PeerCase] = []

    def add(name: str, source: str, expected: dict[str, Any], dumps: dict[int, dict[str, Any]]) -> None:
        cases.append(PeerCase(name, TORCH_SUITE, source, expected, dumps))

    a44 = [[4, 4]]
    e1 = event("all_reduce", a44, a44)
    # test_match_one_event
    add("match/all_reduce_matched", "test_match_one_event e1/e1", healthy("the same all_reduce on both ranks"),
        pair(e1, e1))
    add("match/type_all_reduce_vs_all_gather", "test_match_one_event e1/e2",
        fault("mismatch", [1], "rank 1 calls all_gather where rank 0 calls all_reduce; its all_gather output "
              "[[4, 4]] cannot hold two ranks' [[4, 4]]", acceptable=[0]),
        pair(e1, event("all_gather", a44, a44)))
    add("match/all_to_all_undecided", "test_match_one_event e3/e4", healthy("an all_to_all whose totals add up"),
        pair(event("all_to_all", a44, a44), event("all_to_all", a44, a44)))
    add("match/all_reduce_input_differs", "test_match_one_event e1/e5",
        fault("mismatch", [1], "rank 1's all_reduce reads [[5, 4]] but writes [[4, 4]]"),
        pair(e1, event("all_reduce", [[5, 4]], a44, p2p_seq=1)))
    add("match/all_reduce_output_differs", "test_match_one_event e1/e6",
        fault("mismatch", [1], "rank 1's all_reduce reads [[4, 4]] but writes [[5, 4]]"),
        pair(e1, event("all_reduce", a44, [[5, 4]], p2p_seq=2)))
    e7 = event("all_reduce", a44, [[5, 4]], seq=2)
    add("match/all_reduce_inconsistent_on_both", "test_match_one_event e7/e7",
        fault("mismatch", [0, 1], "both ranks' all_reduce reads [[4, 4]] but writes [[5, 4]]"), pair(e7, e7))
    e9 = event("all_reduce", a44, a44, state="completed")
    add("match/state_scheduled_vs_completed", "test_match_one_event e1/e9",
        healthy("the same all_reduce, completed on rank 1 and still scheduled in rank 0's record (a dump of a "
                "running job: NCCL cannot complete it on one rank alone)"), pair(e1, e9))
    add("match/output_dtype_float16", "test_match_one_event e10/e9",
        fault("mismatch", [0], "rank 0's all_reduce reads float32 but writes float16"),
        pair(event("all_reduce", a44, a44, state="completed", out_dtypes="float16"), e9))
    e11 = event("gather", a44, [[4, 4], [4, 4]], state="completed")
    add("match/gather_nonroot_empty_output", "test_match_one_event e11/e12",
        healthy("a gather: the root receives two chunks, the other rank records an empty output list"),
        pair(e11, event("gather", a44, [[]], state="completed", out_dtypes="")))
    add("match/gather_nonroot_output_as_input", "test_match_one_event e11/e13",
        healthy("a gather: the non-root records its own chunk as output, with no dtype"),
        pair(e11, event("gather", a44, a44, state="completed", out_dtypes="")))

    # test_all_events: every collective the suite knows, the same on both ranks.
    for name in COLLECTIVES:
        ins, outs = a44, a44
        if name in ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"):
            outs = [[ins[0][0] * 2]]
        if name in ("all_gather", "_all_gather_base", "all_gather_into_tensor_coalesced"):
            outs = [[math.prod(ins[0]) * 2]]
        add(f"all_events/{name}", f"test_all_events {name}", healthy(f"the same {name} on both ranks"),
            pair(event(name, ins, outs), event(name, ins, outs)))

    # test_collective_variants_are_distinct_types: one rank calls one variant, the other another.
    for a, b in (("all_gather", "_all_gather_base"), ("all_reduce", "allreduce_coalesced"),
                 ("reduce_scatter", "_reduce_scatter_base"), ("all_to_all", "all_to_all_single")):
        add(f"variants/{a}_vs_{b}", f"test_collective_variants_are_distinct_types {a}/{b}",
            fault("mismatch", [0, 1], f"rank 0 calls {a}, rank 1 {b}: two ranks, two answers"),
            pair(event(a, [[8]], [[8]]), event(b, [[8]], [[8]])))

    # test_all_gather_base_numel_is_checked
    add("numel/all_gather_base_good", "test_all_gather_base_numel_is_checked good",
        healthy("a flattened all_gather of [8] into [16] over two ranks"),
        both([event("_all_gather_base", [[8]], [[16]])]))
    add("numel/all_gather_base_bad", "test_all_gather_base_numel_is_checked bad",
        fault("mismatch", [0, 1], "both ranks gather [8] from two ranks into [24]"),
        both([event("_all_gather_base", [[8]], [[24]])]))
    add("numel/all_to_all_single_uneven", "test_all_to_all_single_uneven_splits_are_not_a_mismatch",
        healthy("uneven all_to_all_single splits: 8+12 in, 12+8 out"),
        pair(event("all_to_all_single", [[8]], [[12]]), event("all_to_all_single", [[12]], [[8]])))

    # test_recv_any_source_has_no_peer: a two-rank subgroup of global ranks 2 and 5 in a world of 6.
    add("p2p/recv_any_source_matches_send", "test_recv_any_source_has_no_peer send/recv",
        healthy("rank 2 sends to group rank 1 (global 5), which receives from any source"),
        p2p_job([("send 0->1", [[8]])], [("recv 1<-?", [[8]])]))
    add("p2p/short_send_to_any_source", "test_recv_any_source_has_no_peer short",
        fault("mismatch", [2, 5], "rank 2 sends [4] where rank 5 receives [8]"),
        p2p_job([("send 0->1", [[4]])], [("recv 1<-?", [[8]])]))
    add("p2p/send_without_recv", "test_recv_any_source_has_no_peer (a send nobody receives)",
        fault("hang", [5], "rank 2 sends to rank 5, which never posted the receive", code="collective.p2p_unmatched"),
        p2p_job([("send 0->1", [[8]])], []))
    add("p2p/second_send_without_recv", "test_recv_any_source_has_no_peer (a second send nobody receives)",
        fault("hang", [5], "rank 2 sends to rank 5 twice; rank 5 posted one receive: the first pair is in flight, "
              "the second send can never complete", code="collective.p2p_unmatched"),
        p2p_job([("send 0->1", [[8]]), ("send 0->1", [[8]])], [("recv 1<-0", [[8]])]))

    # FlightRecorderOpBackendTest: the same completed all_reduce under each prefix a producer writes.
    for backend in ("nccl", "ncclx", "gloo", "xccl", "nccl2", "c10d", "unknown_backend", "weird:backend"):
        ev = event("all_reduce", a44, a44, state="completed", backend=backend)
        add(f"backend/{backend.replace(':', '_')}", f"FlightRecorderOpBackendTest {backend}",
            healthy(f"a matched all_reduce recorded as {backend}:all_reduce"), pair(ev, ev))
    add("backend/nccl2_p2p", "FlightRecorderOpBackendTest test_nccl2_backend_p2p",
        healthy("a matched send/recv pair recorded as nccl2"),
        pair(event("send 0->1", [[4, 4]], [[4, 4]], state="completed", seq=0, p2p_seq=1, backend="nccl2"),
             event("recv 1<-0", [[4, 4]], [[4, 4]], state="completed", seq=0, p2p_seq=1, backend="nccl2")))

    # FlightRecorderHookShapeTest: c10d's FlightRecorderHook shapes (nccl2, dtypes as lists, list-form buffers).
    def hook(name: str, ins: list[list[int]], outs: list[list[int]], seq: int) -> dict[str, Any]:
        return event(name, ins, outs, seq=seq, in_dtypes=["Float"] * len(ins), out_dtypes=["Float"] * len(outs),
                     backend="nccl2")

    shapes = (("all_reduce", [[8]], [[8]]), ("allreduce_coalesced", [[8], [4]], [[8], [4]]),
              ("reduce", [[8]], [[8]]), ("all_gather", [[8]], [[8], [8]]), ("reduce_scatter", [[8], [8]], [[8]]))
    for name, ins, outs in shapes:
        add(f"hook/{name}", f"test_matcher_accepts_hook_shapes {name}", healthy(f"a hook-shaped {name}"),
            both([hook(name, ins, outs, 1)]))
    add("hook/shaped_run", "test_hook_shaped_run_has_no_mismatch", healthy("five hook-shaped collectives in a row"),
        both([hook(n, i, o, k + 1) for k, (n, i, o) in enumerate(shapes)]))
    add("hook/list_all_gather_wrong_count", "test_list_form_all_gather_mismatch_is_caught",
        fault("mismatch", [0, 1], "a list-form all_gather of [8] into three buffers over two ranks"),
        both([hook("all_gather", [[8]], [[8], [8], [8]], 1)]))
    add("hook/list_reduce_scatter_wrong_count", "test_list_form_reduce_scatter_mismatch_is_caught",
        fault("mismatch", [0, 1], "a list-form reduce_scatter of three buffers into [8] over two ranks"),
        both([hook("reduce_scatter", [[8], [8], [8]], [[8]], 1)]))
    add("hook/flattened_all_gather_wrong", "test_flattened_form_mismatch_is_still_caught all_gather",
        fault("mismatch", [0, 1], "a flattened all_gather of [8] into [17] over two ranks"),
        both([hook("all_gather", [[8]], [[17]], 1)]))
    add("hook/flattened_reduce_scatter_wrong", "test_flattened_form_mismatch_is_still_caught reduce_scatter",
        fault("mismatch", [0, 1], "a flattened reduce_scatter of [17] into [8] over two ranks"),
        both([hook("reduce_scatter", [[17]], [[8]], 1)]))

    cases += build_db_cases()
    return cases


def p2p_job(sends: list[tuple[str, list[list[int]]]], recvs: list[tuple[str, list[list[int]]]]) -> dict[int, Any]:
    """A world of 6 that all_reduces once; then group "2" (global ranks 2 and 5) exchanges p2p ops: ``sends``
    on rank 2 (group rank 0), ``recvs`` on rank 5 (group rank 1), still scheduled."""
    config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3, 4, 5]"},
              "2": {"name": "2", "desc": "pair_pg", "ranks": "[2, 5]"}}
    out: dict[int, Any] = {}
    for rank in range(6):
        entries = [event("all_reduce", [[4, 4]], [[4, 4]], state="completed")]
        ops = sends if rank == 2 else recvs if rank == 5 else []
        entries += [event(name, sizes, sizes, seq=0, p2p_seq=k + 1, group=("2", "pair_pg"))
                    for k, (name, sizes) in enumerate(ops)]
        out[rank] = suite_dump(rank, entries, {**config, "1": {"name": "1", "desc": "sub_pg", "ranks": f"[{rank}]"}})
    return out


def build_db_cases() -> list[PeerCase]:
    """testBuildDB's six cases (completed entries, the sequence id "0" throughout)."""
    def entry(name: str, sizes: list[list[int]], group: tuple[str, str] = ("0", "default")) -> dict[str, Any]:
        return event(name, sizes, sizes, state="completed", seq=0, group=group)

    a4, a5, none = [[4, 4]], [[5, 5]], [[]]
    cases = [
        ("builddb/1_all_reduce_and_subgroup", healthy("a matched all_reduce, and one in each rank's own subgroup"),
         both([entry("all_reduce", a4), entry("all_reduce", a5, ("1", "sub_pg"))])),
        ("builddb/2_allreduce_coalesced", healthy("a matched allreduce_coalesced"),
         both([entry("allreduce_coalesced", a4)])),
        ("builddb/3_broadcast_coalesced", healthy("two broadcasts closed by a coalesced marker, on both ranks"),
         both([entry("broadcast", a4), entry("broadcast", a4), entry("coalesced", none)])),
        ("builddb/4_uneven_broadcast", fault("mismatch", [0, 1], "rank 0 broadcasts [5, 5] where rank 1 "
                                             "broadcasts [4, 4] inside one coalesced group: two ranks, two answers"),
         {0: suite_dump(0, [entry("_broadcast_oop", a4), entry("_broadcast_oop", a5), entry("ALLGATHER_coalesced",
                                                                                            none)]),
          1: suite_dump(1, [entry("_broadcast_oop", a4), entry("_broadcast_oop", a4), entry("ALLGATHER_coalesced",
                                                                                            none)])}),
        ("builddb/5_reduce_coalesced", healthy("two reduces closed by a REDUCE_SCATTER_coalesced marker"),
         both([entry("_reduce_oop", a4), entry("_reduce_oop", a4), entry("REDUCE_SCATTER_coalesced", none)])),
        ("builddb/6_empty_coalesced_on_rank0", healthy("a coalesced call that recorded nothing on rank 0"),
         {0: suite_dump(0, [entry("all_reduce", a4)]),
          1: suite_dump(1, [entry("all_reduce", a4), entry("_reduce_oop", a4), entry("_reduce_oop", a4),
                            entry("REDUCE_SCATTER_coalesced", none)])}),
    ]
    return [PeerCase(n, TORCH_SUITE, f"testBuildDB case {n.split('/')[1][0]}", e, d) for n, e, d in cases]


# --------------------------------------------------------------------------------- NVIDIA: stragglers


def section_steps(world: int, iters: int, sections: Sequence[str], seconds: Callable[[str, int, int], float],
                  seed: int) -> list[dict[str, Any]]:
    """Step records of a job whose ranks run ``sections`` in turn each iteration; ``seconds(section, rank, i)``
    is the section's mean time, drawn with the suite's noise (Gaussian, σ = 30 % of the healthy mean, ≥ 0).
    Each rank writes one record per section and one for the whole step (compute = the sections' sum)."""
    rng = random.Random(seed)
    out = []
    t = 1.7e9
    for i in range(iters):
        drawn = {(s, r): max(0.0, rng.gauss(seconds(s, r, i), 0.003)) for s in sections for r in range(world)}
        wall = max(sum(drawn[s, r] for s in sections) for r in range(world)) + 0.002
        for r in range(world):
            for s in sections:
                out.append({"job_id": "peer", "rank": r, "step": i, "start_time": t, "wall_s": wall,
                            "compute_s": drawn[s, r], "comm_wait_s": None, "section": s})
            total = sum(drawn[s, r] for s in sections)
            out.append({"job_id": "peer", "rank": r, "step": i, "start_time": t, "wall_s": wall,
                        "compute_s": total, "comm_wait_s": wall - total})
        t += wall
    return out


def scaled_steps(factors: Sequence[float], iters: int, base: float, seed: int, cv: float = 0.05,
                 onset: int = 0) -> list[dict[str, Any]]:
    """Whole-step records: rank r computes ``base × factors[r]`` (from ``onset`` on; before it, ``base``). Each
    carries the job's world size, as the hook writes it (one rank's records alone are no job without it)."""
    rng = random.Random(seed)
    out = []
    t = 1.7e9
    for i in range(iters):
        comp = [base * (f if i >= onset else 1.0) * max(0.2, rng.gauss(1.0, cv)) for f in factors]
        wall = max(comp) + 0.1 * base
        for r, c in enumerate(comp):
            out.append({"job_id": "peer", "rank": r, "step": i, "start_time": t, "wall_s": wall, "compute_s": c,
                        "comm_wait_s": wall - c, "world_size": len(factors)})
        t += wall
    return out


SECTIONS = ("section00", "section01", "section02")


def nvidia_cases() -> list[PeerCase]:
    cases: list[PeerCase] = []
    # test_sections.py: 4 ranks, 3 sections of 10 ms ± 3 ms, a straggling (section, rank) at 15 ms ± 3 ms,
    # 100 iterations; "indiv" stragglers slow down only after the first half (their own history changes).
    scenarios: list[tuple[str, list[tuple[str, int]], bool]] = [
        ("one", [("section00", 0)], False), ("two_same_section", [("section00", 0), ("section00", 1)], False),
        ("two_sections", [("section00", 0), ("section01", 1)], False), ("none", [], False),
        ("indiv_one", [("section00", 0)], True), ("indiv_two_same_section", [("section00", 0), ("section00", 1)], True),
        ("indiv_two_sections", [("section00", 0), ("section01", 1)], True), ("indiv_none", [], True)]
    for k, (label, slow, second_half) in enumerate(scenarios):
        def seconds(s: str, r: int, i: int, slow: list[tuple[str, int]] = slow, second_half: bool = second_half
                    ) -> float:
            return 0.015 if (s, r) in slow and (not second_half or i > 50) else 0.010

        steps = section_steps(4, 100, SECTIONS, seconds, seed=k)
        ranks = sorted({r for _, r in slow})
        if slow:
            sections = sorted({s for s, _ in slow})
            expected = fault("straggler", ranks, "slow (1.5x) in " + ", ".join(f"{s} on rank {r}" for s, r in slow),
                             code="rank.straggler", section=",".join(sections))
            expected["sections"] = {s: sorted(r for t, r in slow if t == s) for s in sections}
        else:
            expected = healthy("every section takes 10 ms ± 3 ms on every rank")
        cases.append(PeerCase(f"sections/{label}", NVIDIA_SUITE, f"test_sections.py scenario {k + 1}", expected,
                              steps=steps))
    # A rank 2x slower in one of two sections (the wording of the same class).
    cases.append(PeerCase("sections/two_sections_2x", NVIDIA_SUITE, "test_sections.py, 2x in one of two sections",
                          dict(fault("straggler", [2], "rank 2 takes 2x in section01 of two", code="rank.straggler",
                                     section="section01"), sections={"section01": [2]}),
                          steps=section_steps(4, 100, SECTIONS[:2],
                                              lambda s, r, i: 0.020 if (s, r) == ("section01", 2) else 0.010, 11)))
    # test_relative_gpu_scores.py / test_individual_gpu_scores.py: rank r runs its kernels (r + 1)x as long.
    cases.append(PeerCase("relative/ranks_times_rank_plus_one", NVIDIA_SUITE,
                          "test_relative_gpu_scores_gather_on_rank0 (and _no_gather, _some_common_kernels)",
                          fault("straggler", [1, 2, 3], "ranks 1-3 compute 2x, 3x, 4x what rank 0 does",
                                code="rank.straggler"), steps=scaled_steps((1.0, 2.0, 3.0, 4.0), 60, 0.05, 21)))
    cases.append(PeerCase("relative/one_rank", NVIDIA_SUITE, "test_relative_gpu_scores_one_rank",
                          healthy("a one-rank job: nobody waits for anybody"),
                          steps=scaled_steps((1.25,), 60, 0.05, 22)))
    cases.append(PeerCase("individual/ranks_slow_down_by_rank", NVIDIA_SUITE,
                          "test_individual_gpu_scores_gather_on_rank0 (and _no_gather)",
                          fault("straggler", [1, 2, 3], "after a reference interval, rank r computes (r + 1)x",
                                code="rank.straggler"),
                          steps=scaled_steps((1.0, 2.0, 3.0, 4.0), 80, 0.05, 23, onset=30)))
    # The graded case of the same class: three ranks slow by different amounts among four.
    cases.append(PeerCase("relative/graded_1.1_1.2_1.3", NVIDIA_SUITE, "relative scores, graded slowdowns",
                          fault("straggler", [1, 2, 3], "ranks 1-3 compute 1.1x, 1.2x, 1.3x what rank 0 does",
                                code="rank.straggler"), steps=scaled_steps((1.0, 1.1, 1.2, 1.3), 100, 0.05, 24, 0.03)))
    # func/ddp_test.py run as its check_log expects it on a healthy node: no straggler on 8 ranks.
    cases.append(PeerCase("ddp/healthy_8_ranks", NVIDIA_SUITE, "func/ddp_test.py + check_log.py --ranks (none)",
                          healthy("eight ranks of a DDP job with 5 % noise"),
                          steps=scaled_steps((1.0,) * 8, 120, 0.05, 25)))
    return cases


def section_misses(findings: Sequence[Any], expected: dict[str, Any]) -> list[str]:
    """The (section, rank) pairs ``expected["sections"]`` names that no active straggler finding names: a
    straggling code section must be named for that section, not only as a slow step."""
    named = {(f.evidence.get("section"), f.evidence.get("rank")) for f in findings
             if f.code == "rank.straggler" and f.evidence.get("active", True)}
    return [f"rank {r} not named for {s}" for s, ranks in expected.get("sections", {}).items() for r in ranks
            if (s, r) not in named]


def family(name: str) -> str:
    """The class a case is scored under: its suite and the group of tests it comes from."""
    head = name.split("/")[0]
    return ("nvidia/" if head in ("sections", "relative", "individual", "ddp") else "torch/") + head


def all_cases() -> list[PeerCase]:
    return torch_cases() + nvidia_cases()


def write(case: PeerCase, root: Path) -> Path:
    """The case as a corpus folder under ``root``; returns it."""
    folder = root / case.name
    dumps = folder / "dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    for rank, doc in case.dumps.items():
        (dumps / f"dump_file_rank_{rank}").write_text(json.dumps(doc))
    by_rank: dict[int, list[str]] = {}
    for rec in case.steps:
        by_rank.setdefault(int(rec["rank"]), []).append(json.dumps(rec))
    for rank, lines in by_rank.items():
        (folder / f"steps_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    expected = dict(case.expected, suite=case.suite, source=case.source)
    (folder / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    return folder


def write_all(root: Path) -> list[PeerCase]:
    cases = all_cases()
    for c in cases:
        write(c, root)
    return cases


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {MADE_BY}")
    made = write_all(Path(sys.argv[1]))
    print(f"{len(made)} cases written to {sys.argv[1]}")
