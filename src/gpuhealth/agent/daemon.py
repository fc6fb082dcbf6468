"""The per-node agent: collectors on a schedule, a cache, ``/metrics`` + ``/health``, extensions.

Extension seam (``Agent(config, backend, extensions=[...])``; see ``agent/extensions.py``). An
extension's ``start(agent)`` gets this object and may use only:

- ``agent.config`` (``Config``), ``agent.node_name`` (str), ``agent.simulated`` (bool)
- ``agent.gpus`` → ``list[GpuIdentity]``: the GPUs of the last enumeration
- ``agent.current_findings()`` → ``list[Finding]``: every active finding (collectors + agent)
- ``agent.node_report()`` → ``dict``: the ``gpuhealth status --json`` shape
  (``{"node": {...}, "gpus": [{"index", "uuid", "name", "health", "findings"}], "findings": [...]}``)
- ``agent.add_findings_listener(cb)``: ``cb(findings: list[Finding])`` is called (on an agent
  thread; keep it quick, never block) whenever the active findings change. Extensions start
  before the first sweep, so a listener added in ``start`` sees every change; ``agent.gpus`` is
  empty until NVML has been initialised.
- ``agent.set_gpu_label_provider(fn)``: ``fn() -> {gpu_uuid_or_index: {label: value}}`` adds
  labels (``pod``, ``namespace``, ``container``, ``slurm_job_id``) to every GPU series, as
  dcgm-exporter does. It is called from the agent's own thread every fast interval, never from a
  scrape, so a slow provider delays only itself.
- ``agent.publish_findings(source, findings, interval_s=…)``: findings produced outside the
  scheduler (periodic diagnostics) join the node's findings, ``/health`` and ``/metrics`` as if
  ``source`` were a collector; each call replaces that source's previous findings.

Everything else here is internal. The agent never imports torch and never exits the process.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import FrameType
from typing import Any

from gpuhealth import __version__
from gpuhealth.agent.cache import Cache
from gpuhealth.agent.extensions import AgentExtension
from gpuhealth.agent.scheduler import Job, Scheduler
from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.errors import DRIVER_GONE_CODES, BackendUnavailable, NvmlError
from gpuhealth.collectors.base import CollectContext, Collector, GpuIdentity, Lane
from gpuhealth.collectors.runner import CollectorRun, CollectorRunner
from gpuhealth.config import Config
from gpuhealth.exporters import ExportSnapshot, NodeFacts
from gpuhealth.model import Action, Entity, Finding, Health, Sample, Severity
from gpuhealth.runtime.sdnotify import SystemdNotifier

log = logging.getLogger("gpuhealth.agent")

FindingsListener = Callable[[list[Finding]], None]
GpuLabelProvider = Callable[[], Mapping[str, Mapping[str, str]]]

NVML_UNAVAILABLE = "nvml.unavailable"
REINIT_BACKOFF_MIN_S = 1.0
REINIT_BACKOFF_MAX_S = 60.0
LOST_GPU_REINIT_S = 30.0  # first re-init of NVML after a GPU answers GPU_IS_LOST; doubles while it stays lost
LOST_GPU_REINIT_MAX_S = 600.0
IDLE_TICK_S = 5.0  # longest the scheduler loop sleeps (wakeups cost CPU; jobs wake it when due)
EVENT_WAIT_DRAIN_S = 0.6  # > the XID pump's 500 ms wait_xid_events timeout
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
    ) -> None:
        self.config = config
        self.backend = backend
        self._given_collectors = collectors
        self._collectors: dict[str, Collector] = {}
        self._kmsg = kmsg
        self._sysfs = sysfs
        self._extras: dict[str, Any] = {"agent": True}
        self.runner = runner or CollectorRunner(timeout_s=config.collectors.timeout_s)
        self.notifier = notifier or SystemdNotifier()
        self.cache = Cache(
            NodeFacts(node_name=config.node_name, simulated=backend.simulated, backend=backend.description,
                      version=__version__, nvml_up=False),
            history_len=config.collectors.history_len,
        )
        watchdog = self.notifier.watchdog_interval_s
        # the loop must come round often enough to ping systemd's watchdog on time
        self.scheduler = Scheduler(on_hung=self._on_hung, on_tick=self._on_tick,
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
        self._state_lock = threading.Lock()
        self._backoff_s = REINIT_BACKOFF_MIN_S
        self._ever_up = False
        self._nvml_attempted = False
        self._down_since: float | None = None
        self._lost_gpus: frozenset[int] = frozenset()
        self.lost_gpu_reinit_s = LOST_GPU_REINIT_S
        self._ready_sent = False
        self._last_watchdog = 0.0
        self._last_status = ""
        self._notify_lock = threading.Lock()
        self._loop: threading.Thread | None = None
        self._stop = threading.Event()
        self._stopping = False
        self._reload_requested = threading.Event()
        self._main_wake = threading.Event()
        self.cache.add_listener(self._on_snapshot)

    # ================================================================== extension seam
    @property
    def node_name(self) -> str:
        return self.config.node_name

    @property
    def simulated(self) -> bool:
        return self.backend.simulated

    @property
    def gpus(self) -> list[GpuIdentity]:
        return list(self.cache.snapshot().gpus)

    def current_findings(self) -> list[Finding]:
        return list(self.cache.snapshot().findings)

    def node_report(self) -> dict[str, Any]:
        from gpuhealth.node import report_of_snapshot

        return report_of_snapshot(self.cache.snapshot(), self._versions()).to_dict()

    def _versions(self) -> dict[str, Any]:
        if "versions" not in self._collectors:
            return {}
        try:
            from gpuhealth.collectors.versions import versions_of

            return dict(versions_of(self.cache.history("versions").latest()))
        except Exception:
            log.debug("versions unavailable", exc_info=True)
            return {}

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

    # ================================================================== state for HTTP
    def snapshot(self) -> ExportSnapshot:
        return self.cache.snapshot()

    @property
    def ready(self) -> bool:
        return self.cache.snapshot().ready

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

            self.http = AgentHttpServer(self, self.config.agent.listen, dcgm_compat=self.config.agent.dcgm_compat)
            self.http.start()
            log.info("serving /metrics, /health, /ready on %s", self.http.url)
        # Extensions start before the first sweep, so their listeners see every change from the start.
        for ext in self.extensions:
            try:
                ext.start(self)
                self._started_extensions.append(ext)
                log.info("extension %s started", getattr(ext, "name", type(ext).__name__))
            except Exception:
                log.exception("extension %s failed to start; the agent runs without it",
                              getattr(ext, "name", type(ext).__name__))
        self._loop = threading.Thread(target=self.scheduler.run_forever, name="gpuhealth-scheduler", daemon=True)
        self._loop.start()

    def stop(self) -> None:
        with self._notify_lock:
            self._stopping = True  # from here on, NVML errors are ours (shutdown), not the driver's
            self.notifier.stopping()
        log.info("stopping")
        for ext in reversed(self._started_extensions):
            try:
                ext.stop()
            except Exception:
                log.exception("extension %s failed to stop", getattr(ext, "name", type(ext).__name__))
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
        self.notifier.close()

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
                    self.notifier.reloading()
                    try:
                        self.reload(reload_config())
                    except Exception as exc:  # ConfigError and friends: keep running on the old config
                        log.error("reload failed, keeping the current config: %s", exc)
                    self.notifier.ready(self._status_line())
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
            self.http.set_dcgm_compat(config.agent.dcgm_compat)
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
        self.scheduler.add(Job(_REINIT, 3600.0, self._reinit_job, timeout_s=timeout,
                               enabled=lambda: not self.cache.facts.nvml_up))
        self.scheduler.add(Job(_ENUMERATE, cfg.fast_interval_s, self._enumerate_job, timeout_s=timeout,
                               enabled=lambda: self.cache.facts.nvml_up))
        for name, col in self._collectors.items():
            interval = _interval_of(col, cfg.fast_interval_s, cfg.slow_interval_s)
            self.cache.register(name, str(getattr(col, "lane", Lane.FAST)), interval)
            needs_nvml = bool(getattr(col, "needs_nvml", True))
            self.scheduler.add(Job(name, interval, self._collector_job(col), timeout_s=timeout,
                                   enabled=(lambda: self.cache.facts.nvml_up) if needs_nvml else (lambda: True)))
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
        out: dict[str, Collector] = {}
        for c in cols:
            if c.name in disabled:
                continue
            out[c.name] = self._collectors.get(c.name, c)
        return out

    def _context(self) -> CollectContext:
        snap = self.cache.snapshot()
        return CollectContext(
            backend=self.backend, config=self.config, gpus=snap.gpus, node_name=self.node_name, now=time.time(),
            sysfs=self._sysfs, kmsg=self._kmsg, extras=self._extras,
        )

    def _prepare_context(self) -> None:
        """Sources and thresholds the collectors share (built at start and on reload, not per run)."""
        from gpuhealth.backends.sysfs import sysfs_for
        from gpuhealth.node import default_kmsg

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
                self._nvml_lost(f"collector {name} saw NVML error {min(driver_codes)}")
                return
            previous = self.cache.statuses().get(name)
            self.cache.record(outcome)
            if not outcome.success and (previous is None or previous.success is not False):
                log.warning("collector %s failed: %s", name, outcome.error,
                            extra={"collector": name, "timed_out": outcome.timed_out})
            elif outcome.success and previous is not None and previous.success is False:
                log.info("collector %s recovered", name, extra={"collector": name})
            self._note_gone_gpus(outcome)

        return run

    def _enumerate_job(self) -> None:
        from gpuhealth.collectors.runner import enumerate_gpus

        facts = self.cache.facts
        try:
            gpus = tuple(enumerate_gpus(self.backend, facts.gpus))
        except NvmlError as exc:
            if exc.driver_gone:
                self._nvml_lost(f"device count failed: {exc.message}")
            else:
                log.warning("GPU enumeration failed: %s", exc.message)
            return
        if gpus != facts.gpus:
            if facts.gpus:
                log.warning("GPU list changed: %d → %d GPUs", len(facts.gpus), len(gpus))
            self.cache.update_facts(gpus=gpus)
        if self._lost_gpus and time.monotonic() - (self._lost_since or 0.0) > self._lost_wait_s:
            self._lost_since = time.monotonic()
            self._lost_wait_s = min(self._lost_wait_s * 2, LOST_GPU_REINIT_MAX_S)
            self._reinit_in_place()

    _lost_since: float | None = None
    _lost_wait_s: float = LOST_GPU_REINIT_S

    def _quiesce_event_readers(self) -> None:
        """Stop threads that block inside NVML (the XID event pump) before NVML is shut down: freeing
        an event set another thread waits on is undefined behaviour in the driver library. Their
        collectors restart them on the next run. The pump waits at most 500 ms per call."""
        closed = False
        for col in self._collectors.values():
            if callable(getattr(col, "close", None)):
                _close(col)
                closed = True
        if closed and not self.backend.simulated:
            time.sleep(EVENT_WAIT_DRAIN_S)

    def _reinit_in_place(self) -> None:
        """A GPU answers GPU_IS_LOST: fresh NVML handles in case it came back after a reset."""
        try:
            self._quiesce_event_readers()
            self.backend.shutdown()
            self.backend.init()
            log.info("NVML re-initialised to refresh handles of lost GPU(s) %s", sorted(self._lost_gpus))
            self.cache.update_facts(nvml_reinits_total=self.cache.facts.nvml_reinits_total + 1)
        except (NvmlError, BackendUnavailable) as exc:
            self._nvml_lost(f"re-initialisation failed: {exc}")

    def _reinit_job(self) -> None:
        try:
            try:
                if self._ever_up:
                    self._quiesce_event_readers()
                self.backend.shutdown()
            except Exception:
                log.debug("shutdown before re-init failed", exc_info=True)
            self.backend.init()
            from gpuhealth.collectors.runner import enumerate_gpus

            gpus = tuple(enumerate_gpus(self.backend, self.cache.facts.gpus))
            driver = _safe_system(self.backend, "driver")
            cuda = _safe_system(self.backend, "cuda_driver")
        except (NvmlError, BackendUnavailable, OSError) as exc:
            self._nvml_attempted = True
            self._nvml_down(f"NVML init failed: {exc}")
            log.warning("NVML unavailable (%s); retrying in %.0f s", exc, self._backoff_s)
            self.scheduler.delay(_REINIT, self._backoff_s)
            self._backoff_s = min(self._backoff_s * 2, REINIT_BACKOFF_MAX_S)
            return
        reinits = self.cache.facts.nvml_reinits_total + (1 if self._ever_up else 0)
        if self._ever_up:
            log.warning("NVML is back after %.1f s (re-initialised)", time.monotonic() - (self._down_since or 0.0))
        else:
            log.info("NVML up: %d GPU(s), driver %s", len(gpus), driver)
        self._ever_up = True
        self._nvml_attempted = True
        self._down_since = None
        self._backoff_s = REINIT_BACKOFF_MIN_S
        self.cache.update_facts(nvml_up=True, gpus=gpus, driver_version=driver, cuda_driver_version=cuda,
                                nvml_reinits_total=reinits, agent_findings=())
        for name in self._collectors:
            self.scheduler.run_soon(name)

    def _nvml_lost(self, why: str) -> None:
        with self._state_lock:
            if self._stopping or not self.cache.facts.nvml_up:
                return
            log.error("NVML went away (%s); re-initialising with backoff", why)
            self._nvml_down(why)
            independent = [n for n, c in self._collectors.items() if not getattr(c, "needs_nvml", True)]
            self.cache.mark_unavailable("NVML unavailable", independent=independent, keep_findings=["xid"])
        self.scheduler.run_soon(_REINIT)

    def _nvml_down(self, why: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
        finding = Finding(
            NVML_UNAVAILABLE, Severity.CRITICAL, Entity.node(self.node_name),
            f"NVML is not answering ({why}); GPU health is unknown until it is back",
            Action.REBOOT, {"reason": why, "retry_in_s": self._backoff_s}, "agent",
        )
        self.cache.update_facts(nvml_up=False, agent_findings=(finding,))

    def _note_gone_gpus(self, outcome: CollectorRun) -> None:
        """Lost GPUs are those the presence collector reports (``gpu.lost``); other collectors only
        hint (their GPU_IS_LOST errors), so a hint without a finding starts the re-init clock too."""
        lost = {f.entity.gpu_index for f in self.cache.snapshot().findings
                if f.code == "gpu.lost" and f.entity.gpu_index is not None}
        if not lost and outcome.gone_gpus and "presence" not in self._collectors:
            lost = set(outcome.gone_gpus)
        new = frozenset(i for i in lost if i is not None)
        if new != self._lost_gpus:
            if new - self._lost_gpus:
                log.error("GPU(s) %s answer GPU_IS_LOST/RESET_REQUIRED", sorted(new - self._lost_gpus))
                self._lost_since = time.monotonic()
                self._lost_wait_s = self.lost_gpu_reinit_s
            if self._lost_gpus - new:
                log.warning("GPU(s) %s answer again", sorted(self._lost_gpus - new))
            self._lost_gpus = new

    def _extensions_job(self) -> None:
        """Export what the extensions say about themselves (``samples()``: connected ranks, the
        coordinator link's state and backlog), registered only once one has something to say."""
        samples: list[Sample] = []
        for ext in list(self._started_extensions):
            fn = getattr(ext, "samples", None)
            if fn is None:
                continue
            try:
                samples.extend(fn())
            except Exception:
                log.exception("extension %s: samples() failed", getattr(ext, "name", ext))
        if not samples and not self.cache.is_registered(_EXTENSIONS):
            return
        interval = self.config.collectors.fast_interval_s
        self.cache.register(_EXTENSIONS, "external", interval)
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
        """After every change (on the writer's thread): findings listeners and systemd status."""
        self._tell_systemd(snap)
        # Writers run on several threads: deliver the cache's newest state, in order, so a slower
        # writer can never leave listeners (the coordinator link) holding an older set.
        with self._listeners_lock:
            findings = self.cache.snapshot().findings
            if findings == self._last_findings:
                return
            self._last_findings = findings
            for cb in list(self._listeners):
                try:
                    cb(list(findings))
                except Exception:
                    log.exception("findings listener failed")

    def _tell_systemd(self, snap: ExportSnapshot) -> None:
        with self._notify_lock:
            if self._stopping:  # STOPPING=1 is the last word
                return
            status = self._status_line(snap)
            # READY=1 once the agent has something true to say: the first sweep is done, or NVML
            # could not be initialised (then it serves nvml.unavailable; a unit that never became
            # ready would be killed and restarted in a loop by systemd, and report nothing).
            answered = snap.ready or (self._nvml_attempted and not snap.nvml_up)
            if answered and not self._ready_sent:
                self._ready_sent = True
                self._last_status = status
                log.info("first sweep done: %s" if snap.ready else "serving without NVML: %s", status)
                self.notifier.ready(status)
            elif status != self._last_status and self._ready_sent:
                self._last_status = status
                self.notifier.status(status)

    def _on_tick(self) -> None:
        """The scheduler loop's heartbeat: proves to systemd that the loop still comes round."""
        interval = self.notifier.watchdog_interval_s
        if interval is not None and not self._stopping:
            now = time.monotonic()
            if now - self._last_watchdog >= interval:
                self._last_watchdog = now
                self.notifier.watchdog()

    def _status_line(self, snap: ExportSnapshot | None = None) -> str:
        snap = snap or self.cache.snapshot()
        sim = "SIMULATED, " if snap.simulated else ""
        if not snap.nvml_up:
            return f"{sim}NVML unavailable"
        counts: dict[Health, int] = {}
        for g in snap.gpus:
            h = snap.gpu_health(g)
            counts[h] = counts.get(h, 0) + 1
        parts = ", ".join(f"{n} {h}" for h, n in sorted(counts.items()))
        return f"{sim}{len(snap.gpus)} GPUs: {parts or 'none'}; node {snap.node_health()}"


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
    return None


def _interval_of(col: Collector, fast: float, slow: float) -> float:
    own = getattr(col, "interval_s", None)
    if isinstance(own, (int, float)) and own > 0:
        return float(own)
    return slow if getattr(col, "lane", Lane.FAST) == Lane.SLOW else fast


def _safe_system(backend: NvmlBackend, key: str) -> str:
    try:
        return str(backend.system(key))
    except NvmlError:
        return ""


def _close(collector: Any) -> None:
    close = getattr(collector, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            log.exception("collector %s failed to close", getattr(collector, "name", "?"))


__all__ = ["Agent", "FindingsListener", "GpuLabelProvider"]
