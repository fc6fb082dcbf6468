"""Step timers. The lazy CUDA-event logic is driven by a fake device at the hardware boundary (``gpu``
fixture, conftest.py): events stamp the time their stream reaches them, and report done only once the
fake GPU got that far."""

from __future__ import annotations

from typing import Any

import pytest

from gpuhealth.instrument.timing import EventSpan, HostTimer, LazyEventTimer, StepTiming, WorkSpan


def _step(timer: LazyEventTimer, gpu: Any, n: int, compute_ms: float, comm_ms: float) -> None:
    timer.begin_step(n, 1000.0 + n)
    gpu.launch(compute_ms)
    timer.begin_collective()
    gpu.launch(comm_ms)
    timer.end_collective()
    gpu.launch(1.0)  # optimizer
    timer.end_step()


def test_lazy_timer_never_syncs_and_resolves_only_finished_steps(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event)
    for n in range(3):
        _step(timer, gpu, n, compute_ms=10.0, comm_ms=4.0)
        assert timer.poll() == []  # the GPU has not run anything yet: nothing to report, no waiting
    assert timer.pending == 3 and gpu.syncs == 0
    gpu.run(15.0 + 15.0)  # two steps' worth (each 15 ms of GPU work)
    out = timer.poll()
    assert [t.step for t in out] == [0, 1]
    assert out[0] == StepTiming(0, 1000.0, 0.015, pytest.approx(0.011), pytest.approx(0.004))
    assert timer.pending == 1
    gpu.run(15.0)
    assert [t.step for t in timer.poll()] == [2]
    assert gpu.syncs == 0


def test_lazy_timer_in_order_even_if_a_later_event_looks_done(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event)
    _step(timer, gpu, 0, 5.0, 5.0)
    gpu.run(3.0)  # step 0 half done
    assert timer.poll() == []
    gpu.run(100.0)
    _step(timer, gpu, 1, 5.0, 5.0)
    gpu.run(100.0)
    assert [t.step for t in timer.poll()] == [0, 1]


def test_lazy_timer_reuses_events(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event)
    for n in range(1000):
        _step(timer, gpu, n, 1.0, 1.0)
        gpu.run(3.0)
        timer.poll()
    # 4 events a step; resolved steps give theirs back, so a handful serve a thousand steps.
    assert gpu.events_created <= 12


def test_lazy_timer_bounds_unresolved_steps(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event, max_pending=5)
    for n in range(12):  # the GPU never advances (stuck)
        _step(timer, gpu, n, 1.0, 1.0)
    assert timer.pending == 5 and timer.dropped == 7
    gpu.run(1e6)
    assert [t.step for t in timer.poll()] == [7, 8, 9, 10, 11]


def test_lazy_timer_flush_waits_for_the_device(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event)
    _step(timer, gpu, 0, 2.0, 3.0)
    _step(timer, gpu, 1, 2.0, 3.0)
    out = timer.flush(timeout_s=1.0)
    assert [t.step for t in out] == [0, 1] and gpu.syncs >= 1
    assert out[1].comm_wait_s == pytest.approx(0.003)


def test_lazy_timer_multiple_collectives_and_abort(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event)
    timer.begin_step(0, 0.0)
    for _ in range(3):
        gpu.launch(2.0)
        timer.begin_collective()
        gpu.launch(1.5)
        timer.end_collective()
    timer.end_step()
    timer.begin_step(1, 0.0)  # this one fails mid-way
    timer.begin_collective()
    timer.abort_step()
    timer.end_collective()  # a dangling end is harmless
    gpu.run(100.0)
    (t,) = timer.poll()
    assert t.wall_s == pytest.approx(0.0105) and t.comm_wait_s == pytest.approx(0.0045)
    assert t.compute_s == pytest.approx(0.006)


class FakeWork:
    def __init__(self, duration_ms: float | None) -> None:
        self.done = False
        self.duration_ms = duration_ms

    def is_completed(self) -> bool:
        return self.done

    def _get_duration(self) -> float:
        if self.duration_ms is None:
            raise RuntimeError("timing not enabled for this backend")
        return self.duration_ms

    def wait(self) -> bool:
        self.done = True
        return True


