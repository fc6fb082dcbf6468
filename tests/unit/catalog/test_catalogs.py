"""The finding-code and metric-family catalogs against the code, both ways, and the docs generated
from them.

- Every finding code the source can emit is in ``catalog/findings.csv``, emitted where the row says;
  every row is emitted somewhere. Real collector runs on every scenario stay within each code's
  severities and actions.
- Every family the agent or the coordinator exposes is in ``catalog/metrics.csv`` with its type;
  every row is made where it says.
- ``docs/findings.md`` and ``docs/metrics.md`` are exactly what ``scripts/gen_docs.py`` writes.

The failure messages say what to add where: a new code or family is one line in a CSV file.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuhealth.catalog.findings import XID_FAMILY, CodeInfo, code_info, finding_codes, parse_codes
from gpuhealth.catalog.metrics import metric_families, parse_families
from gpuhealth.catalog.xid import CatalogError

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src" / "gpuhealth"
SCENARIOS = REPO / "tests" / "fixtures" / "scenarios"
FINDINGS_CSV = "src/gpuhealth/catalog/findings.csv"
METRICS_CSV = "src/gpuhealth/catalog/metrics.csv"
CODE_SHAPE = re.compile(r"^[a-z][a-z0-9]*\.[a-z][a-z0-9_]*$")
REGENERATE = "then run `.venv/bin/python scripts/gen_docs.py`"


def gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ the code scan
class CodeScan(ast.NodeVisitor):
    """Finding codes in one module's source, wherever they are written: the first argument (or
    ``code=``) of ``Finding(...)``, of a dataclass with a ``code`` field, a module constant or dict of
    codes, an f-string family (``f"xid.{n}"`` → ``xid.<n>``). A code-shaped string counts when it sits
    in such a place, or anywhere but a comparison, a call argument or a docstring when its area
    (``ecc`` of ``ecc.sbe_rate``) is one the catalog knows."""

    def __init__(self, areas: set[str]) -> None:
        self.areas = areas
        self.found: dict[str, int] = {}  # code → first line
        self._skip: set[int] = set()
        self._code_classes: dict[str, int] = {}  # dataclass name → position of its ``code`` field

    def scan(self, tree: ast.Module) -> dict[str, int]:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    self._skip.add(id(first.value))  # a docstring
            if isinstance(node, ast.ClassDef):
                fields = [s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                if "code" in fields:
                    self._code_classes[node.name] = fields.index("code")
            if isinstance(node, ast.Compare):
                self._skip.update(id(n) for n in ast.walk(node))  # f.code == "gpu.lost" reads a code
            if isinstance(node, ast.Dict):
                self._skip.update(id(k) for k in node.keys if k is not None)
        self.visit(tree)
        return self.found

    def _add(self, value: Any, line: int, placed: bool) -> None:
        if isinstance(value, ast.JoinedStr):
            head = value.values[0] if value.values else None
            if (placed and isinstance(head, ast.Constant) and isinstance(head.value, str)
                    and re.fullmatch(r"[a-z][a-z0-9]*\.", head.value)):
                self.found.setdefault(f"{head.value}<n>", line)
            return
        if (isinstance(value, ast.Constant) and isinstance(value.value, str) and CODE_SHAPE.match(value.value)
                and (placed or value.value.split(".", 1)[0] in self.areas)):
            self.found.setdefault(value.value, line)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        placed: list[ast.expr] = []
        if name == "Finding" and node.args:
            placed.append(node.args[0])
        if name in self._code_classes and len(node.args) > self._code_classes[name]:
            placed.append(node.args[self._code_classes[name]])
        placed += [k.value for k in node.keywords if k.arg == "code"]
        for arg in placed:
            self._add(arg, node.lineno, placed=True)
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            self._skip.add(id(arg))  # other call arguments (check_name(x, "sdc.key")) are not codes
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if id(node) not in self._skip:
            self._add(node, node.lineno, placed=False)


@pytest.fixture(scope="module")
def emitted() -> dict[str, dict[str, int]]:
    """code → {file under src/gpuhealth: line}."""
    areas = {c.split(".", 1)[0] for c in finding_codes()}
    out: dict[str, dict[str, int]] = defaultdict(dict)
    for path in sorted(SRC.rglob("*.py")):
        if "_pb2" in path.name or path.parent.name == "catalog":
            continue
        rel = str(path.relative_to(SRC))
        for code, line in CodeScan(areas).scan(ast.parse(path.read_text(), str(path))).items():
            out[code][rel] = line
    return out


def test_the_scan_finds_codes_however_they_are_written() -> None:
    source = '''
"""Docstring naming ecc.dbe_volatile is no emission."""
import logging
log = logging.getLogger("gpuhealth.agent")
CODE = "rank.straggler"
KINDS = {"type": "collective.type_mismatch", "size": "collective.size_mismatch"}

@dataclass
class Reason:
    bit: int
    code: str | None

REASONS = (Reason(1, "throttle.hw_slowdown"),)

def judge(f, n):
    check_name(f.code, "sdc.key")
    if f.code == "gpu.lost":
        return [Finding("newarea.thing", 1), Finding(code=f"xid.{n}"), Finding(CODE)]
'''
    found = CodeScan({"rank", "collective", "sdc", "gpu", "throttle", "ecc"}).scan(ast.parse(source))
    assert set(found) == {"rank.straggler", "collective.type_mismatch", "collective.size_mismatch",
                          "throttle.hw_slowdown", "newarea.thing", "xid.<n>"}


def test_every_emitted_finding_code_is_in_the_catalog(emitted: dict[str, dict[str, int]]) -> None:
    missing = {code: where for code, where in emitted.items() if code_info(code) is None and code != XID_FAMILY}
    lines = [f"  {code} (emitted in {', '.join(f'src/gpuhealth/{f}:{n}' for f, n in sorted(where.items()))}):\n"
             f"    {code},<severity>,<action>,{' '.join(sorted(where))},<what it means>,<what to do>"
             for code, where in sorted(missing.items())]
    assert not missing, (f"finding codes that are in no catalog. Add one line per code to {FINDINGS_CSV} "
                         f"(severity: info|warning|critical, action: none|monitor|check_job|reset_gpu|reboot|"
                         f"drain|rma, '|'-separated when several), {REGENERATE}:\n" + "\n".join(lines))


def test_every_catalog_code_is_emitted_where_it_says(emitted: dict[str, dict[str, int]]) -> None:
    wrong = []
    for info in finding_codes().values():
        where = set(emitted.get(info.code, {}))
        if not where:
            wrong.append(f"  {info.code}: emitted nowhere in src/gpuhealth (a code that is gone stays documented "
                         "only if something still emits it: remove its row)")
        elif where != set(info.emitted_by):
            wrong.append(f"  {info.code}: emitted_by says {' '.join(info.emitted_by)}, the code emits it in "
                         f"{' '.join(sorted(where))}")
    assert not wrong, f"fix these rows of {FINDINGS_CSV}, {REGENERATE}:\n" + "\n".join(wrong)


def _scenario_findings() -> Iterable[Any]:
    """Every collector over every scenario fixture and both real recordings, at three points in time."""
    import json
    import tempfile

    from gpuhealth.backends.errors import NvmlError
    from gpuhealth.backends.nvml_fake import FakeNvml
    from gpuhealth.backends.sysfs import sysfs_for
    from gpuhealth.collectors.base import CollectContext, History
    from gpuhealth.collectors.registry import all_collectors
    from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
    from gpuhealth.config import Config
    from gpuhealth.node import default_kmsg

    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    sources = [*sorted(SCENARIOS.glob("*.yaml"))]
    with tempfile.TemporaryDirectory() as tmp:
        for rec in ("nvml_h200x2.json", "nvml_h100x1.json"):
            p = Path(tmp) / f"{rec}.json"
            p.write_text(json.dumps({"recording": rec}))
            sources.append(p)
        for source in sources:
            clock = Clock()
            backend = FakeNvml.from_file(source, clock=clock)
            backend.init()
            cfg = Config()
            cfg.agent.node_name = "n"
            collectors = [c for c in all_collectors(cfg) if c.name != "host"]
            histories = {c.name: History(16) for c in collectors}
            runner = CollectorRunner(timeout_s=None)
            try:
                for dt in (0.0, 30.0, 60.0):
                    clock.now += dt
                    try:
                        gpus = enumerate_gpus(backend)
                    except NvmlError:  # a scenario whose driver goes away: nothing to collect then
                        continue
                    ctx = CollectContext(backend=backend, config=cfg, gpus=gpus, node_name="n", now=clock.now,
                                         sysfs=sysfs_for(backend, "/"), kmsg=default_kmsg(backend, cfg),
                                         extras={"one_shot": True})
                    for c in collectors:
                        yield from runner.run(c, ctx, histories[c.name]).findings
            finally:
                for c in collectors:
                    close = getattr(c, "close", None)
                    if callable(close):
                        close()


def test_real_findings_stay_within_their_catalog_rows() -> None:
    seen: set[str] = set()
    for f in _scenario_findings():
        info = code_info(f.code)
        assert info is not None, f"{f.code} is not in {FINDINGS_CSV}"
        assert f.severity in info.severities, f"{f.code} emitted {f.severity}: add it to its row's severity"
        assert f.action in info.actions, f"{f.code} emitted action {f.action}: add it to its row's action"
        seen.add(f.code)
    # the scenarios exercise the hardware faults they are named after
    assert {"pcie.link_degraded", "ecc.dbe_volatile", "memory.row_remap_failed", "throttle.hw_slowdown",
            "nvlink.link_down", "fabric.degraded", "thermal.gpu_temp"} <= seen


def test_findings_doc_is_generated_from_the_catalog() -> None:
    expected = gen_docs().render_findings()
    assert (REPO / "docs" / "findings.md").read_text() == expected, f"docs/findings.md is out of date: {REGENERATE}"
    for info in finding_codes().values():
        assert f"`{info.code}`" in expected


def test_a_malformed_catalog_row_is_a_clear_error() -> None:
    header = "code,severity,action,emitted_by,meaning,what_to_do\n"
    with pytest.raises(CatalogError, match="data row 1"):
        parse_codes(header + "a.b,loud,none,x.py,m,w\n", "f.csv")
    with pytest.raises(CatalogError, match="listed twice"):
        parse_codes(header + "a.b,info,none,x.py,m,w\na.b,info,none,x.py,m,w\n", "f.csv")
    with pytest.raises(CatalogError, match="needs a value"):
        parse_codes(header + "a.b,info,none,x.py,,w\n", "f.csv")
    info = parse_codes(header + "a.b,warning|critical,monitor|drain,x.py y.py,m,w\n", "f.csv")["a.b"]
    assert isinstance(info, CodeInfo) and len(info.severities) == 2 and info.emitted_by == ("x.py", "y.py")


def test_xid_codes_belong_to_the_xid_family() -> None:
    assert code_info("xid.79") is finding_codes()[XID_FAMILY]
    assert code_info("xid.seventy-nine") is None and code_info("nope.code") is None


# ------------------------------------------------------------------------------------------ metrics
def _exposed() -> dict[str, str]:
    """Family name → type, as the agent (with every extension) and the coordinator expose them."""
    import dataclasses
    import json
    import tempfile

    sys.path.insert(0, str(REPO / "tests" / "unit" / "exporters"))
    from exporter_testing import real_snapshot

    from gpuhealth.agent.coordinator_link import CoordinatorLink, LinkSettings
    from gpuhealth.agent.ranks import RankHub
    from gpuhealth.coordinator.metrics import CoordinatorCollector
    from gpuhealth.diag.metrics import diag_samples
    from gpuhealth.diag.runner import DiagOutcome
    from gpuhealth.exporters.prometheus import MetricsEndpoint, build_families

    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hub = RankHub(Path(tmp) / "a.sock")
        link = CoordinatorLink(LinkSettings(address="127.0.0.1:1", spool_path=str(Path(tmp) / "spool.db")))
        # real outcomes of a qualify run on 4 x H200, as periodic diagnostics keep them
        doc = json.loads((REPO / "tests" / "fixtures" / "diag" / "diag_outcomes_4xh200.json").read_text())
        outcomes = {d["diag"]: DiagOutcome(d["diag"], d["status"], d["reason"], [], d["result"], d["gpu_seconds"],
                                           d["skipped_gpus"], d["gpus"], d["wall_s"]) for d in doc["diagnostics"]}
        ran = dict.fromkeys(outcomes, 1_800_000_000.0)
        extra = [*hub.samples(), *link.samples(),
                 *diag_samples(outcomes, ran, {g["uuid"]: g["index"] for g in doc["gpus"]})]
        link.spool.close()
        for scenario in sorted(SCENARIOS.glob("*.yaml")):
            snap = real_snapshot(scenario)
            snap = dataclasses.replace(snap, samples=(*snap.samples, *extra))
            for fam in build_families(snap):
                if fam.series:
                    out[fam.sample_name] = fam.kind
            body, _ = MetricsEndpoint(lambda snap=snap: snap).render()
            for line in body.decode().splitlines():
                if line.startswith("# TYPE process_"):
                    _, _, name, kind = line.split()
                    out[name] = kind
    for metric in CoordinatorCollector().collect():
        out[metric.name + ("_total" if metric.type == "counter" else "")] = metric.type
    return out


def test_every_exposed_family_is_in_the_catalog_with_its_type() -> None:
    families = metric_families()
    exposed = _exposed()
    missing = sorted(n for n in exposed if n not in families)
    assert not missing, (f"metric families exposed but in no catalog: add one line each to {METRICS_CSV} "
                         f"(name,type,labels,section,emitted_by,help), {REGENERATE}: {missing}")
    wrong = {n: (families[n].type, kind) for n, kind in exposed.items() if families[n].type != kind}
    assert not wrong, f"{METRICS_CSV}: type differs from what is exposed (catalog, exposed): {wrong}"


def test_every_sample_the_source_names_is_in_the_catalog() -> None:
    """Families that only conditions show (IB ports, retired pages, an expected GPU count) are found
    by name in the source: every ``Sample("name", …)``."""
    bases = {f.base_name for f in metric_families().values()}
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Sample"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and not {node.args[0].value, node.args[0].value.removesuffix("_info")} & bases):
                missing.append(f"{node.args[0].value} (src/gpuhealth/{path.relative_to(SRC)}:{node.lineno})")
    assert not missing, f"samples whose family is in no catalog: add them to {METRICS_CSV}, {REGENERATE}: {missing}"


def test_every_catalog_family_is_made_where_it_says() -> None:
    wrong = []
    for f in metric_families().values():
        if f.emitted_by == "prometheus-client":
            continue  # the process collector: checked by the exposure test
        path = SRC / f.emitted_by
        # the name, or its tail after a prefix the code adds (PREFIX + "collector_success")
        names = {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
                 and isinstance(n.value, str)} if path.is_file() else set()
        if not any(n in (f.base_name, f.base_name + "_info") or (len(n) > 3 and f.base_name.endswith("_" + n))
                   for n in names):
            wrong.append(f"{f.name}: nothing in src/gpuhealth/{f.emitted_by} names it")
    assert not wrong, f"fix these rows of {METRICS_CSV} (or remove families nothing makes): {wrong}"


def test_metrics_doc_is_generated_from_the_catalog() -> None:
    expected = gen_docs().render_metrics()
    assert (REPO / "docs" / "metrics.md").read_text() == expected, f"docs/metrics.md is out of date: {REGENERATE}"


def test_a_malformed_metrics_row_is_a_clear_error() -> None:
    header = "name,type,labels,section,emitted_by,help\n"
    with pytest.raises(CatalogError, match="type must be one of"):
        parse_families(header + "gpuhealth_x,histogramish,,agent,x.py,h\n", "m.csv")
    with pytest.raises(CatalogError, match="listed twice"):
        parse_families(header + "gpuhealth_x,gauge,,agent,x.py,h\ngpuhealth_x,gauge,,agent,x.py,h\n", "m.csv")
