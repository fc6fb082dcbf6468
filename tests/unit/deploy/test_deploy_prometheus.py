"""Alert rules: promtool accepts them, promtool's unit tests pass, every alert has a case where
it fires and one where it must not, every alert has its runbook in docs/alerts.md, and every code
and metric an alert names is in the catalogs (src/gpuhealth/catalog/)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuhealth.catalog.findings import code_info, finding_codes
from gpuhealth.catalog.metrics import metric_families

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


def _selectors(expr: str, metric: str) -> list[dict[str, tuple[str, str]]]:
    """Label matchers of every ``metric{...}`` selector in ``expr``: label → (op, value)."""
    out = []
    for body in re.findall(re.escape(metric) + r"\{([^}]*)\}", expr):
        matchers = re.findall(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"', body)
        out.append({k: (op, v.replace("\\\\", "\\")) for k, op, v in matchers})
    return out


def test_alerts_route_on_catalog_finding_codes_and_can_fire() -> None:
    """Every code an alert names is in the finding-code catalog, and every selector on
    gpuhealth_findings matches at least one catalog code with a severity the selector allows."""
    codes = finding_codes()
    examples = {c.replace("<n>", "79"): info for c, info in codes.items()}
    checked = 0
    for a in alerts():
        for sel in _selectors(a["expr"], "gpuhealth_findings"):
            candidates = list(examples.items())
            if "code" in sel:
                op, value = sel["code"]
                if op == "=":
                    assert code_info(value) is not None, f"{a['alert']}: code {value!r} is in no catalog row"
                    candidates = [(value, code_info(value))]  # type: ignore[list-item]
                else:
                    candidates = [(c, i) for c, i in candidates if re.fullmatch(value, c)]
            if "severity" in sel:
                op, value = sel["severity"]
                candidates = [(c, i) for c, i in candidates
                              if any(re.fullmatch(value, str(s)) for s in i.severities)]
            assert candidates, f"{a['alert']}: {sel} matches no catalog finding code: it can never fire"
            checked += 1
    assert checked >= 8


def metric_names_in(rule: dict[str, Any]) -> set[str]:
    """Every gpuhealth/process family a rule reads: its expression and the queries in its annotations."""
    text = " ".join([rule["expr"], *map(str, (rule.get("annotations") or {}).values())])
    return set(re.findall(r"\b((?:gpuhealth|process)_[a-z_]+)\b", text))


def test_alerts_use_only_catalog_metrics() -> None:
    families = metric_families()
    for a in alerts():
        for name in metric_names_in(a):
            assert name in families, f"{a['alert']}: {name} is in no row of src/gpuhealth/catalog/metrics.csv"


def test_example_prometheus_config_is_valid_and_names_the_jobs_the_rules_use() -> None:
    config = PROM / "prometheus.example.yml"
    result = promtool("check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {c["job_name"] for c in yaml.safe_load(config.read_text())["scrape_configs"]}
    used = set(re.findall(r'job="([^"]+)"', RULES.read_text()))
    assert used <= jobs


def _selector_matches(selector: str, code: str, severity: str) -> bool:
    """Whether a ``gpuhealth_findings{…}`` matcher list selects a series with this code and severity."""
    for name, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', selector):
        if name not in ("code", "severity"):
            continue
        pattern = value.encode().decode("unicode_escape")
        actual = code if name == "code" else severity
        hit = re.fullmatch(pattern, actual) is not None if "~" in op else actual == pattern
        if hit != (op in ("=", "=~")):
            return False
    return True


def _agent_codes() -> list[str]:
    """Critical codes the agent can put on /metrics (emitted by the agent, its collectors or diagnostics)."""
    out = []
    for info in finding_codes().values():
        if info.per_xid_catalog:
            out.append("xid.79")
            continue
        sources = " ".join(info.emitted_by)
        if "critical" in {str(s) for s in info.severities} and any(
                part in sources for part in ("collectors/", "agent/", "diag/", "node.py")):
            out.append(info.code)
    return out


@pytest.mark.parametrize("code", _agent_codes())
def test_every_critical_finding_the_agent_emits_reaches_a_critical_alert(code: str) -> None:
    critical = [a for a in alerts() if a["labels"]["severity"] == "critical"]
    hits = [a["alert"] for a in critical for sel in re.findall(r"gpuhealth_findings\{([^}]*)\}", a["expr"])
            if _selector_matches(sel, code, "critical")]
    if code == "nvml.unavailable":  # its own series: gpuhealth_nvml_up == 0
        hits += [a["alert"] for a in critical if "gpuhealth_nvml_up" in a["expr"]]
    assert hits, f"a critical {code} fires no critical alert"


def test_a_code_nobody_knows_yet_still_pages() -> None:
    [catch_all] = [a for a in alerts() if a["alert"] == "GpuhealthCriticalFinding"]
    [sel] = re.findall(r"gpuhealth_findings\{([^}]*)\}", catch_all["expr"])
    assert _selector_matches(sel, "newarea.fault", "critical")
    assert not _selector_matches(sel, "newarea.fault", "warning")


def test_rendered_rules_have_absolute_runbook_urls_under_a_chosen_base(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_prometheusrule", PROM / "render_prometheusrule.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    manifest = yaml.safe_load(mod.render(RULES.read_text(), "https://wiki.example.org/ops/gpuhealth"))
    urls = [r["annotations"]["runbook_url"] for g in manifest["spec"]["groups"] for r in g["rules"]]
    assert urls and all(u.startswith("https://wiki.example.org/ops/gpuhealth/docs/alerts.md#gpuhealth") for u in urls)
    shipped = yaml.safe_load((REPO / "deploy/kubernetes/base/prometheusrule.yaml").read_text())
    assert all(r["annotations"]["runbook_url"].startswith(mod.DEFAULT_RUNBOOK_BASE_URL)
               for g in shipped["spec"]["groups"] for r in g["rules"])
    # the plain rule file is valid for promtool and links the same way
    out = tmp_path / "rules.yaml"
    assert mod.main(["--format", "rules", "--runbook-base-url", "https://wiki.example.org/x/", "--output",
                     str(out)]) == 0
    assert "https://wiki.example.org/x/docs/alerts.md#gpuhealthxidfatal" in out.read_text()
    result = promtool("check", "rules", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    with pytest.raises(ValueError, match="absolute http"):
        mod.render(RULES.read_text(), "wiki/gpuhealth")


def test_collector_alerts_exempt_exactly_the_nvml_collectors_while_nvml_is_down() -> None:
    """CollectorFailing and StaleData keep quiet about NVML collectors while NVML is down (one cause, its own
    alert); the collectors that do not use NVML are named in the rules and must stay the code's list."""
    from gpuhealth.collectors.registry import all_collectors

    independent = sorted(c.name for c in all_collectors() if not getattr(c, "needs_nvml", True))
    assert independent  # host, infiniband
    by_name = {a["alert"]: a["expr"] for a in alerts()}
    for name in ("GpuhealthCollectorFailing", "GpuhealthStaleData"):
        [listed] = re.findall(r'collector!~"([^"]+)"', by_name[name])
        assert sorted(listed.split("|")) == independent, name


