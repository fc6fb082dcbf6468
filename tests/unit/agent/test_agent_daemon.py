"""The agent keeps serving through failing, hanging and vanishing parts, and recovers."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from agent_testing import HangingCollector, RaisingCollector, TempCollector, fast_config, wait_for

from gpuhealth.agent.daemon import Agent
from gpuhealth.agent.nvml_supervisor import NVML_UNAVAILABLE, NvmlPolicy
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.registry import all_collectors
from gpuhealth.model import Finding, Health
from gpuhealth.runtime.sdnotify import SystemdNotifier

QUIET = SystemdNotifier(env={})


def _scenario_backend(clock: Any, events: list[dict[str, Any]]) -> FakeNvml:
    return FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "events": events}, clock=clock)


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for a in started:
        a.stop()


def _start(agents: list[Agent], agent: Agent) -> Agent:
    agents.append(agent)
    agent.start()
    return agent


def _get(agent: Agent, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(agent.http.url + path, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_collector_that_raises_is_reported_and_the_rest_keeps_running(agents: list[Agent], clock: Any) -> None:
    temp = TempCollector()
    agent = _start(agents, Agent(fast_config(), _scenario_backend(clock, []), collectors=[RaisingCollector(), temp],
                                 extensions=[], notifier=QUIET))
    wait_for(lambda: agent.ready, what="first sweep")
    wait_for(lambda: temp.runs >= 3, what="the healthy collector to keep running")
    snap = agent.snapshot()
    boom = next(c for c in snap.collectors if c.name == "boom")
    assert boom.success is False and boom.errors_total >= 1 and "sensor exploded" in boom.last_error
    assert next(c for c in snap.collectors if c.name == "temp").success is True
    failed = [f for f in snap.findings if f.code == "collector.failed"]
    assert failed and failed[0].evidence["collector"] == "boom"
    status, body = _get(agent, "/metrics")
    text = body.decode()
    assert status == 200
    assert 'gpuhealth_collector_success{collector="boom"} 0.0' in text
    assert 'gpuhealth_collector_success{collector="temp"} 1.0' in text
    assert 'gpuhealth_test_temperature_celsius{gpu="0"' in text


def test_hung_collector_times_out_without_stalling_the_agent_and_recovers(agents: list[Agent], clock: Any
                                                                          ) -> None:
    hang, temp = HangingCollector(), TempCollector()
    cfg = fast_config(timeout_s=0.3)
    agent = _start(agents, Agent(cfg, _scenario_backend(clock, []), collectors=[hang, temp], extensions=[],
                                 notifier=QUIET))
    wait_for(lambda: any(c.name == "hang" and c.timeouts_total >= 1 for c in agent.snapshot().collectors),
             what="the hung run to time out")
    runs_then = temp.runs
    wait_for(lambda: temp.runs >= runs_then + 5, what="other collectors to keep running while one hangs")
    # The scrape never waits on the hung call: that one returns only when released (below) or after 30 s. The
    # bound is far from both and far above a scrape on a loaded machine (GIL shared with the collectors).
    t0 = time.perf_counter()
    status, _ = _get(agent, "/metrics")
    took = time.perf_counter() - t0
    assert status == 200 and took < 5.0, took
    st = next(c for c in agent.snapshot().collectors if c.name == "hang")
    assert st.success is False and "timed out" in st.last_error
    assert hang.calls == 1  # never started again while the stuck call had not returned
    hang.release.set()
    wait_for(lambda: next(c for c in agent.snapshot().collectors if c.name == "hang").success is True,
             what="the collector to recover once its call returns")
    assert hang.calls >= 2


def test_gpu_lost_mid_run_is_reported_and_clears_when_it_answers_again(agents: list[Agent], clock: Any
                                                                       ) -> None:
    backend = _scenario_backend(clock, [{"at": 5, "type": "lost", "gpu": 1}, {"at": 20, "type": "restore", "gpu": 1}])
    agent = Agent(fast_config(), backend, collectors=all_collectors(fast_config()), extensions=[], notifier=QUIET,
                  nvml_policy=NvmlPolicy(lost_gpu_reinit_s=0.3))  # fresh NVML handles this often while a GPU is lost
    _start(agents, agent)
    wait_for(lambda: agent.ready, what="first sweep")
    assert agent.node_report()["node"]["health"] == "healthy"
    clock.advance(6)

    def lost() -> list[Finding]:
        return [f for f in agent.current_findings() if f.code == "gpu.lost"]

    wait_for(lambda: bool(lost()), what="gpu.lost")
    assert lost()[0].entity.gpu_index == 1
    report = agent.node_report()
    assert [g["health"] for g in report["gpus"]] == ["healthy", "unhealthy"]
    _, body = _get(agent, "/metrics")
    text = body.decode()
    assert re.search(r'^gpuhealth_gpu_health\{gpu="1",[^}]*\} 2\.0$', text, re.M)  # 2 = unhealthy
    assert re.search(r'^gpuhealth_gpu_health\{gpu="0",[^}]*\} 0\.0$', text, re.M)
    assert re.search(r'^gpuhealth_findings\{gpu="1",[^}]*code="gpu.lost",severity="critical"', text, re.M)
    assert 'gpuhealth_gpu_temperature_celsius{gpu="0"' in text  # the other GPU is still read
    assert agent.snapshot().nvml_up  # a lost GPU is not a lost driver
    wait_for(lambda: agent.snapshot().nvml_reinits_total >= 1, what="NVML re-initialised for the lost GPU")
    wait_for(lambda: any(s.name == "gpu_temperature_celsius" and s.gpu == 0 for s in agent.snapshot().samples),
             what="GPU 0 still read after the re-init")
    clock.advance(15)
    wait_for(lambda: not lost(), what="gpu.lost to clear once the GPU answers")
    wait_for(lambda: agent.node_report()["gpus"][1]["health"] == "healthy", what="GPU 1 healthy again")


def test_driver_unloaded_then_back_reinitialises_nvml(agents: list[Agent], clock: Any) -> None:
    backend = _scenario_backend(clock, [{"at": 5, "type": "driver_unloaded", "until": 15}])
    cfg = fast_config()
    agent = _start(agents, Agent(cfg, backend, collectors=all_collectors(cfg), extensions=[], notifier=QUIET))
    wait_for(lambda: agent.ready, what="first sweep")
    clock.advance(6)
    wait_for(lambda: not agent.snapshot().nvml_up, what="NVML down")
    snap = agent.snapshot()
    assert [f.code for f in snap.findings] == [NVML_UNAVAILABLE]
    assert all(snap.gpu_health(g) is Health.UNKNOWN for g in snap.gpus)
    assert not any(s.name == "gpu_temperature_celsius" for s in snap.samples)  # nothing stale from a gone driver
    status, body = _get(agent, "/metrics")
    assert status == 200 and b"gpuhealth_nvml_up 0.0" in body
    status, body = _get(agent, "/health")
    assert status == 200 and json.loads(body)["findings"][0]["code"] == NVML_UNAVAILABLE
    clock.advance(10)
    wait_for(lambda: agent.snapshot().nvml_up, timeout=15, what="NVML re-initialised")
    wait_for(lambda: any(s.name == "gpu_temperature_celsius" for s in agent.snapshot().samples),
             what="readings back")
    snap = agent.snapshot()
    assert snap.nvml_reinits_total == 1
    assert not any(f.code == NVML_UNAVAILABLE for f in snap.findings)
    wait_for(lambda: agent.node_report()["node"]["health"] == "healthy", what="healthy again")


def test_while_nvml_is_down_the_xid_that_took_it_and_nvml_free_collectors_stay(agents: list[Agent],
                                                                                clock: Any) -> None:
    """The XID 79 that preceded a driver failure is the most useful thing on the page: it stays, and
    collectors that don't use NVML (host, InfiniBand) keep running."""
    backend = _scenario_backend(clock, [{"at": 1, "type": "xid", "gpu": 1, "xid": 79},
                                        {"at": 5, "type": "driver_unloaded", "until": 1000}])
    cfg = fast_config()
    agent = _start(agents, Agent(cfg, backend, collectors=all_collectors(cfg), extensions=[], notifier=QUIET))
    wait_for(lambda: agent.ready, what="first sweep")
    clock.advance(2)
    wait_for(lambda: any(f.code == "xid.79" for f in agent.snapshot().findings), what="the XID")
    clock.advance(4)
    wait_for(lambda: not agent.snapshot().nvml_up, what="NVML down")
    codes = {f.code for f in agent.snapshot().findings}
    assert {NVML_UNAVAILABLE, "xid.79"} <= codes
    host_runs = next(c for c in agent.snapshot().collectors if c.name == "host").runs_total
    wait_for(lambda: next(c for c in agent.snapshot().collectors if c.name == "host").runs_total > host_runs,
             what="the host collector still running")
    assert next(c for c in agent.snapshot().collectors if c.name == "host").success


