"""In-job instrumentation: ``from gpuhealth.instrument import Tracker``.

Times training steps (compute vs collective wait), ships records to the local agent over a unix
socket (or a JSONL file when none listens) and answers the agent's flight-recorder and stack
requests. See docs/instrument.md. Importing this package does not import torch.
"""

from gpuhealth.instrument.tracker import COLLECTIVES, Tracker

__all__ = ["COLLECTIVES", "Tracker"]