# The labels the agent puts on a GPU series for whoever holds the GPU now (agent/attribution.py): they
# change with every job, so an alert keyed on them restarts its `for:` at every job (issue 32).
HOLDER_LABELS = {"namespace", "pod", "container", "slurm_job_id", "hpc_job"}


def finding_alerts() -> list[dict[str, Any]]:
    """Alerts about findings (GpuhealthNvmlDown only reads one to stay quiet: not its subject)."""
    return [a for a in alerts() if "gpuhealth_findings" in a["expr"].split("unless")[0]]


def test_finding_alerts_are_keyed_on_the_gpu_and_code_not_on_the_job_holding_it() -> None:
    """Every aggregation of a finding alert names what the problem belongs to (node, GPU, code) and none of
    the holder labels; the holder is the `holder` annotation, read at evaluation time."""
    assert len(finding_alerts()) >= 9
    for a in finding_alerts():
        groupings = re.findall(r"\b(?:max|sum|min|count) by \(([^)]*)\)", a["expr"])
        assert groupings, f"{a['alert']}: gpuhealth_findings without an aggregation keeps every label, holders too"
        for grouping in groupings:
            labels = {label.strip() for label in grouping.split(",")}
            assert "instance" in labels and "code" in labels, (a["alert"], labels)
            holders = labels & HOLDER_LABELS
            assert not holders, f"{a['alert']}: grouped by the job holding the GPU ({holders})"
        # About the agent, or about a node's network as the fabric probe measured it between jobs: never a job's.
        if a["alert"] not in ("GpuhealthCannotCheckGpus", "GpuhealthFabricSlow"):
            assert "holder" in a["annotations"], a["alert"]


def test_every_finding_alert_is_tested_across_job_churn() -> None:
    """alerts_test.yaml has, for every finding alert about a GPU, a case whose GPU changes holder with stale
    markers between jobs, where the alert fires after the first holder's series went stale and is gone once
    the finding is (promtool runs it: test_promtool_unit_tests_pass)."""
    churned: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        holders_by_gpu: dict[tuple[str, str], set[str]] = {}
        first_stale_min = None
        for s in case["input_series"]:
            if not s["series"].startswith("gpuhealth_findings{") or "stale" not in s["values"]:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', s["series"]))
            key = (labels.get("instance", ""), labels.get("code", ""))
            holders_by_gpu.setdefault(key, set()).add(",".join(labels.get(h, "") for h in sorted(HOLDER_LABELS)))
            stale_at = _expanded(s["values"]).index("stale")
            first_stale_min = stale_at if first_stale_min is None else min(first_stale_min, stale_at)
        if first_stale_min is None or not any(len(h) >= 3 for h in holders_by_gpu.values()):
            continue
        firing = {t["alertname"] for t in case["alert_rule_test"]
                  if t.get("exp_alerts") and _minutes(t["eval_time"]) > first_stale_min}
        resolved = {t["alertname"] for t in case["alert_rule_test"] if not t.get("exp_alerts")}
        churned |= firing & resolved
    gpu_alerts = {a["alert"] for a in finding_alerts() if "holder" in a["annotations"]}
    assert gpu_alerts - churned == set(), "finding alerts with no job-churn case"


def _minutes(duration: str) -> int:
    value = int(duration[:-1])
    return {"m": value, "h": 60 * value}[duration[-1]]


def _expanded(values: str) -> list[str]:
    """promtool's series notation, as far as the churn cases use it: '1x3' is 4 samples, '_x3' 3 gaps."""
    out: list[str] = []
    for token in values.split():
        head, _, times = token.partition("x")
        if not times:
            out.append(head)
        else:
            out += [head] * (int(times) + (0 if head == "_" else 1))
    return out
