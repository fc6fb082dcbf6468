"""The coordinator is secure by default, through ``gpuhealth coordinator`` itself (issue 23).

Before: the command built its policy by hand and ignored the node secret, TokenReview and the shared-token
rule; it served 0.0.0.0:9500 to everyone, and everyone was an operator. Now:

- it refuses to listen beyond loopback without authentication unless ``coordinator.allow_unauthenticated``
  says so, and ``--token`` alone is refused like ``coordinator.token`` (``shared_token: true`` keeps it);
- a node token, a ServiceAccount token or a client certificate reports as its own node only: another
  node's credential claiming it is refused and the real node's stream is not cut;
- open mode grants operator actions (live triage, remote diagnostics) to callers on the coordinator's own
  host only; ``operator_token`` without node authentication asks callers for it;
- bad settings are one line naming the key, exit 3: a secret file missing, world-readable or short, a
  database folder that does not exist (never created), an address that is not host:port or is taken;
- ``jobs``/``fleet``/``triage --job`` find the token in ``coordinator.token_file`` or ``GPUHEALTH_TOKEN_FILE``;
- a command whose extra is not installed says which to install, in one line.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from commands import (
    SCENARIO,
    Agent,
    Coordinator,
    make_pki,
    run_cli,
    until,
    write_config,
    write_secret,
)
from simagent import SimAgent, step_batch_message

from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.runtime.credentials import node_token
from gpuhealth.runtime.tls import token_metadata

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _no_inherited_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("GPUHEALTH_"):
            monkeypatch.delenv(name)


def _start_error(tmp_path: Path, sections: dict[str, Any], *args: str, env: dict[str, str] | None = None) -> str:
    """Start ``gpuhealth coordinator`` on ``sections``: it must refuse, exit 3, one line."""
    cfg = write_config(tmp_path / "refused.yaml", sections)
    res = run_cli("coordinator", "--config", str(cfg), *args, env=env, timeout=30)
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuhealth coordinator: "), res.stderr
    return lines[0]


@pytest.mark.slow
def test_refusals_at_start_are_one_line_naming_the_key(tmp_path: Path) -> None:
    db = str(tmp_path / "c.db")
    # The defaults: 0.0.0.0:9500 with no authentication.
    line = _start_error(tmp_path, {"coordinator": {"db_path": db, "metrics_listen": "off"}})
    assert "coordinator.listen 0.0.0.0:9500: no authentication" in line and "allow_unauthenticated" in line
    assert "[::]:0" in _start_error(tmp_path, {"coordinator": {"db_path": db, "listen": "[::]:0"}})
    # A shared token nobody asked to keep — from the file, the flag or the environment.
    loop = {"listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": db}
    for how in ({"sections": {"coordinator": {**loop, "token": "t0ken-shared"}}},
                {"sections": {"coordinator": loop}, "args": ("--token", "t0ken-shared")},
                {"sections": {"coordinator": loop}, "env": {"GPUHEALTH_COORDINATOR_TOKEN": "t0ken-shared"}}):
        line = _start_error(tmp_path, how["sections"], *how.get("args", ()), env=how.get("env"))
        assert "coordinator.shared_token: true" in line, line
    # The cluster secret: missing, readable by every user, too short.
    secret = tmp_path / "secret"
    line = _start_error(tmp_path, {"coordinator": {**loop, "node_secret_file": str(secret)}})
    assert "cannot read the cluster secret" in line
    write_secret(secret)
    os.chmod(secret, 0o644)
    with_secret = {"coordinator": {**loop, "node_secret_file": str(secret)}}
    assert "readable by every user" in _start_error(tmp_path, with_secret)
    write_secret(secret, b"six by")
    assert "at least 32" in _start_error(tmp_path, with_secret)
    # Paths: a database folder that does not exist is not created.
    missing = tmp_path / "no" / "such" / "folder" / "c.db"
    line = _start_error(tmp_path, {"coordinator": {**loop, "db_path": str(missing)}})
    assert f"coordinator.db_path {missing}: the folder {missing.parent} does not exist" in line
    assert not (tmp_path / "no").exists()
    # Addresses.
    line = _start_error(tmp_path, {"coordinator": {**loop, "metrics_listen": "host:notaport"}})
    assert "coordinator.metrics_listen: 'host:notaport' is not host:port" in line
    line = _start_error(tmp_path, {"coordinator": loop}, env={"GPUHEALTH_COORDINATOR_LISTEN": "localhost"})
    assert "GPUHEALTH_COORDINATOR_LISTEN (coordinator.listen): 'localhost' is not host:port" in line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = _start_error(tmp_path, {"coordinator": {**loop, "listen": f"127.0.0.1:{port}"}})
        assert f"coordinator.listen 127.0.0.1:{port}: cannot listen: Address already in use" in line
        line = _start_error(tmp_path, {"coordinator": {**loop, "metrics_listen": f"127.0.0.1:{port}"}})
        assert f"coordinator.metrics_listen 127.0.0.1:{port}: cannot listen" in line


def test_a_loopback_coordinator_without_metrics_says_so(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                             "db_path": str(tmp_path / "c.db")}})
    coord = Coordinator(tmp_path / "coordinator", cfg)
    try:
        coord.wait()
        log = coord.log()
        assert "metrics off" in log and "None" not in log, log
        assert "WITHOUT authentication on 127.0.0.1:0: only this host can reach it" in log
    finally:
        coord.stop()


def _outward_address() -> str | None:
    """An address of this host that is not loopback (the route a datagram would take; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # TEST-NET-3: only the route is looked up
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _triage_code(address: str, token: str | None = None) -> grpc.StatusCode:
    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary("/gpuhealth.v1.Coordinator/Triage",
                                   request_serializer=pb.LiveTriageRequest.SerializeToString,
                                   response_deserializer=pb.TriageReply.FromString)
        call(pb.LiveTriageRequest(job_id="no-such-job", timeout_s=1), timeout=10, metadata=token_metadata(token))
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    finally:
        channel.close()
    return grpc.StatusCode.OK


def test_open_mode_never_makes_a_remote_caller_an_operator(tmp_path: Path) -> None:
    outward = _outward_address()
    if outward is None:
        pytest.skip("this host has no address but loopback: no remote caller can be made here")
    cfg = write_config(tmp_path / "c.yaml", {"coordinator": {"listen": "0.0.0.0:0", "metrics_listen": "off",
                                                             "db_path": str(tmp_path / "c.db"),
                                                             "allow_unauthenticated": True}})
    coord = Coordinator(tmp_path / "coordinator", cfg)
    try:
        port = coord.wait()["grpc_port"]
        # From this host: an operator (the job is unknown: NOT_FOUND, past authorisation).
        assert _triage_code(f"127.0.0.1:{port}") is grpc.StatusCode.NOT_FOUND
        # From the network (this host's outward address is not loopback to the coordinator): reads, never acts.
        assert _triage_code(f"{outward}:{port}") is grpc.StatusCode.PERMISSION_DENIED
        res = run_cli("fleet", "--coordinator", f"{outward}:{port}", "--json")
        assert res.returncode == 3 and json.loads(res.stdout)["nodes"] == [], res.stderr  # read: no node to judge
    finally:
        coord.stop()


def test_an_operator_token_without_node_authentication_is_asked_for(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                             "db_path": str(tmp_path / "c.db"),
                                                             "operator_token": "op-s3cret"}})
    coord = Coordinator(tmp_path / "coordinator", cfg)
    try:
        address = coord.address()
        assert _triage_code(address) is grpc.StatusCode.PERMISSION_DENIED
        assert _triage_code(address, "wrong") is grpc.StatusCode.PERMISSION_DENIED
        assert _triage_code(address, "op-s3cret") is grpc.StatusCode.NOT_FOUND
        res = run_cli("fleet", "--coordinator", address, "--sdc", "--device", "cpu", "--timeout", "10")
        assert res.returncode == 3 and "PERMISSION_DENIED" in res.stderr, res.stderr
    finally:
        coord.stop()


