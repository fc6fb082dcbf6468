"""``gpuhealth triage`` and PyTorch's ``torchfrtrace`` on the same real dumps, against the known answer.

For every fixture folder with an ``expected.json`` (the fault that was injected, see
tests/integration/fr_jobs/job.py) and per-rank pickles, both analysers run in their own process:
torchfrtrace on the pickles (the only format it reads, named ``<prefix><rank>``, with
``--allow-incomplete-ranks``), ours on the folder (JSON first). A row says whether each named the
right rank first, what else it named, or how it failed.

    .venv/bin/python benchmarks/torchfrtrace_compare.py [--fixtures tests/fixtures/flightrec] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PREFIX = "nccl_trace_rank_"


def cases(root: Path) -> list[tuple[Path, Path, dict[str, Any]]]:
    """(case folder, dumps folder, expected) for every fixture with an expected.json."""
    out = []
    for exp in sorted(root.rglob("expected.json")):
        folder = exp.parent
        dumps = folder / "dumps" if (folder / "dumps").is_dir() else folder
        out.append((folder, dumps, json.loads(exp.read_text())))
    for exp in sorted(root.glob("*.expected.json")):
        folder = root / exp.name.removesuffix(".expected.json")
        out.append((folder, folder, json.loads(exp.read_text())))
    return out


def run_ours(folder: Path, dumps: Path) -> dict[str, Any]:
    steps = ["--steps", str(folder)] if any(folder.glob("steps_rank*.jsonl")) else []
    proc = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "triage", str(dumps), *steps, "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        return {"error": (proc.stderr or proc.stdout)[-300:]}
    roots = [r for r in doc.get("roots", []) if r.get("kind") != "behind"]
    # The headline: the first root cause; a straggler verdict has no root, its culprits are the stragglers.
    first = sorted(roots[0]["ranks"]) if roots else sorted(doc.get("culprits", []))
    return {"verdict": doc.get("verdict"), "first": first, "named": sorted(doc.get("culprits", []))}


_CULPRIT = re.compile(r"Culprit rank (\d+)")
_MISSING = re.compile(r"missing ranks?:?\s*\{([\d, ]*)\}", re.IGNORECASE)


def run_theirs(dumps: Path) -> dict[str, Any]:
    pickles = sorted(dumps.glob("*.pkl"))
    if not pickles:
        return {"error": "no pickles in this fixture"}
    with tempfile.TemporaryDirectory() as tmp:
        for p in pickles:
            rank = re.findall(r"\d+", p.stem)[-1]
            shutil.copy(p, Path(tmp) / f"{PREFIX}{rank}")
        try:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", tmp, "-p",
                                   PREFIX, "--allow-incomplete-ranks"], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return {"error": "timed out after 300 s"}
    text = proc.stdout + proc.stderr
    if "Traceback" in text:
        last = [line for line in text.strip().splitlines() if line.strip()][-1]
        return {"error": f"crashed: {last[:160]}"}
    culprits = [int(x) for x in _CULPRIT.findall(text)]
    missing = sorted({int(x) for m in _MISSING.findall(text) for x in m.replace(" ", "").split(",") if x})
    first = [culprits[0]] if culprits else missing
    return {"first": first, "named": sorted(set(culprits) | set(missing)),
            "said": "errors found" if ("has errors" in text or culprits or missing) else "no errors"}


def _cell(res: dict[str, Any], want: list[int]) -> str:
    if "error" in res:
        return res["error"]
    first = res.get("first", [])
    right = first == want if want else not first
    extra = sorted(set(res.get("named", [])) - set(want))
    text = ("**right**" if right else "wrong") + f" (first: {first or 'none'}"
    if extra:
        text += f"; also names {extra}"
    return text + (f"; verdict {res['verdict']}" if "verdict" in res else "") + ")"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=REPO / "tests" / "fixtures" / "flightrec")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for folder, dumps, exp in cases(args.fixtures):
        want = sorted(exp.get("root_ranks", []))
        rows.append({"case": str(folder.relative_to(args.fixtures)), "expected": exp.get("verdict"), "want": want,
                     "ours": run_ours(folder, dumps), "theirs": run_theirs(dumps)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| case | injected fault (root ranks) | gpuhealth triage | torchfrtrace |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['expected']} {r['want'] or ''} | {_cell(r['ours'], r['want'])} | "
              f"{_cell(r['theirs'], r['want'])} |")
    ours = sum(1 for r in rows if r["ours"].get("first") == r["want"] and r["ours"].get("verdict") == r["expected"])
    theirs = sum(1 for r in rows if "error" not in r["theirs"] and r["theirs"].get("first") == r["want"])
    crashed = sum(1 for r in rows if "error" in r["theirs"])
    print(f"\n{len(rows)} cases: gpuhealth right (verdict and first-named ranks) in {ours}; torchfrtrace names the "
          f"right rank first in {theirs}, crashes or cannot read {crashed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
