"""``/screen`` on the agent's HTTP server: GET shows the screens, POST (from this node only, parameters in
the query string) asks for one; anything else is a clear refusal."""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path
from typing import Any

from gpuhealth.agent.extensions import _PeriodicDiagnostics
from gpuhealth.agent.http import AgentHttpServer
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import Config
from gpuhealth.diag.periodic import PeriodicDiagnostics

SLOW_CHILD = f"#!{sys.executable}\nimport time; time.sleep(30)\n"


class View:
    """The little of ``AgentView`` the server and screening read."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.simulated = False
        self.node_name = "node-a"
        self.gpus = [GpuIdentity(0, "GPU-a", "NVIDIA H200", "00000000:00:06.0")]
        self.http: Any = None

    def publish_findings(self, *a: Any, **k: Any) -> None:
        pass

    def snapshot(self) -> Any:
        raise AssertionError("not scraped here")


def _ask(server: AgentHttpServer, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def test_screen_endpoint(tmp_path: Path) -> None:
    child = tmp_path / "py"
    child.write_text(SLOW_CHILD)
    child.chmod(0o755)
    cfg = Config()
    cfg.diag.state_dir = str(tmp_path / "state")
    cfg.diag.golden_dir = str(tmp_path / "golden")
    cfg.diag.screen_block_dir = str(tmp_path / "block")

    def backend() -> FakeNvml:
        b = FakeNvml.bundled()
        b.init()
        return b

    view = View(cfg)
    view.http = AgentHttpServer(view, "127.0.0.1:0")  # type: ignore[arg-type]
    view.http.start()
    periodic = PeriodicDiagnostics(python=str(child), backend_factory=backend, first_delay_s=3600, tick_s=0.05)
    ext = _PeriodicDiagnostics(3600, periodic=periodic)
    ext.start(view)  # type: ignore[arg-type]
    try:
        code, doc = _ask(view.http, "GET", "/screen")
        assert code == 200 and doc["enabled"] is True and doc["running"] is None and doc["screens"] == []
        code, doc = _ask(view.http, "POST", "/screen?level=quick&trigger=epilog")
        assert code == 202 and doc["accepted"] is True
        code, doc = _ask(view.http, "POST", "/screen?level=quick&trigger=epilog")
        assert code == 409 and "already running or queued" in doc["reason"]
        code, doc = _ask(view.http, "GET", "/screen")
        assert code == 200 and (doc["running"] or doc["pending"])["level"] == "quick"
        assert _ask(view.http, "POST", "/screen?level=fast")[0] == 409
        assert _ask(view.http, "POST", "/screen?level=quick", body=b"level=quick")[0] == 400  # no bodies
        assert _ask(view.http, "POST", "/metrics")[0] == 501  # only /screen takes a POST
        assert _ask(view.http, "POST", "/nothing")[0] == 501
        # from another host: refused (only the node's own epilog may hand it the GPUs)
        assert ext.http_screen("POST", {"level": "quick"}, "10.1.2.3")[0] == 403
        assert ext.http_screen("POST", {"level": "quick"}, "::1")[0] == 409  # loopback, but one is running
    finally:
        ext.stop()
        view.http.stop()


def test_a_local_client_of_a_dual_stack_listener_counts_as_loopback() -> None:
    from gpuhealth.agent.extensions import _is_loopback

    # [::]:9502 sees the epilog's 127.0.0.1 as ::ffff:127.0.0.1 (Python 3.11 calls that not loopback)
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("::ffff:127.0.0.1")
    assert not _is_loopback("::ffff:10.0.0.5") and not _is_loopback("10.0.0.5") and not _is_loopback("nonsense")