def test_label_provider_adds_pod_labels_to_gpu_series_only_where_valid(agents: list[Agent], clock: Any
                                                                       ) -> None:
    cfg = fast_config()
    cfg.agent.dcgm_compat = True
    agent = Agent(cfg, _scenario_backend(clock, []), collectors=[TempCollector()], extensions=[], notifier=QUIET)
    agent.set_gpu_label_provider(lambda: {
        "GPU-00000000-1111-2222-3333-444444444440": {"pod": "train-0", "namespace": "ml", "container": "main",
                                                     "gpu": "spoofed", "bad-name": "x"},
        "1": {"slurm_job_id": "4242"},  # keyed by index, as the Slurm job map may be
    })
    _start(agents, agent)
    wait_for(lambda: bool(agent.snapshot().gpu_labels.get("GPU-00000001-1111-2222-3333-444444444441")),
             what="labels")
    _, body = _get(agent, "/metrics")
    text = body.decode()
    assert ('gpuhealth_test_temperature_celsius{gpu="0",uuid="GPU-00000000-1111-2222-3333-444444444440",'
            'pci_bus_id="00000000:00:06.0",model_name="NVIDIA H200",container="main",namespace="ml",pod="train-0"}'
            ) in text
    assert 'slurm_job_id="4242"' in text
    assert "spoofed" not in text and "bad-name" not in text


