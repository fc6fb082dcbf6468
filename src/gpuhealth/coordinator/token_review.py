"""Kubernetes node identity: an agent presents its pod's ServiceAccount token (projected, audience
``gpuhealth``); the coordinator asks the API server who that is (TokenReview) and which node the pod
runs on, so a pod can only report as the node it is on.

    reviewer = KubernetesTokenReview.in_cluster(audience="gpuhealth",
                                                accounts={"system:serviceaccount:gpuhealth:gpuhealth-agent"})
    who = await reviewer.review(token)     # -> ReviewedIdentity | None

The node comes from the token itself where the API server binds it
(``authentication.kubernetes.io/node-name`` in the review's ``extra``, Kubernetes ≥ 1.30), else from
the pod the token is bound to (``GET pods/NAME``, its ``spec.nodeName``, checked against the
token's pod UID). The coordinator needs ``create tokenreviews`` (ClusterRole
``system:auth-delegator``) and, for the fallback, ``get pods`` in the agents' namespace.

Reviews are cached for ``cache_s`` (by the token's SHA-256, bounded), refusals briefly too, and at
most ``max_concurrent`` are in flight: a flood of made-up tokens costs the API server little.
``TokenReviewer`` is the seam: anything with ``async review(token)`` will do.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuhealth.runtime.credentials import CredentialError, read_token
from gpuhealth.runtime.tls import SecurityConfigError

IN_CLUSTER_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
_MAX_REPLY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ReviewedIdentity:
    """Who a ServiceAccount token belongs to, as the API server says."""

    username: str  # system:serviceaccount:<namespace>:<name>
    node: str  # the node the token's pod runs on
    pod: str = ""
    pod_uid: str = ""


class TokenReviewer(Protocol):
    async def review(self, token: str) -> ReviewedIdentity | None:
        """The identity behind ``token``, or None when the API server does not vouch for it (or it is
        not an agent's, or not bound to a node)."""
        ...


class TokenReviewError(RuntimeError):
    """The API server could not be asked (unreachable, refused the coordinator's own credential)."""


def _first(extra: dict[str, Any], key: str) -> str:
    value = extra.get(key)
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return ""


class KubernetesTokenReview:
    """TokenReview over HTTPS against ``api_url``, authenticating with the bearer in ``credential_file``
    (re-read every ``credential_ttl_s``: it rotates too)."""

    def __init__(self, api_url: str, *, ca_file: str | None, credential_file: str, audience: str,
                 accounts: frozenset[str], timeout_s: float = 5.0, cache_s: float = 60.0, cache_size: int = 4096,
                 max_concurrent: int = 8) -> None:
        parsed = urllib.parse.urlparse(api_url)
        if parsed.scheme != "https" or not parsed.hostname:
            raise SecurityConfigError(f"coordinator.token_review: {api_url!r} is not an https:// URL of the API server")
        if not accounts:
            raise SecurityConfigError("coordinator.agent_service_accounts: name the agents' ServiceAccount "
                                      "(system:serviceaccount:NAMESPACE:NAME); without it any pod could report")
        self.api_url = api_url.rstrip("/")
        self.audience = audience
        self.accounts = accounts
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self.cache_size = cache_size
        self._credential_file = credential_file
        self._credential: tuple[str, float] | None = None
        try:
            self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
        except (OSError, ssl.SSLError) as exc:
            raise SecurityConfigError(f"coordinator.token_review_ca {ca_file}: {exc}") from exc
        self._cache: collections.OrderedDict[str, tuple[float, ReviewedIdentity | None]] = collections.OrderedDict()
        self._slots = asyncio.Semaphore(max_concurrent)
        self.stats = {"reviews": 0, "cache_hits": 0, "refused": 0, "errors": 0}
        self._credential_value()  # a missing credential fails at start, not at the first agent

    @classmethod
    def in_cluster(cls, *, audience: str, accounts: frozenset[str], directory: Path = IN_CLUSTER_DIR,
                   env: dict[str, str] | None = None, ca_file: str | None = None,
                   credential_file: str | None = None) -> KubernetesTokenReview:
        """The API server the pod's environment names (``KUBERNETES_SERVICE_HOST``/``_PORT``), with the
        CA and the coordinator's own token from ``directory`` (the automounted ServiceAccount folder) —
        or from ``ca_file`` / ``credential_file`` where the pod mounts a projected token elsewhere."""
        env = dict(os.environ) if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise SecurityConfigError("coordinator.token_review: in-cluster, but KUBERNETES_SERVICE_HOST is not set "
                                      "(not in a pod?); give the API server's URL instead")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", ca_file=ca_file or str(directory / "ca.crt"),
                   credential_file=credential_file or str(directory / "token"), audience=audience, accounts=accounts)

    def _credential_value(self) -> str:
        now = time.monotonic()
        if self._credential is None or now - self._credential[1] > 60.0:
            try:
                self._credential = (read_token(self._credential_file), now)
            except CredentialError as exc:
                raise SecurityConfigError(f"coordinator.token_review_credential_file: {exc}") from exc
        return self._credential[0]

    async def review(self, token: str) -> ReviewedIdentity | None:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            self._cache.move_to_end(key)
            self.stats["cache_hits"] += 1
            return hit[1]
        async with self._slots:
            try:
                who = await asyncio.to_thread(self._review, token)
            except TokenReviewError:
                self.stats["errors"] += 1
                raise
        self.stats["reviews"] += 1
        if who is None:
            self.stats["refused"] += 1
        self._cache[key] = (now + (self.cache_s if who is not None else min(self.cache_s, 5.0)), who)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return who

    # -- blocking HTTP (on a worker thread) --------------------------------------------------------
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.api_url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self._credential_value()}", "Content-Type": "application/json",
            "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                raw = resp.read(_MAX_REPLY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise TokenReviewError(f"{method} {path}: HTTP {exc.code} from the API server") from None
        except (OSError, ssl.SSLError) as exc:
            raise TokenReviewError(f"{method} {path}: {exc}") from None
        if len(raw) > _MAX_REPLY_BYTES:
            raise TokenReviewError(f"{method} {path}: reply over {_MAX_REPLY_BYTES} bytes")
        try:
            doc = json.loads(raw)
        except ValueError:
            raise TokenReviewError(f"{method} {path}: the API server's reply is not JSON") from None
        if not isinstance(doc, dict):
            raise TokenReviewError(f"{method} {path}: the API server's reply is not an object")
        return doc

    def _review(self, token: str) -> ReviewedIdentity | None:
        doc = self._call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience]}})
        status = doc.get("status") if isinstance(doc.get("status"), dict) else {}
        assert isinstance(status, dict)
        user = status.get("user") if isinstance(status.get("user"), dict) else {}
        assert isinstance(user, dict)
        audiences = status.get("audiences")
        if status.get("authenticated") is not True or not isinstance(audiences, list) or self.audience not in audiences:
            return None
        username = user.get("username")
        if not isinstance(username, str) or username not in self.accounts:
            return None
        extra = user.get("extra") if isinstance(user.get("extra"), dict) else {}
        assert isinstance(extra, dict)
        pod, pod_uid = _first(extra, POD_NAME_EXTRA), _first(extra, POD_UID_EXTRA)
        node = _first(extra, NODE_NAME_EXTRA)
        if not node and pod and pod_uid:
            node = self._node_of_pod(username, pod, pod_uid)
        if not node:
            return None  # a token bound to no pod (a long-lived Secret token): it names no node
        return ReviewedIdentity(username, node, pod, pod_uid)

    def _node_of_pod(self, username: str, pod: str, pod_uid: str) -> str:
        namespace = username.split(":")[2] if username.count(":") == 3 else ""
        if not namespace:
            return ""
        path = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods/{urllib.parse.quote(pod)}"
        try:
            doc = self._call("GET", path)
        except TokenReviewError:
            return ""
        meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
        spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
        assert isinstance(meta, dict) and isinstance(spec, dict)
        node = spec.get("nodeName")
        return node if meta.get("uid") == pod_uid and isinstance(node, str) else ""


__all__ = ["KubernetesTokenReview", "ReviewedIdentity", "TokenReviewError", "TokenReviewer"]
