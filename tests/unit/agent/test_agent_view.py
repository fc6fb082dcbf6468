"""The seam: the HTTP edge works from an ``AgentView`` alone, and the running agent is one."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_testing import fast_config, wait_for

from gpuhealth.agent.daemon import Agent
from gpuhealth.agent.http import AgentHttpServer
from gpuhealth.agent.view import AgentExtension, AgentView, FindingsListener, GpuLabelProvider, ReportsSamples
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import Config
from gpuhealth.exporters import ExportSnapshot
from gpuhealth.model import Finding
from gpuhealth.node import report_of_snapshot
from gpuhealth.runtime.sdnotify import SystemdNotifier

GPU = GpuIdentity(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", "00000000:18:00.0", 0)


class FrozenView:
    """An AgentView that is no agent: one snapshot, forever."""

    def __init__(self, snap: ExportSnapshot) -> None:
        self.snap = snap
        self.config = Config()
        self.node_name = snap.node_name
        self.simulated = snap.simulated

    @property
    def gpus(self) -> list[GpuIdentity]:
        return list(self.snap.gpus)

    @property
    def ready(self) -> bool:
        return self.snap.ready

    def snapshot(self) -> ExportSnapshot:
        return self.snap

    def current_findings(self) -> list[Finding]:
        return list(self.snap.findings)

    def node_report(self) -> dict[str, Any]:
        return report_of_snapshot(self.snap).to_dict()

    def add_findings_listener(self, callback: FindingsListener) -> None:
        pass

    def set_gpu_label_provider(self, provider: GpuLabelProvider | None) -> None:
        pass

    def publish_findings(self, source: str, findings: Sequence[Finding], *, interval_s: float, ok: bool = True,
                         error: str = "") -> None:
        pass


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_http_edge_needs_only_the_view() -> None:
    view: AgentView = FrozenView(ExportSnapshot(node_name="frozen", generated_at=1.0, simulated=True, nvml_up=True,
                                                ready=False, gpus=(GPU,)))
    server = AgentHttpServer(view, "127.0.0.1:0")
    server.start()
    try:
        status, body = _get(server.url + "/metrics")
        assert status == 200 and b'gpuhealth_gpu_info{gpu="0",uuid="GPU-aaaa"' in body
        status, body = _get(server.url + "/health")
        assert status == 200 and json.loads(body)["node"]["name"] == "frozen"
        assert _get(server.url + "/ready")[0] == 503  # the view says: not ready
    finally:
        server.stop()


def test_the_running_agent_is_an_agent_view_and_extensions_get_it(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    class Probe:
        name = "probe"

        def start(self, agent: AgentView) -> None:
            seen["view"] = agent

        def stop(self) -> None:
            pass

    assert isinstance(Probe(), AgentExtension) and not isinstance(Probe(), ReportsSamples)
    cfg = fast_config()
    cfg.agent.socket_path = ""
    agent = Agent(cfg, FakeNvml.bundled(), extensions=[Probe()], serve_http=False, notifier=SystemdNotifier(env={}))
    agent.start()
    try:
        wait_for(lambda: agent.ready, what="the first sweep")
        view = seen["view"]
        assert view is agent
        members = [m for m in dir(AgentView) if not m.startswith("_")]
        assert all(hasattr(view, m) for m in members), members
        assert [g.index for g in view.gpus] == [0, 1] and view.node_report()["node"]["ready"] is True
    finally:
        agent.stop()