def test_extensions_see_the_seam_and_are_started_and_stopped(clock: Any) -> None:
    seen: dict[str, Any] = {}

    class Ext:
        name = "probe"

        def start(self, agent: Any) -> None:
            seen["started"] = True
            seen["node"] = agent.node_name
            agent.add_findings_listener(lambda fs: seen.setdefault("findings", []).append([f.code for f in fs]))

        def stop(self) -> None:
            seen["stopped"] = True

    class Broken:
        name = "broken"

        def start(self, agent: Any) -> None:
            raise RuntimeError("no")

        def stop(self) -> None:
            seen["broken_stopped"] = True  # never started, so never stopped

    agent = Agent(fast_config(), _scenario_backend(clock, []), collectors=[RaisingCollector()],
                  extensions=[Broken(), Ext()], notifier=QUIET, serve_http=False)
    agent.start()
    try:
        wait_for(lambda: bool(seen.get("findings")), what="findings listener")
        assert seen["node"] == "testnode"
        assert ["collector.failed"] in seen["findings"]
        assert [g.index for g in agent.gpus] == [0, 1]
        report = agent.node_report()
        assert set(report) >= {"node", "gpus", "findings"}
        assert {"index", "uuid", "name", "health", "findings"} <= set(report["gpus"][0])
    finally:
        agent.stop()
    assert seen["stopped"]
    assert "broken_stopped" not in seen


def test_reload_applies_new_intervals_and_disabled_collectors(agents: list[Agent], clock: Any) -> None:
    cfg = fast_config()
    agent = _start(agents, Agent(cfg, _scenario_backend(clock, []), collectors=[TempCollector(), RaisingCollector()],
                                 extensions=[], notifier=QUIET, serve_http=False))
    wait_for(lambda: agent.ready, what="first sweep")
    new = fast_config(disabled=["boom"], fast_interval_s=0.25)
    agent.reload(new)
    snap = agent.snapshot()
    assert [c.name for c in snap.collectors] == ["temp"]
    assert snap.collectors[0].interval_s == 0.25
    assert not any(f.code == "collector.failed" for f in snap.findings)
    with pytest.raises(ValueError, match="nope"):
        agent.reload(fast_config(disabled=["nope"]))
    assert agent.config is new  # a refused reload changes nothing


def test_ready_is_503_until_the_first_sweep_completes(agents: list[Agent], clock: Any) -> None:
    hang = HangingCollector()
    cfg = fast_config(timeout_s=20.0)
    agent = _start(agents, Agent(cfg, _scenario_backend(clock, []), collectors=[hang, TempCollector()],
                                 extensions=[], notifier=QUIET))
    wait_for(lambda: hang.calls == 1, what="the slow first run to start")
    status, body = _get(agent, "/ready")
    assert status == 503 and json.loads(body)["ready"] is False
    status, _ = _get(agent, "/metrics")  # /metrics answers before the first sweep too
    assert status == 200
    assert _get(agent, "/healthz") == (200, b'{\n "status": "ok"\n}')  # liveness never waits on GPUs
    assert _get(agent, "/nope")[0] == 404
    hang.release.set()
    wait_for(lambda: _get(agent, "/ready")[0] == 200, what="ready after the first sweep")


