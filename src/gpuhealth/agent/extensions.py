"""Which optional parts an agent starts, decided from config (wired by the lead; see daemon.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpuhealth.config import Config


class AgentExtension(Protocol):
    """A part that runs beside the agent's scheduler. ``start`` must not block: run your own
    thread(s). ``agent`` is the running ``gpuhealth.agent.daemon.Agent``."""

    name: str

    def start(self, agent: object) -> None: ...

    def stop(self) -> None: ...


def default_extensions(config: Config) -> list[AgentExtension]:
    """Extensions the config asks for. Filled in as the parts land (rank hub, coordinator link)."""
    return []
