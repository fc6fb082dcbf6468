"""In-job instrumentation: ``from gpuhealth.instrument import Tracker``.

Times training steps (compute vs collective wait), ships records to the local agent over a unix
socket (or a JSONL file when none listens) and answers the agent's flight-recorder and stack
requests. See docs/instrument.md. Importing this package does not import torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuhealth.instrument.tracker import COLLECTIVES, Tracker


def __getattr__(name: str) -> Any:
    """``Tracker`` and ``COLLECTIVES`` load the hook on first use: the agent imports only ``protocol`` from this
    package (its rank socket's wire), and the hook (tracker, link, timing, control) would be ~1 MiB of it for
    nothing on every node."""
    if name in __all__:
        from gpuhealth.instrument import tracker

        return getattr(tracker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["COLLECTIVES", "Tracker"]
