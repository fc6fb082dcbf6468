"""Every page the repository sends a reader to exists: relative links in README, BENCHMARKS and
docs/**.md, any ``*.md`` those pages name in passing, and any ``*.md`` named in the code's comments and
docstrings (src/, benchmarks/). A citation of a file the repository lacks (MEASUREMENTS.md was one,
six times) hides the numbers it stands for."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]
CODE = [p for part in ("src", "benchmarks") for p in sorted((REPO / part).rglob("*.py"))
        if "_pb2" not in p.name]

_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
_WHOLE_LINK = re.compile(r"\[[^\]]*\]\([^)]*\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)  # [name]: target
# A file name ending in .md, with or without folders before it, not part of a URL or a longer word.
_MD_NAME = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.md)\b")
REFERENCE = REPO / "docs" / "reference"
_EXTERNAL = ("http://", "https://", "mailto:", "#")


def _relative_links(text: str) -> list[str]:
    out = []
    for target in [*_LINK.findall(text), *_REF_LINK.findall(text)]:
        if not target.startswith(_EXTERNAL):
            out.append(target.split("#", 1)[0])
    return [t for t in out if t]


def _resolves(name: str, *bases: Path) -> bool:
    return any((base / name).exists() for base in bases)


def test_every_relative_link_in_the_pages_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in _relative_links(page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)}: ({target})")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_every_md_file_the_pages_name_in_passing_exists() -> None:
    broken = []
    for page in PAGES:
        if REFERENCE in page.parents:
            continue  # verbatim copies of notes written outside the repository (their provenance says so)
        text = _WHOLE_LINK.sub("", page.read_text(encoding="utf-8"))  # links are the test above
        for name in sorted(set(_MD_NAME.findall(text))):
            if not _resolves(name, page.parent, REPO):
                broken.append(f"{page.relative_to(REPO)}: {name}")
    assert not broken, "pages name files the repository lacks:\n" + "\n".join(broken)


def test_every_md_file_the_code_cites_exists() -> None:
    broken = []
    for path in CODE:
        for name in sorted(set(_MD_NAME.findall(path.read_text(encoding="utf-8", errors="replace")))):
            if not _resolves(name, REPO, path.parent):
                broken.append(f"{path.relative_to(REPO)}: {name}")
    assert not broken, "the code cites files the repository lacks (cite them by their path from the repository " \
                       "root):\n" + "\n".join(broken)


def test_the_checks_see_a_missing_file() -> None:
    # The patterns find what these tests are for (a regex that matched nothing would pass everything).
    assert _relative_links("see [the numbers](reference/MEASUREMENTS.md#nccl) and [x](https://a.b/c.md)") \
        == ["reference/MEASUREMENTS.md"]
    assert _MD_NAME.findall("measured (MEASUREMENTS.md); see docs/triage.md, https://x.org/y.md") \
        == ["MEASUREMENTS.md", "docs/triage.md"]
    assert not _resolves("MEASUREMENTS.md", REPO, REPO / "docs")
    assert _resolves("measurements.md", REPO / "docs")
