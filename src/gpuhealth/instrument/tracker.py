"""``Tracker``: the few lines a training script adds.

    tracker = Tracker()
    for batch in loader:
        with tracker.step():
            loss = model(batch); loss.backward()
            with tracker.collective():          # or tracker.wrap_collectives() once
                dist.all_reduce(grad)
            opt.step()
    tracker.close()

Per step it measures wall time, compute and collective wait (``model.StepRecord``), and ships the
records from a background thread (``link.AgentLink``) that also answers the agent's flight-recorder
and stack requests (``control``). torch is imported only when the script already uses it.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from gpuhealth.instrument.control import handle_request
from gpuhealth.instrument.identity import identity_from_env
from gpuhealth.instrument.link import JSONL_ENV, AgentLink, default_socket_path
from gpuhealth.instrument.timing import (
    EventSpan,
    FutureSpan,
    HostTimer,
    LazyEventTimer,
    StepTimer,
    StepTiming,
    WorkSpan,
)
from gpuhealth.model import RankIdentity, StepRecord

# torch.distributed functions ``wrap_collectives`` patches by default.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "reduce", "gather", "scatter", "barrier", "send", "recv", "batch_isend_irecv",
)
# Those that take ``async_op`` and return a Work: NCCL's own timing can be read from that Work.
_ASYNC_CAPABLE = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier",
})
_WRAPPED_MARK = "__gpuhealth_original__"
_MAIN_THREAD_POLL_AT = 256  # unresolved device steps before the training thread resolves them itself


def _torch() -> Any:
    return sys.modules.get("torch")


def _cuda_usable() -> bool:
    torch = _torch()
    try:
        return torch is not None and bool(torch.cuda.is_available())
    except Exception:
        return False


class _StepContext:
    __slots__ = ("_tracker",)

    def __init__(self, tracker: Tracker) -> None:
        self._tracker = tracker

    def __enter__(self) -> _StepContext:
        self._tracker._begin_step()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._tracker._end_step(failed=et is not None)


class _CollectiveContext:
    __slots__ = ("_tracker",)

    def __init__(self, tracker: Tracker) -> None:
        self._tracker = tracker

    def __enter__(self) -> _CollectiveContext:
        t = self._tracker
        t._coll_depth += 1
        if t._coll_depth == 1 and t._in_step:
            t._timer.begin_collective()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        t = self._tracker
        t._coll_depth -= 1
        if t._coll_depth == 0 and t._in_step:
            t._timer.end_collective()


class Tracker:
    """Step timing and the agent link for one training process.

    ``path``: JSONL file for step records when no agent listens (default ``$GPUHEALTH_STEPS_JSONL``;
    ``{rank}`` in it becomes the rank). ``socket_path``: the agent's socket (default
    ``$GPUHEALTH_SOCKET`` or ``/run/gpuhealth/agent.sock``; ``""`` for none). ``timing``: "auto"
    (CUDA events when torch is loaded and CUDA is available, else host clock), "cuda" or "cpu".
    ``nccl_timing``: take wrapped collectives' wait from NCCL's own timing (``Work.get_duration``);
    None means when ``TORCH_NCCL_ENABLE_TIMING=1`` and CUDA timing is used. ``control``: answer
    the agent's dump/stack requests.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        socket_path: str | None = None,
        identity: RankIdentity | None = None,
        job_id: str | None = None,
        timing: str = "auto",
        nccl_timing: bool | None = None,
        flush_interval_s: float = 1.0,
        max_queue: int = 10_000,
        control: bool = True,
        timer: StepTimer | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        if timing not in ("auto", "cuda", "cpu"):
            raise ValueError(f"timing must be 'auto', 'cuda' or 'cpu', not {timing!r}")
        self.identity = identity or identity_from_env(env, job_id=job_id)
        use_cuda = timing == "cuda" or (timing == "auto" and timer is None and _cuda_usable())
        self.timing = "custom" if timer is not None else ("cuda" if use_cuda else "cpu")
        self._timer: StepTimer = timer or (self._cuda_timer() if use_cuda else HostTimer())
        # Host timings are final at once and cheap to collect: take them every step. Lazy device
        # timings are resolved by the link thread (every 0.1 s) so the training thread pays only
        # for recording events; it helps out only when that thread falls behind.
        self._poll_threshold = 1 if isinstance(self._timer, HostTimer) else _MAIN_THREAD_POLL_AT
        if nccl_timing is None:
            nccl_timing = use_cuda and env.get("TORCH_NCCL_ENABLE_TIMING") == "1"
        # On the host clock a collective's wait is already measured directly.
        self.nccl_timing = bool(nccl_timing) and not isinstance(self._timer, HostTimer)
        jsonl = str(path) if path is not None else (env.get(JSONL_ENV) or None)
        sock = default_socket_path(env) if socket_path is None else (socket_path or None)
        # Guards the timer between the training thread (end of step) and the link thread, which
        # resolves finished steps too: records keep coming while the training thread is stuck.
        self._timer_lock = threading.Lock()
        self._link = AgentLink(
            self.identity, socket_path=sock, jsonl_path=jsonl, handler=handle_request if control else None,
            flush_interval_s=flush_interval_s, max_queue=max_queue, on_tick=self._background_poll,
        )
        self._step_no = 0
        self._explicit_step: int | None = None
        self._in_step = False
        self._coll_depth = 0
        self._steps_failed = 0
        self._errors = 0
        self._step_ctx = _StepContext(self)
        self._coll_ctx = _CollectiveContext(self)
        self._wrapped: dict[str, Callable[..., Any]] = {}
        self._closed = False
        self._link.start()
        atexit.register(self.close)

    @staticmethod
    def _cuda_timer() -> LazyEventTimer:
        torch = _torch()
        if torch is None:
            import torch  # lazy: timing="cuda" was asked for explicitly

        return LazyEventTimer(lambda: torch.cuda.Event(enable_timing=True), stream_getter=torch.cuda.current_stream)

    # -- public API ---------------------------------------------------------------------------------

    def step(self, step: int | None = None) -> _StepContext:
        """Context manager around one training step; ``step`` overrides the running counter."""
        self._explicit_step = step
        return self._step_ctx

    def collective(self) -> _CollectiveContext:
        """Context manager around code that waits for a collective (nested ones count once)."""
        return self._coll_ctx

    def wrap_collectives(self, names: Iterable[str] = COLLECTIVES) -> list[str]:
        """Patch ``torch.distributed`` collectives so that each call inside a step counts as
        collective wait. Returns the names patched; ``close()`` (or ``unwrap_collectives``) undoes it.
        Async calls (``async_op=True``) count only their launch: time ``work.wait()`` with
        ``collective()`` yourself."""
        import torch.distributed as dist  # only when the script asks for it

        done: list[str] = []
        for name in names:
            original = getattr(dist, name, None)
            if original is None or name in self._wrapped or hasattr(original, _WRAPPED_MARK):
                continue
            setattr(dist, name, self._wrapper(name, original))
            self._wrapped[name] = original
            done.append(name)
        return done

    def ddp_comm_hook(self) -> Callable[[Any, Any], Any]:
        """A DistributedDataParallel communication hook that does what DDP does by default (average
        the gradient bucket with an all_reduce) and times it for the step record:

            model = DDP(model, ...)
            model.register_comm_hook(model.process_group, tracker.ddp_comm_hook())

        The hook's state is the process group it reduces over: pass DDP's own (``model.process_group``,
        the data-parallel group in a TP+DP job); ``None`` means the default group.

        DDP's all_reduce runs from C++ beside backward, where ``wrap_collectives`` cannot see it. The
        step's collective wait is the time this rank is held up for the others: from the end of its
        backward (the LAST bucket's launch, ``bucket.is_last()``) until that bucket is reduced, i.e.
        until the slowest rank's backward is done too. Under CUDA timing: two events on the compute
        stream around a stream-wait on the bucket (what the optimizer step would wait for anyway);
        on the host clock (Gloo/CPU): launch to completion of its future. Measured on 2 × H200, the
        sum of NCCL's per-bucket durations instead overstated a 1.45× straggler as 3.5×: the buckets
        that wait overlap the fast ranks' own backward.
        NCCL averages in the all_reduce itself (``ReduceOp.AVG``: no extra pass over the gradients);
        other backends divide first, as DDP's Python default hook does."""
        torch = _torch()
        if torch is None:
            import torch  # the hook is asked for by a DDP script: torch is there

        dist = torch.distributed
        all_reduce = getattr(dist.all_reduce, _WRAPPED_MARK, dist.all_reduce)  # never time it twice

        def hook(state: Any, bucket: Any) -> Any:
            tensor = bucket.buffer()
            # "cpu:gloo,cuda:nccl" backends: what runs this bucket depends on where it lives
            nccl = tensor.is_cuda and "nccl" in str(dist.get_backend(state))
            if nccl:
                work = all_reduce(tensor, op=dist.ReduceOp.AVG, group=state, async_op=True)
            else:
                tensor.div_(dist.get_world_size(state))
                work = all_reduce(tensor, group=state, async_op=True)
            future = work.get_future()
            if self._in_step and bucket.is_last():
                span: Any = None
                if isinstance(self._timer, LazyEventTimer) and tensor.is_cuda:
                    with self._timer_lock:
                        begin, end = self._timer.event(), self._timer.event()
                    begin.record()
                    work.wait()  # the compute stream waits for the reduced gradients (host does not block)
                    end.record()
                    span = EventSpan(begin, end)
                elif isinstance(self._timer, HostTimer) and not nccl:
                    span = FutureSpan(future)
                if span is not None:
                    with self._timer_lock:
                        self._timer.add_span(span)
            return future.then(lambda fut: fut.value()[0])

        # DDP checks the hook's annotations; this module's are strings (postponed evaluation).
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        return hook

    def unwrap_collectives(self) -> None:
        dist = getattr(_torch(), "distributed", None)
        for name, original in self._wrapped.items():
            current = getattr(dist, name, None)
            if current is not None and getattr(current, _WRAPPED_MARK, None) is original:
                setattr(dist, name, original)
        self._wrapped.clear()

    def close(self, timeout_s: float = 5.0) -> None:
        """Resolve pending timings, deliver what is queued, stop the background thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.unwrap_collectives()
        try:
            with self._timer_lock:
                for timing in self._timer.flush(timeout_s):
                    self._submit(timing)
        except Exception:
            self._errors += 1
        self._link.close(timeout_s)

    def stats(self) -> dict[str, Any]:
        out = self._link.stats.to_dict()
        out.update(
            steps=self._step_no, steps_failed=self._steps_failed, pending=self._timer.pending,
            unresolved_dropped=getattr(self._timer, "dropped", 0), hook_errors=self._errors,
            span_errors=self._span_errors(), invalid_steps=int(getattr(self._timer, "invalid", 0)),
            connected=self._link.connected, timing=self.timing, nccl_timing=self.nccl_timing,
        )
        return out

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------

    def _begin_step(self) -> None:
        if self._in_step:  # a nested step() is part of the outer one
            return
        if self._explicit_step is not None:
            self._step_no = self._explicit_step
            self._explicit_step = None
        self._in_step = True
        self._coll_depth = 0
        self._timer.begin_step(self._step_no, time.time())

    def _end_step(self, *, failed: bool) -> None:
        if not self._in_step:
            return
        self._in_step = False
        self._step_no += 1
        try:
            with self._timer_lock:
                if failed:  # an exception left the step: its timing would mislead
                    self._steps_failed += 1
                    self._timer.abort_step()
                else:
                    self._timer.end_step()
                if self._timer.pending >= self._poll_threshold:
                    self._collect()
        except Exception:  # the hook must never break the training loop
            self._errors += 1

    def _background_poll(self) -> None:
        """On the link thread: report steps whose events completed since the last step ended."""
        if self._closed or not self._timer_lock.acquire(blocking=False):
            return  # the training thread is at it right now; next tick
        try:
            self._collect()
        finally:
            self._timer_lock.release()

    def _collect(self) -> None:
        """Submit resolved timings (the caller holds the timer lock)."""
        for timing in self._timer.poll():
            self._submit(timing)
        if self.nccl_timing and self._span_errors() > 0:
            self.nccl_timing = False  # this backend gives no timing: bracket with events instead

    def _span_errors(self) -> int:
        return int(getattr(self._timer, "span_errors", 0))

    def _submit(self, t: StepTiming) -> None:
        ident = self.identity
        self._link.submit(StepRecord(ident.job_id, ident.rank, t.step, t.start_time, t.wall_s, t.compute_s,
                                     t.comm_wait_s, world_size=ident.world_size))

    def _wrapper(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        async_capable = name in _ASYNC_CAPABLE

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step or self._coll_depth:
                return original(*args, **kwargs)
            if self.nccl_timing and async_capable and not kwargs.get("async_op", False):
                kwargs["async_op"] = True
                self._coll_depth += 1
                try:
                    work = original(*args, **kwargs)
                finally:
                    self._coll_depth -= 1
                if work is not None:
                    self._timer.add_span(WorkSpan(work))
                    work.wait()
                return None
            with self._coll_ctx:
                return original(*args, **kwargs)

        setattr(wrapped, _WRAPPED_MARK, original)
        return wrapped
