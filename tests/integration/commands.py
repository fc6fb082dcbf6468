"""The shipped commands as subprocesses, for tests that judge a setting by what the command does with it:
``gpuhealth coordinator`` (port 0, its ready file says which), ``gpuhealth agent`` (its log line says where
it serves), and one-shot CLI calls. Each process's output goes to a log file in its work folder; every
process started is stopped (and reaped) by ``Procs.stop_all``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

CLI = [sys.executable, "-m", "gpuhealth.cli.main"]
REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "tests" / "fixtures" / "scenarios" / "faulty_node.yaml"
_SERVING = re.compile(r"serving /metrics, /health, /ready on http://([0-9.]+|\[[0-9a-f:]+\]):(\d+)")


def until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def write_config(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({s: dict(v) for s, v in sections.items() if v}, sort_keys=True))
    return path


class Proc:
    def __init__(self, args: list[str], log: Path, env: Mapping[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log
        self._log = log.open("ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


class Coordinator(Proc):
    """``gpuhealth coordinator --config FILE --ready-file F`` (plus ``args``); ``wait`` for its ports."""

    def __init__(self, work: Path, config: Path, env: Mapping[str, str] | None = None, args: list[str] = ()) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.ready = work / "coordinator.ready.json"
        super().__init__([*CLI, "coordinator", "--config", str(config), "--ready-file", str(self.ready), *args],
                         work / "coordinator.log", env)

    def wait(self, timeout: float = 30.0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if not self.alive():
                raise AssertionError(f"coordinator exited {self.proc.returncode}:\n{self.log()}")
            return json.loads(self.ready.read_text()) if self.ready.exists() else None

        doc: dict[str, Any] = until(ready, timeout, "the coordinator's ready file")
        return doc

    def address(self, host: str = "127.0.0.1") -> str:
        return f"{host}:{self.wait()['grpc_port']}"


class Agent(Proc):
    """``gpuhealth agent --config FILE``; ``url`` is where its log says it serves."""

    def __init__(self, work: Path, config: Path, env: Mapping[str, str] | None = None, *,
                 argv_prefix: list[str] | None = None) -> None:
        work.mkdir(parents=True, exist_ok=True)
        # argv_prefix: run it under a wrapper (setpriv, to start it with fewer capabilities)
        super().__init__([*(argv_prefix or []), *CLI, "agent", "--config", str(config)], work / "agent.log", env)
        self._url: str | None = None

    @property
    def url(self) -> str:
        def found() -> str | None:
            m = _SERVING.search(self.log())
            if m is None and not self.alive():
                raise AssertionError(f"agent exited {self.proc.returncode}:\n{self.log()}")
            return f"http://{m.group(1)}:{m.group(2)}" if m else None

        if self._url is None:
            self._url = until(found, 30, "the agent's 'serving' line")
        return self._url

    def wait_ready(self, timeout: float = 30.0) -> None:
        until(lambda: self._ready(), timeout, "the agent's /ready")

    def _ready(self) -> bool:
        try:
            return http_get(self.url + "/ready", 2)[0] == 200
        except OSError:
            return False

    def get(self, path: str) -> str:
        code, body = http_get(self.url + path)
        assert code == 200, (path, code, body)
        return body

    def health(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.get("/health"))
        return doc


def run_cli(*args: str, env: Mapping[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first series ``name{labels ⊇ given}`` in Prometheus text, or None."""
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(value)
    return None


RANKS_SCRIPT = r"""
import os, socket, sys, time
from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord
path, job, ranks, steps, period = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
conns = []
for r in range(ranks):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(protocol.encode(protocol.hello(RankIdentity(job, r, ranks, "settings", os.getpid()))))
    conns.append(s)
for step in range(steps):
    for r, s in enumerate(conns):
        s.sendall(protocol.encode(protocol.steps([StepRecord(job, r, step, time.time(), period, period * 0.8,
                                                             period * 0.2)])))
    time.sleep(period)
print("sent", flush=True)
sys.stdin.read()  # hold the connections (the ranks stay alive) until told
"""


class Ranks(Proc):
    """Ranks of one job, connected to an agent's rank socket: ``steps`` steps of ``period`` seconds each, then
    they stay connected (alive, no progress) until stopped."""

    def __init__(self, work: Path, socket_path: str, job: str, *, ranks: int = 2, steps: int = 20,
                 period: float = 0.02) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.log_path = work / f"ranks-{job}.log"
        self._log = self.log_path.open("ab")
        self.args = [sys.executable, "-c", RANKS_SCRIPT, socket_path, job, str(ranks), str(steps), str(period)]
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_sent(self, timeout: float = 30) -> None:
        until(lambda: "sent" in self.log() or (not self.alive() and _raise(self.log())), timeout, "the ranks' steps")


def rank_process_of(agent_pid: int) -> int | None:
    """The pid of the agent's unprivileged rank process (``gpuhealth.agent.tenant_proc``), or None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == agent_pid and b"gpuhealth.agent.tenant_proc" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def proc_status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict (values as the kernel writes them)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def proc_limit(pid: int, name: str) -> str:
    """The soft limit ``name`` ("Max address space", …) of ``/proc/<pid>/limits``, as written there."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith(name):
            return line[len(name):].split()[0]
    raise AssertionError(f"no {name} in /proc/{pid}/limits")


def _raise(text: str) -> bool:
    raise AssertionError(f"the ranks exited:\n{text}")


def make_pki(directory: Path, names: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """A CA (``directory/ca.crt``) and, per ``name → CN``, a certificate (CN and DNS SAN, IP SAN 127.0.0.1)
    and key: ``{name: (cert path, key path)}``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(cn: str, key: Any, issuer: Any, issuer_key: Any, ca: bool) -> Any:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        builder = (x509.CertificateBuilder().subject_name(name)
                   .issuer_name(issuer.subject if issuer is not None else name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName(cn), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("gpuhealth test CA", ca_key, None, ca_key, True)
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out = {}
    for name, cn in names.items():
        key = ec.generate_private_key(ec.SECP256R1())
        c, k = directory / f"{name}.crt", directory / f"{name}.key"
        c.write_bytes(cert(cn, key, ca, ca_key, False).public_bytes(serialization.Encoding.PEM))
        k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
        os.chmod(k, 0o600)
        out[name] = (str(c), str(k))
    return out


def write_secret(path: Path, secret: bytes = b"0123456789abcdef0123456789abcdef-settings") -> bytes:
    path.write_bytes(secret + b"\n")
    os.chmod(path, 0o600)
    return secret
