"""Node credentials, shared by the agent, the coordinator and the CLI (docs/security.md).

A *node token* names one node and proves it with an HMAC of the name under the cluster secret::

    gpuhealth-node-v1.<node name, base64url>.<HMAC-SHA256(secret, "gpuhealth node token v1\\0" + name), hex>

The coordinator verifies it with the secret alone (no database of tokens); a node holding its own
token can report as that node and no other. ``gpuhealth token --node NAME --secret-file F`` mints
one. Tokens and secrets are read from files or the environment, never taken from a command line,
where ``ps`` shows them to every user of the machine.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import stat
from pathlib import Path

NODE_TOKEN_PREFIX = "gpuhealth-node-v1"
MIN_SECRET_BYTES = 32  # 256 bits: `head -c 32 /dev/urandom | base64 > secret`
_MAX_FILE_BYTES = 64 * 1024  # a token or a secret; a ServiceAccount token is ~1-2 KiB
_CONTEXT = b"gpuhealth node token v1\0"


class CredentialError(ValueError):
    """A token or secret file that cannot be used; the message names the file and why."""


def _read_small(path: str | os.PathLike[str], what: str) -> bytes:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = fh.read(_MAX_FILE_BYTES + 1)
            mode = os.fstat(fh.fileno()).st_mode
    except OSError as exc:
        raise CredentialError(f"{p}: cannot read the {what}: {exc.strerror or exc}") from exc
    if len(data) > _MAX_FILE_BYTES:
        raise CredentialError(f"{p}: over {_MAX_FILE_BYTES} bytes; not a {what}")
    if what == "cluster secret" and mode & stat.S_IROTH:
        raise CredentialError(f"{p}: the cluster secret is readable by every user (chmod 600 or 640; on "
                              "Kubernetes, defaultMode: 0400 on its Secret volume)")
    return data.strip()


def read_token(path: str | os.PathLike[str]) -> str:
    """A bearer token from a file (read again at every use: projected tokens rotate)."""
    data = _read_small(path, "token")
    try:
        token = data.decode("ascii")
    except UnicodeDecodeError:
        raise CredentialError(f"{path}: a token is printable ASCII") from None
    if not token or any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise CredentialError(f"{path}: a token is one line of printable ASCII without spaces")
    return token


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The cluster secret: at least ``MIN_SECRET_BYTES`` bytes (the file's bytes, whitespace around
    them ignored), not readable by every user."""
    data = _read_small(path, "cluster secret")
    if len(data) < MIN_SECRET_BYTES:
        raise CredentialError(f"{path}: the cluster secret is {len(data)} bytes; use at least {MIN_SECRET_BYTES} "
                              "(head -c 32 /dev/urandom | base64)")
    return data


def _mac(secret: bytes, node: str) -> str:
    return hmac.new(secret, _CONTEXT + node.encode(), hashlib.sha256).hexdigest()


def node_token(secret: bytes, node: str) -> str:
    """The token of ``node`` under ``secret``."""
    if not node or any(ord(c) < 0x20 for c in node):
        raise CredentialError(f"node name {node[:40]!r}: must be printable text")
    name = base64.urlsafe_b64encode(node.encode()).decode("ascii").rstrip("=")
    return f"{NODE_TOKEN_PREFIX}.{name}.{_mac(secret, node)}"


def is_node_token(token: str) -> bool:
    return token.startswith(NODE_TOKEN_PREFIX + ".")


def verify_node_token(secret: bytes, token: str) -> str | None:
    """The node ``token`` was minted for, when ``secret`` minted it; None otherwise (constant time in
    the MAC)."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != NODE_TOKEN_PREFIX or len(parts[1]) > 1024:
        return None
    try:
        node = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    if not node or any(ord(c) < 0x20 for c in node):
        return None
    return node if hmac.compare_digest(_mac(secret, node), parts[2]) else None


def fingerprint(token: str) -> str:
    """A short, stable name for a credential in logs and bindings (never the credential itself)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


__all__ = ["MIN_SECRET_BYTES", "NODE_TOKEN_PREFIX", "CredentialError", "fingerprint", "is_node_token", "node_token",
           "read_secret", "read_token", "verify_node_token"]
