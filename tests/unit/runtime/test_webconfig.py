"""The web config (exporter-toolkit's format) is checked whole before anything is served: every key known or
refused by name, files regular and small, TLS loadable, hashes bcrypt; basic auth verifies with bcrypt (a
success cached, a wrong password never); a renewed certificate is picked up, a broken one is not."""

from __future__ import annotations

import base64
import os
import sys
import time
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml

from gpuhealth.runtime import webconfig
from gpuhealth.runtime.webconfig import WebConfigError, WebGuard, load_web_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from commands import make_pki

# A fixed salt: the hash appears in test ids, which pytest-xdist needs equal in every worker.
HASH = bcrypt.hashpw(b"pw", b"$2b$04$abcdefghijklmnopqrstuu").decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    d = tmp_path_factory.mktemp("pki")
    made = make_pki(d, {"server": "server", "other": "other"})
    made["ca"] = (str(d / "ca.crt"), "")
    return made


def _write(tmp_path: Path, doc: Any, pki: dict[str, tuple[str, str]]) -> Path:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    text = (text.replace("CERT", pki["server"][0]).replace("OTHERKEY", pki["other"][1])
            .replace("KEY", pki["server"][1]).replace("CA", pki["ca"][0]))
    path = tmp_path / "web.yml"
    path.write_text(text)
    return path


TLS = {"cert_file": "CERT", "key_file": "KEY"}