async def _register(address: str, node: str, metadata: Any = (), credentials: Any = None) -> Any:
    agent = SimAgent(address, node, metadata=metadata, incarnation=f"i-{time.monotonic_ns()}", credentials=credentials)
    try:
        await agent.register()
        await agent.connect()
        await agent.send(step_batch_message(1, "intruder-job", [0], 1))
        await agent.wait_acked(1, timeout_s=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await agent.close()
    return None


def _agent(tmp_path: Path, name: str, address: str, coordinator: dict[str, Any]) -> Agent:
    (tmp_path / name).mkdir()
    cfg = write_config(tmp_path / f"{name}.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "node_name": name, "coordinator": address,
                  "state_dir": str(tmp_path / name), "socket_path": str(tmp_path / name / "r.sock")},
        "coordinator": coordinator, "diag": {"enabled": False}})
    return Agent(tmp_path / f"{name}-agent", cfg)


def _node_view(address: str, node: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> Any:
    res = run_cli("fleet", "--coordinator", address, "--json", *args, env=env)
    if res.returncode not in (0, 1):
        return None
    return next((n for n in json.loads(res.stdout)["nodes"] if n["name"] == node), None)


def _stream_survives(agent: Agent, address: str, node: str, env: dict[str, str] | None = None,
                     args: tuple[str, ...] = ()) -> None:
    time.sleep(1.0)
    view = _node_view(address, node, env, args)
    assert view is not None and view["connected"], view
    assert "ABORTED" not in agent.log(), agent.log()


def test_node_tokens_through_the_command(tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "cluster.secret")
    cfg = write_config(tmp_path / "c.yaml", {"coordinator": {
        "listen": "0.0.0.0:0", "metrics_listen": "off", "db_path": str(tmp_path / "c.db"),
        "node_secret_file": str(tmp_path / "cluster.secret"), "operator_token": "op-s3cret"}})
    coord = Coordinator(tmp_path / "coordinator", cfg)
    victim = None
    try:
        address = coord.address()
        assert "WITHOUT authentication" not in coord.log()
        (tmp_path / "victim.token").write_text(node_token(secret, "victim") + "\n")
        victim = _agent(tmp_path, "victim", address, {"token_file": str(tmp_path / "victim.token")})
        operator = {"GPUHEALTH_TOKEN": "op-s3cret"}
        until(lambda: (_node_view(address, "victim", operator) or {}).get("connected"), 30, "the victim's stream")
        stolen = token_metadata(node_token(secret, "attacker"))
        assert asyncio.run(_register(address, "victim", stolen)) is grpc.StatusCode.PERMISSION_DENIED
        assert asyncio.run(_register(address, "victim")) is grpc.StatusCode.UNAUTHENTICATED
        _stream_survives(victim, address, "victim", operator)
        assert "refused Register for node 'victim'" in coord.log()
        # No step record of the intruder's job was taken.
        assert run_cli("jobs", "intruder-job", "--coordinator", address, env=operator).returncode == 3
        # An operator token is no node credential, a node token no operator credential.
        assert asyncio.run(_register(address, "victim", token_metadata("op-s3cret"))) is \
            grpc.StatusCode.PERMISSION_DENIED
        assert _triage_code(address, node_token(secret, "victim")) is grpc.StatusCode.PERMISSION_DENIED
        assert _triage_code(address) is grpc.StatusCode.UNAUTHENTICATED
        assert _triage_code(address, "op-s3cret") is grpc.StatusCode.NOT_FOUND
    finally:
        if victim is not None:
            victim.stop()
        coord.stop()


def test_token_review_through_the_command(tmp_path: Path) -> None:
    from tokenreview_standin import ServiceAccountToken, StandIn

    account = "system:serviceaccount:gpuhealth:gpuhealth-agent"
    api = StandIn(tmp_path)
    api.start()
    api.tokens = {"aaa.bbb.n1": ServiceAccountToken(account, ["gpuhealth"], "agent-1", "uid-1", node="n1"),
                  "aaa.bbb.n2": ServiceAccountToken(account, ["gpuhealth"], "agent-2", "uid-2", node="n2")}
    cfg = write_config(tmp_path / "c.yaml", {"coordinator": {
        "listen": "0.0.0.0:0", "metrics_listen": "off", "db_path": str(tmp_path / "c.db"),
        "token_review": "in-cluster", "token_review_ca": api.ca_file,
        "token_review_credential_file": str(api.credential_file)}})
    host, port = api.url.removeprefix("https://").rsplit(":", 1)
    coord = Coordinator(tmp_path / "coordinator", cfg,  # as the kubelet tells a pod where its API server is
                        env={"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port})
    agent = None
    try:
        address = coord.address()
        (tmp_path / "sa-token").write_text("aaa.bbb.n1\n")  # the projected token, read at every connect
        agent = _agent(tmp_path, "n1", address, {"token_file": str(tmp_path / "sa-token")})
        reader = {"GPUHEALTH_TOKEN": "aaa.bbb.n2"}
        until(lambda: (_node_view(address, "n1", reader) or {}).get("connected"), 30, "n1's stream")
        assert asyncio.run(_register(address, "n1", token_metadata("aaa.bbb.n2"))) is \
            grpc.StatusCode.PERMISSION_DENIED  # n2's pod claiming n1
        assert asyncio.run(_register(address, "n1", token_metadata("aaa.bbb.zzz"))) is \
            grpc.StatusCode.UNAUTHENTICATED  # a token the API server does not know
        _stream_survives(agent, address, "n1", reader)
    finally:
        if agent is not None:
            agent.stop()
        coord.stop()
        api.stop()


def test_mutual_tls_through_the_command(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", {"server": "coordinator", "n1": "n1", "n2": "n2", "op": "alice"})
    ca = str(tmp_path / "pki" / "ca.crt")
    cfg = write_config(tmp_path / "c.yaml", {"coordinator": {
        "listen": "0.0.0.0:0", "metrics_listen": "off", "db_path": str(tmp_path / "c.db"),
        "tls_cert": pki["server"][0], "tls_key": pki["server"][1], "tls_ca": ca, "operator_names": "alice"}})
    coord = Coordinator(tmp_path / "coordinator", cfg)
    agent = None
    try:
        address = coord.address("localhost")
        agent = _agent(tmp_path, "n1", address, {"client_tls_cert": pki["n1"][0], "client_tls_key": pki["n1"][1],
                                                 "tls_ca": ca})
        as_op = ("--tls-cert", pki["op"][0], "--tls-key", pki["op"][1], "--tls-ca", ca)
        until(lambda: (_node_view(address, "n1", args=as_op) or {}).get("connected"), 30, "n1's stream")
        n2 = grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(pki["n2"][1]).read_bytes(),
                                          Path(pki["n2"][0]).read_bytes())
        assert asyncio.run(_register(address, "n1", credentials=n2)) is grpc.StatusCode.PERMISSION_DENIED
        # Roles are disjoint (issue 30 item 11): the operator's certificate names "alice"; it acts on nodes
        # and reads, but never reports as a node — not as "alice" (its own name), nor as any other.
        op = grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(pki["op"][1]).read_bytes(),
                                          Path(pki["op"][0]).read_bytes())
        for node in ("alice", "n1"):
            assert asyncio.run(_register(address, node, credentials=op)) is grpc.StatusCode.PERMISSION_DENIED, node
        _stream_survives(agent, address, "n1", args=as_op)
    finally:
        if agent is not None:
            agent.stop()
        coord.stop()


@pytest.mark.slow
def test_queries_find_their_token_in_files(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", {"coordinator": {"listen": "127.0.0.1:0", "metrics_listen": "off",
                                                             "db_path": str(tmp_path / "c.db"),
                                                             "operator_token": "op-from-a-file"}})
    coord = Coordinator(tmp_path / "coordinator", cfg)
    try:
        address = coord.address()
        token_file = tmp_path / "operator.token"
        token_file.write_text("op-from-a-file\n")
        client = write_config(tmp_path / "client.yaml", {"agent": {"coordinator": address},
                                                         "coordinator": {"token_file": str(token_file)}})
        # coordinator.token_file in the client's config (jobs and fleet read it; before: ignored)
        res = run_cli("fleet", "--config", str(client), "--sdc", "--device", "cpu", "--timeout", "10")
        assert res.returncode == 3 and "no nodes: no agent has registered" in " ".join(res.stdout.split()), \
            (res.stdout, res.stderr)  # authorised (not PERMISSION_DENIED); no node to run on: nothing judged
        res = run_cli("triage", "--job", "no-such-job", "--config", str(client))
        assert "no job 'no-such-job'" in res.stderr, res.stderr
        # GPUHEALTH_TOKEN_FILE reaches triage --job too (it has no --token-file flag)
        res = run_cli("triage", "--job", "no-such-job", "--coordinator", address,
                      env={"GPUHEALTH_TOKEN_FILE": str(token_file)})
        assert "no job 'no-such-job'" in res.stderr, res.stderr
        res = run_cli("triage", "--job", "no-such-job", "--coordinator", address)
        assert "PERMISSION_DENIED" in res.stderr, res.stderr  # without it: refused
        # A bad config is exit 3 (1 means "a job is hung or straggling"), in one line.
        bad = tmp_path / "bad.yaml"
        bad.write_text("coordinator:\n  metrics_listen: host:notaport\n")
        for command in ("jobs", "fleet"):
            res = run_cli(command, "--config", str(bad))
            assert res.returncode == 3 and res.stderr.count("\n") == 1, (command, res.returncode, res.stderr)
            assert res.stderr.startswith(f"gpuhealth {command}: ") and "coordinator.metrics_listen" in res.stderr
        client_bad = write_config(tmp_path / "client-bad.yaml", {"coordinator": {"token_file": str(tmp_path / "x")}})
        res = run_cli("jobs", "--config", str(client_bad), "--coordinator", address)
        assert res.returncode == 3 and "coordinator.token_file" in res.stderr, res.stderr
    finally:
        coord.stop()


