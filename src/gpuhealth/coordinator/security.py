"""Who may talk to the coordinator, and as which node (docs/security.md).

A caller is authenticated by one credential, and a node credential names its node:

- a **node token** (``runtime.credentials``): an HMAC of the node name under the cluster secret —
  verified with the secret alone, good for that node only;
- a **ServiceAccount token** (Kubernetes): the API server says which pod it is and the node it runs
  on (``token_review``); good for that node only;
- a **client certificate** (mutual TLS): its CN or a DNS SAN must equal the node it registers;
- the **shared agent token** (compatibility, ``coordinator.shared_token``): every agent holds the
  same one, so it cannot say which node is which — any holder can report as any node (warned);
- the **operator token**, or a certificate named in ``operator_names``: may act on nodes
  (LiveTriage makes ranks dump and runs py-spy, RunDiagnostic runs GPU work) and read; it never
  reports as a node, whatever is presented with it (the roles are disjoint).

Without any of them the coordinator runs **open**: it then listens on loopback only, unless
``coordinator.allow_unauthenticated`` says otherwise (``from_config`` refuses the rest), and even then
only a caller on its own host (a loopback peer) may act on nodes.

``AuthPolicy.from_config`` is the one way from the configuration to a policy; ``gpuhealth coordinator``
(``coordinator.run.build``) uses nothing else.

A Connect stream belongs to the session its Register obtained, under the same credential; a second
Register for a node whose stream is live under a different credential is refused and logged.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.config import CoordinatorConfig, split_address
from gpuhealth.coordinator.token_review import KubernetesTokenReview, TokenReviewer
from gpuhealth.proto.options import TOKEN_METADATA
from gpuhealth.runtime.credentials import (
    CredentialError,
    fingerprint,
    is_node_token,
    read_secret,
    read_token,
    verify_node_token,
)
from gpuhealth.runtime.tls import SecurityConfigError

_JWT = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$")


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller. ``node``: the one node its credential is good for (None: any node —
    open mode or the shared token — or none, for an operator). ``credential``: a stable, non-secret
    name of the credential, which a node's stream is bound to."""

    kind: str  # "open", "node_token", "service_account", "certificate", "shared_token", "operator"
    credential: str
    node: str | None = None
    operator: bool = False

    @property
    def reports(self) -> bool:
        """May this caller report as a node at all?"""
        return self.kind != "operator"

    def may_be(self, node: str) -> bool:
        return self.reports and (self.node is None or self.node == node)


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    token: str | None = None  # the shared agent token (compatibility: any holder is any node)
    mtls: bool = False
    operator_token: str | None = None
    operator_names: frozenset[str] = frozenset()
    node_secret: bytes | None = field(default=None, repr=False)
    token_review: TokenReviewer | None = None

    @classmethod
    def from_config(cls, cfg: CoordinatorConfig, *, mtls: bool) -> AuthPolicy:
        """The policy ``cfg`` asks for; ``SecurityConfigError`` (one line, naming the key) for a secret
        that cannot be read, a shared token nobody asked to keep, or no authentication at all on an
        address beyond loopback without ``allow_unauthenticated``."""
        try:
            shared = cfg.token or (read_token(cfg.token_file) if cfg.token_file else None)
            secret = read_secret(cfg.node_secret_file) if cfg.node_secret_file else None
        except CredentialError as exc:
            raise SecurityConfigError(str(exc)) from exc
        if shared and not cfg.shared_token:
            raise SecurityConfigError(
                "coordinator.token is one token every agent shares, and any holder could report as any node: give "
                "each node its own (coordinator.node_secret_file here, `gpuhealth token` for each node), or set "
                "coordinator.shared_token: true to keep it")
        reviewer: TokenReviewer | None = None
        if cfg.token_review:
            accounts = frozenset(a.strip() for a in cfg.agent_service_accounts.split(",") if a.strip())
            if cfg.token_review == "in-cluster":
                reviewer = KubernetesTokenReview.in_cluster(audience=cfg.token_review_audience, accounts=accounts,
                                                            ca_file=cfg.token_review_ca,
                                                            credential_file=cfg.token_review_credential_file)
            else:
                reviewer = KubernetesTokenReview(
                    cfg.token_review, ca_file=cfg.token_review_ca, audience=cfg.token_review_audience,
                    accounts=accounts,
                    credential_file=cfg.token_review_credential_file or "/var/run/secrets/kubernetes.io/"
                                                                        "serviceaccount/token")
        policy = cls(token=shared if cfg.shared_token else None, mtls=mtls, operator_token=cfg.operator_token or None,
                     operator_names=frozenset(n.strip() for n in cfg.operator_names.split(",") if n.strip()),
                     node_secret=secret, token_review=reviewer)
        if policy.open and not cfg.allow_unauthenticated and not is_loopback_address(cfg.listen):
            raise SecurityConfigError(
                f"coordinator.listen {cfg.listen}: no authentication is configured, so anyone who can reach this "
                "address could report as any node; configure node tokens (coordinator.node_secret_file), "
                "coordinator.token_review or mutual TLS (coordinator.tls_*), listen on 127.0.0.1 only, or set "
                "coordinator.allow_unauthenticated: true")
        return policy

    @property
    def open(self) -> bool:
        return not self.token and not self.mtls and not self.node_secret and self.token_review is None

    @property
    def bearer_required(self) -> bool:
        return bool(self.token or self.node_secret or self.token_review is not None)

    @property
    def operators_configured(self) -> bool:
        return bool(self.operator_token or self.operator_names)

    async def authenticate(self, metadata: Any, auth_context: dict[str, list[bytes]], peer: str = "") -> Caller | None:
        """Who is calling (``peer``: gRPC's ``context.peer()``), or None (refuse: UNAUTHENTICATED).
        ``TokenReviewError`` when a ServiceAccount token cannot be checked now (the API server is away)."""
        presented = _bearer(metadata)
        operator = self.is_operator(metadata, auth_context, peer)
        cert = _certificate(auth_context) if self.mtls else None
        if presented is not None and _same(presented, self.operator_token):
            return Caller("operator", "operator:" + fingerprint(presented), operator=True)
        if cert is not None and self.operator_names & peer_names(auth_context):
            # Roles are disjoint: an operator's certificate is an operator whatever else is presented with
            # it; it never reports as a node (not even one named like the certificate).
            return Caller("operator", "operator-" + cert, operator=True)
        if self.bearer_required:
            caller = await self._bearer_caller(presented) if presented is not None else None
            if caller is None:
                return None
            return Caller(caller.kind, caller.credential + (f"+{cert}" if cert else ""), caller.node, operator)
        if cert is not None:
            return Caller("certificate", cert, None, operator)  # the node comes from node_allowed
        return Caller("open", "open", None, operator) if self.open else None

    async def _bearer_caller(self, presented: str) -> Caller | None:
        if is_node_token(presented):
            node = verify_node_token(self.node_secret, presented) if self.node_secret else None
            return Caller("node_token", "node-token:" + fingerprint(presented), node) if node else None
        if self.token and _same(presented, self.token):
            return Caller("shared_token", "shared-token")
        if self.token_review is not None and _JWT.match(presented):
            who = await self.token_review.review(presented)
            if who is None:
                return None
            return Caller("service_account", f"service-account:{who.username}:{who.pod_uid or who.pod}", who.node)
        return None

    def is_operator(self, metadata: Any, auth_context: dict[str, list[bytes]], peer: str = "") -> bool:
        """May this caller act on nodes? The operator token, or (mTLS) a client certificate named in
        operator_names. Open mode without either configured: a caller on this host only (a loopback
        ``peer``) — never one from the network, whatever ``allow_unauthenticated`` lets in."""
        presented = _bearer(metadata)
        if presented is not None and _same(presented, self.operator_token):
            return True
        if self.mtls and self.operator_names & peer_names(auth_context):
            return True
        return self.open and not self.operators_configured and is_loopback_peer(peer)

    def node_allowed(self, auth_context: dict[str, list[bytes]], node: str) -> bool:
        """With mTLS, the peer certificate must name the node (CN or a SAN)."""
        if not self.mtls:
            return True
        return node in peer_names(auth_context)


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == TOKEN_METADATA and isinstance(value, str) and value.startswith("Bearer "):
            return value[7:]
    return None


def _same(presented: str, expected: str | None) -> bool:
    return bool(expected) and hmac.compare_digest(presented.encode(), (expected or "").encode())


def _certificate(auth_context: dict[str, list[bytes]]) -> str | None:
    pem = auth_context.get("x509_pem_cert")
    if not pem:
        return None
    return "certificate:" + hashlib.sha256(pem[0]).hexdigest()[:16]


def is_loopback_address(address: str) -> bool:
    """Does a listen address (``host:port``) bind loopback only? A name other than ``localhost`` is not
    trusted to be loopback: it could resolve to anything."""
    parts = split_address(address)
    if parts is None or not parts[0]:
        return False
    host = parts[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_peer(peer: str) -> bool:
    """Is a gRPC peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``ipv6:%5B::1%5D:5000``, ``unix:…``)
    on this host?"""
    peer = urllib.parse.unquote(peer or "")
    if peer.startswith("unix:"):
        return True
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return False
    host = rest.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def peer_names(auth_context: dict[str, list[bytes]]) -> set[str]:
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth_context.get(key, []):
            names.add(value.decode(errors="replace"))
    return names


__all__ = ["AuthPolicy", "Caller", "is_loopback_address", "is_loopback_peer", "peer_names"]
