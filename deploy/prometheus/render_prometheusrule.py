#!/usr/bin/env python3
"""Render deploy/kubernetes/base/prometheusrule.yaml from deploy/prometheus/alerts.yaml (the one source
of truth for alert rules). Run after editing alerts.yaml:

    python deploy/prometheus/render_prometheusrule.py          # rewrite the manifest
    python deploy/prometheus/render_prometheusrule.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "alerts.yaml"
TARGET = HERE.parent / "kubernetes" / "base" / "prometheusrule.yaml"

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


def render(source_text: str) -> str:
    rules = yaml.safe_load(source_text)
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "gpuhealth",
            "namespace": "gpuhealth",
            "labels": {"app.kubernetes.io/part-of": "gpuhealth", "prometheus": "k8s", "role": "alert-rules"},
        },
        "spec": {"groups": rules["groups"]},
    }
    return HEADER + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=4096, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the manifest is up to date")
    args = parser.parse_args(argv)
    text = render(SOURCE.read_text())
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is out of date; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
