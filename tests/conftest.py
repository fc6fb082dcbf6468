"""Shared fixtures: the bundled real recordings and a steppable clock for scenario time; how the suite is
spread over pytest-xdist workers (``scripts/test.sh``, docs/testing.md)."""

from __future__ import annotations

import os
from collections import Counter
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the files that hold ``slow`` tests first, the most first. ``--dist loadfile
    --no-loadscope-reorder`` hands whole files to workers in this order, so no long file starts last and
    runs alone at the end. (Files, not ``xdist_group``: pytest 9.2 ignores the node-id suffix xdist 3.8's
    loadgroup relies on, pytest-dev/pytest-xdist#1386, and spreads a group's tests over all workers.)"""
    if not hasattr(config, "workerinput"):
        return
    slow = Counter(_file(item) for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[_file(item)])  # stable: a file's own order is kept


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]
