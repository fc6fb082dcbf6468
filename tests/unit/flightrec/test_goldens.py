"""The verdict of every real dump in tests/fixtures/flightrec is pinned in tests/golden/triage/: what an
operator reads (verdict, summary, the root causes in order, the findings) may change only on purpose.

After a deliberate change to the analyser, regenerate and review the diff:
    GPUHEALTH_UPDATE_GOLDENS=1 .venv/bin/python -m pytest -q tests/unit/flightrec/test_goldens.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from frbuild import FIXTURES

from gpuhealth.flightrec.report import TriageReport
from gpuhealth.flightrec.verdict import triage

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "triage"
UPDATE = os.environ.get("GPUHEALTH_UPDATE_GOLDENS") == "1"


def dump_folders() -> list[Path]:
    """Every fixture folder that holds one job's dumps (``rank*.json`` / ``*.pkl`` files)."""
    out = set()
    for p in FIXTURES.rglob("*"):
        if p.is_file() and p.suffix in (".json", ".pkl") and p.name != "expected.json" \
                and not p.name.endswith(".expected.json") and p.name != "launcher.json":
            out.add(p.parent)
    return sorted(out)


def digest(rep: TriageReport) -> dict[str, Any]:
    """What an operator reads, without what depends on where the files are (paths, mtimes)."""
    return {
        "verdict": rep.verdict.value,
        "summary": rep.summary,
        "roots": [{k: v for k, v in r.to_dict().items() if k != "created_ns"} for r in rep.roots],
        "findings": [{"code": f.code, "severity": f.severity.name.lower(), "entity": f.entity.id,
                      "rank": f.evidence.get("rank"), "message": f.message} for f in rep.findings],
        "ranks_seen": rep.ranks_seen, "ranks_missing": rep.ranks_missing,
        "ranks_unreadable": rep.ranks_unreadable,
        "problems": sorted(f"{Path(p.path).name}: {p.severity}: {p.message}" for p in rep.problems),
    }


@pytest.mark.parametrize("folder", dump_folders(), ids=lambda p: str(p.relative_to(FIXTURES)))
def test_verdict_matches_its_golden(folder: Path) -> None:
    got = digest(triage(folder))
    path = GOLDEN / (str(folder.relative_to(FIXTURES)).replace("/", "__") + ".json")
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert path.exists(), f"no golden for {folder}: run with GPUHEALTH_UPDATE_GOLDENS=1 and review it"
    want = json.loads(path.read_text())
    assert got == want, f"{folder}: the verdict changed; if on purpose, regenerate the golden and review the diff"


def test_every_golden_has_its_dumps() -> None:
    names = {str(f.relative_to(FIXTURES)).replace("/", "__") + ".json" for f in dump_folders()}
    stale = sorted(p.name for p in GOLDEN.glob("*.json") if p.name not in names)
    assert not stale, f"goldens without fixture dumps (delete them): {stale}"