# Installed as sitecustomize of every Python process the command starts (diag's child too): the modules
# named in GPUHEALTH_TEST_BLOCK cannot be imported, as in an installation without their extra.
_BLOCK = """
import os, sys
blocked = tuple(os.environ.get("GPUHEALTH_TEST_BLOCK", "").split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
"""


@pytest.mark.parametrize(("blocked", "args", "extra"), [
    ("grpc,google", ["jobs", "--coordinator", "127.0.0.1:9"], "coordinator"),
    ("grpc,google", ["fleet", "--coordinator", "127.0.0.1:9"], "coordinator"),
    ("grpc,google", ["coordinator", "--listen", "127.0.0.1:0"], "coordinator"),
    ("torch,numpy", ["diag", "sdc", "--device", "cpu"], "diag"),
])
def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path, blocked: str, args: list[str], extra: str) -> None:
    (tmp_path / "sitecustomize.py").write_text(_BLOCK)
    res = run_cli(*args, env={"PYTHONPATH": str(tmp_path), "GPUHEALTH_TEST_BLOCK": blocked,
                              "GPUHEALTH_COORDINATOR_DB_PATH": str(tmp_path / "c.db")}, timeout=120)
    text = res.stdout + res.stderr
    assert "Traceback" not in text, text
    assert f"pip install 'gpuhealth[{extra}]'" in text, text
    assert res.returncode == 3, (res.returncode, text)
    assert len(text.strip().splitlines()) == 1, text


