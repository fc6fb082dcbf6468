"""TLS files and gRPC credentials, for every gRPC client and server of gpuhealth (the agent's link,
the CLI's queries, the coordinator), and the bearer-token metadata they send.

gRPC is imported only by the functions that build credentials: checking a configuration's TLS
files needs no ``gpuhealth[coordinator]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpuhealth.proto.options import TOKEN_METADATA

if TYPE_CHECKING:
    import grpc


class SecurityConfigError(ValueError):
    """TLS files missing or unreadable, or half a TLS configuration."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: str
    key: str
    ca: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA", self.ca)):
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise SecurityConfigError(f"cannot read TLS {what} {path}: {exc.strerror or exc}") from exc
        return out[0], out[1], out[2]


def tls_files(cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    """All three files (mutual TLS), or none (None); anything in between is an error."""
    given = [x for x in (cert, key, ca) if x]
    if not given:
        return None
    if len(given) != 3:
        raise SecurityConfigError("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca")
    assert cert and key and ca
    return TlsFiles(cert, key, ca)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    import grpc

    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    import grpc

    cert, key, ca = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``token`` as a bearer token (none without one)."""
    return ((TOKEN_METADATA, f"Bearer {token}"),) if token else ()


__all__ = ["SecurityConfigError", "TlsFiles", "channel_credentials", "server_credentials", "tls_files",
           "token_metadata"]