@pytest.mark.parametrize(("doc", "says"), [
    ({"tls_server_confg": TLS}, "unknown key 'tls_server_confg'"),
    ({"tls_server_config": {**TLS, "certfile": "x"}}, "unknown key tls_server_config.'certfile'"),
    ({"tls_server_config": {**TLS, "cipher_suites": ["TLS_AES_128_GCM_SHA256"]}}, "cipher_suites is not supported"),
    ({"tls_server_config": {"key_file": "KEY"}}, "needs both cert_file and key_file"),
    ({"tls_server_config": {"cert_file": "/nonexistent/tls.crt", "key_file": "KEY"}},
     "tls_server_config.cert_file /nonexistent/tls.crt: cannot read it"),
    ({"tls_server_config": {"cert_file": "/dev/zero", "key_file": "KEY"}}, "not a regular file"),
    ({"tls_server_config": {"cert_file": "CERT", "key_file": "OTHERKEY"}}, "cannot load cert_file"),
    ({"tls_server_config": {**TLS, "client_ca_file": "CA"}}, "client_auth_type is NoClientCert"),
    ({"tls_server_config": {**TLS, "client_auth_type": "RequireAndVerifyClientCert"}}, "needs client_ca_file"),
    ({"tls_server_config": {**TLS, "client_auth_type": "Sometimes"}}, "is not one of NoClientCert"),
    ({"tls_server_config": {**TLS, "client_auth_type": "RequireAnyClientCert"}}, "nobody verifies"),
    ({"tls_server_config": {**TLS, "client_allowed_sans": ["x"]}}, "needs client_auth_type RequireAndVerify"),
    ({"tls_server_config": {**TLS, "min_version": "TLS14"}}, "min_version 'TLS14' is not one of"),
    ({"tls_server_config": {**TLS, "min_version": "TLS13", "max_version": "TLS12"}}, "above max_version"),
    ({"tls_server_config": {**TLS, "client_auth_type": "VerifyClientCertIfGiven", "client_ca_file": "KEY"}},
     "no CA certificate"),
    ({"tls_server_config": "yes"}, "tls_server_config: expected a mapping"),
    ({"basic_auth_users": {"u": "secret"}}, "basic_auth_users.u: not a bcrypt hash"),
    ({"basic_auth_users": {"u": "$2b$31$" + HASH[7:]}}, "not a bcrypt hash"),  # cost 31: a minute a check
    ({"basic_auth_users": {"a:b": HASH}}, "is not a user name"),
    ({"basic_auth_users": ["u"]}, "expected a mapping of user"),
    ({"http_server_config": {"headers": {"X-Frame-Options": "deny"}}}, "unknown key http_server_config.'headers'"),
    ({"http_server_config": {"http2": "no"}}, "http2: expected true/false"),
    ("tls_server_config: [", "not valid YAML"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("a: &a [1]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nd: [*c, *c, *c, *c]\n", "unknown key 'a'"),
    ("x" * (webconfig.MAX_FILE_BYTES + 1), "over 1048576 bytes"),
], ids=lambda v: str(v)[:40])
def test_what_cannot_be_served_is_one_line(tmp_path: Path, pki: dict[str, tuple[str, str]], doc: Any,
                                           says: str) -> None:
    path = _write(tmp_path, doc, pki)
    with pytest.raises(WebConfigError) as info:
        load_web_config(path)
    message = str(info.value)
    assert says in message and "\n" not in message and message.startswith(str(path)), message


def test_a_directory_or_fifo_is_not_a_web_config(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError, match="not a regular file"):
        load_web_config(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(WebConfigError, match="not a regular file"):  # opened without blocking on a writer
        load_web_config(fifo)


def test_a_full_config_loads(tmp_path: Path, pki: dict[str, tuple[str, str]]) -> None:
    doc = {"tls_server_config": {**TLS, "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "CA",
                                 "client_allowed_sans": ["prometheus"], "min_version": "TLS12",
                                 "max_version": "TLS13", "prefer_server_cipher_suites": True},
           "basic_auth_users": {"prometheus": HASH}, "http_server_config": {"http2": False}}
    settings = load_web_config(_write(tmp_path, doc, pki))
    assert settings.scheme == "https" and set(settings.users) == {"prometheus"}
    assert settings.allowed_sans == frozenset({"prometheus"}) and len(settings.files) == 4
    assert load_web_config(_write(tmp_path, "", pki)).scheme == "http"  # an empty file: plain HTTP, no auth


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_basic_auth(tmp_path: Path, pki: dict[str, tuple[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    guard = WebGuard.open(str(_write(tmp_path, {"basic_auth_users": {"prometheus": HASH}}, pki)))
    checks: list[bytes] = []
    real = bcrypt.checkpw

    def counted(pw: bytes, hashed: bytes) -> bool:
        checks.append(pw)
        return real(pw, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counted)
    assert guard.authorized(_basic("prometheus", "pw"))
    assert guard.authorized(_basic("prometheus", "pw")) and checks == [b"pw"]  # the success is cached
    for header in (_basic("prometheus", "pw2"), _basic("prometheus", "wrong"), _basic("nobody", "pw"), None, "",
                   "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"no-colon").decode(),
                   "Basic " + base64.b64encode(b"\xff\xfe:pw").decode()):
        assert not guard.authorized(header), header
    assert checks == [b"pw", b"pw2", b"wrong"]  # a wrong password is checked each time (never cached)
    assert WebGuard.open(str(_write(tmp_path, "", pki))).authorized(None)  # no users: no auth asked


def test_a_renewed_certificate_is_taken_a_broken_one_is_not(tmp_path: Path, pki: dict[str, tuple[str, str]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webconfig, "RELOAD_CHECK_S", 0.0)
    cert = tmp_path / "tls.crt"
    cert.write_bytes(Path(pki["server"][0]).read_bytes())
    doc = {"tls_server_config": {"cert_file": str(cert), "key_file": "KEY"}}
    guard = WebGuard.open(str(_write(tmp_path, doc, pki)))
    first = guard.context()
    assert first is not None and guard.context() is first  # nothing changed: the same context
    cert.write_bytes(Path(pki["server"][0]).read_bytes() + b"\n")  # renewed (same key)
    time.sleep(0.01)
    renewed = guard.context()
    assert renewed is not None and renewed is not first
    cert.write_bytes(Path(pki["other"][0]).read_bytes())  # does not match the key: logged, the last good kept
    assert guard.context() is renewed