def test_the_shipped_systemd_coordinator_starts_with_node_tokens(tmp_path: Path) -> None:
    """deploy/systemd: the unit hands the cluster secret to the service where coordinator.yaml reads it, and that
    config starts an authenticated coordinator (the unit's paths replaced by this test's: the credential as
    systemd would write it, mode 0400; the database as the unit's Environment= names it; port 0)."""
    import configparser

    systemd = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((systemd / "gpuhealth-coordinator.service").read_text())
    name, _, source = unit["Service"]["LoadCredential"].partition(":")
    shipped = yaml.safe_load((systemd / "coordinator.yaml").read_text())["coordinator"]
    assert shipped["node_secret_file"] == f"/run/credentials/gpuhealth-coordinator.service/{name}"
    assert source == "/etc/gpuhealth/cluster.secret"
    credential = tmp_path / name
    write_secret(credential)
    os.chmod(credential, 0o400)
    coord = Coordinator(tmp_path / "coordinator", systemd / "coordinator.yaml", env={
        "GPUHEALTH_COORDINATOR_NODE_SECRET_FILE": str(credential),
        "GPUHEALTH_COORDINATOR_DB_PATH": str(tmp_path / "c.db"),
        "GPUHEALTH_COORDINATOR_LISTEN": "0.0.0.0:0", "GPUHEALTH_COORDINATOR_METRICS_LISTEN": "127.0.0.1:0"})
    try:
        address = coord.address()
        assert "WITHOUT authentication" not in coord.log()
        assert asyncio.run(_register(address, "n1")) is grpc.StatusCode.UNAUTHENTICATED
        secret = credential.read_bytes().strip()
        assert asyncio.run(_register(address, "n1", token_metadata(node_token(secret, "n1")))) is None
    finally:
        coord.stop()


