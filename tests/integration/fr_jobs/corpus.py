"""The fixture corpus: dump folders with a known answer, and the rules a triage report is judged by.

A case is a folder with ``expected.json`` beside a ``dumps/`` folder (and optional ``steps_rank*.jsonl``), or —
for a folder that holds only dumps — a ``<folder>.expected.json`` beside it. ``expected.json``::

    {"verdict": "hang|mismatch|straggler|healthy|incomplete", "root_ranks": [3], "root_code": "...",
     "group": "0", "why": "the injected fault in words", "made_by": "exact command", "torch": "2.13.0",
     "backend": "gloo",
     "also_acceptable": [2], "acceptable_why": "...",     # optional: ranks the dumps cannot tell from the root
     "allowed_consequences": [1], "consequences_why": "...",   # optional: may be named at warning or above
     "job": {"world_size": 4}}                            # optional: what an operator passes (--world-size)

The rules (what an operator relies on):
  verdict   the report's verdict equals the expected one;
  headline  the first finding of the highest severity (what an operator reads first) names root rank(s) and
            no other rank (``also_acceptable`` widens "root" where the evidence cannot separate them); when
            nothing widens it, every root rank is named by some finding of that severity; a healthy job has
            no finding at warning or above;
  culprits  no rank outside the root (and ``also_acceptable``, ``allowed_consequences``) is named by a
            finding at warning or above.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.model import EntityKind, Finding, Severity, StepRecord

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "flightrec"
VERDICTS = ("hang", "mismatch", "straggler", "healthy", "incomplete")


@dataclass(frozen=True)
class Case:
    name: str  # the folder, relative to the corpus root
    dumps: Path
    steps_dir: Path | None  # where steps_rank*.jsonl are, if any
    expected: Mapping[str, Any]

    @property
    def klass(self) -> str:
        """The class a benchmark groups this case under (root_code, else the verdict)."""
        return str(self.expected.get("root_code") or self.expected["verdict"])


def check_expected(doc: Any, where: str) -> list[str]:
    """What is wrong with an expected.json (empty when it is usable)."""
    if not isinstance(doc, dict):
        return [f"{where}: not a JSON object"]
    errors = []
    if doc.get("verdict") not in VERDICTS:
        errors.append(f"{where}: verdict must be one of {', '.join(VERDICTS)}")
    for key in ("root_ranks", "also_acceptable", "allowed_consequences"):
        value = doc.get(key, [])
        if not isinstance(value, list) or not all(isinstance(r, int) and r >= 0 for r in value):
            errors.append(f"{where}: {key} must be a list of ranks")
    if doc.get("verdict") == "healthy" and doc.get("root_ranks"):
        errors.append(f"{where}: a healthy job has no root rank")
    if doc.get("verdict") not in ("healthy", None) and not doc.get("root_ranks"):
        errors.append(f"{where}: a faulty job names its root rank(s)")
    for key in ("why", "made_by"):
        if not isinstance(doc.get(key), str) or not doc.get(key):
            errors.append(f"{where}: {key} must say how the case was made")
    return errors


def discover(root: Path = FIXTURES) -> list[Case]:
    """Every case under ``root`` (sorted by name). Raises ValueError naming a malformed expected.json."""
    cases = []
    for exp in sorted(root.rglob("expected.json")):
        folder = exp.parent
        dumps = folder / "dumps"
        cases.append(_case(root, exp, dumps if dumps.is_dir() else folder, folder))
    for exp in sorted(root.rglob("*.expected.json")):
        folder = exp.with_name(exp.name[: -len(".expected.json")])
        cases.append(_case(root, exp, folder, folder))
    return sorted(cases, key=lambda c: c.name)


def _case(root: Path, exp: Path, dumps: Path, folder: Path) -> Case:
    try:
        doc = json.loads(exp.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{exp}: {exc}") from None
    errors = check_expected(doc, str(exp))
    if errors:
        raise ValueError("; ".join(errors))
    name = str(folder.relative_to(root)) if folder.is_relative_to(root) else str(folder)
    steps_dir = folder if any(folder.glob("steps_rank*.jsonl")) else None
    return Case(name=name, dumps=dumps, steps_dir=steps_dir, expected=doc)


def load_steps(folder: Path | None) -> list[StepRecord]:
    if folder is None:
        return []
    return [StepRecord.from_dict(json.loads(line)) for p in sorted(folder.glob("steps_rank*.jsonl"))
            for line in p.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------- judging


def named_ranks(f: Finding) -> set[int]:
    """The ranks a finding puts forward as culprits: ``evidence.rank``, ``evidence.ranks`` and a rank entity.
    Waiting ranks and consequences nested in the evidence are not culprits."""
    out: set[int] = set()
    ev = f.evidence
    if _is_rank(ev.get("rank")):
        out.add(int(ev["rank"]))
    ranks = ev.get("ranks")
    if isinstance(ranks, list | tuple):
        out.update(int(r) for r in ranks if _is_rank(r))
    if f.entity.kind is EntityKind.RANK and f.entity.id.isdigit():
        out.add(int(f.entity.id))
    return out


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _active(f: Finding) -> bool:
    return f.evidence.get("active", True) is not False  # a recovered straggler episode names nobody now


def headline(findings: Sequence[Finding]) -> Finding | None:
    """The first finding of the highest severity: what an operator reads first."""
    if not findings:
        return None
    top = max(f.severity for f in findings)
    return next(f for f in findings if f.severity == top)


@dataclass
class Judgement:
    verdict: str  # what triage said
    verdict_ok: bool
    headline_ok: bool
    false_culprits: list[int]  # ranks named at warning or above that are neither root nor allowed
    headline_text: str
    reasons: list[str] = field(default_factory=list)  # why a rule failed, one line each

    @property
    def ok(self) -> bool:
        return self.verdict_ok and self.headline_ok and not self.false_culprits


def verdict_text(verdict: Any) -> str:
    return str(getattr(verdict, "value", verdict))


def judge(verdict: Any, findings: Sequence[Finding], expected: Mapping[str, Any]) -> Judgement:
    got = verdict_text(verdict)
    want = str(expected["verdict"])
    roots = set(expected.get("root_ranks", []))
    acceptable = roots | set(expected.get("also_acceptable", []))
    allowed = acceptable | set(expected.get("allowed_consequences", []))
    reasons = []
    verdict_ok = got == want
    if not verdict_ok:
        reasons.append(f"verdict {got}, expected {want}")

    serious = [f for f in findings if f.severity >= Severity.WARNING and _active(f)]
    head = headline(serious)
    head_text = f"[{head.severity}] {head.code}: {head.message}" if head else "(no finding at warning or above)"
    if not roots:
        headline_ok = head is None
        if not headline_ok:
            reasons.append(f"a healthy job got a headline: {head_text}")
    elif head is None:
        headline_ok = False
        reasons.append("no finding at warning or above names the root")
    else:
        named = named_ranks(head)
        top = [f for f in serious if f.severity == head.severity]
        covered = set().union(*(named_ranks(f) for f in top))
        headline_ok = bool(named) and named <= acceptable and (acceptable != roots or roots <= covered)
        if not named:
            reasons.append(f"the headline names no rank: {head_text}")
        elif not named <= acceptable:
            reasons.append(f"the headline names rank(s) {sorted(named - acceptable)}, root is {sorted(roots)}")
        elif acceptable == roots and not roots <= covered:
            reasons.append(f"root rank(s) {sorted(roots - covered)} not named at {head.severity}")
    false = sorted(set().union(*(named_ranks(f) for f in serious)) - allowed) if serious else []
    if false:
        reasons.append(f"rank(s) {false} named at warning or above but not at fault")
    return Judgement(got, verdict_ok, headline_ok, false, head_text, reasons)


def judge_case(case: Case) -> tuple[Any, Judgement]:
    """Run triage on one case as a user would (its step records and operator context) and judge it."""
    from gpuhealth.flightrec.verdict import triage

    steps = load_steps(case.steps_dir)
    job = case.expected.get("job")
    rep = triage(case.dumps, steps=steps or None, job=job if isinstance(job, dict) else None)
    return rep, judge(rep.verdict, rep.findings, case.expected)


def summarise(rows: Iterable[tuple[str, Judgement]]) -> dict[str, dict[str, int]]:
    """Per class: cases, verdict correct, headline correct, cases with false culprits, all three right."""
    out: dict[str, dict[str, int]] = {}
    for klass, j in rows:
        for key in (klass, "TOTAL"):
            s = out.setdefault(key, {"cases": 0, "verdict_ok": 0, "headline_ok": 0, "false_culprits": 0, "all_ok": 0})
            s["cases"] += 1
            s["verdict_ok"] += j.verdict_ok
            s["headline_ok"] += j.headline_ok
            s["false_culprits"] += bool(j.false_culprits)
            s["all_ok"] += j.ok
    return out
