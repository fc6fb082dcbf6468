"""Straggler detection (pure): which rank makes a synchronous job slow, by how much, since when,
and what it costs the job.

Wall step time cannot show a straggler — every rank waits at the collective, so wall times are
equal. The signal is in *compute* time (or, equivalently, collective wait: the straggler waits
least), from step records or from flight-recorder ``duration_ms``. Window statistics over the last
8–256 steps compare each rank with the median of the other ranks (and, when half the job is slow,
with the fastest ranks); see docs/stragglers.md for the definitions and limits.

* :class:`StragglerDetector` — online, bounded memory (the coordinator's feed uses it).
* :func:`detect_stragglers` — a finished list of step records (``gpuhealth triage --steps``).
* :func:`detect_from_durations` — flight-recorder durations only.
"""

from gpuhealth.stragglers.batch import detect_from_durations, detect_stragglers
from gpuhealth.stragglers.config import StragglerConfig
from gpuhealth.stragglers.detector import CODE, StragglerDetector
from gpuhealth.stragglers.trend import CODE as JOB_SLOWDOWN_CODE

__all__ = ["CODE", "JOB_SLOWDOWN_CODE", "StragglerConfig", "StragglerDetector", "detect_from_durations",
           "detect_stragglers"]
