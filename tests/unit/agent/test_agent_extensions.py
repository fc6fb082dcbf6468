"""Which extensions a config starts, and findings published from outside the scheduler."""

from __future__ import annotations

from typing import Any

from agent_testing import TempCollector, fast_config, wait_for

from gpuhealth.agent.daemon import Agent
from gpuhealth.agent.extensions import default_extensions
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.model import Action, Entity, Finding, Health, Severity
from gpuhealth.runtime.sdnotify import SystemdNotifier


def test_default_extensions_follow_the_config(tmp_path: Any) -> None:
    cfg = fast_config()
    cfg.agent.socket_path = ""
    # zero-code discovery and screening need no config (screening never runs on a simulated backend)
    # netprobe: the fabric probe's word about this node (POST /fabric), always there
    assert [e.name for e in default_extensions(cfg)] == ["zerocode", "netprobe", "diagnostics"]
    cfg.diag.enabled = False  # the one line that turns screening off
    assert [e.name for e in default_extensions(cfg)] == ["zerocode", "netprobe"]
    cfg.agent.socket_path = str(tmp_path / "agent.sock")
    cfg.agent.coordinator = "127.0.0.1:1"
    cfg.agent.state_dir = str(tmp_path / "state")
    cfg.diag.enabled = True
    extensions = default_extensions(cfg)
    assert [e.name for e in extensions] == ["ranks", "zerocode", "coordinator_link", "netprobe", "diagnostics"]
    # with a coordinator, the first scheduled screen waits for this node's turn to arrive
    assert extensions[-1]._first_delay_s == 120.0  # type: ignore[attr-defined]


def test_published_diagnostic_findings_join_health_and_metrics(tmp_path: Any) -> None:
    backend = FakeNvml.bundled()
    cfg = fast_config()
    cfg.agent.socket_path = ""

    class Publisher:
        """Stands in for periodic diagnostics: publishes one SDC mismatch after the first sweep."""

        name = "diagnostics"

        def start(self, agent: Any) -> None:
            self.agent = agent

        def stop(self) -> None:
            pass

    pub = Publisher()
    agent = Agent(cfg, backend, collectors=[TempCollector()], extensions=[pub],
                  notifier=SystemdNotifier(env={}), serve_http=False)
    agent.start()
    try:
        wait_for(lambda: agent.ready, what="first sweep")
        uuid = agent.gpus[1].uuid
        mismatch = Finding("sdc.mismatch", Severity.CRITICAL, Entity.gpu(uuid, 1),
                           "GPU 1: bf16 8192x8192 digest differs from the golden and from 1 peer", Action.DRAIN,
                           {"datapath": "bf16", "shape": [8192, 8192, 8192]}, source="diagnostics")
        pub.agent.publish_findings("diagnostics", [mismatch], interval_s=3600)
        report = agent.node_report()
        gpu1 = next(g for g in report["gpus"] if g["index"] == 1)
        assert gpu1["health"] == str(Health.UNHEALTHY)
        assert [f["code"] for f in gpu1["findings"]] == ["sdc.mismatch"]
        # a SIGHUP reload re-registers the collectors but keeps what extensions published
        agent.reload(cfg)
        gpu1 = next(g for g in agent.node_report()["gpus"] if g["index"] == 1)
        assert [f["code"] for f in gpu1["findings"]] == ["sdc.mismatch"]
        # a later cycle with a clean result replaces the earlier findings
        pub.agent.publish_findings("diagnostics", [], interval_s=3600)
        assert all(g["health"] == "healthy" for g in agent.node_report()["gpus"])
        assert agent.ready
    finally:
        agent.stop()


def test_connected_ranks_show_in_the_agents_metrics(tmp_path: Any) -> None:
    import socket

    from gpuhealth.agent.ranks import RankHub
    from gpuhealth.exporters.prometheus import build_families, encode_text
    from gpuhealth.instrument import protocol
    from gpuhealth.model import RankIdentity

    backend = FakeNvml.bundled()
    cfg = fast_config()
    cfg.agent.socket_path = ""
    hub = RankHub(tmp_path / "agent.sock")
    agent = Agent(cfg, backend, collectors=[TempCollector()], extensions=[hub],
                  notifier=SystemdNotifier(env={}), serve_http=False)
    agent.start()
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        wait_for(lambda: agent.ready, what="first sweep")
        rank.connect(str(tmp_path / "agent.sock"))
        rank.sendall(protocol.encode(protocol.hello(RankIdentity("job-7", 3, 8, "h", 1))))

        def text() -> str:
            return encode_text(build_families(agent.snapshot())).decode()

        wait_for(lambda: 'gpuhealth_agent_job_ranks_connected{job_id="job-7"} 1' in text(), what="the rank in /metrics")
        assert "gpuhealth_agent_ranks_connected 1" in text()
        assert "gpuhealth_agent_dump_budget_refusals_total 0" in text()
        assert agent.ready  # an extension's samples never hold /ready back
    finally:
        rank.close()
        agent.stop()
