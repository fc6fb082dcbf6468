"""Triage quality: does ``gpuhealth triage`` name the root cause, as a number over many cases?

Runs ``gpuhealth.flightrec.verdict.triage`` on every case with a known answer and judges each report by the
rules of tests/integration/fr_jobs/corpus.py — the same rules as tests/unit/flightrec/test_fixture_corpus.py:

  verdict ok    the verdict is the expected one
  headline ok   the first finding of the highest severity names the root rank(s) and no other
  false         some rank that is not at fault is named at warning or above (a false culprit)
  all ok        all three right

Printed per class (the case's ``root_code``, or its verdict when healthy) and in total, for each corpus:

  fixtures      every expected.json under tests/fixtures/flightrec (real Gloo and NCCL jobs)
  FOLDER …      any other corpus laid out the same way (held-out cases)
  synthetic     ``--synthetic N --seed S``: N generated cases, round-robin over the classes of
                tests/integration/fr_jobs/synth.py — random world 2–64 as TP x PP x DP, the fault's class,
                rank and step drawn at random, Gloo or NCCL flavour, JSON or pickle dumps, ring buffers of
                40–2000 entries. The classes (see synth.py): healthy, healthy_timed, host_stuck, skip,
                size_mismatch, dtype_mismatch, type_mismatch, coalesced_mismatch, p2p_unmatched,
                p2p_size_mismatch, alltoall_split, silent_then_stall, self_inconsistent, same_named_groups,
                gpu_stall, dump_missing, dump_unreadable, straggler_fr, healthy_live, straggler_live.
  peer suites   ``--peer-suites``: the cases of PyTorch's flight-recorder analyser tests and NVIDIA's straggler
                tests, rebuilt in the shapes those suites produce (tests/integration/fr_jobs/peer_suites.py),
                per group of tests; a straggling code section must also be named for its section.

    python benchmarks/triage_quality.py [FOLDER ...] [--no-fixtures] [--synthetic 360 --seed 0]
        [--peer-suites] [--keep DIR] [--json] [--failures]

``--keep DIR`` writes the synthetic cases there (a corpus anyone can re-run as FOLDER); ``--failures`` lists
every case that is not all right with the reasons. A crash of triage on a case counts as all wrong and is
listed. Exit status 0 (a measurement, not a gate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "fr_jobs"))
import corpus  # the judging rules, shared with the corpus test
import peer_suites  # the peer suites' cases
import synth  # the synthetic generator

COLUMNS = ("cases", "verdict_ok", "headline_ok", "false_culprits", "all_ok")


def run_corpus(cases: list[corpus.Case], klass: Callable[[corpus.Case], str] | None = None) -> dict[str, Any]:
    rows: list[tuple[str, corpus.Judgement]] = []
    failures = []
    t0 = time.perf_counter()
    for case in cases:
        try:
            rep, judged = corpus.judge_case(case)
            misses = peer_suites.section_misses(rep.findings, dict(case.expected))
            if misses:  # a straggling code section named only as a slow step: the headline is not right
                judged = dataclasses.replace(judged, headline_ok=False, reasons=[*judged.reasons, *misses])
        except Exception as exc:  # a crash is a wrong answer; keep measuring the rest
            judged = corpus.Judgement("crash", False, False, [], "", [f"triage raised {type(exc).__name__}: {exc}"])
        rows.append((klass(case) if klass else case.klass, judged))
        if not judged.ok:
            failures.append({"case": case.name, "class": case.klass, "backend": case.expected.get("backend"),
                             "expected": case.expected["verdict"], "got": judged.verdict,
                             "root_ranks": case.expected.get("root_ranks"), "reasons": judged.reasons,
                             "headline": judged.headline_text})
    return {"classes": corpus.summarise(rows), "failures": failures, "seconds": round(time.perf_counter() - t0, 2)}


def peer_suite_cases(folder: Path) -> list[corpus.Case]:
    peer_suites.write_all(folder)
    return corpus.discover(folder)


def synthetic_cases(n: int, seed: int, folder: Path) -> list[corpus.Case]:
    cases = []
    for made in synth.generate(n, seed):
        root = synth.write(made, folder)
        cases.append(corpus.Case(name=made.name, dumps=root / "dumps", steps_dir=None, expected=made.expected))
    return cases


def _peer_family(case: corpus.Case) -> str:
    return peer_suites.family(case.name)


def _table(title: str, result: dict[str, Any]) -> str:
    lines = [f"{title}  ({result['seconds']} s)", f"  {'class':32s} " + " ".join(f"{c:>14s}" for c in COLUMNS)]
    classes = result["classes"]
    for name in sorted(k for k in classes if k != "TOTAL") + (["TOTAL"] if "TOTAL" in classes else []):
        row = classes[name]
        cells = [f"{row['cases']:>14d}"] + [f"{row[c]:>7d} ({row[c] / row['cases']:4.0%})" for c in COLUMNS[1:]]
        lines.append(f"  {name:32s} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="*", type=Path, help="other corpora (held-out cases) laid out like the fixtures")
    p.add_argument("--no-fixtures", action="store_true", help="skip tests/fixtures/flightrec")
    p.add_argument("--synthetic", type=int, default=0, metavar="N", help="also judge N generated cases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-suites", action="store_true",
                   help="also judge the peer suites' cases (PyTorch's analyser tests, NVIDIA's straggler tests)")
    p.add_argument("--keep", type=Path, help="write the synthetic cases here (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--failures", action="store_true", help="list the cases that are not all right")
    args = p.parse_args(argv)

    corpora: dict[str, list[corpus.Case]] = {}
    try:
        if not args.no_fixtures:
            corpora["fixtures"] = corpus.discover()
        for folder in args.folders:
            if not folder.is_dir():
                p.error(f"{folder}: not a folder")
            corpora[str(folder)] = corpus.discover(folder)
    except ValueError as exc:  # a malformed expected.json: say which, never a traceback
        p.error(str(exc))
    tmp = None
    peer_name = "peer suites (PyTorch flight-recorder analyser tests, NVIDIA straggler tests)"
    if args.synthetic or args.peer_suites:
        folder = args.keep or Path(tmp := tempfile.mkdtemp(prefix="triage_quality_"))
        if args.synthetic:
            name = f"synthetic (n={args.synthetic}, seed={args.seed})"
            corpora[name] = synthetic_cases(args.synthetic, args.seed, folder)
        if args.peer_suites:
            corpora[peer_name] = peer_suite_cases(folder / "peer_suites")
    try:
        results = {name: run_corpus(cases, _peer_family if name == peer_name else None)
                   for name, cases in corpora.items()}
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    given = argv if argv is not None else sys.argv[1:]
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "host": platform.node(),
            "python": platform.python_version(),
            "command": " ".join(["python", "benchmarks/triage_quality.py", *given])}
    if args.json:
        print(json.dumps({"meta": meta, "corpora": results}, indent=2))
        return 0
    print(f"triage quality — {meta['date']}, {meta['command']}")
    for name, result in results.items():
        print()
        print(_table(name, result))
        if args.failures:
            for f in result["failures"]:
                print(f"    ✗ {f['case']}: expected {f['expected']} root {f['root_ranks']}, got {f['got']}")
                for reason in f["reasons"]:
                    print(f"        - {reason[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
