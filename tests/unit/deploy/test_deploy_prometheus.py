"""Alert rules: promtool accepts them, promtool's unit tests pass, every alert has a case where
it fires and one where it must not, and every alert has its runbook in docs/alerts.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
PROM = REPO / "deploy" / "prometheus"
RULES = PROM / "alerts.yaml"
RULE_TESTS = PROM / "alerts_test.yaml"
RUNBOOKS = REPO / "docs" / "alerts.md"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def alerts() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    # The same tests against rules whose XID alert never fires must fail: the suite has teeth.
    broken = RULES.read_text().replace('severity="critical"}) > 0', 'severity="critical"}) > 1', 1)
    (tmp_path / "alerts.yaml").write_text(broken)
    (tmp_path / "alerts_test.yaml").write_text(RULE_TESTS.read_text())
    result = promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert result.returncode != 0
    assert "GpuhealthXidFatal" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fires if t.get("exp_alerts") else silent).add(t["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - fires == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested staying silent"


@pytest.mark.parametrize("alert", [a["alert"] for a in alerts()])
def test_alert_has_severity_annotations_and_runbook_section(alert: str) -> None:
    rule = next(a for a in alerts() if a["alert"] == alert)
    assert rule["labels"]["severity"] in ("warning", "critical")
    ann = rule["annotations"]
    assert {"summary", "description", "runbook", "runbook_url"} <= set(ann)
    anchor = ann["runbook_url"].split("#", 1)[1]
    assert anchor == alert.lower()
    text = RUNBOOKS.read_text()
    # GitHub-style anchor of a "## GpuhealthXxx" heading is its lower-cased name
    headings = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
                for h in re.findall(r"^## (.+)$", text, flags=re.M)}
    assert anchor in headings, f"docs/alerts.md has no '## {alert}' section"


def documented_codes() -> set[str]:
    """The finding codes of docs/architecture.md ("Finding codes"); ``xid.<n>`` stands for every XID."""
    section = (REPO / "docs" / "architecture.md").read_text().split("### Finding codes", 1)[1].split("\n### ", 1)[0]
    return set(re.findall(r"`([a-z][a-z0-9_]*\.[a-z0-9_<>]+)`", section))


def _matches(code: str, codes: set[str]) -> bool:
    return code in codes or (code.startswith("xid.") and code[4:].isdigit() and "xid.<n>" in codes)


def test_alerts_route_on_documented_finding_codes() -> None:
    codes = documented_codes()
    assert {"ecc.dbe_volatile", "gpu.lost", "xid.<n>"} <= codes, "the code list of docs/architecture.md moved"
    for a in alerts():
        for literal in re.findall(r'code="([^"]+)"', a["expr"]):
            assert _matches(literal, codes), f"{a['alert']}: code {literal!r} is no documented finding code"
        for pattern in re.findall(r'code=~"([^"]+)"', a["expr"]):
            regex = re.compile(pattern.replace("\\\\", "\\"))
            examples = [c.replace("<n>", "79") for c in codes]
            assert any(regex.fullmatch(c) for c in examples), (
                f"{a['alert']}: code=~{pattern!r} matches no documented finding code, so it can never fire")


def test_example_prometheus_config_is_valid_and_names_the_jobs_the_rules_use() -> None:
    config = PROM / "prometheus.example.yml"
    result = promtool("check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {c["job_name"] for c in yaml.safe_load(config.read_text())["scrape_configs"]}
    used = set(re.findall(r'job="([^"]+)"', RULES.read_text()))
    assert used <= jobs
