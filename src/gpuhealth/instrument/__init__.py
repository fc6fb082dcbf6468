"""In-job instrumentation: ``from gpuhealth.instrument import Tracker``.

Times training steps (compute vs collective wait), ships records to the local agent over a unix
socket (or a JSONL file when none listens) and answers the agent's flight-recorder and stack
requests. See docs/instrument.md. Importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuhealth.instrument.tracker import COLLECTIVES, Tracker

__all__ = ["COLLECTIVES", "Tracker"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: the agent's rank process imports ``instrument.protocol`` alone, and a package that
    # imported the tracker (timing, the agent link, the request handlers) would double what it loads.
    if name in __all__:
        from gpuhealth.instrument import tracker

        return getattr(tracker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