def test_systemd_hears_ready_even_when_nvml_cannot_start(agents: list[Agent], clock: Any, tmp_path: Any) -> None:
    """A Type=notify unit that never became ready would be killed and restarted in a loop; an agent
    without a driver must still come up and serve nvml.unavailable."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(5)
    backend = _scenario_backend(clock, [{"at": 0, "type": "driver_unloaded"}])
    notifier = SystemdNotifier(env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    agent = _start(agents, Agent(fast_config(), backend, collectors=[TempCollector()], extensions=[],
                                 notifier=notifier))
    message = listener.recv(4096).decode()
    assert message.startswith("READY=1\nSTATUS=SIMULATED, NVML unavailable"), message
    assert _get(agent, "/ready")[0] == 503  # readiness still says: no GPU data
    assert [f["code"] for f in agent.node_report()["findings"]] == [NVML_UNAVAILABLE]
    listener.close()


def test_nvlink_series_per_gpu_by_default_per_link_from_config_reload_or_one_scrape(agents: list[Agent],
                                                                                    clock: Any) -> None:
    agent = _start(agents, Agent(fast_config(), _scenario_backend(clock, []), collectors=all_collectors(),
                                 extensions=[], notifier=QUIET))
    wait_for(lambda: agent.ready, what="first sweep")
    per_link = b"gpuhealth_gpu_nvlink_state{"
    assert per_link not in _get(agent, "/metrics")[1]
    assert b"gpuhealth_gpu_nvlink_errors_total{" in _get(agent, "/metrics")[1]  # summed per GPU
    assert per_link in _get(agent, "/metrics?nvlink=link")[1]  # one scrape asks for every link
    cfg = fast_config()
    cfg.agent.nvlink_per_link = True
    agent.reload(cfg)  # what SIGHUP does with the edited file
    assert per_link in _get(agent, "/metrics")[1]
    assert per_link not in _get(agent, "/metrics?nvlink=gpu")[1]


class _DriverView:
    """The host's side while NVML will not start: the driver's /proc directory (or not) and GPUs on the bus."""

    def __init__(self, driver_loaded: bool, gpus_on_bus: int) -> None:
        self.driver_loaded, self.gpus_on_bus = driver_loaded, gpus_on_bus

    def nvidia_driver_gpus(self) -> dict[str, int | None] | None:
        return {} if self.driver_loaded else None

    def nvidia_pci_devices(self) -> list[object]:
        return [object()] * self.gpus_on_bus


@pytest.mark.parametrize(("container", "health", "action"), [(True, "unknown", "none"),
                                                              (False, "unhealthy", "reboot")])
def test_nvml_that_never_starts_takes_the_node_out_only_when_the_driver_is_at_fault(
        agents: list[Agent], clock: Any, container: bool, health: str, action: str) -> None:
    """8 GPUs on the bus, no /proc/driver/nvidia, NVML answers DRIVER_NOT_LOADED from the start: on bare metal
    the module did not load — no GPU job can run here, reboot; in a container the bus is the host's and this
    view has no driver — could not check, and the node's health is unknown (a warning alone would call
    unchecked GPUs fit)."""
    backend = FakeNvml.from_scenario({"recording": "nvml_h200x2.json",
                                      "events": [{"at": 0, "type": "driver_unloaded"}],
                                      "system": {"environment": {"virtualization": "none", "container": container}}},
                                     clock=clock)
    agent = _start(agents, Agent(fast_config(), backend, collectors=[TempCollector()], extensions=[], notifier=QUIET,
                                 sysfs=_DriverView(False, 8)))
    wait_for(lambda: agent.node_report()["findings"], what="nvml.unavailable")
    report = agent.node_report()
    [finding] = report["findings"]
    assert finding["code"] == NVML_UNAVAILABLE and finding["action"] == action
    assert (report["node"]["health"], report["node"]["action"]) == (health, action)
    assert agent.snapshot().node_health() is Health[health.upper()]


def test_a_named_kernel_log_the_agent_cannot_read_leaves_the_node_unknown(agents: list[Agent], clock: Any,
                                                                          tmp_path: Any) -> None:
    """collectors.kmsg_path names a log that is not there (issue 33): the XID check is not made, so /health and
    /metrics say unknown, not healthy (a scenario's own kernel lines are not that log)."""
    from gpuhealth.collectors.xid import XidCollector

    cfg = fast_config(kmsg_path=str(tmp_path / "kern.log"))
    agent = _start(agents, Agent(cfg, _scenario_backend(clock, []), collectors=[XidCollector(event_thread=False)],
                                 extensions=[], notifier=QUIET))
    wait_for(lambda: agent.node_report()["findings"], what="kmsg.unreadable")
    report = agent.node_report()
    assert [f["code"] for f in report["findings"]] == ["kmsg.unreadable"]
    assert report["node"]["health"] == "unknown" and agent.snapshot().node_health() is Health.UNKNOWN
    (tmp_path / "kern.log").write_text("[    1.000000] Linux version 6.8.0\n")  # the log appears: judged again
    wait_for(lambda: not agent.node_report()["findings"], what="the kernel log read")
    assert agent.node_report()["node"]["health"] == "healthy"
