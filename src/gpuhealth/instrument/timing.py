"""Step timers: split each step's wall time into compute and collective wait.

Two timers share one small interface (``StepTimer``):

- ``HostTimer`` reads ``time.perf_counter``: right on CPU/Gloo, where a collective blocks the
  calling thread for as long as it waits.
- ``LazyEventTimer`` records device events (CUDA events in practice) around the step and around
  each collective, and resolves them *later*, when ``query()`` says they are done: the training
  loop never waits for the GPU (no host sync per step). A step's numbers come out a few steps
  after it ran. Collective spans can also be NCCL's own timings (``WorkSpan``: ``Work.
  get_duration()`` with ``TORCH_NCCL_ENABLE_TIMING=1``), resolved the same lazy way.

Pure: no torch import. The event objects come from a factory given to the constructor, so tests
drive the lazy logic with a small fake at the hardware boundary.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


class StepTiming(NamedTuple):
    """What a timer knows about one finished step (the Tracker adds job id and rank). A tuple: it is
    made once per step on the training thread, where a frozen dataclass costs more."""

    step: int
    start_time: float  # wall clock (epoch seconds) when the step began on the host
    wall_s: float
    compute_s: float | None
    comm_wait_s: float | None


class StepTimer(Protocol):
    def begin_step(self, step: int, start_time: float) -> None: ...

    def begin_collective(self) -> None: ...

    def end_collective(self) -> None: ...

    def add_span(self, span: CommSpan) -> None: ...

    def end_step(self) -> None: ...

    def abort_step(self) -> None: ...

    def poll(self) -> list[StepTiming]: ...

    def flush(self, timeout_s: float) -> list[StepTiming]: ...

    @property
    def pending(self) -> int: ...


class TimingEvent(Protocol):
    """The part of ``torch.cuda.Event(enable_timing=True)`` the lazy timer uses."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds

    def synchronize(self) -> None: ...


class CommSpan(Protocol):
    """One collective's wait, known once ``ready()``."""

    def ready(self) -> bool: ...

    def seconds(self) -> float: ...

    def wait(self) -> None: ...


@dataclass(slots=True)
class EventSpan:
    """Wait between two events recorded on the compute stream just before and after a collective."""

    begin: TimingEvent
    end: TimingEvent

    def ready(self) -> bool:
        return self.end.query()

    def seconds(self) -> float:
        return self.begin.elapsed_time(self.end) / 1000.0

    def wait(self) -> None:
        self.end.synchronize()


@dataclass(slots=True)
class WorkSpan:
    """NCCL's own timing of one collective (``TORCH_NCCL_ENABLE_TIMING=1``): ``Work._get_duration()``
    (``get_duration`` in some builds) in ms, valid once ``Work.is_completed()``. Backends without
    timing raise; the timer then reports the step without a split."""

    work: Any

    def ready(self) -> bool:
        return bool(self.work.is_completed())

    def seconds(self) -> float:
        getter = getattr(self.work, "_get_duration", None) or self.work.get_duration
        ms = float(getter())
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"collective duration {ms} ms is not a time")
        return ms / 1000.0

    def wait(self) -> None:
        self.work.wait()


