"""The chart's web values (issue 32, item 4): TLS and basic auth on the agents' and the coordinator's HTTP, from one
web config the chart writes; the pods read it (--web.config.file) from where it is mounted, their probes follow
(HTTPS, no password, TCP when clients must present a certificate), and the ServiceMonitors scrape over TLS with
the CA, server name, client certificate and basic auth the values name. Rendered by Helm's engine and validated
against the Kubernetes and prometheus-operator schemas; values that cannot work together are refused."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import bcrypt
import helm_python as helm
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from chart_docs import NS, one, rendered
from test_deploy_kubernetes import K8S_VERSIONS, validate

HASH = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
ON = {"web": {"tls": {"secretName": "gh-tls"},
              "basicAuth": {"users": {"prometheus": HASH}, "scrapeSecret": "gh-scrape"}}}


def _container(docs: list[dict[str, Any]], kind: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = one(docs, kind, name)["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def _mounted_secret(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) a container path is read from: the mount holding it and the volume's Secret."""
    [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume["secret"]["secretName"], path[len(mount["mountPath"]) + 1:]


def test_off_by_default(chart: Any) -> None:
    docs = rendered(chart)
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "gpuhealth-web-config"]
    for kind, name in (("DaemonSet", "gpuhealth-agent"), ("Deployment", "gpuhealth-coordinator")):
        assert "--web.config.file" not in _container(docs, kind, name)[1]["args"]
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        assert not {"scheme", "tlsConfig", "basicAuth"} & set(sm["spec"]["endpoints"][0])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_tls_and_basic_auth_render_valid_objects(chart: Any, version: str) -> None:
    for doc in rendered(chart, ON):
        validate(doc, version)


def test_the_pods_read_the_web_config_the_chart_writes(chart: Any) -> None:
    docs = rendered(chart, ON)
    secret = one(docs, "Secret", "gpuhealth-web-config")
    web = yaml.safe_load(secret["stringData"]["web.yml"])
    assert web["basic_auth_users"] == {"prometheus": HASH}
    assert web["tls_server_config"]["min_version"] == "TLS12"
    assert web["tls_server_config"]["client_auth_type"] == "NoClientCert"
    for kind, name in (("DaemonSet", "gpuhealth-agent"), ("Deployment", "gpuhealth-coordinator")):
        spec, c = _container(docs, kind, name)
        path = c["args"][c["args"].index("--web.config.file") + 1]
        assert _mounted_secret(spec, c, path) == ("gpuhealth-web-config", "web.yml")
        tls = web["tls_server_config"]
        assert _mounted_secret(spec, c, tls["cert_file"]) == ("gh-tls", "tls.crt")  # a kubernetes.io/tls Secret
        assert _mounted_secret(spec, c, tls["key_file"]) == ("gh-tls", "tls.key")
    spec, agent = _container(docs, "DaemonSet", "gpuhealth-agent")
    # the kubelet's probes: HTTPS, and paths that ask no password (basic auth spares /healthz and /ready)
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics", "scheme": "HTTPS"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics", "scheme": "HTTPS"}


def test_the_service_monitors_scrape_over_tls_with_basic_auth(chart: Any) -> None:
    docs = rendered(chart, ON)
    for service in ("gpuhealth-agent", "gpuhealth-coordinator"):
        [endpoint] = one(docs, "ServiceMonitor", service)["spec"]["endpoints"]
        assert endpoint["scheme"] == "https"
        assert endpoint["tlsConfig"] == {"serverName": f"{service}.{NS}.svc",
                                         "ca": {"secret": {"name": "gh-tls", "key": "ca.crt"}}}
        assert endpoint["basicAuth"] == {"username": {"name": "gh-scrape", "key": "username"},
                                         "password": {"name": "gh-scrape", "key": "password"}}


def test_client_certificates(chart: Any) -> None:
    values = {"web": {"tls": {"secretName": "gh-tls", "clientAuthType": "RequireAndVerifyClientCert",
                              "scrapeClientSecret": "prom-client"}}}
    docs = rendered(chart, values)
    web = yaml.safe_load(one(docs, "Secret", "gpuhealth-web-config")["stringData"]["web.yml"])
    spec, agent = _container(docs, "DaemonSet", "gpuhealth-agent")
    assert _mounted_secret(spec, agent, web["tls_server_config"]["client_ca_file"]) == ("gh-tls", "ca.crt")
    assert "basic_auth_users" not in web
    # the kubelet cannot present a client certificate: its probes only connect
    assert agent["livenessProbe"]["tcpSocket"] == agent["readinessProbe"]["tcpSocket"] == {"port": "metrics"}
    [endpoint] = one(docs, "ServiceMonitor", "gpuhealth-agent")["spec"]["endpoints"]
    assert endpoint["tlsConfig"]["cert"] == {"secret": {"name": "prom-client", "key": "tls.crt"}}
    assert endpoint["tlsConfig"]["keySecret"] == {"name": "prom-client", "key": "tls.key"}
    assert "basicAuth" not in endpoint
    optional = rendered(chart, {"web": {"tls": {"secretName": "gh-tls", "clientAuthType": "VerifyClientCertIfGiven"}}})
    web = yaml.safe_load(one(optional, "Secret", "gpuhealth-web-config")["stringData"]["web.yml"])
    assert web["tls_server_config"]["client_ca_file"].endswith("/ca.crt")
    assert _container(optional, "DaemonSet", "gpuhealth-agent")[1]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


@pytest.mark.parametrize(("values", "says"), [
    ({"web": {"basicAuth": {"users": {"prometheus": HASH}}}}, "set web.basicAuth.scrapeSecret"),
    ({"web": {"tls": {"secretName": "t", "clientAuthType": "RequireAndVerifyClientCert"}}},
     "set web.tls.scrapeClientSecret"),
    ({"web": {"tls": {"clientAuthType": "VerifyClientCertIfGiven"}}}, "needs web.tls.secretName"),
    ({"web": {"tls": {"secretName": "t"}}, "npd": {"enabled": True}}, "node-problem-detector's check"),
    ({"web": {"basicAuth": {"users": {"prometheus": "plain-text"}, "scrapeSecret": "s"}}}, "does not match pattern"),
    ({"web": {"basicAuth": {"users": {"a:b": HASH}, "scrapeSecret": "s"}}}, "invalid propertyName 'a:b'"),
    ({"web": {"tls": {"secretName": "t", "clientAuthType": "RequireAnyClientCert"}}}, "clientAuthType"),
    ({"web": {"tls": {"secretName": "t", "minVersion": "TLS14"}}}, "minVersion"),
], ids=["users-no-scrape-secret", "client-certs-no-scrape-cert", "client-ca-no-tls", "npd", "plain-password",
        "colon-in-user", "unverified-client-certs", "tls14"])
def test_values_that_cannot_work_are_refused(chart: Any, values: dict[str, Any], says: str) -> None:
    with pytest.raises((helm.HelmRenderError, helm.HelmValuesError), match=says):
        chart.render(values, name="gh", namespace=NS, is_install=True)


def test_without_service_monitors_no_scrape_secret_is_needed(chart: Any) -> None:
    docs = rendered(chart, {"web": {"basicAuth": {"users": {"prometheus": HASH}}},
                            "monitoring": {"serviceMonitor": False}})
    assert "--web.config.file" in _container(docs, "DaemonSet", "gpuhealth-agent")[1]["args"]
