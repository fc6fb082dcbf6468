"""Every path value of the Helm chart reaches the pods, or the chart refuses it: the agent's and coordinator's
folders and sockets live in volumes the templates mount at fixed places, so a config path outside them fails the
render with one line naming the value and the folder to keep it in (as agent.config.agent.listen does), and one
inside them renders, mounted. The scrape intervals and the operator token's Secret reach their objects too.
Rendered by Helm's own engine (helm-python-sdk); configs loaded with gpuhealth's own loader."""

from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from chart_docs import CHART, NS, one, rendered
from chart_docs import config as loaded


def mounted(docs: list[dict[str, Any]], kind: str, name: str, path: str) -> bool:
    """``path`` lies in a volume the workload's first container mounts (not on its read-only root)."""
    container = one(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
               for m in container["volumeMounts"])


AGENT = ("DaemonSet", "gpuhealth-agent")
COORDINATOR = ("Deployment", "gpuhealth-coordinator")

# (values, the key as named in the values, the folder to keep it in)
OUTSIDE = [
    ({"agent": {"config": {"agent": {"state_dir": "/data/gpuhealth"}}}}, "agent.config.agent.state_dir",
     "/var/lib/gpuhealth"),
    ({"agent": {"config": {"agent": {"socket_path": "/run/other/agent.sock"}}}}, "agent.config.agent.socket_path",
     "/run/gpuhealth"),
    ({"agent": {"config": {"agent": {"pod_resources_socket": "/run/kubelet/pod-resources.sock"}}}},
     "agent.config.agent.pod_resources_socket", "/var/lib/kubelet/pod-resources"),
    ({"agent": {"config": {"agent": {"state_dir": "/var/lib/gpuhealth/../other"}}}}, "agent.config.agent.state_dir",
     "/var/lib/gpuhealth"),
    ({"agent": {"config": {"diag": {"state_dir": "/opt/diag"}}}}, "agent.config.diag.state_dir",
     "/var/lib/gpuhealth"),
    ({"coordinator": {"config": {"coordinator": {"db_path": "/data/coordinator.db"}}}},
     "coordinator.config.coordinator.db_path", "/var/lib/gpuhealth"),
    ({"coordinator": {"config": {"coordinator": {"evidence_dir": "/data/evidence"}}}},
     "coordinator.config.coordinator.evidence_dir", "/var/lib/gpuhealth"),
]


@pytest.mark.parametrize(("values", "key", "folder"), OUTSIDE, ids=[o[1] + "@" + str(i) for i, o in enumerate(OUTSIDE)])
def test_a_path_the_mounts_do_not_follow_is_refused_with_a_clear_line(chart: Any, values: dict[str, Any], key: str,
                                                                      folder: str) -> None:
    with pytest.raises(helm.HelmError) as refused:
        chart.render(values, name="gh", namespace=NS, is_install=True)
    message = str(refused.value)
    assert f"{key}: " in message and f"keep it under {folder}" in message, message


def test_paths_inside_the_mounted_folders_render_mounted_and_a_look_alike_folder_does_not(chart: Any) -> None:
    docs = rendered(chart, {})
    acfg = loaded(docs, "gpuhealth-agent-config", "agent.yaml")
    ccfg = loaded(docs, "gpuhealth-coordinator-config", "coordinator.yaml")
    for path in (acfg.agent.state_dir, posixpath.dirname(acfg.agent.socket_path), acfg.diag.screen_block_dir,
                 posixpath.dirname(acfg.agent.pod_resources_socket)):
        assert mounted(docs, *AGENT, path), path  # the defaults
    assert mounted(docs, *COORDINATOR, posixpath.dirname(ccfg.coordinator.db_path))
    docs = rendered(chart, {
        "agent": {"config": {"agent": {"state_dir": "/var/lib/gpuhealth/node", "socket_path": "/run/gpuhealth/a.sock"},
                             "diag": {"state_dir": "/var/lib/gpuhealth/diag2"}}},
        "coordinator": {"config": {"coordinator": {"db_path": "/var/lib/gpuhealth/db/c.db"}}}})
    acfg = loaded(docs, "gpuhealth-agent-config", "agent.yaml")
    ccfg = loaded(docs, "gpuhealth-coordinator-config", "coordinator.yaml")
    assert (acfg.agent.state_dir, acfg.agent.socket_path) == ("/var/lib/gpuhealth/node", "/run/gpuhealth/a.sock")
    assert ccfg.coordinator.db_path == "/var/lib/gpuhealth/db/c.db"
    for path in (acfg.agent.state_dir, posixpath.dirname(acfg.agent.socket_path), acfg.diag.state_dir):
        assert mounted(docs, *AGENT, path), path
    assert mounted(docs, *COORDINATOR, posixpath.dirname(ccfg.coordinator.db_path))
    # a folder whose name only starts like the mounted one is another folder
    with pytest.raises(helm.HelmError, match=re.escape("coordinator.db_path: /var/lib/gpuhealth-old/c.db is outside")):
        chart.render({"coordinator": {"config": {"coordinator": {"db_path": "/var/lib/gpuhealth-old/c.db"}}}},
                     name="gh", namespace=NS, is_install=True)


def test_the_scrape_interval_values_reach_both_service_monitors(chart: Any) -> None:
    docs = rendered(chart, {"monitoring": {"interval": "20s", "coordinatorInterval": "45s"}})
    assert one(docs, "ServiceMonitor", "gpuhealth-agent")["spec"]["endpoints"][0]["interval"] == "20s"
    assert one(docs, "ServiceMonitor", "gpuhealth-coordinator")["spec"]["endpoints"][0]["interval"] == "45s"
    defaults = rendered(chart, {})  # as before: agents every 15 s, the coordinator every 30 s
    assert one(defaults, "ServiceMonitor", "gpuhealth-coordinator")["spec"]["endpoints"][0]["interval"] == "30s"


def test_an_existing_operator_secret_with_the_operator_token_off_is_refused_not_ignored(chart: Any) -> None:
    refusal = re.escape("auth.existingOperatorSecret is set but auth.operatorToken is false")
    with pytest.raises(helm.HelmError, match=refusal):
        chart.render({"auth": {"operatorToken": False, "existingOperatorSecret": "ops"}}, name="gh", namespace=NS,
                     is_install=True)
    env = one(rendered(chart, {"auth": {"existingOperatorSecret": "ops"}}), *COORDINATOR)[
        "spec"]["template"]["spec"]["containers"][0]["env"]
    [token] = [e for e in env if e["name"] == "GPUHEALTH_COORDINATOR_OPERATOR_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "ops", "key": "token"}


def test_the_values_file_names_the_operator_secret_the_chart_makes(chart: Any) -> None:
    values = (CHART / "values.yaml").read_text()
    assert "<release>-operator-token" not in values
    secret = [d for d in rendered(chart, {}) if d["kind"] == "Secret" and "operator" in d["metadata"]["name"]]
    [name] = [d["metadata"]["name"] for d in secret]
    assert f"the Secret {name}," in values