class FutureSpan:
    """Host clock from a collective's launch to the moment its future completes: for collectives
    the calling thread does not wait in (DDP's gradient all_reduce runs beside backward), on
    backends without NCCL's timing. ``HostTimer`` adds these to the step's collective wait."""

    __slots__ = ("_clock", "_future", "begin", "end")
    host_clock = True

    def __init__(self, future: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._future = future
        self.begin = clock()
        self.end: float | None = None
        future.add_done_callback(self._done)

    def _done(self, _future: Any) -> None:
        self.end = self._clock()

    def ready(self) -> bool:
        return self.end is not None

    def seconds(self) -> float:
        return 0.0 if self.end is None else max(0.0, self.end - self.begin)

    def wait(self) -> None:
        self._future.wait()


class HostTimer:
    """perf_counter timing: a collective's wait is the time the host spent inside it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._t0 = 0.0
        self._c0 = 0.0
        self._comm = 0.0
        self._step = -1
        self._start_time = 0.0
        self._done: list[StepTiming] = []
        self._spans: list[CommSpan] = []

    def begin_step(self, step: int, start_time: float) -> None:
        self._step = step
        self._start_time = start_time
        self._comm = 0.0
        self._spans = []
        self._t0 = self._clock()

    def begin_collective(self) -> None:
        self._c0 = self._clock()

    def end_collective(self) -> None:
        self._comm += self._clock() - self._c0

    def add_span(self, span: CommSpan) -> None:
        """Host-clock spans (``FutureSpan``: collectives nobody waits in on this thread) count at the
        end of the step; others are ignored: the time spent waiting in them is already counted."""
        if getattr(span, "host_clock", False):
            self._spans.append(span)

    def end_step(self) -> None:
        wall = self._clock() - self._t0
        comm = min(self._comm + sum(s.seconds() for s in self._spans if s.ready()), wall)
        self._spans = []
        self._done.append(StepTiming(self._step, self._start_time, wall, wall - comm, comm))

    def abort_step(self) -> None:
        self._comm = 0.0
        self._spans = []

    def poll(self) -> list[StepTiming]:
        if not self._done:
            return []
        out, self._done = self._done, []
        return out

    def flush(self, timeout_s: float) -> list[StepTiming]:
        return self.poll()

    @property
    def pending(self) -> int:
        return len(self._done)


@dataclass(slots=True)
class _PendingStep:
    step: int
    start_time: float
    start: TimingEvent
    end: TimingEvent | None = None
    spans: list[CommSpan] = field(default_factory=list)


class LazyEventTimer:
    """Records events, resolves them once done; never blocks the caller except in ``flush``.

    Steps are resolved in order: a step waits for the ones before it, so records keep their order.
    Events are pooled and reused after a step is resolved (creating CUDA events every step costs).
    More than ``max_pending`` unresolved steps (a GPU far behind, or stuck) drops the oldest ones,
    counted in ``dropped``, so memory stays bounded (4 small events per step).
    """

    def __init__(
        self,
        event_factory: Callable[[], TimingEvent],
        *,
        max_pending: int = 1024,
        stream_getter: Callable[[], Any] | None = None,
    ) -> None:
        self._new_event = event_factory
        # Asking torch for the current stream costs more than recording an event: ask once per step
        # and record the step's events on that stream.
        self._get_stream = stream_getter
        self._stream: Any = None
        self._pool: list[TimingEvent] = []
        self._pending: deque[_PendingStep] = deque()
        self._current: _PendingStep | None = None
        self._open_begin: TimingEvent | None = None
        self._max_pending = max_pending
        self.dropped = 0
        self.span_errors = 0  # collective spans whose timing could not be read
        self.invalid = 0  # steps whose events gave no usable wall time (not reported)

    def _event(self) -> TimingEvent:
        return self._pool.pop() if self._pool else self._new_event()

    def event(self) -> TimingEvent:
        """An event from this timer's pool, for a span handed back with ``add_span`` (it returns to
        the pool when the step is resolved, so events are not created every step)."""
        return self._event()

    def _release(self, p: _PendingStep) -> None:
        self._pool.append(p.start)
        if p.end is not None:
            self._pool.append(p.end)
        for span in p.spans:
            if isinstance(span, EventSpan):
                self._pool.extend((span.begin, span.end))

    def begin_step(self, step: int, start_time: float) -> None:
        if self._get_stream is not None:
            self._stream = self._get_stream()
        ev = self._event()
        ev.record(self._stream)
        self._current = _PendingStep(step, start_time, ev)

    def begin_collective(self) -> None:
        if self._current is None:
            return
        ev = self._event()
        ev.record(self._stream)
        self._open_begin = ev

    def end_collective(self) -> None:
        if self._current is None or self._open_begin is None:
            return
        ev = self._event()
        ev.record(self._stream)
        self._current.spans.append(EventSpan(self._open_begin, ev))
        self._open_begin = None

    def add_span(self, span: CommSpan) -> None:
        if self._current is not None:
            self._current.spans.append(span)

    def end_step(self) -> None:
        cur = self._current
        if cur is None:
            return
        ev = self._event()
        ev.record(self._stream)
        cur.end = ev
        self._current = None
        self._pending.append(cur)
        while len(self._pending) > self._max_pending:
            self._release(self._pending.popleft())
            self.dropped += 1

    def abort_step(self) -> None:
        if self._current is not None:
            # Events may still be in flight on the stream; do not reuse them, let them be freed.
            self._current = None
        self._open_begin = None

    @staticmethod
    def _ready(p: _PendingStep) -> bool:
        return p.end is not None and p.end.query() and all(s.ready() for s in p.spans)

    def _resolve(self, p: _PendingStep) -> StepTiming | None:
        assert p.end is not None
        try:
            wall = p.start.elapsed_time(p.end) / 1000.0
        except Exception:
            wall = math.nan
        if not math.isfinite(wall) or wall < 0:
            self.invalid += 1  # nothing trustworthy to report for this step
            return None
        try:
            comm = sum(s.seconds() for s in p.spans)
            if not math.isfinite(comm) or comm < 0:
                raise ValueError(f"collective wait {comm} s is not a time")
        except Exception:  # e.g. a Work without timing: keep the wall time, say the split is unknown
            self.span_errors += 1
            return StepTiming(p.step, p.start_time, wall, None, None)
        comm = min(comm, wall)
        return StepTiming(p.step, p.start_time, wall, wall - comm, comm)

    def poll(self) -> list[StepTiming]:
        out: list[StepTiming] = []
        while self._pending and self._ready(self._pending[0]):
            p = self._pending.popleft()
            timing = self._resolve(p)
            if timing is not None:
                out.append(timing)
            self._release(p)
        return out

    def flush(self, timeout_s: float) -> list[StepTiming]:
        """Resolve everything recorded so far, waiting for the device (used at close only)."""
        deadline = time.monotonic() + timeout_s
        out: list[StepTiming] = []
        while self._pending and time.monotonic() < deadline:
            head = self._pending[0]
            if not self._ready(head):
                assert head.end is not None
                head.end.synchronize()
                for s in head.spans:
                    s.wait()
            out.extend(self.poll())
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)
