"""TLS and basic auth on the agent's /metrics and /health and the coordinator's /metrics (issue 32, item 4),
through the shipped commands: ``gpuhealth agent`` given exporter-toolkit's web config (``--web.config.file``, or
``agent.web_config_file`` / ``GPUHEALTH_AGENT_WEB_CONFIG_FILE``), ``gpuhealth coordinator`` given one
(``coordinator.metrics_web_config_file``, ``--web.config.file``).

A real Prometheus (Debian's) scrapes the agent over TLS with basic auth and stores its series; the same target
with a wrong password (401), without a password (401) and over plain HTTP is down. A TLS handshake that never
completes holds no worker: scrapes answer while such connections are open, and the agent closes them at its
header deadline. Client certificates (RequireAndVerifyClientCert, client_allowed_sans) are checked. A web
config the agent cannot serve stops it at start with one line (exit 3)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from agent_process import AgentProcess, http_get, prometheus_port
from commands import CLI, Coordinator, make_pki

pytestmark = pytest.mark.integration
SCENARIO = Path(__file__).parents[1] / "fixtures" / "scenarios" / "faulty_node.yaml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
USER, PASSWORD = "prometheus", "correct horse battery staple"


@dataclass
class Pki:
    ca: str
    agent: tuple[str, str]
    client: tuple[str, str]  # CN "prometheus.monitoring"
    stranger: tuple[str, str]  # CN "someone-else", same CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    made = make_pki(d, {"agent": "gpu-node-7", "client": "prometheus.monitoring", "stranger": "someone-else"})
    return Pki(str(d / "ca.crt"), made["agent"], made["client"], made["stranger"])


def _start(work: Path, web: dict[str, Any], *, given: str) -> AgentProcess:
    """The agent with ``web`` as its web config, ``given`` by the config file ("file"), the environment ("env")."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "web.yml").write_text(yaml.safe_dump(web))
    cfg = work / "agent.yaml"
    agent = {"node_name": "gpu-node-7", "socket_path": str(work / "agent.sock"),
             "pod_resources_socket": str(work / "no-kubelet.sock")}
    if given == "file":
        agent["web_config_file"] = str(work / "web.yml")
    cfg.write_text(yaml.safe_dump({"collectors": {"fast_interval_s": 1.0, "slow_interval_s": 2.0}, "agent": agent}))
    args = ["--config", str(cfg), "--scenario", str(SCENARIO)]
    env = {"GPUHEALTH_AGENT_WEB_CONFIG_FILE": str(work / "web.yml")} if given == "env" else {}
    return AgentProcess(work, args, env=env)


def _wait_ready(agent: AgentProcess, ctx: ssl.SSLContext, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert agent.proc.poll() is None, agent.log()
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{agent.port}/ready", context=ctx, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"agent not ready over TLS:\n{agent.log()[-3000:]}")


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[AgentProcess]:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=8)).decode()
    web = {"tls_server_config": {"cert_file": pki.agent[0], "key_file": pki.agent[1], "min_version": "TLS12"},
           "basic_auth_users": {USER: hashed}}
    proc = _start(tmp_path_factory.mktemp("agent"), web, given="env")
    try:
        _wait_ready(proc, _client_ctx(pki))
        yield proc
    finally:
        proc.stop()


