"""Fleet screening (issue 18): what the coordinator keeps of the agents' screens, fleet coverage as a
number, and the rotation that hands out screening turns. Pure logic over plain data: the service feeds
it and persists it (``store``), the tests drive it with a clock of their own.

- ``screens_from_pb`` validates one record's ``ScreenResults`` (a bad screen rejects the record with a
  line naming the screen and the field).
- ``ScreenBook`` is the per-GPU memory: the last completed (pass or fail) screen, the last screen of
  any result, and when the coordinator first saw each GPU. ``coverage`` turns it into the numbers.
- ``Rotation`` decides which nodes hold a turn: never-screened and longest-unscreened nodes first, at
  most a share of the connected nodes at a time, each turn ``turn_s`` long, released early when the
  node reports every GPU screened. Every connected node always holds a turn — the current one, or its
  estimated slot in the future — because an agent with no valid turn keeps its own schedule.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import WireError, check_name

LEVELS = ("periodic", "quick", "standard", "full")
RESULTS = ("pass", "fail", "aborted", "error")
TRIGGERS = ("schedule", "epilog", "operator")
COMPLETED = frozenset({"pass", "fail"})  # a screen that judged the GPU: what coverage counts

MAX_SCREENS_PER_RECORD = 1_024  # a node's GPUs (MIG instances too) times the levels, with room to spare
MAX_DIGESTS_PER_SCREEN = 256
MAX_REASON_CHARS = 4_096  # "one line"; a traceback pasted whole is refused, not stored
MAX_FUTURE_S = 86_400.0  # a screen that finishes more than a day ahead of the coordinator's clock is garbage
MAX_GPU_INDEX = 4_096
EARLIEST = 946_684_800.0  # 2000-01-01: an agent time before it is a zero or a unit mistake


@dataclass(frozen=True, slots=True)
class Screen:
    """One GPU's screen as the coordinator keeps it. ``received_at`` is the coordinator's clock."""

    node: str
    gpu_uuid: str
    gpu_index: int | None
    started_at: float
    finished_at: float
    level: str
    result: str
    reason: str
    trigger: str
    digests: tuple[tuple[str, str], ...]  # (golden key, digest)
    received_at: float

    @property
    def completed(self) -> bool:
        return self.result in COMPLETED

    @property
    def screened_at(self) -> float:
        """When the GPU counts as screened: the agent's finish time, never later than its arrival (an
        agent clock running ahead must not make a GPU look freshly screened for a day)."""
        return min(self.finished_at, self.received_at)


def screens_from_pb(msg: pb.ScreenResults, node: str, received_at: float) -> list[Screen]:
    """Validated screens of one record; ``WireError`` naming the first bad screen and field."""
    count = len(msg.screens)
    if count == 0:
        raise WireError("screens: the record carries no screen")
    if count > MAX_SCREENS_PER_RECORD:
        raise WireError(f"screens: {count} screens in one record is over {MAX_SCREENS_PER_RECORD}")
    return [_screen(m, node, received_at, f"screens[{i}]") for i, m in enumerate(msg.screens)]


def _screen(m: pb.ScreenResult, node: str, received_at: float, where: str) -> Screen:
    uuid = check_name(m.gpu_uuid, f"{where}.gpu_uuid")
    if not -1 <= m.gpu_index <= MAX_GPU_INDEX:
        raise WireError(f"{where}.gpu_index: {m.gpu_index} is not -1 (unknown) or 0..{MAX_GPU_INDEX}")
    started = _time(m.started_at, f"{where}.started_at", received_at)
    finished = _time(m.finished_at, f"{where}.finished_at", received_at)
    if finished < started:
        raise WireError(f"{where}: finished_at {finished:.3f} is before started_at {started:.3f}")
    level = _choice(m.level, LEVELS, f"{where}.level")
    result = _choice(m.result, RESULTS, f"{where}.result")
    trigger = _choice(m.trigger or "schedule", TRIGGERS, f"{where}.trigger")  # empty: the agent's own schedule
    if len(m.reason) > MAX_REASON_CHARS:
        raise WireError(f"{where}.reason: {len(m.reason)} characters is over {MAX_REASON_CHARS} (one line)")
    if len(m.digests) > MAX_DIGESTS_PER_SCREEN:
        raise WireError(f"{where}.digests: {len(m.digests)} is over {MAX_DIGESTS_PER_SCREEN}")
    digests = []
    for j, d in enumerate(m.digests):
        if d.gpu_uuid and d.gpu_uuid != uuid:
            raise WireError(f"{where}.digests[{j}].gpu_uuid: {d.gpu_uuid[:60]!r} is not the screen's GPU {uuid!r}")
        digests.append((check_name(d.key, f"{where}.digests[{j}].key", 1024),
                        check_name(d.digest, f"{where}.digests[{j}].digest", 256)))
    reason = "".join(c if c >= " " or c == "\t" else " " for c in m.reason)  # one line, as the proto says
    return Screen(node, uuid, m.gpu_index if m.gpu_index >= 0 else None, started, finished, level, result,
                  reason, trigger, tuple(digests), received_at)


def _time(value: float, what: str, now: float) -> float:
    if not math.isfinite(value):
        raise WireError(f"{what}: {value} is not a time")
    if value < EARLIEST:
        raise WireError(f"{what}: {value} is not a time since the epoch (before 2000)")
    if value > now + MAX_FUTURE_S:
        raise WireError(f"{what}: {value:.0f} is more than a day ahead of the coordinator's clock ({now:.0f})")
    return float(value)


def _choice(value: str, allowed: Sequence[str], what: str) -> str:
    if value not in allowed:
        raise WireError(f"{what}: {value[:40]!r} is not one of {', '.join(allowed)}")
    return value


# ---------------------------------------------------------------------------------------- coverage

GpuKey = tuple[str, str]  # (node, gpu uuid): simulated nodes and CPU "devices" may share uuids


@dataclass(frozen=True, slots=True)
class KnownGpu:
    node: str
    uuid: str
    index: int | None


def known_gpus(node: str, gpus: Iterable[Mapping[str, object]]) -> list[KnownGpu]:
    """A node's registered GPUs (``GpuInfo`` as dicts) as coverage counts them; a GPU registered without
    a uuid is known by its index."""
    out = []
    for g in gpus:
        index = g.get("index")
        idx = index if isinstance(index, int) else None
        uuid = str(g.get("uuid") or (f"index:{idx}" if idx is not None else ""))
        if uuid:
            out.append(KnownGpu(node, uuid, idx))
    return out


@dataclass(slots=True)
class ScreenBook:
    """Per GPU: the last completed screen, the last screen of any result, and when it was first seen.
    Completed screens are kept per node (node -> uuid -> screen): the rotation asks per node."""

    completed: dict[str, dict[str, Screen]] = field(default_factory=dict)
    last: dict[GpuKey, Screen] = field(default_factory=dict)
    first_seen: dict[GpuKey, float] = field(default_factory=dict)

    def add(self, screen: Screen) -> None:
        key = (screen.node, screen.gpu_uuid)
        old = self.last.get(key)
        if old is None or screen.finished_at >= old.finished_at:
            self.last[key] = screen
        if screen.completed:
            node = self.completed.setdefault(screen.node, {})
            done = node.get(screen.gpu_uuid)
            if done is None or screen.screened_at >= done.screened_at:
                node[screen.gpu_uuid] = screen

    def last_completed(self, node: str, uuid: str) -> Screen | None:
        return self.completed.get(node, {}).get(uuid)

    def seen(self, gpu: KnownGpu, at: float) -> None:
        self.first_seen.setdefault((gpu.node, gpu.uuid), at)

    def node_screened_at(self, node: str, gpus: Sequence[KnownGpu]) -> float | None:
        """When the node's least recently screened GPU was screened (None: one was never screened). A
        node that registered no GPU: its newest completed screen of any device, if any."""
        done = self.completed.get(node, {})
        if not gpus:
            return max((s.screened_at for s in done.values()), default=None)
        oldest = math.inf
        for g in gpus:
            s = done.get(g.uuid)
            if s is None:
                return None
            oldest = min(oldest, s.screened_at)
        return oldest

    def all_reported_since(self, node: str, gpus: Sequence[KnownGpu], since: float) -> bool:
        """Has every GPU of the node reported a completed screen that arrived at or after ``since``?"""
        done = self.completed.get(node, {})
        if not gpus:
            return any(s.received_at >= since for s in done.values())
        return all((s := done.get(g.uuid)) is not None and s.received_at >= since for g in gpus)


@dataclass(frozen=True, slots=True)
class Coverage:
    gpus: int
    screened: int  # with a completed screen inside the window
    window_s: float
    oldest: KnownGpu | None  # the GPU screened longest ago (never-screened ones count from first seen)
    oldest_age_s: float
    oldest_screened_at: float | None  # None: never screened

    @property
    def unscreened(self) -> int:
        return self.gpus - self.screened

    @property
    def ratio(self) -> float:
        """Screened / known; 1 when no GPU is known (nothing is owed a screen)."""
        return self.screened / self.gpus if self.gpus else 1.0


def coverage(gpus: Iterable[KnownGpu], book: ScreenBook, now: float, window_s: float) -> Coverage:
    """Fleet coverage over ``gpus`` at ``now``: one pass, two dict lookups per GPU."""
    since = now - window_s
    total = screened = 0
    oldest: KnownGpu | None = None
    oldest_at = math.inf
    oldest_screened: float | None = None
    completed, first_seen = book.completed, book.first_seen
    empty: dict[str, Screen] = {}
    for g in gpus:
        total += 1
        done = completed.get(g.node, empty).get(g.uuid)
        if done is not None:
            at = done.screened_at
            if at >= since:
                screened += 1
            ever: float | None = at
        else:
            at = first_seen.get((g.node, g.uuid), now)
            ever = None
        # Ties go to the never-screened GPU, then to the first in order (the caller sorts by node).
        if at < oldest_at or (at == oldest_at and ever is None and oldest_screened is not None):
            oldest, oldest_at, oldest_screened = g, at, ever
    age = max(0.0, now - oldest_at) if oldest is not None else 0.0
    return Coverage(total, screened, window_s, oldest, age, oldest_screened)


# ---------------------------------------------------------------------------------------- rotation


@dataclass(frozen=True, slots=True)
class Turn:
    node: str
    started_at: float
    until: float


@dataclass(frozen=True, slots=True)
class Offer:
    """What to send a node: ``ScreenTurn{not_before, valid_for_s}``; ``not_before`` 0 means now (the
    agent's clock decides, so a skewed agent clock cannot shorten the window)."""

    not_before: float
    valid_for_s: float

    @property
    def now(self) -> bool:
        return self.not_before == 0.0


# How long before a future turn opens on the agent the coordinator re-sends a later one when the node
# was pushed back in the queue (covers clock skew between the two and the tick's delay).
RESEND_MARGIN_S = 300.0
# A turn ends this long before its window closes on the agent, so the node's next (future) turn
# replaces the current one before it lapses: an agent with a lapsed turn falls back to its own schedule.
HANDOVER_S = 1.0


class Rotation:
    """Who holds a screening turn. Deterministic: the same inputs give the same turns (ties by name)."""

    def __init__(self, turn_s: float, share: float) -> None:
        self.turn_s = turn_s
        self.share = share
        self.active: dict[str, Turn] = {}
        self.last_turn: dict[str, float] = {}  # start of each node's latest turn (a used one or not)
        self._sent_active: dict[str, float] = {}  # node -> until of the current turn we told it about
        self._sent_future: dict[str, float] = {}  # node -> not_before of the future turn we told it about
        self.estimates: dict[str, float] = {}  # the last plan's estimated start per queued node

    def slots(self, connected: int) -> int:
        """Turns held at once: ``share`` of the connected nodes, at least one."""
        return max(1, math.floor(self.share * connected + 1e-9))

    def restore(self, turns: Iterable[Turn], last_turn: Mapping[str, float]) -> None:
        """Continue after a restart (the store's turns)."""
        for t in turns:
            self.active[t.node] = t
        self.last_turn.update(last_turn)

    def release(self, node: str) -> Turn | None:
        """The node reported its screen: its turn ends now (another node may go)."""
        return self.active.pop(node, None)

    def forget(self, node: str) -> None:
        """A node gone past the retention: nothing of it is kept (node names churn on a large fleet)."""
        for d in (self.active, self.last_turn, self._sent_active, self._sent_future, self.estimates):
            d.pop(node, None)

    def forget_sent(self, node: str) -> None:
        """The node's stream is new: it must hear its turn again."""
        self._sent_active.pop(node, None)
        self._sent_future.pop(node, None)

    def plan(self, now: float, connected: Mapping[str, float | None]) -> dict[str, Offer]:
        """Expire and grant turns; the offers to send (connected nodes only). ``connected``: node ->
        when its least recently screened GPU was screened (None: never)."""
        for node, turn in list(self.active.items()):
            if now >= turn.until - HANDOVER_S:
                del self.active[node]
        k = self.slots(len(connected))
        queue = sorted((n for n in connected if n not in self.active), key=lambda n: (self._priority(n, connected), n))
        granted = 0
        while len(self.active) < k and granted < len(queue):
            node = queue[granted]
            self.active[node] = Turn(node, now, now + self.turn_s)
            self.last_turn[node] = now
            granted += 1
        waiting = queue[granted:]
        # Estimated starts: each of the k slots frees when its turn ends (turns end no later than that).
        untils = sorted(t.until - HANDOVER_S for t in self.active.values())
        free = untils[len(untils) - k:] if len(untils) >= k else untils + [now] * (k - len(untils))
        heapq.heapify(free)
        self.estimates = {}
        for node in waiting:
            start = max(heapq.heappop(free), now)
            self.estimates[node] = start
            heapq.heappush(free, start + self.turn_s - HANDOVER_S)
        offers: dict[str, Offer] = {}
        for node in connected:
            current = self.active.get(node)
            if current is not None:
                if self._sent_active.get(node) != current.until:
                    offers[node] = Offer(0.0, max(0.0, current.until - now))
                    self._sent_active[node] = current.until
                    self._sent_future.pop(node, None)
                continue
            start = self.estimates[node]
            told = self._sent_future.get(node)
            # Tell it when it has no future turn from us, or when the one it has opens soon although
            # the node was pushed back (else it would start outside its turn).
            if node in self._sent_active or told is None or (start > told and told < now + RESEND_MARGIN_S):
                offers[node] = Offer(start, self.turn_s)
                self._sent_future[node] = start
                self._sent_active.pop(node, None)
        return offers

    def _priority(self, node: str, connected: Mapping[str, float | None]) -> float:
        # Longest unscreened first; a node that held a turn recently (used or not) queues as if screened
        # then, so a node that stays busy cannot keep the slot from the others.
        screened = connected.get(node)
        return max(screened if screened is not None else -math.inf, self.last_turn.get(node, -math.inf))
