"""Start ``gpuhealth agent`` as a real subprocess for integration tests (and the overhead benchmark).

The child runs through a tiny wrapper that, at exit, writes whether ``torch`` was ever imported
(the agent process must never import it) to ``<workdir>/modules.json``. It listens on port 0 (the
kernel picks a free one: no port chosen here can be taken by someone else before the agent binds it)
and says which in its log line "serving /metrics, /health, /ready on http://127.0.0.1:PORT".
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
from pathlib import Path
from typing import Any

_WRAPPER = """
import atexit, json, sys
out = sys.argv.pop(1)
def _dump():
    with open(out, "w") as f:
        json.dump({"torch": "torch" in sys.modules, "count": len(sys.modules),
                   "instrument": sorted(m for m in sys.modules if m.startswith("gpuhealth.instrument"))}, f)
atexit.register(_dump)
from gpuhealth.cli.main import main
sys.argv = ["gpuhealth", *sys.argv[1:]]
main()
"""


_SERVING = re.compile(r"serving /metrics, /health, /ready on https?://127\.0\.0\.1:(\d+)")


_PROMETHEUS_LISTENING = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')


def prometheus_port(log: Path, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """The port a Prometheus started with ``--web.listen-address=127.0.0.1:0`` bound, from its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _PROMETHEUS_LISTENING.search(log.read_text(errors="replace"))
        if m is not None:
            return int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"Prometheus never said where it listens:\n{log.read_text(errors='replace')[-3000:]}")


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class AgentProcess:
    def __init__(self, workdir: Path, args: list[str], *, env: dict[str, str] | None = None) -> None:
        self._port: int | None = None
        self.workdir = workdir
        self.log_path = workdir / "agent.log"
        self.modules_path = workdir / "modules.json"
        full_env = {**os.environ, **(env or {})}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRAPPER, str(self.modules_path), "agent", "--listen", "127.0.0.1:0", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
        )

    @property
    def port(self) -> int:
        """The port the agent bound, from its log (waits up to 30 s for the line)."""
        deadline = time.monotonic() + 30.0
        while self._port is None:
            m = _SERVING.search(self.log())
            if m is not None:
                self._port = int(m.group(1))
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the agent never said which port it serves on:\n{self.log()}")
            else:
                time.sleep(0.05)
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log()}")
            if self._port is None and _SERVING.search(self.log()) is None:
                time.sleep(0.05)
                continue
            try:
                code, _ = http_get(self.url + "/ready", timeout=1)
                if code == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"agent not ready after {timeout} s:\n{self.log()}")

    def get(self, path: str, **kw: Any) -> tuple[int, str]:
        return http_get(self.url + path, **kw)

    def metrics(self) -> str:
        code, body = self.get("/metrics")
        assert code == 200, body
        return body

    def health(self) -> dict[str, Any]:
        code, body = self.get("/health")
        assert code == 200, body
        return json.loads(body)  # type: ignore[no-any-return]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def imported_torch(self) -> bool:
        return bool(json.loads(self.modules_path.read_text())["torch"])

    def modules(self) -> dict[str, Any]:
        """What the agent had imported when it exited: ``torch`` (bool), ``count``, ``instrument`` (names)."""
        return json.loads(self.modules_path.read_text())  # type: ignore[no-any-return]
