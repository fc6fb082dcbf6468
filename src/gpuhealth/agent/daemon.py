"""The per-node agent: collectors on a schedule, a cache, ``/metrics`` + ``/health``, extensions.

``Agent`` wires the parts and runs the jobs; each part does one thing:

- ``scheduler.Scheduler``: runs every job at its interval on worker threads, never waiting on one.
- ``cache.Cache``: the last outcome per collector, published as an immutable ``ExportSnapshot``.
- ``nvml_supervisor.NvmlSupervisor``: NVML's lifecycle (start, driver lost, re-initialise, lost GPUs).
- ``systemd.SystemdReporter``: READY, STATUS and WATCHDOG for systemd.
- ``http.AgentHttpServer``: ``/metrics``, ``/health``, ``/ready``, ``/healthz``.
- extensions (``extensions.default_extensions``): the rank hub, the coordinator link, periodic
  diagnostics. They and the HTTP edge see the agent only through ``view.AgentView``, which this
  class implements; everything else here is internal.

The jobs: one per collector, ``_nvml_reinit`` (while NVML is not up), ``_enumerate`` (GPU list and
lost-GPU handle refresh, while it is), ``_gpu_labels`` (the label provider) and
``agent_extensions`` (the extensions' own ``samples()``). The agent never imports torch and never
exits the process.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import FrameType
from typing import Any

from gpuhealth import __version__
from gpuhealth.agent.cache import Cache
from gpuhealth.agent.health_log import HealthLog
from gpuhealth.agent.nvml_supervisor import (
    NvmlChange,
    NvmlEvent,
    NvmlPolicy,
    NvmlState,
    NvmlSupervisor,
    start_view,
    unavailable_finding,
)
from gpuhealth.agent.scheduler import Job, Scheduler
from gpuhealth.agent.systemd import SystemdReporter
from gpuhealth.agent.view import AgentExtension, FindingsListener, GpuLabelProvider, GpuProcess, ReportsSamples
from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.errors import DRIVER_GONE_CODES
from gpuhealth.collectors.base import CollectContext, Collector, GpuIdentity, Lane
from gpuhealth.collectors.runner import CollectorRun, CollectorRunner
from gpuhealth.collectors.xid import EVENT_WAIT_MS
from gpuhealth.config import Config
from gpuhealth.exporters import ExportSnapshot, NodeFacts
from gpuhealth.model import Action, Entity, Finding, Sample, Severity
from gpuhealth.runtime.sdnotify import SystemdNotifier

log = logging.getLogger("gpuhealth.agent")

IDLE_TICK_S = 5.0  # longest the scheduler loop sleeps (wakeups cost CPU; jobs wake it when due)
EVENT_WAIT_DRAIN_S = EVENT_WAIT_MS / 1000 + 0.1  # > the XID pump's wait_xid_events timeout
_ENUMERATE, _REINIT, _LABELS = "_enumerate", "_nvml_reinit", "_gpu_labels"
_EXTENSIONS = "agent_extensions"  # the cache entry extensions' own samples are exported under


class Agent:
    def __init__(
        self,
        config: Config,
        backend: NvmlBackend,
        *,
        extensions: Sequence[AgentExtension] | None = None,
        collectors: Sequence[Collector] | None = None,
        runner: CollectorRunner | None = None,
        notifier: SystemdNotifier | None = None,
        serve_http: bool = True,
        kmsg: Any = None,
        sysfs: Any = None,
        nvml_policy: NvmlPolicy | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self._given_collectors = collectors
        self._collectors: dict[str, Collector] = {}
        self._kmsg = kmsg
        self._sysfs = sysfs
        self._environment: Any = None  # backends.environment.Environment, read in _prepare_context
        self._extras: dict[str, Any] = {"agent": True}
        self.runner = runner or CollectorRunner(timeout_s=config.collectors.timeout_s)
        self.cache = Cache(
            NodeFacts(node_name=config.node_name, simulated=backend.simulated, backend=backend.description,
                      version=__version__, nvml_up=False),
            history_len=config.collectors.history_len,
        )
        self.nvml = NvmlSupervisor(backend, self._on_nvml, policy=nvml_policy, quiesce=self._quiesce_event_readers,
                                   view=lambda: start_view(self.backend, self.config.collectors.sysfs_root,
                                                           sysfs=self._sysfs))
        self.systemd = SystemdReporter(notifier or SystemdNotifier(),
                                       nvml_attempted=lambda: self.nvml.state is not NvmlState.STARTING)
        watchdog = self.systemd.watchdog_interval_s
        # the loop must come round often enough to ping systemd's watchdog on time
        self.scheduler = Scheduler(on_hung=self._on_hung, on_tick=self.systemd.on_tick,
                                   tick_s=min(IDLE_TICK_S, watchdog / 2) if watchdog else IDLE_TICK_S)
        if extensions is None:
            from gpuhealth.agent.extensions import default_extensions

            extensions = default_extensions(config)
        self.extensions: list[AgentExtension] = list(extensions)
        self._started_extensions: list[AgentExtension] = []
        self._serve_http = serve_http
        self.http: Any = None
        self._listeners: list[FindingsListener] = []
        self._listeners_lock = threading.RLock()  # serialises deliveries (see _on_snapshot)
        self._label_provider: GpuLabelProvider | None = None
        self._last_findings: tuple[Finding, ...] = ()
        self._health_log = HealthLog()
        self._health_seen: tuple[Any, ...] | None = None  # what the health log last judged
        self._loop: threading.Thread | None = None
        self._stop = threading.Event()
        self._reload_requested = threading.Event()
        self._main_wake = threading.Event()
        self.cache.add_listener(self._on_snapshot)

    # ================================================================== AgentView (view.py)
    @property
    def node_name(self) -> str:
        return self.config.node_name

    @property
    def simulated(self) -> bool:
        return self.backend.simulated

    @property
    def gpus(self) -> list[GpuIdentity]:
        return list(self.cache.snapshot().gpus)

    @property
    def ready(self) -> bool:
        return self.cache.snapshot().ready

    def snapshot(self) -> ExportSnapshot:
        return self.cache.snapshot()

    def current_findings(self) -> list[Finding]:
        return list(self.cache.snapshot().findings)

    def node_report(self) -> dict[str, Any]:
        from gpuhealth.node import report_of_snapshot

        return report_of_snapshot(self.cache.snapshot(), self._versions()).to_dict()

    def publish_findings(self, source: str, findings: Sequence[Finding], *, interval_s: float,
                         ok: bool = True, error: str = "") -> None:
        """Findings from outside the scheduler (e.g. periodic SDC checks) under collector name ``source``.
        Registered on first use, so an extension that never publishes never holds ``/ready`` back."""
        self.cache.register(source, "external", interval_s)
        self.cache.record(CollectorRun(source, time.time(), 0.0, ok, error=error or None, findings=list(findings)))

    def add_findings_listener(self, callback: FindingsListener) -> None:
        self._listeners.append(callback)

    def set_gpu_label_provider(self, provider: GpuLabelProvider | None) -> None:
        self._label_provider = provider
        if provider is not None:
            self.scheduler.run_soon(_LABELS)

    def gpu_processes(self) -> list[GpuProcess]:
        """Each GPU's compute processes (``view.ListsGpuProcesses``); empty while NVML is not up."""
        if self.nvml.state is not NvmlState.UP:
            return []
        from gpuhealth.agent.zerocode.gpuprocs import gpu_processes

        return gpu_processes(self.backend, self.gpus)

    def _versions(self) -> dict[str, Any]:
        if "versions" not in self._collectors:
            return {}
        try:
            from gpuhealth.collectors.versions import versions_of

            return dict(versions_of(self.cache.history("versions").latest()))
        except Exception:
            log.debug("versions unavailable", exc_info=True)
            return {}

    # ================================================================== lifecycle
    def start(self) -> None:
        """Start the scheduler thread, the HTTP server and the extensions; returns at once."""
        mode = f"SIMULATED ({self.backend.description})" if self.simulated else self.backend.description
        log.info("gpuhealth agent %s starting on %s: %s", __version__, self.node_name, mode)
        self._prepare_context()
        self._install_jobs()
        if self._label_provider is None:
            self._label_provider = self._default_label_provider()
        if self._serve_http:
            from gpuhealth.agent.http import AgentHttpServer

            self.http = AgentHttpServer(self, self.config.agent.listen, dcgm_compat=self.config.agent.dcgm_compat,
                                        nvlink_per_link=self.config.agent.nvlink_per_link,
                                        dcgm_hostname_label=self.config.agent.dcgm_hostname_label,
                                        dcgm_schema=self.config.agent.dcgm_schema,
                                        web_config_file=self.config.agent.web_config_file)
            self.http.start()
            log.info("serving /metrics, /health, /ready on %s", self.http.url)
        # Extensions start before the first sweep, so their listeners see every change from the start.
        for ext in self.extensions:
            try:
                ext.start(self)
                self._started_extensions.append(ext)
                log.info("extension %s started", _name(ext))
            except Exception:
                log.exception("extension %s failed to start; the agent runs without it", _name(ext))
        self._loop = threading.Thread(target=self.scheduler.run_forever, name="gpuhealth-scheduler", daemon=True)
        self._loop.start()

    def stop(self) -> None:
        self.nvml.stop()  # from here on, NVML errors are ours (shutdown), not the driver's
        self.systemd.stopping()
        log.info("stopping")
        for ext in reversed(self._started_extensions):
            try:
                ext.stop()
            except Exception:
                log.exception("extension %s failed to stop", _name(ext))
        self.scheduler.stop()
        if self.http is not None:
            self.http.stop()
        if self._loop is not None:
            self._loop.join(timeout=2.0)
        for c in self._collectors.values():
            _close(c)
        self.runner.close()
        try:
            self.backend.shutdown()
        except Exception:
            log.debug("backend shutdown failed", exc_info=True)
        self.systemd.close()

    def run_until_signalled(self, reload_config: Callable[[], Config] | None = None) -> int:
        """Main-thread loop: SIGTERM/SIGINT stop, SIGHUP reloads (``reload_config`` builds the new
        config; a bad one is logged and the old one kept). Returns the exit status."""

        def on_stop(signum: int, _frame: FrameType | None) -> None:
            log.info("received %s", signal.Signals(signum).name)
            self._stop.set()
            self._main_wake.set()

        def on_hup(_signum: int, _frame: FrameType | None) -> None:
            self._reload_requested.set()
            self._main_wake.set()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)
        self.start()
        while not self._stop.is_set():
            self._main_wake.wait(60.0)  # the signal handlers wake it; no polling
            self._main_wake.clear()
            if self._stop.is_set():
                break
            if self._reload_requested.is_set():
                self._reload_requested.clear()
                if reload_config is not None:
                    self.systemd.reloading()
                    try:
                        self.reload(reload_config())
                    except Exception as exc:  # ConfigError and friends: keep running on the old config
                        log.error("reload failed, keeping the current config: %s", exc)
                    self.systemd.reloaded(self.cache.snapshot())
        self.stop()
        return 0

    def request_stop(self) -> None:
        self._stop.set()
        self._main_wake.set()

    def reload(self, config: Config) -> None:
        """Apply a new config: intervals, timeouts, enabled collectors, labels, log level, compat."""
        known = None if self._given_collectors is None else [c.name for c in self._given_collectors]
        problem = config_problem(config, known)  # a bad reload leaves the agent as it was
        if problem:
            raise ValueError(problem)
        level = logging.getLevelName(config.agent.log_level.strip().upper())
        old = self.config
        self.config = config
        if config.agent.listen != old.agent.listen:
            log.warning("agent.listen changed to %s: takes effect after a restart", config.agent.listen)
        self.runner.timeout_s = config.collectors.timeout_s
        if self.http is not None:
            self.http.set_dcgm_compat(config.agent.dcgm_compat, config.agent.dcgm_hostname_label,
                                      config.agent.dcgm_schema)
            self.http.set_nvlink_per_link(config.agent.nvlink_per_link)
        self.cache.update_facts(node_name=config.node_name)
        self._prepare_context()
        logging.getLogger("gpuhealth").setLevel(level)
        self._install_jobs()
        log.info("configuration reloaded", extra={"collectors": sorted(self._collectors)})

    # ================================================================== jobs
    def _install_jobs(self) -> None:
        cfg = self.config.collectors
        wanted = self._wanted_collectors()
        for name in list(self._collectors):
            if name not in wanted:
                _close(self._collectors.pop(name))
                self.scheduler.remove(name)
        for name, col in wanted.items():
            self._collectors.setdefault(name, col)
        timeout = cfg.timeout_s + 5.0  # the runner answers at timeout_s; this is the backstop

        def nvml_up() -> bool:
            return self.nvml.state is NvmlState.UP

        self.scheduler.add(Job(_REINIT, 3600.0, lambda: self.nvml.initialise(self.cache.facts.gpus),
                               timeout_s=timeout,
                               enabled=lambda: self.nvml.state in (NvmlState.STARTING, NvmlState.DOWN)))
        self.scheduler.add(Job(_ENUMERATE, cfg.fast_interval_s, lambda: self.nvml.enumerate(self.cache.facts.gpus),
                               timeout_s=timeout, enabled=nvml_up))
        for name, col in self._collectors.items():
            interval = _interval_of(col, cfg.fast_interval_s, cfg.slow_interval_s)
            self.cache.register(name, str(getattr(col, "lane", Lane.FAST)), interval)
            needs_nvml = bool(getattr(col, "needs_nvml", True))
            self.scheduler.add(Job(name, interval, self._collector_job(col), timeout_s=timeout,
                                   enabled=nvml_up if needs_nvml else (lambda: True)))
        self.cache.unregister_except(self._collectors)
        self.scheduler.add(Job(_LABELS, cfg.fast_interval_s, self._labels_job, timeout_s=timeout, pool="labels",
                               enabled=lambda: self._label_provider is not None))
        self.scheduler.add(Job(_EXTENSIONS, cfg.fast_interval_s, self._extensions_job, timeout_s=timeout,
                               pool="labels"))

    def _wanted_collectors(self) -> dict[str, Collector]:
        if self._given_collectors is not None:
            cols = list(self._given_collectors)
        else:
            from gpuhealth.collectors.registry import all_collectors

            cols = list(all_collectors(self.config))
        disabled = set(self.config.collectors.disabled)
        return {c.name: self._collectors.get(c.name, c) for c in cols if c.name not in disabled}

    def _context(self) -> CollectContext:
        snap = self.cache.snapshot()
        return CollectContext(
            backend=self.backend, config=self.config, gpus=snap.gpus, node_name=self.node_name, now=time.time(),
            sysfs=self._sysfs, kmsg=self._kmsg, environment=self._environment, extras=self._extras,
        )

    def _prepare_context(self) -> None:
        """Sources and thresholds the collectors share (built at start and on reload, not per run)."""
        from gpuhealth.backends.environment import environment_for
        from gpuhealth.backends.sysfs import sysfs_for
        from gpuhealth.node import default_kmsg

        env = environment_for(self.backend, self.config.collectors.sysfs_root)
        if env != self._environment:  # what each check can see from here (docs/environments.md)
            log.info("environment: %s (%s)", env.summary(), "; ".join(env.evidence))
            self._environment = env
            self.cache.update_facts(environment=env.to_dict())
        if self._sysfs is None:
            self._sysfs = sysfs_for(self.backend, self.config.collectors.sysfs_root)
        if self._kmsg is None:
            try:
                self._kmsg = default_kmsg(self.backend, self.config)
            except OSError as exc:
                log.warning("kernel log unavailable (%s); XIDs come from NVML events only", exc)
        extras: dict[str, Any] = {"agent": True}
        if not self.backend.simulated:
            # Collectors that must remember across restarts (the XID ledger) keep it here; a replayed
            # recording has nothing worth remembering.
            extras["state_dir"] = self.config.agent.state_dir
        if self.config.collectors.thresholds_file:
            from gpuhealth.catalog.thresholds import load_thresholds

            extras["thresholds"] = load_thresholds(self.config.collectors.thresholds_file)
        self._extras = extras

    def _collector_job(self, collector: Collector) -> Callable[[], None]:
        name = collector.name

        def run() -> None:
            history = self.cache.history(name)
            try:
                outcome = self.runner.run(collector, self._context(), history)
            except Exception as exc:  # the runner itself failed: still never the agent
                log.exception("runner failed on %s", name)
                outcome = CollectorRun(name, time.time(), 0.0, False, error=f"runner: {exc}")
            driver_codes = outcome.nvml_codes & DRIVER_GONE_CODES
            if driver_codes:
                self.cache.record(replace(outcome, success=False, findings=[], samples=[],
                                          error=f"NVML unavailable (code {min(driver_codes)})"))
                self.nvml.driver_lost(f"collector {name} saw NVML error {min(driver_codes)}")
                return
            previous = self.cache.statuses().get(name)
            self.cache.record(outcome)
            if not outcome.success and (previous is None or previous.success is not False):
                log.warning("collector %s failed: %s", name, outcome.error,
                            extra={"collector": name, "timed_out": outcome.timed_out})
            elif outcome.success and previous is not None and previous.success is False:
                log.info("collector %s recovered", name, extra={"collector": name})
            self.nvml.note_lost_gpus(self._lost_gpus(outcome))

        return run

    def _lost_gpus(self, outcome: CollectorRun) -> frozenset[int]:
        """Lost GPUs are those the presence collector reports (``gpu.lost``); other collectors only
        hint (their GPU_IS_LOST errors), so a hint without a finding starts the re-open clock too."""
        lost = {f.entity.gpu_index for f in self.cache.snapshot().findings
                if f.code == "gpu.lost" and f.entity.gpu_index is not None}
        if not lost and outcome.gone_gpus and "presence" not in self._collectors:
            lost = set(outcome.gone_gpus)
        return frozenset(i for i in lost if i is not None)

    def _on_nvml(self, change: NvmlChange) -> None:
        """What each NVML transition means for the cache and the schedule (``nvml_supervisor``)."""
        event = change.event
        if event is NvmlEvent.INIT_OK:
            self.cache.update_facts(nvml_up=True, gpus=change.gpus, driver_version=change.driver_version,
                                    cuda_driver_version=change.cuda_driver_version,
                                    nvml_reinits_total=change.reinits, agent_findings=())
            for name in self._collectors:
                self.scheduler.run_soon(name)
        elif event is NvmlEvent.INIT_FAILED:
            self.cache.update_facts(nvml_up=False, agent_findings=(unavailable_finding(self.node_name, change),))
            self.scheduler.delay(_REINIT, change.retry_in_s)
        elif event is NvmlEvent.DRIVER_LOST:
            self.cache.update_facts(nvml_up=False, agent_findings=(unavailable_finding(self.node_name, change),))
            independent = [n for n, c in self._collectors.items() if not getattr(c, "needs_nvml", True)]
            # an XID from the kernel log is still true: often the reason the driver went away
            self.cache.mark_unavailable("NVML unavailable", independent=independent, keep_findings=["xid"])
            self.scheduler.run_soon(_REINIT)
        elif event is NvmlEvent.GPUS_ENUMERATED:
            self.cache.update_facts(gpus=change.gpus)
        elif event is NvmlEvent.HANDLES_REFRESHED:
            self.cache.update_facts(nvml_reinits_total=change.reinits)

    def _quiesce_event_readers(self) -> None:
        """Stop threads that block inside NVML (the XID event pump) before NVML is shut down: freeing
        an event set another thread waits on is undefined behaviour in the driver library. Their
        collectors restart them on the next run. The pump waits at most ``EVENT_WAIT_MS`` per call."""
        closed = False
        for col in self._collectors.values():
            if callable(getattr(col, "close", None)):
                _close(col)
                closed = True
        if closed and not self.backend.simulated:
            time.sleep(EVENT_WAIT_DRAIN_S)

    def _extensions_job(self) -> None:
        """Export what the extensions say about themselves (``samples()``: connected ranks, the
        coordinator link's state and backlog), registered only once one has something to say."""
        samples: list[Sample] = []
        for ext in list(self._started_extensions):
            if not isinstance(ext, ReportsSamples):
                continue
            try:
                samples.extend(ext.samples())
            except Exception:
                log.exception("extension %s: samples() failed", _name(ext))
        if not samples and not self.cache.is_registered(_EXTENSIONS):
            return
        self.cache.register(_EXTENSIONS, "external", self.config.collectors.fast_interval_s)
        self.cache.record(CollectorRun(_EXTENSIONS, time.time(), 0.0, True, samples=samples))

    def _labels_job(self) -> None:
        provider = self._label_provider
        if provider is None:
            return
        try:
            labels = provider()
        except Exception:
            log.exception("GPU label provider failed")
            return
        by_uuid: dict[str, dict[str, str]] = {}
        for gpu in self.cache.facts.gpus:
            extra = labels.get(gpu.uuid) or labels.get(str(gpu.index))
            if extra:
                by_uuid[gpu.uuid] = dict(extra)
        if by_uuid != self.cache.facts.gpu_labels:
            self.cache.update_facts(gpu_labels=by_uuid)

    def _default_label_provider(self) -> GpuLabelProvider | None:
        try:
            from gpuhealth.agent.attribution import build_label_provider
        except ImportError:
            return None
        try:
            return build_label_provider(
                self.config, index_to_uuid=lambda: {g.index: g.uuid for g in self.cache.facts.gpus})
        except Exception:
            log.exception("GPU attribution unavailable")
            return None

    def _on_hung(self, job: Job, elapsed: float) -> None:
        if job.name in self._collectors:
            error = f"hung for {elapsed:.1f} s (no answer from the runner)"
            finding = Finding("collector.failed", Severity.WARNING, Entity.node(self.node_name),
                              f"collector '{job.name}' failed: {error}", Action.MONITOR,
                              {"collector": job.name, "error": error}, "agent")
            self.cache.record(CollectorRun(job.name, time.time() - elapsed, elapsed, False, error=error,
                                           findings=[finding], timed_out=True))

    # ================================================================== notifications
    def _on_snapshot(self, snap: ExportSnapshot) -> None:
        """After every change (on the writer's thread): systemd, then the findings listeners."""
        self.systemd.on_snapshot(snap)
        # Writers run on several threads: deliver the cache's newest state, in order, so a slower
        # writer can never leave listeners (the coordinator link) holding an older set.
        with self._listeners_lock:
            self._log_health_changes(self.cache.snapshot())
            findings = self.cache.snapshot().findings
            if findings == self._last_findings:
                return
            self._last_findings = findings
            for cb in list(self._listeners):
                try:
                    cb(list(findings))
                except Exception:
                    log.exception("findings listener failed")

    def _log_health_changes(self, snap: ExportSnapshot) -> None:
        """One line per change of a GPU's or the node's health (``health_log``), from the first full sweep."""
        if not snap.ready:
            return
        seen = (snap.findings, snap.gpus, snap.nvml_up)
        if seen == self._health_seen:
            return
        self._health_seen = seen
        from gpuhealth.node import report_of_snapshot

        try:
            changes = self._health_log.observe(report_of_snapshot(snap))
        except Exception:  # the journal line is worth a lot, but never the agent
            log.exception("health change log failed")
            return
        for change in changes:
            log.log(change.level, change.text, extra=change.extra)


