"""Small helpers the hardware collectors share: entities, batched field reads, counter deltas.

Kept private (``_shared``): the public contract is the collector protocol in ``base.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from gpuhealth.backends import errors
from gpuhealth.backends.environment import Environment, environment_for
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.sysfs import Sysfs, sysfs_for
from gpuhealth.collectors.base import CollectContext, History, Observations
from gpuhealth.model import Entity, EntityKind


def gpu_entity(ctx: CollectContext, index: int) -> Entity:
    g = ctx.gpu_by_index(index)
    return Entity.gpu(g.uuid if g is not None else f"gpu{index}", index)


def link_entity(ctx: CollectContext, index: int, kind: str, link: int | str) -> Entity:
    """A per-GPU link ("GPU-uuid/nvlink/3", "GPU-uuid/pcie")."""
    g = ctx.gpu_by_index(index)
    uuid = g.uuid if g is not None else f"gpu{index}"
    suffix = f"{kind}/{link}" if link != "" else kind
    return Entity(EntityKind.LINK, f"{uuid}/{suffix}", index)


def node_entity(ctx: CollectContext) -> Entity:
    return Entity.node(ctx.node_name)


def sysfs_of(ctx: CollectContext) -> Sysfs:
    """The context's sysfs, or the one matching its backend (recording → recorded sysfs)."""
    given: Sysfs | None = ctx.sysfs
    if given is not None:
        return given
    return sysfs_for(ctx.backend, ctx.config.collectors.sysfs_root)


def environment_of(ctx: CollectContext) -> Environment:
    """Where the readings come from (bare metal, VM guest, container; backends/environment.py): the
    context's, else the recording's for a replay, else this host's (read once per process)."""
    given: Environment | None = ctx.environment
    if given is not None:
        return given
    return environment_for(ctx.backend, ctx.config.collectors.sysfs_root)


def read_fields(
    ctx: CollectContext,
    obs: Observations,
    index: int,
    requests: Sequence[tuple[str, int]],
    failures: dict[tuple[str, int], NvmlError] | None = None,
) -> dict[tuple[str, int], Any]:
    """One batched ``field_values`` call; returns the values that came back. Per-field failures
    go to ``obs`` ("Not Supported" → unsupported, anything else → errors) keyed ``FIELD`` or
    ``FIELD@scope``, and to ``failures`` when given (a caller that can ask another way needs to know
    which fields the driver does not serve); a failure of the whole call is recorded once under
    ``field_values``."""
    if not requests:
        return {}
    try:
        results = ctx.backend.field_values(index, list(requests))
    except NvmlError as exc:
        obs.note_error(index, "field_values", exc)
        return {}
    out: dict[tuple[str, int], Any] = {}
    for (name, scope), res in zip(requests, results, strict=False):
        if isinstance(res, NvmlError):
            if failures is not None:
                failures[(name, scope)] = res
            key = name if scope == 0 else f"{name}@{scope}"
            if res.code == errors.INVALID_ARGUMENT:
                # Drivers answer INVALID_ARGUMENT per field for ids they don't serve (seen on 580 with
                # newer field ids): the field is unavailable here, not a failing GPU.
                obs.unsupported.add((index, key))
            else:
                obs.note_error(index, key, res)
        elif res is not None:
            out[(name, scope)] = res
    return out


def is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def earlier_reading(
    history: History,
    now: Observations,
    *,
    time_of: Callable[[Observations], Any] | None = None,
    window_s: float | None = None,
    latest: bool = False,
    has: Callable[[Observations], bool] | None = None,
) -> tuple[Observations, float] | None:
    """The earlier observation to compare ``now`` with, and the seconds between the two readings.

    The oldest one read within ``window_s`` (or the most recent, ``latest=True``) whose reading time
    (``time_of``, default the observation's time) is before now's and that ``has`` accepts."""
    t_now = now.time if time_of is None else time_of(now)
    if not is_number(t_now):
        return None
    items = list(history)
    best: tuple[Observations, float] | None = None
    if latest or window_s is not None:  # newest first: stop at the window's edge
        for past in reversed(items):
            t_past = past.time if time_of is None else time_of(past)
            if past is now or not is_number(t_past) or t_past >= t_now:
                continue
            if window_s is not None and t_now - t_past > window_s:
                break
            if has is not None and not has(past):
                continue
            best = (past, float(t_now - t_past))
            if latest:
                break
        return best
    for past in items:  # oldest first: the first usable one
        t_past = past.time if time_of is None else time_of(past)
        if past is now or not is_number(t_past) or t_past >= t_now:
            continue
        if has is None or has(past):
            return past, float(t_now - t_past)
    return None


def increase(cur: Any, prev: Any) -> float | None:
    """Growth of a counter from ``prev`` to ``cur``; one that went backwards (GPU reset, driver
    reload) counts from zero."""
    if not is_number(cur) or not is_number(prev):
        return None
    return float(cur - prev if cur >= prev else cur)


def counter_delta(
    history: History,
    now: Observations,
    get: Callable[[Observations], Any],
    window_s: float | None = None,
    time_of: Callable[[Observations], Any] | None = None,
    latest: bool = False,
) -> tuple[float, float] | None:
    """(increase, seconds) of a counter between the oldest usable earlier observation and ``now``.

    ``get`` pulls the counter out of an observation (None when absent); ``time_of`` the time it was
    read (default: the observation's time; see ``Periodic`` for readings carried between sweeps).
    Only readings within ``window_s`` count. A counter that went backwards (GPU reset, driver
    reload) counts from zero. ``latest`` compares with the most recent earlier reading instead of the
    oldest. None when there is no earlier reading."""
    cur = get(now)
    if not is_number(cur):
        return None
    found = earlier_reading(history, now, time_of=time_of, window_s=window_s, latest=latest,
                            has=lambda o: is_number(get(o)))
    if found is None:
        return None
    delta = increase(cur, get(found[0]))
    return None if delta is None else (delta, found[1])


class Periodic:
    """Readings too costly for every fast-lane sweep (a 3 ms energy counter, a 1.7 ms violation
    batch): read at most every ``interval_s`` per key, the last answer carried forward between
    reads together with the time it was read (so rates use read times, not sweep times).

    ``phase`` (0..1) delays a key's second read by that share of the interval, so GPUs of one node
    spread their costly reads over several sweeps instead of all paying in the same one."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, dict[str, Any]]] = {}
        self._due: dict[str, float] = {}

    def get(
        self, key: str, now: float, read: Callable[[], dict[str, Any]], phase: float = 0.0
    ) -> tuple[float, dict[str, Any]]:
        last = self._last.get(key)
        due = self._due.get(key)
        if last is None or due is None or now >= due or now < last[0]:
            first = last is None
            last = (now, read())
            self._last[key] = last
            self._due[key] = now + self.interval_s * (1.0 + (phase % 1.0 if first else 0.0))
        return last


def gpu_key(index: int, key: str) -> Callable[[Observations], Any]:
    """Accessor for ``counter_delta``: ``obs.per_gpu[index][key]``."""
    return lambda o: o.per_gpu.get(index, {}).get(key)


def fetch(ctx: CollectContext, obs: Observations, index: int, key: str) -> Any:
    """``backend.query`` that records a failure in ``obs`` and returns None, without storing."""
    try:
        return ctx.backend.query(index, key)
    except NvmlError as exc:
        obs.note_error(index, key, exc)
        return None
