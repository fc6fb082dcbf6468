"""Fault tests: the coordinator killed with SIGKILL and restarted mid-run loses no acknowledged
record and stores none twice; mutual TLS refuses a wrong certificate and an agent claiming another
node."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from simagent import SimAgent, step_batch_message

from gpuhealth.agent.coordinator_link import CoordinatorLink, LinkSettings
from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.model import StepRecord
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.runtime.tls import TlsFiles, channel_credentials

pytestmark = pytest.mark.integration


def _until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def _start_coordinator(port: int, db: Path, ready: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Port 0 the first time (the kernel picks a free one); the same port again on a restart."""
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuhealth.cli.main", "coordinator", "--listen", f"127.0.0.1:{port}",
         "--metrics-listen", "off", "--db", str(db), "--ready-file", str(ready), "--hang-floor", "3600"],
        stdout=subprocess.DEVNULL, stderr=open(db.parent / "coordinator.log", "ab"))  # noqa: SIM115
    _until(ready.exists, 30, "the coordinator to serve")
    return proc, int(json.loads(ready.read_text())["grpc_port"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_and_restart_loses_no_acknowledged_record(tmp_path: Path) -> None:
    db, ready = tmp_path / "coord.db", tmp_path / "ready.json"
    coord, port = _start_coordinator(0, db, ready)
    link = CoordinatorLink(LinkSettings(address=f"127.0.0.1:{port}", spool_path=str(tmp_path / "spool.db"),
                                        batch_interval_s=0.05, backoff_initial_s=0.2, backoff_max_s=1.0))
    link.start(None)
    sent: set[tuple[int, int]] = set()
    job, world = "job-restart", 8
    try:
        def feed(first: int, last: int) -> None:
            for step in range(first, last):
                recs = [StepRecord(job, r, step, 1.7e9 + step, 0.1, 0.06, 0.04) for r in range(world)]
                link.on_steps(None, recs)
                sent.update((r, step) for r in range(world))
                time.sleep(0.01)

        feed(0, 150)
        _until(lambda: link.spool.acked > 0, 20, "some records acknowledged")
        acked_before_kill = link.spool.acked
        coord.send_signal(signal.SIGKILL)
        coord.wait(10)
        feed(150, 300)  # spooled on disk while the coordinator is down
        assert link.spool.stats().depth > 0
        coord, _ = _start_coordinator(port, db, ready)
        feed(300, 400)
        def all_acked() -> bool:
            st = link.spool.stats()
            return link.buffered() == 0 and st.depth == 0 and st.acked >= st.next_seq - 1

        _until(all_acked, 30, "every record acknowledged after the restart")
        assert link.spool.acked > acked_before_kill
        assert link.stats["connects"] >= 2
    finally:
        link.stop()
        coord.send_signal(signal.SIGTERM)
        coord.wait(10)
    # What the coordinator committed is exactly what was sent: nothing lost, nothing twice.
    stored: list[tuple[int, int]] = []
    with sqlite3.connect(db) as con:
        for (payload,) in con.execute("SELECT payload FROM step_batches ORDER BY id"):
            batch = pb.AgentMessage.FromString(payload).record.steps
            stored += list(zip(batch.rank, batch.step, strict=True))
        (journal,) = con.execute("PRAGMA journal_mode").fetchone()
    assert len(stored) == len(sent) == world * 400
    assert set(stored) == sent
    assert journal == "wal"


# -- mutual TLS ---------------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject_cn: str, key: Any, issuer: x509.Certificate | None, issuer_key: Any, *, ca: bool = False,
          dns: tuple[str, ...] = (), ip: tuple[str, ...] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer.subject if issuer is not None else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ip]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(tmp: Path, name: str, cert: x509.Certificate, key: Any) -> tuple[str, str]:
    c, k = tmp / f"{name}.crt", tmp / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    os.chmod(k, 0o600)
    return str(c), str(k)


def _pki(tmp: Path) -> dict[str, TlsFiles]:
    ca_key, rogue_key = _key(), _key()
    ca = _cert("gpuhealth test CA", ca_key, None, ca_key, ca=True)
    rogue = _cert("rogue CA", rogue_key, None, rogue_key, ca=True)
    ca_path = tmp / "ca.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out = {}
    for name, cn, issuer, issuer_key, dns in (
        ("server", "coordinator", ca, ca_key, ("localhost",)),
        ("n1", "n1", ca, ca_key, ("n1",)),
        ("rogue-n1", "n1", rogue, rogue_key, ("n1",)),
    ):
        key = _key()
        cert, keyfile = _write(tmp, name, _cert(cn, key, issuer, issuer_key, dns=dns, ip=("127.0.0.1",)), key)
        out[name] = TlsFiles(cert, keyfile, str(ca_path))
    return out


def test_mtls_refuses_wrong_certificate_and_other_node(tmp_path: Path) -> None:
    pki = _pki(tmp_path)

    async def main() -> None:
        coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(evidence_dir=str(tmp_path / "ev")))
        server = CoordinatorServer(coord, listen="127.0.0.1:0", metrics_listen=None, policy=AuthPolicy(mtls=True),
                                   tls=pki["server"])
        endpoints = await server.start()
        addr = f"localhost:{endpoints.grpc_port}"
        try:
            good = SimAgent(addr, "n1", credentials=channel_credentials(pki["n1"]))
            await good.register()
            await good.connect()
            await good.send(step_batch_message(1, "j", [0, 1], 1))
            await good.wait_acked(1)
            await good.close()
            # The right CA but registering as another node.
            liar = SimAgent(addr, "n2", credentials=channel_credentials(pki["n1"]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await liar.register()
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "n2" in (err.value.details() or "")
            await liar.close()
            # A certificate from another CA: the TLS handshake fails, nothing reaches the service.
            rogue = SimAgent(addr, "n1", credentials=channel_credentials(pki["rogue-n1"]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rogue.register()
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            await rogue.close()
            # No client certificate at all.
            anon = SimAgent(addr, "n1", credentials=grpc.ssl_channel_credentials(
                Path(pki["server"].ca).read_bytes()))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await anon.register()
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            await anon.close()
            assert coord.store.step_record_count() == 2
            assert [n.name for n in coord.store.nodes()] == ["n1"]
        finally:
            await server.stop(0)

    asyncio.run(main())
