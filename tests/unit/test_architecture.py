"""The layer rules of docs/architecture.md, enforced on the source.

The rules live in one place, the "Layers" table of docs/architecture.md: this test reads them from
there, so the document and the code cannot drift apart. Every ``import`` counts (at module level,
inside a function, or under ``TYPE_CHECKING``): a lazy import is still a dependency someone has to
understand.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PACKAGE = SRC / "gpuhealth"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# Import loops that exist and have an owner who removes them: {frozenset(modules): "who, which issue"}.
# Each entry must still be a loop; once it is gone the test says to delete it here. (The last one,
# coordinator/hangs <-> coordinator/service, is gone: hangs became the coordinator's own collaborator.)
KNOWN_LOOPS: dict[frozenset[str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name}


def _resolve(name: str, known: Iterable[str]) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.c`` → ``a.b`` when ``c`` is a symbol)."""
    known = set(known)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """module → the gpuhealth modules it imports (anywhere in the file)."""
    mods = modules()
    graph: dict[str, frozenset[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.add(full if full in mods else source)
        resolved = {_resolve(t, mods) for t in targets if t == "gpuhealth" or t.startswith("gpuhealth.")}
        graph[name] = frozenset(t for t in resolved if t is not None and t != name)
    return graph


def loops(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:  # type: ignore[attr-defined]
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


# ------------------------------------------------------------------------------ the rules, from the doc
ANYTHING = "anything"


@cache
def layer_rules() -> dict[str, frozenset[str] | None]:
    """part → parts it may import (None: anything), read from the "Layers" table."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, frozenset[str] | None] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        part = cells[0].strip("`")
        allowed = cells[-1]
        if allowed == ANYTHING:
            rules[part] = None
        else:
            rules[part] = frozenset(re.findall(r"`([a-z_.]+)`", allowed))
    return rules


def part_of(module: str, parts: Iterable[str]) -> str | None:
    """The part a module belongs to: the longest part name that is the module or a package above it."""
    rel = module.removeprefix("gpuhealth").removeprefix(".") or "gpuhealth"
    best = None
    for part in parts:
        if (rel == part or rel.startswith(part + ".")) and (best is None or len(part) > len(best)):
            best = part
    return best


def test_the_layers_table_is_there_and_names_real_parts() -> None:
    rules = layer_rules()
    assert len(rules) >= 15, f"docs/architecture.md: the Layers table was not found or is cut short: {rules}"
    for part, allowed in rules.items():
        target = PACKAGE if part == "gpuhealth" else PACKAGE.joinpath(*part.split("."))
        assert target.is_dir() or target.with_suffix(".py").is_file(), f"Layers table names `{part}`: no such part"
        for other in allowed or ():
            assert other in rules, f"Layers table: `{part}` may import `{other}`, which has no row of its own"


def test_every_module_belongs_to_a_part_of_the_table() -> None:
    rules = layer_rules()
    orphans = sorted(m for m in modules() if part_of(m, rules) is None)
    assert not orphans, (f"modules in no part of docs/architecture.md's Layers table: {orphans}. Add a row "
                         "for the new part (what it is, and which parts it may import).")


def test_imports_follow_the_layers() -> None:
    rules = layer_rules()
    wrong = []
    for module, targets in sorted(import_graph().items()):
        src = part_of(module, rules)
        allowed = rules[src] if src is not None else None  # a module of no part: the test above says so
        if allowed is None:
            continue
        for target in sorted(targets):
            dst = part_of(target, rules)
            if dst is not None and dst != src and dst not in allowed and dst != "gpuhealth":
                wrong.append(f"{module} imports {target}: `{src}` may not import `{dst}`")
    assert not wrong, ("imports against the layer rules of docs/architecture.md (Layers): remove the import, "
                       "or, when the dependency is right, add the part to the importer's row and say why:\n  "
                       + "\n  ".join(wrong))


def test_the_agent_and_the_coordinator_know_each_other_only_through_the_wire() -> None:
    def top(module: str) -> str:
        return module.split(".")[1] if "." in module else ""

    crossing = [f"{m} imports {t}" for m, ts in sorted(import_graph().items()) for t in sorted(ts)
                if {top(m), top(t)} == {"agent", "coordinator"}]
    assert not crossing, ("the agent and the coordinator share only neutral parts (model, config, proto, "
                          "runtime); move what both need there:\n  " + "\n  ".join(crossing))
    rules = layer_rules()
    shared = (rules["agent"] or frozenset()) & (rules["coordinator"] or frozenset())
    assert shared <= {"gpuhealth", "model", "config", "proto", "runtime"}, shared


def test_there_are_no_import_loops() -> None:
    found = loops(import_graph())
    unexpected = [sorted(c) for c in found if c not in KNOWN_LOOPS]
    assert not unexpected, f"import loops (break them: move the shared part down a layer): {unexpected}"
    stale = [sorted(c) for c in KNOWN_LOOPS if c not in found]
    assert not stale, f"these loops are gone: delete them from KNOWN_LOOPS in {Path(__file__).name}: {stale}"


def test_the_loop_finder_finds_loops() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set[str]()}
    assert loops(graph) == [frozenset({"a", "b", "c"})]
    assert loops({"a": {"b"}, "b": set[str]()}) == []


@pytest.mark.parametrize(("module", "part"), [
    ("gpuhealth.instrument.protocol", "instrument.protocol"),
    ("gpuhealth.instrument.tracker", "instrument"),
    ("gpuhealth", "gpuhealth"),
    ("gpuhealth.agent.daemon", "agent"),
])
def test_modules_map_to_the_most_specific_part(module: str, part: str) -> None:
    assert part_of(module, ["gpuhealth", "agent", "instrument", "instrument.protocol"]) == part


def test_the_repository_cites_its_own_architecture_not_a_design_file_outside_it() -> None:
    """The contracts live in docs/architecture.md; nothing may send a reader to a file the repository lacks."""
    places = [REPO / "README.md", *SRC.rglob("*.py"), *(REPO / "deploy").rglob("*.*"), *(REPO / "scripts").rglob("*"),
              *(REPO / "benchmarks").glob("*.py"), REPO / "docs" / "architecture.md", REPO / "docs" / "metrics.md"]
    citing = []
    for path in places:
        if not path.is_file() or "_pb2" in path.name:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if re.search(r"DESIGN(\.md| rule)", text):
            citing.append(str(path.relative_to(REPO)))
    assert not citing, f"cite docs/architecture.md instead of DESIGN.md in: {citing}"


# ------------------------------------------------------------------------------ one hop from the doc
def test_every_collector_is_one_hop_away() -> None:
    from gpuhealth.collectors.registry import COLLECTOR_MODULES

    text = ARCHITECTURE.read_text()
    for name in COLLECTOR_MODULES:
        assert f"| `{name}` | `src/gpuhealth/collectors/{name}.py` |" in text, (
            f"docs/architecture.md, Collectors: add a row for `{name}` (file, lane, what it reads and judges)")


def test_every_verdict_is_one_hop_away() -> None:
    from gpuhealth.flightrec.verdict import VERDICTS

    section = ARCHITECTURE.read_text().split("### Verdicts", 1)[1].split("\n## ", 1)[0]
    missing = [v for v in VERDICTS if f"`{v}`" not in section]
    assert not missing, f"docs/architecture.md, Verdicts: name the triage verdict(s) {missing}"
    for word in ("healthy", "degraded", "unhealthy", "unknown"):
        assert f"`{word}`" in section


def test_every_path_the_doc_names_exists() -> None:
    text = ARCHITECTURE.read_text()
    paths = set(re.findall(r"`((?:src|tests|docs|deploy|scripts|benchmarks)/[A-Za-z0-9_./-]+)`", text))
    parts = r"(?:agent|collectors|backends|exporters|catalog|runtime|coordinator|flightrec|diag|cli|proto)"
    paths |= {f"src/gpuhealth/{p}" for p in re.findall(rf"`({parts}/[a-z_]+\.py)`", text)}
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
