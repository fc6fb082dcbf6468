"""Which optional parts an agent starts, decided from config (the seam they plug into: ``view.py``).

- ``agent.socket_path`` set (the default): a ``RankHub`` listens for instrumented training ranks, in an
  unprivileged child process (``rank_process.RankProcess``; ``agent.rank_process: false``: in the agent's
  own process, for debugging).
- ``agent.coordinator`` set: a ``CoordinatorLink`` streams findings and step records to the
  coordinator and serves its requests through that same rank hub, handed to it here (needs
  ``gpuhealth[coordinator]``).
- ``diag.enabled`` (on by default; never on a simulated backend): screening (``diag/periodic.py``) —
  SDC and bandwidth checks in a child process on idle GPUs under the per-GPU GPU-time budget, aborted
  when a job starts. Their findings join the agent's findings; each GPU's latest screen is on
  ``/metrics`` and, with a coordinator link, goes up the stream as ``ScreenResults``, while the
  coordinator's ``ScreenTurn`` comes down to it. The HTTP API's ``POST /screen`` (loopback only: the
  Slurm epilog) asks for a screen, ``GET /screen`` shows them.
- zero-code discovery (on unless its settings say otherwise; idle on simulated GPUs): a
  ``zerocode.ZeroCodeWatcher`` finds and watches the PyTorch/NCCL jobs on the node's GPUs that import
  nothing of ours. With a coordinator link, the link serves discovered ranks too (``CombinedRanks``).

An extension that fails to start is logged by the agent, which keeps running without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpuhealth.agent.netprobe import NetprobeReports
from gpuhealth.agent.netprobe import is_loopback as _is_loopback
from gpuhealth.agent.view import AgentExtension, AgentView

if TYPE_CHECKING:
    from gpuhealth.agent.rank_process import RankProcess
    from gpuhealth.agent.ranks import RankHub
    from gpuhealth.config import Config
    from gpuhealth.diag.screen import ScreenResult
    from gpuhealth.model import Finding, Sample

log = logging.getLogger("gpuhealth.agent")
TURN_GRACE_S = 120.0  # an agent with a coordinator waits this long after start for its screening turn


class _RankHubGuard:
    """Starts the rank hub, but a socket it cannot take (another agent holds it, no permission on
    the folder) is one clear log line: the agent's health monitoring does not depend on it."""

    name = "ranks"

    def __init__(self, hub: RankHub | RankProcess) -> None:
        self.hub = hub
        self.error: str | None = None

    def start(self, agent: AgentView) -> None:
        from gpuhealth.agent.ranks import RankHubError

        try:
            self.hub.start(agent)
        except (RankHubError, OSError) as exc:
            self.error = str(exc)
            log.error("rank hub not started: %s (instrumented jobs on this node cannot reach the agent; "
                      "set agent.socket_path)", exc)

    def stop(self) -> None:
        if self.error is None:
            self.hub.stop()

    def samples(self) -> list[Sample]:
        return [] if self.error is not None else list(self.hub.samples())  # no socket: no rank metrics