def _client_ctx(pki: Pki, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def _get(port: int, path: str, ctx: ssl.SSLContext | None, auth: tuple[str, str] | None = None,
         timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    scheme = "https" if ctx is not None else "http"
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_agent_says_it_serves_https(agent: AgentProcess) -> None:
    assert f"serving /metrics, /health, /ready on https://127.0.0.1:{agent.port}" in agent.log()


def test_right_password_wrong_password_no_password(agent: AgentProcess, pki: Pki) -> None:
    ctx = _client_ctx(pki)
    code, _, body = _get(agent.port, "/metrics", ctx, (USER, PASSWORD))
    assert code == 200 and b"gpuhealth_findings" in body
    code, _, body = _get(agent.port, "/health", ctx, (USER, PASSWORD))
    assert code == 200 and json.loads(body)["node"]["health"] == "unhealthy"
    for auth in ((USER, "wrong"), ("root", PASSWORD), None):
        for path in ("/metrics", "/health", "/"):
            code, headers, _ = _get(agent.port, path, ctx, auth)
            assert code == 401, (auth, path)
            assert headers["WWW-Authenticate"] == 'Basic realm="gpuhealth"'
    # a kubelet's probes carry no password: /healthz and /ready answer without one (over TLS)
    assert _get(agent.port, "/healthz", ctx)[0] == 200
    assert _get(agent.port, "/ready", ctx)[0] == 200


def test_plain_http_is_refused(agent: AgentProcess) -> None:
    with pytest.raises((OSError, urllib.error.URLError, ConnectionError)):
        http_get(f"http://127.0.0.1:{agent.port}/metrics", timeout=5)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_a_handshake_that_never_completes_holds_no_worker(agent: AgentProcess, pki: Pki) -> None:
    """Twenty connections (more than the four workers) that never finish a TLS handshake — half silent, half
    stopping inside their ClientHello — take no thread: scrapes answer meanwhile, and the agent closes them at
    the header deadline (10 s) instead of holding them forever."""
    base = _threads(agent.proc.pid)
    stalled: list[socket.socket] = []
    opened = time.monotonic()
    try:
        for i in range(20):
            s = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
            if i % 2:
                s.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello's first bytes, no more
            stalled.append(s)
        ctx = _client_ctx(pki)
        peak = base
        for _ in range(5):  # each answered within its 5 s timeout while the handshakes hang
            code, _, body = _get(agent.port, "/metrics", ctx, (USER, PASSWORD), timeout=5.0)
            assert code == 200 and b"gpuhealth_" in body
            peak = max(peak, _threads(agent.proc.pid))
        assert peak <= base + 6, (base, peak)
        for s in stalled:  # the agent hangs up on each (EOF or reset) once its deadline passes
            s.settimeout(max(0.1, opened + 20 - time.monotonic()))
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        waited = time.monotonic() - opened
        assert 8.0 <= waited <= 20.0, waited
    finally:
        for s in stalled:
            s.close()


# ------------------------------------------------------------------------------------------ Prometheus
def _query(prom: str, promql: str) -> list[dict[str, Any]]:
    code, body = http_get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=5)
    result: list[dict[str, Any]] = json.loads(body)["data"]["result"] if code == 200 else []
    return result


def _until(fn: Any, timeout: float, what: str, detail: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = fn()
        except OSError:
            out = None
        if out:
            return out
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{detail()}" if detail else ""))


def test_a_real_prometheus_scrapes_over_tls_with_basic_auth(agent: AgentProcess, pki: Pki, tmp_path: Path) -> None:
    target: dict[str, Any] = {"static_configs": [{"targets": [f"127.0.0.1:{agent.port}"]}]}
    tls: dict[str, Any] = {"scheme": "https", "tls_config": {"ca_file": pki.ca, "server_name": "gpu-node-7"}}
    jobs: list[dict[str, Any]] = [
        {"job_name": "tls-auth", **target, **tls, "basic_auth": {"username": USER, "password": PASSWORD}},
        {"job_name": "wrong-password", **target, **tls, "basic_auth": {"username": USER, "password": "nope"}},
        {"job_name": "no-password", **target, **tls},
        {"job_name": "plain-http", **target},
    ]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(
        {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs}))
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log:
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             "--web.listen-address=127.0.0.1:0", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{prometheus_port(log_path, prom)}"
            detail = lambda: log_path.read_text(errors="replace")[-3000:]  # noqa: E731
            _until(lambda: _query(url, 'up{job="tls-auth"} == 1'), 60, "Prometheus to scrape over TLS", detail)
            [finding] = _until(lambda: _query(url, 'gpuhealth_findings{job="tls-auth",code="pcie.link_degraded"}'),
                               30, "the agent's series in Prometheus", detail)
            assert finding["metric"]["gpu"] == "3"

            def targets() -> dict[str, dict[str, Any]] | None:
                _, body = http_get(f"{url}/api/v1/targets", timeout=5)
                active: dict[str, dict[str, Any]] = {t["labels"]["job"]: t
                                                     for t in json.loads(body)["data"]["activeTargets"]}
                names = [str(j["job_name"]) for j in jobs]
                seen = all(n in active and active[n]["health"] != "unknown" for n in names)
                return active if seen else None

            active = _until(targets, 30, "every job scraped once", detail)
            assert active["tls-auth"]["health"] == "up"
            for job in ("wrong-password", "no-password", "plain-http"):
                assert active[job]["health"] == "down", (job, active[job])
                assert not _query(url, f'gpuhealth_findings{{job="{job}"}}'), job
            assert "401" in active["wrong-password"]["lastError"], active["wrong-password"]["lastError"]
            assert "401" in active["no-password"]["lastError"], active["no-password"]["lastError"]
        finally:
            prom.terminate()
            prom.wait(10)


# ------------------------------------------------------------------------------------- client certificates
def test_client_certificates_are_verified_and_named(tmp_path: Path, pki: Pki) -> None:
    """RequireAndVerifyClientCert with client_allowed_sans, through agent.web_config_file: no client certificate,
    or one the CA signed for another name, is refused at the handshake; Prometheus' certificate is served."""
    web = {"tls_server_config": {"cert_file": pki.agent[0], "key_file": pki.agent[1],
                                 "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": pki.ca,
                                 "client_allowed_sans": ["prometheus.monitoring"]}}
    proc = _start(tmp_path, web, given="file")
    try:
        _wait_ready(proc, _client_ctx(pki, pki.client))
        assert _get(proc.port, "/metrics", _client_ctx(pki, pki.client))[0] == 200  # no basic auth configured
        for cert in (None, pki.stranger):
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError, OSError)):
                # a refused handshake (no certificate), or a connection closed after it (a name not allowed)
                code, _, _ = _get(proc.port, "/metrics", _client_ctx(pki, cert))
                assert code != 200
    finally:
        proc.stop()


