"""A local HTTPS server that speaks the two Kubernetes API calls the coordinator makes: TokenReview
(``POST /apis/authentication.k8s.io/v1/tokenreviews``) and ``GET /api/v1/namespaces/NS/pods/NAME``.

It is a stand-in for an API server (none runs here): it answers from a table of tokens and pods the
test sets up, checks the caller's own bearer token like an API server, and counts what it was
asked. The shapes are the API's: ``status.authenticated``, ``status.audiences``,
``status.user.username``, ``status.user.extra["authentication.kubernetes.io/node-name"|"pod-name"|
"pod-uid"]`` (lists of strings), a pod's ``metadata.uid`` and ``spec.nodeName``.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class ServiceAccountToken:
    username: str
    audiences: list[str]
    pod: str = ""
    pod_uid: str = ""
    node: str | None = None  # in the token's extra (Kubernetes >= 1.30); None: the pod tells


@dataclass
class StandIn:
    directory: Path
    credential: str = "coordinator-sa-token"
    tokens: dict[str, ServiceAccountToken] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (namespace, name) → pod
    calls: list[str] = field(default_factory=list)
    down: bool = False

    def start(self) -> None:
        cert, key = _self_signed(self.directory)
        self.ca_file = str(cert)
        self.credential_file = self.directory / "coordinator.token"
        self.credential_file.write_text(self.credential + "\n")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorised(self) -> bool:
                if owner.down:
                    self._reply(503, {"kind": "Status", "status": "Failure"})
                    return False
                if self.headers.get("Authorization") != f"Bearer {owner.credential}":
                    self._reply(401, {"kind": "Status", "status": "Failure", "reason": "Unauthorized"})
                    return False
                return True

            def do_POST(self) -> None:
                owner.calls.append(f"POST {self.path}")
                if not self._authorised():
                    return
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                spec = review.get("spec", {})
                who = owner.tokens.get(spec.get("token", ""))
                wanted = spec.get("audiences") or []
                status: dict[str, Any] = {"authenticated": False}
                if who is not None and (not wanted or set(wanted) & set(who.audiences)):
                    extra: dict[str, list[str]] = {}
                    if who.pod:
                        extra["authentication.kubernetes.io/pod-name"] = [who.pod]
                        extra["authentication.kubernetes.io/pod-uid"] = [who.pod_uid]
                    if who.node:
                        extra["authentication.kubernetes.io/node-name"] = [who.node]
                    status = {"authenticated": True, "audiences": sorted(set(wanted) & set(who.audiences)),
                              "user": {"username": who.username, "uid": "u-" + who.username, "extra": extra,
                                       "groups": ["system:serviceaccounts"]}}
                self._reply(201, {**review, "status": status})

            def do_GET(self) -> None:
                owner.calls.append(f"GET {self.path}")
                if not self._authorised():
                    return
                parts = self.path.strip("/").split("/")
                if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
                    pod = owner.pods.get((parts[3], parts[5]))
                    if pod is not None:
                        self._reply(200, pod)
                        return
                self._reply(404, {"kind": "Status", "status": "Failure", "reason": "NotFound"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        self.pods[(namespace, name)] = {"kind": "Pod", "metadata": {"name": name, "namespace": namespace, "uid": uid},
                                        "spec": {"nodeName": node}}


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "apiserver.crt", directory / "apiserver.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