class _PeriodicDiagnostics:
    """Runs ``gpuhealth.diag.periodic`` (screening) and publishes each screen's findings through the
    agent; routes ``/screen`` on the agent's HTTP server; hands screen results to ``on_screens``."""

    name = "diagnostics"

    def __init__(self, interval_s: float, *, periodic: Any = None, first_delay_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self.periodic: Any = periodic
        self.agent: AgentView | None = None
        self._first_delay_s = first_delay_s
        self._screen_listeners: list[Callable[[list[ScreenResult]], None]] = []

    def add_screens_listener(self, callback: Callable[[list[ScreenResult]], None]) -> None:
        """``callback(results)`` after every screen that screened a GPU (the coordinator link)."""
        self._screen_listeners.append(callback)

    def set_turn(self, not_before: float, valid_for_s: float) -> None:
        if self.periodic is not None:
            self.periodic.set_turn(not_before, valid_for_s)

    def start(self, agent: AgentView) -> None:
        from gpuhealth.diag.periodic import PeriodicDiagnostics  # torch-free: the checks run in a child

        def on_findings(findings: list[Finding]) -> None:
            agent.publish_findings(self.name, findings, interval_s=self.interval_s)

        self.agent = agent
        if self.periodic is None:
            self.periodic = PeriodicDiagnostics(first_delay_s=self._first_delay_s)
        self.periodic.on_findings = on_findings
        self.periodic.on_screens = self._screens
        http = getattr(agent, "http", None)  # the running agent's server (started before extensions)
        if http is not None and hasattr(http, "route"):
            http.route("/screen", self.http_screen)
        self.periodic.start(agent)

    def _screens(self, results: list[ScreenResult]) -> None:
        for cb in list(self._screen_listeners):
            try:
                cb(results)
            except Exception:
                log.exception("screen results listener failed")

    def http_screen(self, method: str, query: Mapping[str, str], client: str) -> tuple[int, dict[str, Any]]:
        """``GET /screen``: the screens' state. ``POST /screen?level=quick&trigger=epilog``: ask for one —
        from this node only (a loopback client), 202 when queued, 409 when refused (with the reason)."""
        if self.periodic is None:
            return 503, {"error": "screening has not started"}
        if method == "GET":
            return 200, self.periodic.status()
        if not _is_loopback(client):
            return 403, {"error": "POST /screen is taken from this node only (a loopback address)"}
        level = query.get("level", "quick")
        trigger = query.get("trigger", "operator")
        accepted, why = self.periodic.request_screen(level, trigger)
        return (202 if accepted else 409), {"accepted": accepted, "reason": why, "level": level, "trigger": trigger}

    def samples(self) -> list[Sample]:
        """The numbers behind the findings (bandwidths, GPU time, last run, each GPU's last screen)."""
        if self.periodic is None or self.agent is None:
            return []
        from gpuhealth.diag.metrics import diag_samples, screen_samples

        gpu_index = {g.uuid: g.index for g in self.agent.gpus}
        return [*diag_samples(self.periodic.measured(), self.periodic.finished_at(), gpu_index),
                *screen_samples(self.periodic.screens(), gpu_index)]

    def stop(self) -> None:
        if self.periodic is not None:
            self.periodic.stop()


def _rank_socket(config: Config) -> Any:
    """The rank socket's server: an unprivileged child (``rank_process``), or in this process when
    ``agent.rank_process`` is off (debugging only: tenants' bytes are then parsed by the root process)."""
    if config.agent.rank_process:
        from gpuhealth.agent.rank_process import RankProcess

        return RankProcess(config.agent.socket_path, user=config.agent.rank_process_user,
                           memory_bytes=config.agent.rank_process_memory_mib * 1024 * 1024,
                           cpu_seconds=config.agent.rank_process_cpu_seconds)
    from gpuhealth.agent.ranks import RankHub

    log.warning("agent.rank_process is off: the rank socket is served by the agent's own (privileged) process")
    return RankHub(config.agent.socket_path)


def default_extensions(config: Config) -> list[AgentExtension]:
    """Extensions the config asks for, rank hub first (the coordinator link uses it), then zero-code."""
    from gpuhealth.agent.zerocode.watcher import ZeroCodeWatcher, settings_from

    extensions: list[AgentExtension] = []
    hub = None
    link: Any = None
    if config.agent.socket_path:
        hub = _rank_socket(config)
        extensions.append(_RankHubGuard(hub))
    zero_code = settings_from(config)
    watcher = ZeroCodeWatcher(zero_code) if zero_code.enabled else None
    if watcher is not None:
        extensions.append(watcher)
    if config.agent.coordinator:
        try:
            from gpuhealth.agent.coordinator_link import link_from_config
        except ImportError as exc:  # the gRPC extra is not installed
            log.error("agent.coordinator is set but the coordinator link cannot load (%s); "
                      "install gpuhealth[coordinator]", exc)
        else:
            ranks: Any = hub
            if watcher is not None:
                from gpuhealth.agent.zerocode.ranksource import CombinedRanks

                ranks = CombinedRanks(hub, watcher)
            link = link_from_config(config, rank_hub=ranks)
            if link is not None:
                extensions.append(link)
    extensions.append(NetprobeReports())  # POST /fabric: the fabric probe's word about this node
    if config.diag.enabled:
        # with a coordinator, the first scheduled screen waits a little for the node's turn to arrive
        diag = _PeriodicDiagnostics(config.diag.interval_s,
                                    first_delay_s=TURN_GRACE_S if config.agent.coordinator else 0.0)
        if link is not None:
            diag.add_screens_listener(link.on_screens)
            link.add_turn_listener(diag.set_turn)
        extensions.append(diag)
    return extensions


__all__ = ["default_extensions"]
