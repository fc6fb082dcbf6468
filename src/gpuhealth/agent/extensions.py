"""Which optional parts an agent starts, decided from config (the seam they plug into: ``view.py``).

- ``agent.socket_path`` set (the default): a ``RankHub`` listens for instrumented training ranks.
- ``agent.coordinator`` set: a ``CoordinatorLink`` streams findings and step records to the
  coordinator and serves its requests through that same rank hub, handed to it here (needs
  ``gpuhealth[coordinator]``).
- ``diag.enabled``: periodic SDC and bandwidth checks in a child process under the per-GPU
  GPU-time budget; their findings are published into the agent's findings and ``/metrics``.
- zero-code discovery (on unless its settings say otherwise; idle on simulated GPUs): a
  ``zerocode.ZeroCodeWatcher`` finds and watches the PyTorch/NCCL jobs on the node's GPUs that import
  nothing of ours. With a coordinator link, the link serves discovered ranks too (``CombinedRanks``).

An extension that fails to start is logged by the agent, which keeps running without it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gpuhealth.agent.view import AgentExtension, AgentView

if TYPE_CHECKING:
    from gpuhealth.agent.ranks import RankHub
    from gpuhealth.config import Config
    from gpuhealth.model import Finding, Sample

log = logging.getLogger("gpuhealth.agent")


class _RankHubGuard:
    """Starts the rank hub, but a socket it cannot take (another agent holds it, no permission on
    the folder) is one clear log line: the agent's health monitoring does not depend on it."""

    name = "ranks"

    def __init__(self, hub: RankHub) -> None:
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
    """Runs ``gpuhealth.diag.periodic`` and publishes each cycle's findings through the agent."""

    name = "diagnostics"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.periodic: Any = None
        self.agent: AgentView | None = None

    def start(self, agent: AgentView) -> None:
        from gpuhealth.diag.periodic import PeriodicDiagnostics  # torch-free: the checks run in a child

        def on_findings(findings: list[Finding]) -> None:
            agent.publish_findings(self.name, findings, interval_s=self.interval_s)

        self.agent = agent
        self.periodic = PeriodicDiagnostics(on_findings=on_findings)
        self.periodic.start(agent)

    def samples(self) -> list[Sample]:
        """The numbers behind the findings (bandwidths, GPU time, last run), for /metrics."""
        if self.periodic is None or self.agent is None:
            return []
        from gpuhealth.diag.metrics import diag_samples

        return diag_samples(self.periodic.measured(), self.periodic.finished_at(),
                            {g.uuid: g.index for g in self.agent.gpus})

    def stop(self) -> None:
        if self.periodic is not None:
            self.periodic.stop()


def default_extensions(config: Config) -> list[AgentExtension]:
    """Extensions the config asks for, rank hub first (the coordinator link uses it), then zero-code."""
    from gpuhealth.agent.zerocode.watcher import ZeroCodeWatcher, settings_from

    extensions: list[AgentExtension] = []
    hub = None
    if config.agent.socket_path:
        from gpuhealth.agent.ranks import RankHub

        hub = RankHub(config.agent.socket_path)
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
    if config.diag.enabled:
        extensions.append(_PeriodicDiagnostics(config.diag.interval_s))
    return extensions


__all__ = ["default_extensions"]
