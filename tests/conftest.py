"""Shared fixtures: the bundled real recordings and a steppable clock for scenario time."""

from __future__ import annotations

import os
from collections.abc import Iterator
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


@pytest.fixture(scope="session", autouse=True)
def _own_user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tests' user cache (``XDG_CACHE_HOME``), for this process and every command it starts: diagnostics keep
    their state and goldens there when ``/var/lib/gpuhealth`` is not writable, and the golden store merges the
    cache's goldens in (``diag/golden_place.py``) — a developer's own cache must neither leak into a test nor be
    written by one."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("user-cache"))
    yield
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved
