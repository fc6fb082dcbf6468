"""Node identity under tokens, over real gRPC: a credential reports as its own node and no other.

Before, anyone holding the shared agent token registered as any node; its records were accepted
under that node's name and the real node's stream was cut (ABORTED). Now:

- per-node tokens (an HMAC of the node name under the cluster secret) are good for one node; a
  registration for another node is refused, and the real node's stream keeps going;
- on Kubernetes a ServiceAccount token is checked with TokenReview and bound to its pod's node —
  tested against a local HTTPS stand-in that speaks the TokenReview and pods API (no API server
  runs here);
- a second stream for a node under a different credential is refused and logged;
- the shared token survives only behind ``coordinator.shared_token`` (warned); ``gpuhealth token``
  mints node tokens from a secret file; the agent's stream presents a token from a file (read at
  each connect) or derives its own from the secret.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from simagent import SimAgent, step_batch_message
from tokenreview_standin import ServiceAccountToken, StandIn

from gpuhealth.agent.coordinator_stream import CoordinatorStream, StreamSettings
from gpuhealth.agent.spool import Spool
from gpuhealth.cli.token import command as token_command
from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.query import CoordinatorQueryError, fleet, run_diagnostic
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.coordinator.token_review import KubernetesTokenReview
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.runtime.credentials import node_token, verify_node_token
from gpuhealth.runtime.tls import SecurityConfigError, token_metadata

pytestmark = pytest.mark.integration
SECRET = b"0123456789abcdef0123456789abcdef-cluster"
AGENT_SA = "system:serviceaccount:gpuhealth:gpuhealth-agent"


def _md(node: str, secret: bytes = SECRET) -> tuple[tuple[str, str], ...]:
    return token_metadata(node_token(secret, node))


def _with(tmp_path: Path, policy: AuthPolicy, body: Callable[[CoordinatorServer, str], Awaitable[None]]) -> None:
    async def main() -> None:
        coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(evidence_dir=str(tmp_path / "ev"),
                                                                        hang_floor_s=3600))
        server = CoordinatorServer(coord, listen="127.0.0.1:0", metrics_listen=None, policy=policy)
        endpoints = await server.start()
        try:
            await asyncio.wait_for(body(server, f"127.0.0.1:{endpoints.grpc_port}"), 60)
        finally:
            await server.stop(0)

    asyncio.run(main())


async def _code(coro: Awaitable[object]) -> grpc.StatusCode | None:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None


# ----------------------------------------------------------------------------------- node tokens
def test_a_node_token_reports_as_its_node_only(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, addr: str) -> None:
        real = SimAgent(addr, "n2", metadata=_md("n2"))
        await real.register()
        await real.connect()
        await real.send(step_batch_message(1, "job", [0], 1))
        await real.wait_acked(1)
        # n1's token, claiming n2: refused at Register, and n2's stream is not touched.
        thief = SimAgent(addr, "n2", metadata=_md("n1"), incarnation="thief")
        assert await _code(thief.register()) is grpc.StatusCode.PERMISSION_DENIED
        await real.send(step_batch_message(2, "job", [0], 2))
        await real.wait_acked(2)  # still streaming: not ABORTED
        # A token minted with another secret, or made up, is nobody's.
        forged = SimAgent(addr, "n2", metadata=_md("n2", secret=b"x" * 40), incarnation="forged")
        assert await _code(forged.register()) is grpc.StatusCode.UNAUTHENTICATED
        tampered = node_token(SECRET, "n1")[:-4] + "0000"
        assert await _code(SimAgent(addr, "n1", metadata=token_metadata(tampered)).register()) \
            is grpc.StatusCode.UNAUTHENTICATED
        # n1's own token works for n1, reads the fleet, and cannot act on nodes.
        own = SimAgent(addr, "n1", metadata=_md("n1"))
        await own.register()
        doc = await asyncio.to_thread(fleet, addr, token=node_token(SECRET, "n1"))
        assert sorted(n["name"] for n in doc["nodes"]) == ["n1", "n2"]
        with pytest.raises(CoordinatorQueryError, match="operator"):
            await asyncio.to_thread(run_diagnostic, addr, "sdc", token=node_token(SECRET, "n1"))
        assert server.coord.store.step_record_count() == 2  # only n2's own two batches
        for agent in (real, thief, forged, own):
            await agent.close()

    _with(tmp_path, AuthPolicy(node_secret=SECRET), body)


def test_a_stream_cannot_use_a_session_under_another_credential(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, addr: str) -> None:
        agent = SimAgent(addr, "n1", metadata=_md("n1"))
        await agent.register()
        # Someone who saw n1's session id connects with n2's token claiming n1's session.
        agent.metadata = _md("n2")
        await agent.connect(node="n1")
        await agent.send(step_batch_message(1, "j", [0], 1))
        assert await agent.status() is grpc.StatusCode.PERMISSION_DENIED
        await agent.close()
        assert server.coord.store.step_record_count() == 0

    _with(tmp_path, AuthPolicy(node_secret=SECRET), body)


def test_a_second_credential_for_a_live_node_is_refused_and_logged(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    # A migration: node tokens are on, the old shared token still accepted. The node streams under its
    # own token; someone with the shared token claims it: refused while the stream is live.
    async def body(server: CoordinatorServer, addr: str) -> None:
        real = SimAgent(addr, "n1", metadata=_md("n1"))
        await real.register()
        await real.connect()
        await real.send(step_batch_message(1, "j", [0], 1))
        await real.wait_acked(1)
        other = SimAgent(addr, "n1", metadata=token_metadata("old-shared"), incarnation="other")
        with caplog.at_level(logging.WARNING, logger="gpuhealth.coordinator"):
            assert await _code(other.register()) is grpc.StatusCode.ALREADY_EXISTS
        assert any("refused a second registration" in r.getMessage() for r in caplog.records)
        await real.send(step_batch_message(2, "j", [0], 2))
        await real.wait_acked(2)
        # The same credential re-registering is a reconnect, and replaces the session as before.
        again = SimAgent(addr, "n1", metadata=_md("n1"))
        assert (await again.register()).acked_seq == 2
        for agent in (real, other, again):
            await agent.close()
        assert server.coord.counters.refused_registrations == 1

    _with(tmp_path, AuthPolicy(token="old-shared", node_secret=SECRET), body)


# ---------------------------------------------------------------------------------- TokenReview
@pytest.fixture
def api(tmp_path: Path) -> StandIn:
    standin = StandIn(tmp_path)
    standin.start()
    standin.tokens = {
        "aaa.bbb.ccc": ServiceAccountToken(AGENT_SA, ["gpuhealth"], "agent-x1", "uid-1", node="n1"),
        "aaa.bbb.ddd": ServiceAccountToken(AGENT_SA, ["gpuhealth"], "agent-x2", "uid-2"),  # node from the pod
        "aaa.bbb.eee": ServiceAccountToken(AGENT_SA, ["kubernetes"], "agent-x1", "uid-1", node="n1"),  # audience
        "aaa.bbb.fff": ServiceAccountToken("system:serviceaccount:default:web", ["gpuhealth"], "web", "uid-9",
                                           node="n1"),  # another account
        "aaa.bbb.ggg": ServiceAccountToken(AGENT_SA, ["gpuhealth"], "agent-old", "uid-old"),  # pod uid mismatch
        "aaa.bbb.hhh": ServiceAccountToken(AGENT_SA, ["gpuhealth"], "debug", "uid-7", node="n1"),  # 2nd pod on n1
    }
    standin.add_pod("gpuhealth", "agent-x2", "uid-2", "n2")
    standin.add_pod("gpuhealth", "agent-old", "uid-new", "n3")
    return standin


def _reviewer(api: StandIn) -> KubernetesTokenReview:
    return KubernetesTokenReview(api.url, ca_file=api.ca_file, credential_file=str(api.credential_file),
                                 audience="gpuhealth", accounts=frozenset({AGENT_SA}))


def test_service_account_tokens_are_bound_to_their_pods_node(tmp_path: Path, api: StandIn) -> None:
    async def body(server: CoordinatorServer, addr: str) -> None:
        def sa(token: str, node: str, incarnation: str = "i") -> SimAgent:
            return SimAgent(addr, node, metadata=token_metadata(token), incarnation=incarnation)

        n1 = sa("aaa.bbb.ccc", "n1")
        await n1.register()  # node-name in the token's extra
        await n1.connect()
        await n1.send(step_batch_message(1, "j", [0], 1))
        await n1.wait_acked(1)
        assert await _code(sa("aaa.bbb.ccc", "n2", "x").register()) is grpc.StatusCode.PERMISSION_DENIED
        await sa("aaa.bbb.ddd", "n2").register()  # node from the pod's spec.nodeName
        for token, code in (("aaa.bbb.eee", grpc.StatusCode.UNAUTHENTICATED),   # wrong audience
                            ("aaa.bbb.fff", grpc.StatusCode.UNAUTHENTICATED),   # not the agents' account
                            ("aaa.bbb.ggg", grpc.StatusCode.UNAUTHENTICATED),   # pod replaced since
                            ("aaa.bbb.zzz", grpc.StatusCode.UNAUTHENTICATED)):  # unknown to the API server
            assert await _code(sa(token, "n3", token).register()) is code, token
        # Another pod on n1 under the agents' account while n1's stream is live: a second credential.
        assert await _code(sa("aaa.bbb.hhh", "n1", "debug").register()) is grpc.StatusCode.ALREADY_EXISTS
        # Reviews are cached: registering n2 again does not ask the API server again.
        before = len(api.calls)
        await sa("aaa.bbb.ddd", "n2", "again").register()
        assert len(api.calls) == before
        # The API server away: UNAVAILABLE (try again), never a pass.
        api.down = True
        assert await _code(sa("aaa.bbb.iii", "n4").register()) is grpc.StatusCode.UNAVAILABLE
        api.down = False
        assert all(c.startswith(("POST /apis/authentication.k8s.io/v1/tokenreviews",
                                 "GET /api/v1/namespaces/gpuhealth/pods/")) for c in api.calls)
        await n1.close()

    try:
        _with(tmp_path, AuthPolicy(token_review=_reviewer(api)), body)
    finally:
        api.stop()


def test_token_review_configuration(tmp_path: Path, api: StandIn) -> None:
    try:
        with pytest.raises(SecurityConfigError, match="agent_service_accounts"):
            KubernetesTokenReview(api.url, ca_file=api.ca_file, credential_file=str(api.credential_file),
                                  audience="gpuhealth", accounts=frozenset())
        with pytest.raises(SecurityConfigError, match="https"):
            KubernetesTokenReview("http://127.0.0.1:1", ca_file=None, credential_file=str(api.credential_file),
                                  audience="gpuhealth", accounts=frozenset({AGENT_SA}))
        with pytest.raises(SecurityConfigError, match="KUBERNETES_SERVICE_HOST"):
            KubernetesTokenReview.in_cluster(audience="gpuhealth", accounts=frozenset({AGENT_SA}), env={})
        cfg = CoordinatorConfig(token_review=api.url, token_review_ca=api.ca_file,
                                token_review_credential_file=str(api.credential_file))
        policy = AuthPolicy.from_config(cfg, mtls=False)
        assert policy.token_review is not None and not policy.open
        # The coordinator's own credential is checked by the API server: a wrong one is an error, not a pass.
        api.credential = "rotated-away"
        who = asyncio.run(_review_or_error(_reviewer_with(api, tmp_path)))
        assert who == "error"
    finally:
        api.stop()


def _reviewer_with(api: StandIn, tmp_path: Path) -> KubernetesTokenReview:
    stale = tmp_path / "stale.token"
    stale.write_text("coordinator-sa-token\n")
    return KubernetesTokenReview(api.url, ca_file=api.ca_file, credential_file=str(stale), audience="gpuhealth",
                                 accounts=frozenset({AGENT_SA}))


async def _review_or_error(reviewer: KubernetesTokenReview) -> str:
    from gpuhealth.coordinator.token_review import TokenReviewError

    try:
        return str(await reviewer.review("aaa.bbb.ccc"))
    except TokenReviewError:
        return "error"


# ---------------------------------------------------------------------- configuration and tools
def test_policy_from_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    policy = AuthPolicy.from_config(CoordinatorConfig(node_secret_file=str(secret)), mtls=False)
    assert policy.node_secret == SECRET and policy.token is None
    with pytest.raises(SecurityConfigError, match=r"coordinator\.shared_token: true"):
        AuthPolicy.from_config(CoordinatorConfig(token="t0ken"), mtls=False)
    assert AuthPolicy.from_config(CoordinatorConfig(token="t0ken", shared_token=True), mtls=False).token == "t0ken"
    os.chmod(secret, 0o644)
    with pytest.raises(SecurityConfigError, match="readable by every user"):
        AuthPolicy.from_config(CoordinatorConfig(node_secret_file=str(secret)), mtls=False)
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    os.chmod(short, 0o600)
    with pytest.raises(SecurityConfigError, match="at least 32"):
        AuthPolicy.from_config(CoordinatorConfig(node_secret_file=str(short)), mtls=False)
    with pytest.raises(SecurityConfigError, match="cannot read"):
        AuthPolicy.from_config(CoordinatorConfig(node_secret_file=str(tmp_path / "none")), mtls=False)

    async def start_and_stop() -> None:
        coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(evidence_dir=str(tmp_path / "ev")))
        server = CoordinatorServer(coord, listen="127.0.0.1:0", metrics_listen=None,
                                   policy=AuthPolicy(token="t0ken"))
        await server.start()
        await server.stop(0)

    with caplog.at_level(logging.WARNING, logger="gpuhealth.coordinator"):
        asyncio.run(start_and_stop())
    assert any("any holder can report as any node" in r.getMessage() for r in caplog.records)


def test_gpuhealth_token_mints_from_a_secret_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    os.chmod(secret, 0o600)
    result = CliRunner().invoke(token_command, ["--node", "gpu-node-7", "--secret-file", str(secret)])
    assert result.exit_code == 0, result.output
    assert verify_node_token(SECRET, result.output.strip()) == "gpu-node-7"
    out = tmp_path / "node.token"
    result = CliRunner().invoke(token_command, ["--node", "gpu-node-7", "--secret-file", str(secret),
                                                "--out", str(out)])
    assert result.exit_code == 0 and (out.stat().st_mode & 0o777) == 0o600
    assert verify_node_token(SECRET, out.read_text().strip()) == "gpu-node-7"
    result = CliRunner().invoke(token_command, ["--node", "n", "--secret-file", str(tmp_path / "missing")])
    assert result.exit_code == 3 and "cannot read the cluster secret" in result.output
    # The installed command, as an operator runs it (it was once written but not registered).
    proc = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "token", "--node", "gpu-node-8",
                           "--secret-file", str(secret)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert verify_node_token(SECRET, proc.stdout.strip()) == "gpu-node-8"


def test_node_tokens_name_any_node_and_only_it() -> None:
    for node in ("n1", "gpu-node.example.com", "rack:7/slot.3", "ノード"):
        token = node_token(SECRET, node)
        assert token.isascii() and " " not in token
        assert verify_node_token(SECRET, token) == node
        assert verify_node_token(SECRET + b"!", token) is None
    assert verify_node_token(SECRET, "gpuhealth-node-v1.!!!.00") is None


# ------------------------------------------------------------------------------------ agent side
def _stream(tmp_path: Path, addr: str, node: str, *, token_file: str | None = None,
            node_secret_file: str | None = None) -> CoordinatorStream:
    settings = StreamSettings(address=addr, backoff_initial_s=0.1, backoff_max_s=0.5, token_file=token_file,
                              node_secret_file=node_secret_file)
    return CoordinatorStream(settings, Spool(tmp_path / f"spool-{node}.db"),
                             register=lambda inc: pb.RegisterRequest(node_name=node, incarnation=inc),
                             heartbeat=lambda st: pb.HealthSummary(), on_request=lambda req, emit: None,
                             wait_ready_s=0.0)


def test_the_agent_presents_its_token_from_a_file_or_derives_it(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    token_file = tmp_path / "node.token"
    token_file.write_text("wrong\n")

    async def body(server: CoordinatorServer, addr: str) -> None:
        derived = _stream(tmp_path, addr, "n1", node_secret_file=str(secret))
        from_file = _stream(tmp_path, addr, "n2", token_file=str(token_file))
        derived.start()
        from_file.start()
        try:
            assert await asyncio.to_thread(derived.connected.wait, 20)
            await asyncio.sleep(1.0)
            assert not from_file.connected.is_set()  # a wrong token in the file: refused, retried
            token_file.write_text(node_token(SECRET, "n2") + "\n")  # the file changes: read at the next connect
            assert await asyncio.to_thread(from_file.connected.wait, 20)
            deadline = time.monotonic() + 20
            while {n for n, s in server.coord.by_node.items() if s.connected} != {"n1", "n2"}:
                assert time.monotonic() < deadline, server.coord.by_node
                await asyncio.sleep(0.05)
        finally:
            await asyncio.to_thread(derived.stop)
            await asyncio.to_thread(from_file.stop)

    _with(tmp_path, AuthPolicy(node_secret=SECRET), body)
