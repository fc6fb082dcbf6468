"""Shared fixtures: the bundled real recordings and a steppable clock for scenario time."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuhealth.backends.nvml_fake import bundled_recording_path

FIXTURES = Path(__file__).parent / "fixtures"


class StepClock:
    """A monotonic clock tests move by hand (scenario events fire on it)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


@pytest.fixture
def h200_recording() -> Path:
    return bundled_recording_path("nvml_h200x2.json")


@pytest.fixture
def h100_recording() -> Path:
    return bundled_recording_path("nvml_h100x1.json")