def test_an_agent_port_in_use_names_the_address_and_key(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path / "agent.yaml", {
            "agent": {"nvml_snapshot": str(SCENARIO), "listen": f"127.0.0.1:{port}", "state_dir": str(tmp_path),
                      "socket_path": str(tmp_path / "r.sock")}, "diag": {"enabled": False}})
        res = run_cli("agent", "--config", str(cfg), timeout=60)
    assert res.returncode == 3, res.stderr
    assert f"gpuhealth agent: agent.listen 127.0.0.1:{port}: cannot listen: Address already in use" in res.stderr


def test_an_agent_socket_under_a_missing_folder_is_named_not_created(tmp_path: Path) -> None:
    # only the socket's own folder is made (as systemd's RuntimeDirectory would); a typo above it is not a tree
    # to create as root: the agent says which key, and keeps serving its health
    typo = tmp_path / "rnu" / "gpuhealth" / "agent.sock"
    cfg = write_config(tmp_path / "agent.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "state_dir": str(tmp_path),
                  "socket_path": str(typo)}, "diag": {"enabled": False}})
    agent = Agent(tmp_path / "agent", cfg)
    try:
        until(lambda: "agent.socket_path: " in agent.log(), 30, "the rank hub's refusal naming agent.socket_path")
        assert f"{tmp_path / 'rnu'} does not exist" in agent.log()
        assert not (tmp_path / "rnu").exists()
        agent.wait_ready()
        assert agent.health()["node"]
    finally:
        agent.stop()
    made = tmp_path / "run" / "agent.sock"  # its own folder, under one that exists: made
    cfg = write_config(tmp_path / "agent2.yaml", {
        "agent": {"nvml_snapshot": str(SCENARIO), "listen": "127.0.0.1:0", "state_dir": str(tmp_path),
                  "socket_path": str(made)}, "diag": {"enabled": False}})
    agent = Agent(tmp_path / "agent2", cfg)
    try:
        until(made.exists, 30, "the rank socket in the folder the agent made")
    finally:
        agent.stop()
