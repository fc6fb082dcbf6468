"""Runs jobs at their own intervals without ever waiting on one.

Each job belongs to a *pool*; a pool has one worker thread that runs its due jobs one after
another (the NVML backend is called from one thread at a time). The scheduler loop only looks at
clocks: it hands due jobs to their pool and watches deadlines. A job still running past its
deadline is declared hung (``on_hung``), its worker is abandoned (a fresh one takes over the
pool's queue) and the job is not started again until the stuck call returns. So a hung collector
costs one thread, never the agent, the other collectors or a scrape.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    name: str
    interval_s: float
    run: Callable[[], None]  # must not raise (the agent's job wrappers catch everything)
    timeout_s: float = 10.0
    pool: str = "backend"
    # A job may be held back (NVML down): due but not started; ``enabled`` is asked each tick.
    enabled: Callable[[], bool] = field(default=lambda: True)
    # scheduler state
    next_due: float = 0.0
    queued: bool = False  # handed to its pool, not finished yet
    running_since: float | None = None  # when its worker started it (the hang clock starts here)
    hung: bool = False


class _Worker(threading.Thread):
    def __init__(self, pool: str, jobs: queue.SimpleQueue[Job | None], scheduler: Scheduler, n: int) -> None:
        super().__init__(name=f"gpuhealth-{pool}-{n}", daemon=True)
        self.pool = pool
        self.jobs = jobs
        self.scheduler = scheduler
        self.current: Job | None = None
        self.abandoned = False

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None or self.abandoned:
                if job is not None:  # not ours to run any more: hand it back
                    self.jobs.put(job)
                return
            self.current = job
            self.scheduler._started(job)
            try:
                job.run()
            except Exception:  # a job wrapper bug must not kill the worker
                log.exception("job %s raised", job.name)
            finally:
                self.current = None
                self.scheduler._finished(job)
            if self.abandoned:
                return


class Scheduler:
    """Time-driven job runner. ``run_forever`` blocks until ``stop()``; everything else is quick."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = 1.0,
        on_hung: Callable[[Job, float], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        hang_grace_s: float = 1.0,
    ) -> None:
        self._clock = clock
        self._tick_s = tick_s
        self._on_hung = on_hung
        self._on_tick = on_tick
        self._hang_grace_s = hang_grace_s
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._queues: dict[str, queue.SimpleQueue[Job | None]] = {}
        self._workers: dict[str, _Worker] = {}
        self._worker_serial = 0
        self._stop = threading.Event()
        self._wake = threading.Event()

    # ------------------------------------------------------------------ jobs
    def add(self, job: Job) -> None:
        """Add or replace a job by name (a replaced job keeps its running state and due time)."""
        with self._lock:
            old = self._jobs.get(job.name)
            if old is not None:
                job.next_due = min(old.next_due, self._clock() + job.interval_s)
                job.queued, job.running_since, job.hung = old.queued, old.running_since, old.hung
            self._jobs[job.name] = job
        self._wake.set()

    def remove(self, name: str) -> None:
        with self._lock:
            self._jobs.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def run_soon(self, name: str) -> None:
        """Make a job due now (e.g. re-initialise NVML as soon as a collector saw the driver go)."""
        with self._lock:
            job = self._jobs.get(name)
            if job is not None:
                job.next_due = self._clock()
        self._wake.set()

    def delay(self, name: str, seconds: float) -> None:
        with self._lock:
            job = self._jobs.get(name)
            if job is not None:
                job.next_due = self._clock() + seconds
        self._wake.set()  # the loop may be sleeping towards a later deadline

    def is_running(self, name: str) -> bool:
        with self._lock:
            job = self._jobs.get(name)
            return job is not None and job.queued

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run_forever(self) -> None:
        """Sleep until the next job is due or a running one would pass its deadline (at most
        ``tick_s``, so ``on_tick`` runs at least that often); a finished job or ``run_soon`` wakes
        the loop early. An idle agent wakes about once a second, not in a polling loop."""
        while not self._stop.is_set():
            self.tick()
            self._wake.wait(self._sleep_for())
            self._wake.clear()
        for q in self._queues.values():
            q.put(None)

    def tick(self) -> None:
        """One pass: dispatch due jobs, declare hung ones. Never blocks on a job."""
        now = self._clock()
        hung: list[tuple[Job, float]] = []
        with self._lock:
            for job in self._jobs.values():
                if job.queued:
                    if job.running_since is not None and not job.hung:
                        elapsed = now - job.running_since
                        if elapsed > job.timeout_s + self._hang_grace_s:
                            job.hung = True
                            hung.append((job, elapsed))
                            self._replace_worker(job.pool)
                    continue
                if now < job.next_due or not job.enabled():
                    continue
                job.queued = True
                job.next_due = now + job.interval_s
                self._queue(job.pool).put(job)
                self._ensure_worker(job.pool)
        for job, elapsed in hung:
            log.warning("job %s hung for %.1f s; abandoned its worker", job.name, elapsed,
                        extra={"collector": job.name})
            if self._on_hung is not None:
                self._on_hung(job, elapsed)
        if self._on_tick is not None:
            self._on_tick()

    def _sleep_for(self) -> float:
        now = self._clock()
        soonest = now + self._tick_s
        with self._lock:
            for job in self._jobs.values():
                if job.queued:
                    if job.running_since is not None and not job.hung:
                        soonest = min(soonest, job.running_since + job.timeout_s + self._hang_grace_s)
                    if job.next_due > now:  # past due: its finish wakes the loop
                        soonest = min(soonest, job.next_due)
                elif job.enabled():  # a held-back job is woken by run_soon, not polled
                    soonest = min(soonest, job.next_due)
        return min(self._tick_s, max(0.005, soonest - now))

    # ------------------------------------------------------------------ internals (lock held)
    def _queue(self, pool: str) -> queue.SimpleQueue[Job | None]:
        q = self._queues.get(pool)
        if q is None:
            q = self._queues[pool] = queue.SimpleQueue()
        return q

    def _ensure_worker(self, pool: str) -> None:
        w = self._workers.get(pool)
        if w is None or not w.is_alive() or w.abandoned:
            self._worker_serial += 1
            w = _Worker(pool, self._queue(pool), self, self._worker_serial)
            self._workers[pool] = w
            w.start()

    def _replace_worker(self, pool: str) -> None:
        w = self._workers.get(pool)
        if w is not None:
            w.abandoned = True
        self._workers.pop(pool, None)
        self._ensure_worker(pool)

    def _started(self, job: Job) -> None:
        with self._lock:
            current = self._jobs.get(job.name)
            (current if current is not None else job).running_since = self._clock()

    def _finished(self, job: Job) -> None:
        with self._lock:
            current = self._jobs.get(job.name)
            target = current if current is not None else job
            target.queued = False
            target.running_since = None
            target.hung = False
            overran = self._clock() >= target.next_due
        if overran:  # due again already: dispatch now (else the loop wakes at its due time anyway)
            self._wake.set()


__all__ = ["Job", "Scheduler"]