def test_work_spans_from_nccl_timing(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event)
    work = FakeWork(7.5)
    timer.begin_step(0, 0.0)
    gpu.launch(20.0)
    timer.add_span(WorkSpan(work))
    timer.end_step()
    gpu.run(50.0)
    assert timer.poll() == []  # the collective's Work is not complete yet
    work.done = True
    (t,) = timer.poll()
    assert t.comm_wait_s == pytest.approx(0.0075) and t.compute_s == pytest.approx(0.0125)


def test_work_span_without_timing_gives_wall_only(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event)
    timer.begin_step(0, 0.0)
    gpu.launch(4.0)
    timer.add_span(WorkSpan(FakeWork(None)))
    timer.end_step()
    gpu.run(10.0)
    for s in timer._pending[0].spans:
        s.wait()
    (t,) = timer.poll()
    assert t.wall_s == pytest.approx(0.004) and t.compute_s is None and t.comm_wait_s is None
    assert timer.span_errors == 1


def test_event_span_reads_elapsed_between_its_events(gpu: Any) -> None:
    a, b = gpu.event(), gpu.event()
    a.record()
    gpu.launch(6.0)
    b.record()
    span = EventSpan(a, b)
    assert not span.ready()
    span.wait()
    assert span.ready() and span.seconds() == pytest.approx(0.006)


def test_host_timer_splits_with_its_clock() -> None:
    now = [0.0]
    timer = HostTimer(clock=lambda: now[0])
    timer.begin_step(4, 123.0)
    now[0] += 0.3
    timer.begin_collective()
    now[0] += 0.1
    timer.end_collective()
    now[0] += 0.05
    timer.begin_collective()
    now[0] += 0.05
    timer.end_collective()
    timer.end_step()
    (t,) = timer.poll()
    assert t.step == 4 and t.start_time == 123.0
    assert t.wall_s == pytest.approx(0.5) and t.comm_wait_s == pytest.approx(0.15)
    assert t.compute_s == pytest.approx(0.35)
    assert timer.poll() == []


def test_lazy_timer_asks_for_the_stream_once_per_step(gpu: Any) -> None:
    asked: list[int] = []

    def current_stream() -> str:
        asked.append(1)
        return f"stream-{len(asked)}"

    made: list[Any] = []

    def factory() -> Any:
        ev = gpu.event()
        made.append(ev)
        return ev

    timer = LazyEventTimer(factory, stream_getter=current_stream)
    _step(timer, gpu, 0, 1.0, 1.0)
    assert len(asked) == 1
    assert [ev.stream for ev in made] == ["stream-1"] * 4  # every event of the step on that stream


def test_non_finite_durations_never_become_records(gpu: Any) -> None:
    timer = LazyEventTimer(gpu.event)
    nan_work = FakeWork(float("nan"))
    nan_work.done = True
    timer.begin_step(0, 0.0)
    gpu.launch(3.0)
    timer.add_span(WorkSpan(nan_work))
    timer.end_step()

    class BrokenEvent:
        def record(self, stream: object = None) -> None: ...
        def query(self) -> bool:
            return True
        def elapsed_time(self, end_event: object) -> float:
            raise RuntimeError("CUDA error: device not ready")
        def synchronize(self) -> None: ...

    gpu.run(10.0)
    (t,) = timer.poll()
    assert t.wall_s == pytest.approx(0.003) and t.comm_wait_s is None and timer.span_errors == 1
    broken = LazyEventTimer(BrokenEvent)
    broken.begin_step(0, 0.0)
    broken.end_step()
    assert broken.poll() == [] and broken.invalid == 1 and broken.pending == 0


def test_spans_made_from_the_timers_own_events_do_not_grow_its_pool(gpu: Any) -> None:
    # The DDP hook's span (two events around the wait for the last gradient bucket) comes from the
    # timer's pool and goes back to it: a thousand steps need a handful of events, not two thousand more.
    timer = LazyEventTimer(gpu.event)
    for n in range(1000):
        timer.begin_step(n, float(n))
        gpu.launch(1.0)
        begin, end = timer.event(), timer.event()
        begin.record()
        gpu.launch(0.5)  # the wait for the bucket
        end.record()
        timer.add_span(EventSpan(begin, end))
        timer.end_step()
        gpu.run(2.0)
        (t,) = timer.poll()
        assert t.comm_wait_s == pytest.approx(0.0005)
    assert gpu.events_created <= 12 and len(timer._pool) <= 12
