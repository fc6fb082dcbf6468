"""docs/measurements.md is the project's own account of the measurements its design rests on (issue 32):
it replaced a verbatim copy of outside notes (docs/reference/MEASUREMENTS.md, which named a path on the
machine it was copied from). Every file it points to is in the repository, and the numbers it quotes are
the ones in those files: the NVML recordings' per-call costs, the busbw reference the probe judges
against, the SDC benchmark's results."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from statistics import median
from typing import Any

from gpuhealth.diag.busbw import REFERENCE_CURVES

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "measurements.md"
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]
MiB, GiB = 1 << 20, 1 << 30


def text() -> str:
    """The page with its line breaks as spaces (a quoted number may wrap)."""
    return re.sub(r"\s*\n\s*", " ", DOC.read_text(encoding="utf-8"))


def test_the_outside_copy_is_gone_and_no_page_names_a_path_on_some_machine() -> None:
    assert not (REPO / "docs" / "reference" / "MEASUREMENTS.md").exists()
    for page in PAGES:
        if page.parent.name == "reference":
            continue  # the other verbatim copies (flight recorder, zero-code) say where they came from
        body = page.read_text(encoding="utf-8")
        assert "reference/MEASUREMENTS.md" not in body, page
        assert not re.search(r"(?<![\w.])/(?:work|home|Users)/", body), f"{page}: an absolute path of a machine"


def test_every_repository_path_the_page_names_exists() -> None:
    named = set(re.findall(r"\]\((\.\./[^)#\s]+|[\w-]+\.md)", text()))  # links
    unlinked = re.sub(r"\[[^\]]*\]\(", "(", text())  # a link's text is no path of its own
    named |= set(re.findall(r"`([\w./-]+/[\w.-]*)`", unlinked))  # `path/in/backticks`
    missing = []
    for name in sorted(named):
        if not ((DOC.parent / name).exists() or (REPO / name).exists()):  # a link, or a path from the root
            missing.append(name)
    assert len(named) >= 12
    assert missing == [], missing


def _recording(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REPO / "src" / "gpuhealth" / "data" / name).read_text())
    return data


def _costs_us(recording: dict[str, Any]) -> dict[str, list[float]]:
    """Call name → its recorded median cost on each GPU (µs)."""
    out: dict[str, list[float]] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, dict) and "median_us" in value:
            out.setdefault(key, []).append(float(value["median_us"]))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}.{k}", v)

    for device in recording["devices"]:
        for k, v in device.items():
            walk(k, v)
    return out


def test_the_nvml_costs_quoted_are_the_recordings() -> None:
    doc = text()
    h200, h100 = _recording("nvml_h200x2.json"), _recording("nvml_h100x1.json")
    assert f"takes {round(h200['init_s'] * 1000)} ms on the H200 guest and {round(h100['init_s'] * 1000)} ms" in doc
    costs = _costs_us(h200)
    counters = [c for k, v in costs.items() if re.fullmatch(r"nvlink\.\d+\.err_\w+", k) for c in v]
    low, high, typical = min(counters) / 1000, max(counters) / 1000, median(counters) / 1000
    assert f"({low:.1f}–{high:.1f} ms, median {typical:.1f} ms" in doc
    pcie = max(max(costs["PcieThroughput_RX"]), max(costs["PcieThroughput_TX"])) / 1000
    assert f"PCIe throughput** costs ~{pcie:.0f} ms" in doc
    assert f"energy counter ~{max(costs['TotalEnergyConsumption']) / 1000:.1f} ms" in doc
    clocks = [c / 1000 for k, v in costs.items() if k.startswith("MaxClockInfo_") for c in v]
    assert f"maximum clocks {min(clocks):.1f}–{max(clocks):.1f} ms" in doc
    scalar = ["Temperature_GPU", "PowerUsage", "ClockInfo_SM", "UtilizationRates", "MemoryInfo",
              "CurrentClocksEventReasons", "RemappedRows", "CurrPcieLinkGeneration"]
    assert max(c for k in scalar for c in costs[k]) < 10  # "a few microseconds each"


def _table(doc: str) -> dict[str, dict[int, float]]:
    rows = re.findall(r"\| (\w+) \| (\d+) \| (\d+) \| (\d+) \|", doc)
    return {name: {MiB: float(a), 64 * MiB: float(b), 2 * GiB: float(c)} for name, a, b, c in rows}


def test_the_busbw_reference_is_the_probes_curve_and_the_benchmarks() -> None:
    table = _table(text())
    assert len(table) == 6
    assert table == {k: {s: float(v) for s, v in curve.items()} for k, curve in REFERENCE_CURVES["nvlink@2"].items()}
    bench = ast.parse((REPO / "benchmarks" / "busbw_bench.py").read_text())
    [assign] = [n for n in bench.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "MEASUREMENTS_2GPU" for t in n.targets)]
    names = {"MiB": MiB, "GiB": GiB}
    measured = eval(compile(ast.Expression(assign.value), "busbw_bench", "eval"), {"__builtins__": {}}, names)
    assert table == {k: {s: float(v) for s, v in curve.items()} for k, curve in measured.items()}


def test_the_sdc_numbers_quoted_are_the_benchmarks_results() -> None:
    results = json.loads((REPO / "benchmarks" / "results" / "sdc_h200_2026-11-26.json").read_text())
    [case] = [c for c in results["cases"] if c["case"] == "bf16/square/8192x8192x8192"]
    doc = text()
    share = case["plain_torch_hash_ms"] / case["plain_ms"]
    assert f"took {case['plain_torch_hash_ms']:.2f} ms on the 8192² bf16 output against a {case['plain_ms']:.2f} ms" \
        f" matmul ({share:.0%})".replace("%", " %") in doc
    assert f"costs {case['hash_ms']:.3f} ms there ({case['hash_fraction']:.1%};".replace("%", " %") in doc
    assert len(results["cases"]) == 12 and "12 cases" in doc
    assert all(h["agree"] for h in results["hash_agreement"])
