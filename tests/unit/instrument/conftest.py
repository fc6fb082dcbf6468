"""The fake device at the hardware boundary for the lazy CUDA-event timer (CUDA is absent here)."""

from __future__ import annotations

import threading

import pytest


class FakeGpu:
    """One stream: work is queued (``launch``) and runs as the device clock advances (``run``)."""

    def __init__(self) -> None:
        self.queued_until_ms = 0.0  # when the last queued work will finish
        self.now_ms = 0.0  # how far the device has executed
        self.events_created = 0
        self.syncs = 0
        self.queries = 0
        self.query_threads: set[int] = set()

    def launch(self, ms: float) -> None:
        self.queued_until_ms = max(self.queued_until_ms, self.now_ms) + ms

    def run(self, ms: float) -> None:
        self.now_ms += ms

    def event(self) -> FakeEvent:
        self.events_created += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.stamp_ms: float | None = None
        self.stream: object = None

    def record(self, stream: object = None) -> None:
        self.stream = stream
        self.stamp_ms = max(self.gpu.queued_until_ms, self.gpu.now_ms)

    def query(self) -> bool:
        self.gpu.queries += 1
        self.gpu.query_threads.add(threading.get_ident())
        assert self.stamp_ms is not None, "query on an event never recorded"
        return self.gpu.now_ms >= self.stamp_ms

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.query() and end_event.query(), "elapsed_time before both events completed"
        assert end_event.stamp_ms is not None and self.stamp_ms is not None
        return end_event.stamp_ms - self.stamp_ms

    def synchronize(self) -> None:
        self.gpu.syncs += 1
        assert self.stamp_ms is not None
        self.gpu.now_ms = max(self.gpu.now_ms, self.stamp_ms)


@pytest.fixture
def gpu() -> FakeGpu:
    return FakeGpu()
