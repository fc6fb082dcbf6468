"""Rendering the Helm chart into documents and finding one (shared by the chart tests)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from gpuhealth.config import Config, load_config

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "gpuhealth"
NS = "gpu-mon"


def rendered(chart: Any, values: dict[str, Any] | None = None, namespace: str = NS) -> list[dict[str, Any]]:
    """The objects Helm would install (NOTES.txt, the text Helm prints after an install, is none of them)."""
    out = chart.render(values or {}, name="gh", namespace=namespace, is_install=True)
    return [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]


def notes(chart: Any, values: dict[str, Any] | None = None, namespace: str = NS) -> str:
    """What ``helm install`` prints after installing (templates/NOTES.txt)."""
    out = chart.render(values or {}, name="gh", namespace=namespace, is_install=True)
    return str(out["gpuhealth/templates/NOTES.txt"])


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [d] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def config(docs: list[dict[str, Any]], configmap: str, key: str) -> Config:
    """The config a rendered ConfigMap holds, loaded by gpuhealth's own loader (its name may carry the hash
    suffix kustomize's configMapGenerator adds)."""
    [cm] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(configmap)]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / key
        path.write_text(cm["data"][key])
        return load_config(path, env={})
