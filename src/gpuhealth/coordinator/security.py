"""Who may talk to the coordinator, and as which node.

Two modes (both may be on): mutual TLS, where an agent's certificate CN or a DNS SAN must equal
the node name it registers (so a node cannot report for another), and a shared bearer token for
labs without a PKI, where a Connect stream is bound to the session its node obtained at Register
(a stream cannot switch node). Without either, the coordinator runs open (loopback/tests) and says
so in its log.

Two roles: agents report and read; operators may also act on nodes (LiveTriage makes ranks dump and
runs py-spy on them, RunDiagnostic runs GPU work). An operator presents the operator token, or a
client certificate named in ``operator_names``. Every agent of a fleet holds the agent token, so it
must not be enough to drive every other node.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from gpuhealth.proto.options import TOKEN_METADATA


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    token: str | None = None
    mtls: bool = False
    operator_token: str | None = None
    operator_names: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        return not self.token and not self.mtls

    @property
    def operators_configured(self) -> bool:
        return bool(self.operator_token or self.operator_names)

    def token_ok(self, metadata: Any) -> bool:
        """Constant-time comparison of the bearer token (always true without a token); the operator
        token authenticates too."""
        if not self.token:
            return True
        presented = _bearer(metadata)
        return presented is not None and (_same(presented, self.token) or _same(presented, self.operator_token))

    def is_operator(self, metadata: Any, auth_context: dict[str, list[bytes]]) -> bool:
        """May this caller act on nodes? Open mode: yes. Otherwise the operator token, or (mTLS) a
        client certificate named in operator_names."""
        if self.open and not self.operators_configured:
            return True
        presented = _bearer(metadata)
        if presented is not None and _same(presented, self.operator_token):
            return True
        return bool(self.mtls and self.operator_names & peer_names(auth_context))

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


def peer_names(auth_context: dict[str, list[bytes]]) -> set[str]:
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth_context.get(key, []):
            names.add(value.decode(errors="replace"))
    return names


__all__ = ["AuthPolicy", "peer_names"]