# ------------------------------------------------------------------------------------------- refused at start
@pytest.mark.parametrize(("web", "line"), [
    ({"tls_server_config": {"cert_file": "CERT"}}, "tls_server_config needs both cert_file and key_file"),
    ({"tls_server_config": {"cert_file": "/dev/zero", "key_file": "KEY"}},
     "tls_server_config.cert_file /dev/zero is not a regular file"),
    ({"basic_auth_users": {"prometheus": "plain-text-password"}}, "basic_auth_users.prometheus: not a bcrypt hash"),
], ids=["half-tls", "device-as-cert", "plain-password"])
def test_a_web_config_the_agent_cannot_serve_stops_it_with_one_line(
        tmp_path: Path, pki: Pki, web: dict[str, Any], line: str) -> None:
    text = yaml.safe_dump(web).replace("CERT", pki.agent[0]).replace("KEY", pki.agent[1])
    (tmp_path / "web.yml").write_text(text)
    done = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "agent", "--listen", "127.0.0.1:0",
                           "--scenario", str(SCENARIO), "--web.config.file", str(tmp_path / "web.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done
    [printed] = done.stderr.strip().splitlines()
    assert printed.startswith("gpuhealth agent: agent.web_config_file: ") and line in printed, printed


# ------------------------------------------------------------------------------------------- the coordinator
def test_the_coordinators_metrics_over_tls_with_basic_auth(tmp_path: Path, pki: Pki) -> None:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=6)).decode()
    (tmp_path / "web.yml").write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": pki.agent[0], "key_file": pki.agent[1]},
        "basic_auth_users": {USER: hashed}}))
    cfg = tmp_path / "coordinator.yaml"
    cfg.write_text(yaml.safe_dump({"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "db_path": str(tmp_path / "c.db"),
        "metrics_web_config_file": str(tmp_path / "web.yml")}}))
    coord = Coordinator(tmp_path / "coord", cfg)
    try:
        port = int(coord.wait()["metrics_port"])
        ctx = _client_ctx(pki)
        code, _, body = _get(port, "/metrics", ctx, (USER, PASSWORD))
        assert code == 200 and b"gpuhealth_coordinator_" in body
        for auth in ((USER, "wrong"), None):
            code, headers, _ = _get(port, "/metrics", ctx, auth)
            assert code == 401 and headers["WWW-Authenticate"] == 'Basic realm="gpuhealth"', auth
        with pytest.raises((OSError, urllib.error.URLError, ConnectionError)):
            http_get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        # handshakes that never complete: scrapes answer meanwhile, and each is closed at the deadline (10 s)
        opened = time.monotonic()
        stalled = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
        try:
            for _ in range(3):
                assert _get(port, "/metrics", ctx, (USER, PASSWORD))[0] == 200
            for s in stalled:
                s.settimeout(max(0.1, opened + 20 - time.monotonic()))
                try:
                    assert s.recv(1) == b""
                except ConnectionResetError:
                    pass
            assert 8.0 <= time.monotonic() - opened <= 20.0
        finally:
            for s in stalled:
                s.close()
    finally:
        coord.stop()


def test_a_web_config_the_coordinator_cannot_serve_stops_it_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "web.yml").write_text("tls_server_config:\n  cert_file: /nonexistent.crt\n  key_file: /x.key\n")
    done = subprocess.run([*CLI, "coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                           "--db", str(tmp_path / "c.db"), "--web.config.file", str(tmp_path / "web.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done
    [printed] = done.stderr.strip().splitlines()
    assert printed.startswith("gpuhealth coordinator: coordinator.metrics_web_config_file: "), printed
    assert "tls_server_config.cert_file /nonexistent.crt: cannot read it" in printed, printed


# ------------------------------------------------------------------------------------- the chart, as rendered
def _scrape_config(endpoint: dict[str, Any], secrets: dict[str, dict[str, str]], target: str,
                   folder: Path) -> dict[str, Any]:
    """What prometheus-operator makes of a ServiceMonitor endpoint: scheme, TLS (CA, server name, client
    certificate from Secrets, written to files as the operator mounts them) and basic auth from a Secret."""
    def from_secret(ref: dict[str, str]) -> str:
        return secrets[ref["name"]][ref["key"]]

    def as_file(ref: dict[str, str]) -> str:
        path = folder / f"{ref['name']}-{ref['key']}"
        path.write_text(from_secret(ref))
        return str(path)

    job: dict[str, Any] = {"job_name": "chart", "metrics_path": endpoint["path"],
                           "scheme": endpoint.get("scheme", "http"), "static_configs": [{"targets": [target]}]}
    tls = endpoint.get("tlsConfig")
    if tls:
        job["tls_config"] = {"ca_file": as_file(tls["ca"]["secret"]), "server_name": tls["serverName"]}
        if "cert" in tls:
            job["tls_config"] |= {"cert_file": as_file(tls["cert"]["secret"]), "key_file": as_file(tls["keySecret"])}
    auth = endpoint.get("basicAuth")
    if auth:
        job["basic_auth"] = {"username": from_secret(auth["username"]), "password": from_secret(auth["password"])}
    return job


def test_the_charts_agent_is_scraped_as_its_service_monitor_says(tmp_path: Path, pki: Pki,
                                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """The chart with web.tls and web.basicAuth: the agent started from the rendered DaemonSet (its args, the web
    config Secret and the TLS Secret mounted where the pod spec says), its readiness probe answered as the kubelet
    would ask it, and a real Prometheus scraping it with the settings of the rendered ServiceMonitor."""
    import base64 as b64

    import helm_python as helm
    from test_chart_as_rendered import NAMESPACE, Pod

    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=8)).decode()
    values = {"coordinator": {"enabled": False}, "agent": {"config": {"agent": {"state_dir": "/var/lib/gpuhealth"}}},
              "web": {"tls": {"secretName": "agent-tls"},
                      "basicAuth": {"users": {USER: hashed}, "scrapeSecret": "prometheus-scrape"}}}
    with helm.Chart.load(Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpuhealth") as chart:
        out = chart.render(values, name="gh", namespace=NAMESPACE, is_install=True)
    docs = [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    # what the cluster holds besides the chart: cert-manager's Secret for the Service's name, and the scrape Secret
    named = make_pki(tmp_path_factory.mktemp("svc-pki"), {"svc": f"gpuhealth-agent.{NAMESPACE}.svc"})
    ca = Path(named["svc"][0]).parent / "ca.crt"
    cluster = {"agent-tls": {"tls.crt": Path(named["svc"][0]).read_text(), "tls.key": Path(named["svc"][1]).read_text(),
                             "ca.crt": ca.read_text()},
               "prometheus-scrape": {"username": USER, "password": PASSWORD}}
    for d in docs:
        if d["kind"] == "Secret" and "stringData" in d:  # as the API server stores it
            d["data"] = {k: b64.b64encode(v.encode()).decode() for k, v in d.pop("stringData").items()}
    docs += [{"kind": "Secret", "metadata": {"name": n}, "data": {k: b64.b64encode(v.encode()).decode()
                                                                    for k, v in data.items()}}
             for n, data in cluster.items()]
    pod = Pod(docs, "DaemonSet", "gpuhealth-agent", tmp_path / "pod", tokens={}, cluster_configmaps={})
    container = pod.spec["containers"][0]
    args, env = pod.command(container)
    # the container paths the web config names, read through the volumes (as Pod.command does for --config)
    web_file = Path(args[args.index("--web.config.file") + 1])
    web = yaml.safe_load(web_file.read_text())
    web["tls_server_config"] = {k: pod.host_path(container, v) if str(v).startswith("/") else v
                                for k, v in web["tls_server_config"].items()}
    web_file.write_text(yaml.safe_dump(web))
    (tmp_path / "state").mkdir()
    log_path = tmp_path / "agent.log"
    agent = subprocess.Popen([*args], stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                             env={**os.environ, **env, "GPUHEALTH_AGENT_LISTEN": "127.0.0.1:0",
                                  "GPUHEALTH_AGENT_NVML_SNAPSHOT": str(SCENARIO),
                                  "GPUHEALTH_AGENT_STATE_DIR": str(tmp_path / "state"),
                                  "GPUHEALTH_AGENT_SOCKET_PATH": str(tmp_path / "agent.sock")})
    try:
        port = int(_until(lambda: re.search(r"on https://127\.0\.0\.1:(\d+)", log_path.read_text())
                          or (agent.poll() is not None and pytest.fail(log_path.read_text())),
                          30, "the agent's 'serving' line").group(1))
        # the readiness probe as the kubelet sends it: HTTPS without verifying, no password
        probe = container["readinessProbe"]["httpGet"]
        assert probe["scheme"] == "HTTPS"
        kubelet = ssl.create_default_context()
        kubelet.check_hostname, kubelet.verify_mode = False, ssl.CERT_NONE
        _until(lambda: _get(port, probe["path"], kubelet)[0] == 200, 40, "the readiness probe")
        [endpoint] = _agent_service_monitor(docs)["spec"]["endpoints"]
        job = _scrape_config(endpoint, cluster, f"127.0.0.1:{port}", tmp_path)
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(
            {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": [job]}))
        prom_log = tmp_path / "prometheus.log"
        with prom_log.open("wb") as log:
            prom = subprocess.Popen(
                [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'data'}", "--web.listen-address=127.0.0.1:0"],
                stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{prometheus_port(prom_log, prom)}"
                _until(lambda: _query(url, 'gpuhealth_findings{job="chart",code="pcie.link_degraded"}'), 60,
                       "Prometheus to scrape the chart's agent over TLS with basic auth",
                       lambda: prom_log.read_text(errors="replace")[-3000:])
            finally:
                prom.terminate()
                prom.wait(10)
    finally:
        agent.terminate()
        agent.wait(15)


def _agent_service_monitor(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [sm] = [d for d in docs if d["kind"] == "ServiceMonitor" and d["metadata"]["name"] == "gpuhealth-agent"]
    return sm


def test_local_clients_that_ask_over_plain_http_fall_back_and_say_so(agent: AgentProcess) -> None:
    """docs/security.md: the Slurm hooks' `gpuhealth status --agent` asks over plain HTTP; against an agent with a
    web config it does not reach it, says so and checks once itself."""
    done = subprocess.run([*CLI, "status", "--agent", f"http://127.0.0.1:{agent.port}", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert "the agent did not answer" in done.stderr and "checking once here instead" in done.stderr, done.stderr
    assert "node" in json.loads(done.stdout)  # this machine's own one-shot report (no GPU here: could not check)