# ====================================================================== helpers
def config_problem(config: Config, known_collectors: Sequence[str] | None = None) -> str | None:
    """Why the agent cannot run with ``config``, as one line; None when it can. ``known_collectors``
    defaults to the registry's names."""
    from gpuhealth.agent.http import parse_listen

    try:
        parse_listen(config.agent.listen)
    except ValueError as exc:
        return str(exc)
    if not isinstance(logging.getLevelName(config.agent.log_level.strip().upper()), int):
        return f"agent.log_level: unknown level {config.agent.log_level!r} (debug, info, warning, error)"
    cc = config.collectors
    if cc.fast_interval_s <= 0 or cc.slow_interval_s <= 0:
        return "collectors.fast_interval_s and collectors.slow_interval_s must be > 0"
    if cc.timeout_s <= 0:
        return "collectors.timeout_s must be > 0"
    if known_collectors is None:
        from gpuhealth.collectors.registry import COLLECTOR_MODULES

        known_collectors = COLLECTOR_MODULES
    unknown = sorted(set(cc.disabled) - set(known_collectors))
    if unknown:
        return f"collectors.disabled: unknown collector(s) {unknown}; known: {', '.join(known_collectors)}"
    if cc.thresholds_file:
        from gpuhealth.catalog.thresholds import load_thresholds

        try:
            load_thresholds(cc.thresholds_file)
        except (OSError, ValueError) as exc:  # ThresholdsError is a ValueError
            return str(exc)
    if config.agent.web_config_file:
        from gpuhealth.runtime.webconfig import WebConfigError, load_web_config

        try:
            load_web_config(config.agent.web_config_file)
        except WebConfigError as exc:
            return f"agent.web_config_file: {exc}"
    return None


def _interval_of(col: Collector, fast: float, slow: float) -> float:
    own = getattr(col, "interval_s", None)
    if isinstance(own, (int, float)) and own > 0:
        return float(own)
    return slow if getattr(col, "lane", Lane.FAST) == Lane.SLOW else fast


def _name(ext: object) -> str:
    return str(getattr(ext, "name", type(ext).__name__))


def _close(collector: Any) -> None:
    close = getattr(collector, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            log.exception("collector %s failed to close", getattr(collector, "name", "?"))


__all__ = ["Agent", "config_problem"]
