"""TLS and basic auth for the HTTP endpoints (the agent's /metrics and /health, the coordinator's /metrics),
read from the web config file Prometheus' exporters share (exporter-toolkit's ``--web.config.file``)::

    tls_server_config:
      cert_file: /etc/gpuhealth/web/tls.crt
      key_file: /etc/gpuhealth/web/tls.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default), VerifyClientCertIfGiven, ...
      client_ca_file: /etc/gpuhealth/web/ca.crt
      client_allowed_sans: [prometheus.monitoring]
      min_version: TLS12                              # TLS10 … TLS13
      max_version: TLS13
    basic_auth_users:
      prometheus: $2b$12$...                          # bcrypt hash (htpasswd -nBC 12 "" | tr -d ':\\n')
    http_server_config:
      http2: false                                    # accepted; gpuhealth serves HTTP/1.1

A key exporter-toolkit knows but gpuhealth does not do (``cipher_suites``, ``curve_preferences``, response
``headers``) is refused, as is any other unknown key: a setting that silently did nothing would be worse.
Every problem is one ``WebConfigError`` line naming the file and the key. The files are read again when one
of them changes (a renewed certificate), at most every ``RELOAD_CHECK_S``; a change that does not load is
logged and the last good configuration kept.

``bcrypt`` (the ``web`` extra) is imported only when ``basic_auth_users`` is set.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import ssl
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20  # a web config, a certificate, a key or a CA bundle: never more than this
MAX_USERS = 1_000
MAX_BCRYPT_COST = 16  # 2^16 rounds take about a second a check: more would let each wrong password stall a worker
RELOAD_CHECK_S = 5.0
_CACHE_MAX = 1_024

_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,  # asked for, not verified: Python verifies what it asks for
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1, "TLS12": ssl.TLSVersion.TLSv1_2,
             "TLS13": ssl.TLSVersion.TLSv1_3}
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "client_allowed_sans", "min_version",
             "max_version", "prefer_server_cipher_suites"}
_NOT_DONE = {"cipher_suites": "gpuhealth uses OpenSSL's defaults for the TLS version",
             "curve_preferences": "gpuhealth uses OpenSSL's default groups",
             "cert": "give the certificate as cert_file", "key": "give the key as key_file",
             "client_ca": "give the client CA as client_ca_file"}


class WebConfigError(ValueError):
    """A web config that cannot be served: the message is one line naming the file and the key."""


@dataclass(frozen=True, slots=True)
class WebSettings:
    """What one web config file says, checked and loaded."""

    source: str
    tls: ssl.SSLContext | None
    users: Mapping[str, bytes]  # user → bcrypt hash
    allowed_sans: frozenset[str]
    files: tuple[str, ...]  # the web config and every file it names (their changes reload it)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def load_web_config(path: str | os.PathLike[str]) -> WebSettings:
    """Read and check the web config at ``path``; raises ``WebConfigError`` (one line) when it cannot serve."""
    where = str(path)
    raw = _read_small(where, "web config")
    try:
        doc = yaml.safe_load(raw.decode("utf-8")) or {}
    except UnicodeDecodeError:
        raise WebConfigError(f"{where}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise WebConfigError(f"{where}: not valid YAML{at}: {getattr(exc, 'problem', None) or type(exc).__name__}"
                             ) from None
    except RecursionError:
        raise WebConfigError(f"{where}: not valid YAML: nested too deeply") from None
    if not isinstance(doc, Mapping):
        raise WebConfigError(f"{where}: top level must be a mapping (tls_server_config, basic_auth_users)")
    _only(doc, {"tls_server_config", "basic_auth_users", "http_server_config"}, where, "")
    files = [where]
    tls, sans = None, frozenset[str]()
    if doc.get("tls_server_config") is not None:
        tls, sans, named = _tls(_mapping(doc["tls_server_config"], where, "tls_server_config"), where)
        files += named
    http = doc.get("http_server_config")
    if http is not None:
        http = _mapping(http, where, "http_server_config")
        _only(http, {"http2"}, where, "http_server_config.")
        if "http2" in http and not isinstance(http["http2"], bool):
            raise WebConfigError(f"{where}: http_server_config.http2: expected true/false")
    users = _users(doc.get("basic_auth_users"), where)
    return WebSettings(where, tls, users, sans, tuple(files))


def _read_small(path: str, what: str, where: str = "") -> bytes:
    """A regular file of at most ``MAX_FILE_BYTES`` (never a FIFO or a device that would block or never end);
    ``where``: the web config that names it (errors start with it)."""
    said = f"{where}: {what} {path}" if where else f"{path}: the {what}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise WebConfigError(f"{said}: cannot read it: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WebConfigError(f"{said} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise WebConfigError(f"{said}: cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise WebConfigError(f"{said} is over {MAX_FILE_BYTES} bytes")
    return data


def _mapping(value: Any, where: str, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise WebConfigError(f"{where}: {key}: expected a mapping, got {type(value).__name__}")
    return value


def _only(doc: Mapping[Any, Any], known: set[str], where: str, prefix: str) -> None:
    for key in doc:
        if key in _NOT_DONE:
            raise WebConfigError(f"{where}: {prefix}{key} is not supported: {_NOT_DONE[str(key)]}")
        if key not in known:
            raise WebConfigError(f"{where}: unknown key {prefix}{str(key)[:60]!r} (known: {', '.join(sorted(known))})")


def _text(tls: Mapping[str, Any], key: str, where: str) -> str:
    value = tls.get(key)
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or len(value) > 4096 or any(ord(c) < 0x20 for c in value):
        raise WebConfigError(f"{where}: tls_server_config.{key}: expected a path or name, got {value!r:.60}")
    return value


def _tls(tls: Mapping[str, Any], where: str) -> tuple[ssl.SSLContext, frozenset[str], list[str]]:
    for key in tls:
        if key in _NOT_DONE:
            raise WebConfigError(f"{where}: tls_server_config.{key} is not supported: {_NOT_DONE[str(key)]}")
        if key not in _TLS_KEYS:
            raise WebConfigError(f"{where}: unknown key tls_server_config.{str(key)[:60]!r}")
    cert, key = _text(tls, "cert_file", where), _text(tls, "key_file", where)
    if not cert or not key:
        raise WebConfigError(f"{where}: tls_server_config needs both cert_file and key_file")
    auth = _text(tls, "client_auth_type", where) or "NoClientCert"
    if auth not in _CLIENT_AUTH:
        raise WebConfigError(f"{where}: tls_server_config.client_auth_type {auth[:40]!r} is not one of "
                             f"{', '.join(_CLIENT_AUTH)}")
    ca = _text(tls, "client_ca_file", where)
    if ca and auth == "NoClientCert":
        raise WebConfigError(f"{where}: tls_server_config.client_ca_file is set but client_auth_type is "
                             "NoClientCert (say which client certificates to ask for)")
    if not ca and auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert"):
        raise WebConfigError(f"{where}: tls_server_config.client_auth_type {auth} needs client_ca_file")
    if auth in ("RequestClientCert", "RequireAnyClientCert"):
        raise WebConfigError(f"{where}: tls_server_config.client_auth_type {auth} (a client certificate nobody "
                             "verifies) is not supported: use VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    sans_value = tls.get("client_allowed_sans") or []
    if not isinstance(sans_value, list) or not all(isinstance(s, str) for s in sans_value):
        raise WebConfigError(f"{where}: tls_server_config.client_allowed_sans: expected a list of names")
    if sans_value and auth != "RequireAndVerifyClientCert":
        raise WebConfigError(f"{where}: tls_server_config.client_allowed_sans needs client_auth_type "
                             "RequireAndVerifyClientCert")
    if not isinstance(tls.get("prefer_server_cipher_suites", True), bool):
        raise WebConfigError(f"{where}: tls_server_config.prefer_server_cipher_suites: expected true/false")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    versions = []
    for which in ("min_version", "max_version"):
        text = _text(tls, which, where)
        if text and text not in _VERSIONS:
            raise WebConfigError(f"{where}: tls_server_config.{which} {text[:20]!r} is not one of "
                                 f"{', '.join(_VERSIONS)}")
        versions.append(_VERSIONS.get(text))
    low, high = versions
    if low is not None and high is not None and low > high:
        raise WebConfigError(f"{where}: tls_server_config.min_version is above max_version")
    ctx.minimum_version = low or ssl.TLSVersion.TLSv1_2  # exporter-toolkit's default too
    if high is not None:
        ctx.maximum_version = high
    for path, what in ((cert, "tls_server_config.cert_file"), (key, "tls_server_config.key_file")):
        _read_small(path, what, where)
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise WebConfigError(f"{where}: tls_server_config: cannot load cert_file {cert} with key_file {key}: "
                             f"{getattr(exc, 'reason', None) or exc}") from None
    files = [cert, key]
    ctx.verify_mode = _CLIENT_AUTH[auth]
    if ca:
        try:
            ctx.load_verify_locations(cadata=_read_small(ca, "tls_server_config.client_ca_file", where)
                                      .decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise WebConfigError(f"{where}: tls_server_config.client_ca_file {ca}: no CA certificate in it "
                                 f"({getattr(exc, 'reason', None) or exc})") from None
        files.append(ca)
    return ctx, frozenset(sans_value), files


def _users(value: Any, where: str) -> dict[str, bytes]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise WebConfigError(f"{where}: basic_auth_users: expected a mapping of user: bcrypt hash")
    if len(value) > MAX_USERS:
        raise WebConfigError(f"{where}: basic_auth_users: {len(value)} users is over {MAX_USERS}")
    users: dict[str, bytes] = {}
    for user, hashed in value.items():
        if not isinstance(user, str) or not user or ":" in user or any(ord(c) < 0x20 for c in user):
            raise WebConfigError(f"{where}: basic_auth_users: {str(user)[:40]!r} is not a user name "
                                 "(text without ':' or control characters)")
        if not isinstance(hashed, str) or not _is_bcrypt(hashed):
            raise WebConfigError(f"{where}: basic_auth_users.{user}: not a bcrypt hash ($2a$/$2b$/$2y$, cost 04-"
                                 f"{MAX_BCRYPT_COST}, 60 characters); make one with htpasswd -nBC 12 \"\"")
        users[user] = hashed.encode("ascii")
    if users:
        try:
            import bcrypt  # noqa: F401 (checked here, used per request)
        except ImportError:
            raise WebConfigError(f"{where}: basic_auth_users needs the bcrypt package: pip install "
                                 "'gpuhealth[web]'") from None
    return users


def _is_bcrypt(text: str) -> bool:
    if len(text) != 60 or text[:4] not in ("$2a$", "$2b$", "$2y$") or text[6] != "$":
        return False
    cost = text[4:6]
    return cost.isdigit() and 4 <= int(cost) <= MAX_BCRYPT_COST


def _peer_names(cert: Mapping[str, Any]) -> set[str]:
    names = {str(v) for kind, v in cert.get("subjectAltName", ()) if kind in ("DNS", "IP Address", "email", "URI")}
    for rdn in cert.get("subject", ()):
        names |= {str(v) for k, v in rdn if k == "commonName"}
    return names


@dataclass
class WebGuard:
    """The live web config of one HTTP server: the TLS context to wrap new connections with, and the basic
    auth check; reloads the files when they change."""

    path: str
    settings: WebSettings
    _stamps: tuple[tuple[int, int, int], ...] = ()
    _checked: float = 0.0
    _ok: dict[tuple[str, bytes], bool] = field(default_factory=dict)  # (user, sha256(password)) verified
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, path: str) -> WebGuard:
        guard = cls(path, load_web_config(path))
        guard._stamps = _stamps(guard.settings.files)
        guard._checked = time.monotonic()
        if guard.settings.users and guard.settings.tls is None:
            log.warning("%s: basic auth without tls_server_config: passwords cross the network in clear text", path)
        return guard

    def context(self) -> ssl.SSLContext | None:
        """The TLS context for a new connection (None: plain HTTP), reloaded first when a file changed."""
        now = time.monotonic()
        if now - self._checked >= RELOAD_CHECK_S:
            self._checked = now
            stamps = _stamps(self.settings.files)
            if stamps != self._stamps:
                self._stamps = stamps
                try:
                    new = load_web_config(self.path)
                except WebConfigError as exc:
                    log.error("web config changed but does not load; still serving the last good one: %s", exc)
                else:
                    if (new.tls is None) != (self.settings.tls is None):
                        log.error("%s: turning TLS on or off needs a restart; still serving the last good one",
                                  self.path)
                    else:
                        with self._lock:
                            self.settings = new
                            self._ok.clear()
                        log.info("web config reloaded from %s", self.path)
        return self.settings.tls

    def peer_allowed(self, cert: Mapping[str, Any] | None) -> bool:
        """client_allowed_sans: the verified client certificate names one of them (or none is listed)."""
        sans = self.settings.allowed_sans
        return not sans or (cert is not None and bool(_peer_names(cert) & sans))

    def authorized(self, header: str | None) -> bool:
        """Does an ``Authorization`` header carry a user and password of ``basic_auth_users``? True when no
        users are configured."""
        users = self.settings.users
        if not users:
            return True
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "basic" or not token:
            return False
        try:
            user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return False
        hashed = users.get(user)
        if not sep or hashed is None:
            return False
        key = (user, hashlib.sha256(password.encode() + b"\0" + hashed).digest())
        if self._ok.get(key):
            return True
        import bcrypt

        try:
            ok = bcrypt.checkpw(password.encode("utf-8"), hashed)
        except ValueError:
            return False
        if ok:
            with self._lock:
                if len(self._ok) >= _CACHE_MAX:
                    self._ok.clear()
                self._ok[key] = True
        return ok


def _stamps(paths: tuple[str, ...]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for p in paths:
        try:
            st = Path(p).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((0, -1, 0))
    return tuple(out)


__all__ = ["MAX_BCRYPT_COST", "WebConfigError", "WebGuard", "WebSettings", "load_web_config"]
