#!/usr/bin/env python3
"""Render the alert rules of deploy/prometheus/alerts.yaml (the one source of truth) for use, with
absolute runbook links:

    python deploy/prometheus/render_prometheusrule.py          # rewrite deploy/kubernetes/base/prometheusrule.yaml
                                                               # and the Helm chart's copy of the rules
    python deploy/prometheus/render_prometheusrule.py --check  # exit 1 if it is out of date
    python deploy/prometheus/render_prometheusrule.py --runbook-base-url https://wiki.example/gpuhealth/ \\
        --format rules --output /etc/prometheus/rules/gpuhealth.yaml   # a plain Prometheus rule file

alerts.yaml says ``runbook_url: docs/alerts.md#<alert>`` (relative, so it stays valid in any copy of
the repository); alert receivers need an absolute URL, so every rendering joins it to a base URL:
``--runbook-base-url`` (default: the project's repository), e.g. your own mirror of docs/alerts.md.
The Helm chart does the same with its ``runbookBaseUrl`` value.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "alerts.yaml"
TARGET = HERE.parent / "kubernetes" / "base" / "prometheusrule.yaml"
# The Helm chart cannot read files outside itself: it carries a copy, made here (and checked).
CHART_COPY = HERE.parent / "helm" / "gpuhealth" / "files" / "alerts.yaml"
DEFAULT_RUNBOOK_BASE_URL = "https://github.com/gpuhealth/gpuhealth/blob/main/"

HEADER = """\
# GENERATED from deploy/prometheus/alerts.yaml by deploy/prometheus/render_prometheusrule.py.
# Do not edit: edit alerts.yaml and re-run the script (a test checks they match).
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # multi-line PromQL keeps its block form; everything else plain or quoted as YAML needs
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def absolute_runbooks(groups: list[dict[str, Any]], base_url: str) -> list[dict[str, Any]]:
    """The groups with every relative ``runbook_url`` joined to ``base_url`` (http or https)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"runbook base URL must be an absolute http(s) URL, got {base_url!r}")
    base = base_url if base_url.endswith("/") else base_url + "/"
    out = copy.deepcopy(groups)
    for group in out:
        for rule in group.get("rules", []):
            ann = rule.get("annotations") or {}
            url = ann.get("runbook_url")
            if isinstance(url, str) and not urlsplit(url).scheme:
                ann["runbook_url"] = base + url.lstrip("/")
    return out


def render(source_text: str, runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
    """The PrometheusRule manifest."""
    rules = yaml.safe_load(source_text)
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "gpuhealth",
            "namespace": "gpuhealth",
            "labels": {"app.kubernetes.io/part-of": "gpuhealth", "prometheus": "k8s", "role": "alert-rules"},
        },
        "spec": {"groups": absolute_runbooks(rules["groups"], runbook_base_url)},
    }
    return HEADER + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=4096, allow_unicode=True)


def render_rules(source_text: str, runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
    """A plain Prometheus rule file (``rule_files:``)."""
    groups = absolute_runbooks(yaml.safe_load(source_text)["groups"], runbook_base_url)
    return HEADER + yaml.dump({"groups": groups}, Dumper=_Dumper, sort_keys=False, width=4096, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the manifest is up to date")
    parser.add_argument("--runbook-base-url", default=DEFAULT_RUNBOOK_BASE_URL,
                        help="absolute URL that docs/alerts.md#… is joined to (default: %(default)s)")
    parser.add_argument("--format", choices=("prometheusrule", "rules"), default="prometheusrule",
                        help="a PrometheusRule manifest (default) or a plain Prometheus rule file")
    parser.add_argument("--output", type=Path, default=None, help="where to write (default: the manifest in deploy/)")
    args = parser.parse_args(argv)
    try:
        renderer = render if args.format == "prometheusrule" else render_rules
        text = renderer(SOURCE.read_text(), args.runbook_base_url)
    except ValueError as exc:
        print(f"render_prometheusrule: {exc}", file=sys.stderr)
        return 2
    target = args.output or TARGET
    outputs = {target: text}
    if args.output is None:
        outputs[CHART_COPY] = SOURCE.read_text()
    if args.check:
        stale = [p for p, t in outputs.items() if not p.exists() or p.read_text() != t]
        for p in stale:
            print(f"{p} is out of date; run {Path(__file__).name}", file=sys.stderr)
        return 1 if stale else 0
    for p, t in outputs.items():
        p.write_text(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
