"""XID errors: NVML's event set plus the kernel log, judged against the XID catalog.

XIDs are events, not states, so this collector keeps a ledger (``XidLedger``) of what each GPU
reported: ``collect`` feeds it (new events, GPU resets it can see) and puts a snapshot of the active
entries in the observations; ``evaluate`` turns that snapshot into findings without any I/O.

- An XID stays a finding until that GPU is seen reset (the usual remedy) or ``retention_s`` passes
  (application XIDs: ``app_retention_s``).
- The same XID again on the same GPU *after a reset* escalates: the first remedy did not help, so
  the severity becomes critical and the action the catalog's ``repeat_action`` (RMA, drain…).
- A reset is seen when the GPU answers again after GPU_IS_LOST/RESET_REQUIRED, when it comes back
  into the enumeration, when its volatile ECC counters go back down (they clear on reset), or when
  someone calls ``note_reset``.
- The same XID from NVML and from the kernel log within ``DEDUP_S`` counts once.
- The agent keeps the ledger in ``<agent.state_dir>/xid-ledger.json`` (``ctx.extras["state_dir"]``):
  a restarted agent still knows an XID it saw before (NVML does not re-deliver events) and which
  GPUs were reset since (re-reading the kernel log after a restart must not bring back XIDs a reset
  already cleared). ``gpuhealth status`` reads it too, read-only, for the same reason. A reboot (a new
  ``boot_id``) counts as a reset of every GPU. Occurrences are counted once per source even when the
  kernel log is read again (``seen_until``).
- An XID whose PCI address is none of this view's GPUs, where this view does not hold every GPU on the
  bus (GPUs outside it — another container's, a Slurm job's device cgroup, vfio — or the address is a
  bus GPU NVML does not list), is ``xid.outside_view`` (info) naming the address: the host's kernel log
  speaks of GPUs this agent does not watch, and their owner's agent judges them. Where every GPU on the
  bus is this view's, an unmatched address keeps the catalog's action (a node finding).
- NVML events are read on a thread of their own (``wait_xid_events``) when ``event_thread`` is on,
  else polled without waiting at each ``collect``. ``gpuhealth status`` (``ctx.extras["one_shot"]``)
  never starts the thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.backends.base import NvmlBackend, XidEvent
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.kmsg import (
    KmsgUnavailable,
    SxidEvent,
    boot_time,
    is_kernel_record,
    sxid_events,
    xid_events,
)
from gpuhealth.catalog.thresholds import default_thresholds, thresholds_from
from gpuhealth.catalog.xid import XidInfo, xid_info
from gpuhealth.catalog.xid_nvlink import NVLINK_XIDS, decode_nvlink
from gpuhealth.catalog.xid_policy import XidPolicy
from gpuhealth.collectors.base import CollectContext, CollectError, History, Lane, Observations
from gpuhealth.collectors.presence import PciView, pci_view
from gpuhealth.model import COULD_NOT_CHECK, Action, Entity, EntityKind, Finding, MetricKind, Sample, Severity

DEDUP_S = 10.0  # NVML event and kernel-log line of one XID arrive within this of each other
# Kernel-log times are boot time + offset, and "boot time" is recomputed per read: the same line read
# again may come out a little later. Within this of the newest counted one it is the same occurrence.
SAME_OCCURRENCE_S = 0.05
LEDGER_FILE = "xid-ledger.json"
LEDGER_VERSION = 1
_RESET_COUNTERS = ("TotalEccErrors_CORRECTED_VOLATILE", "TotalEccErrors_UNCORRECTED_VOLATILE")
_MAX_EVENTS_PER_POLL = 256
RECENT_KEPT = 64  # occurrence times kept per (GPU, XID): enough for any count-in-window rule
VIEW_RESCAN_S = 60.0  # the PCI walk behind an unmatched address is redone at most this often (as presence's)
SXID_RETENTION_S = 86400.0
# Why /dev/kmsg could not be read, by errno: the remedy differs (a permission, or a device not there at all).
_KMSG_WHY = {errno.EACCES: " (needs root or CAP_SYSLOG where kernel.dmesg_restrict=1)",
             errno.EPERM: " (needs root or CAP_SYSLOG where kernel.dmesg_restrict=1)",
             errno.ENOENT: " (no such device here: a container without /dev/kmsg mounted?)"}


@dataclass(slots=True)
class XidEntry:
    """What one GPU (by UUID, or ``pci:<addr>`` when no GPU matched) reported for one XID code."""

    gpu_key: str
    gpu_index: int | None
    xid: int
    first_seen: float
    last_seen: float
    count: int = 1
    sources: set[str] = field(default_factory=set)
    pci: str = ""
    detail: str = ""
    raw: str = ""  # the kernel log line behind ``detail`` (empty when only NVML reported it)
    active: bool = True
    cleared_by_reset_at: float | None = None
    # A reset inferred across a gap (counters found lower than when last seen) happened at some time up to
    # this one: a recurrence logged in the gap is active again, not known to have survived the reset.
    reset_uncertain_until: float | None = None
    repeats_after_reset: int = 0
    # Counted occurrences per source not yet matched by the other channel's copy (NVML event vs
    # kernel log): each occurrence pairs once, so the N-th XID is not counted twice either.
    unpaired: dict[str, list[float]] = field(default_factory=dict)
    # The newest occurrence counted per source: an event of that source at or before it is a copy
    # (the kernel log read again after an agent restart), not a new occurrence.
    seen_until: dict[str, float] = field(default_factory=dict)
    # When the latest occurrences happened (newest last, at most RECENT_KEPT): count-in-window escalation.
    recent: list[float] = field(default_factory=list)

    def occurred(self, at: float) -> None:
        self.recent.append(at)
        del self.recent[:-RECENT_KEPT]

    def pair(self, source: str, at: float) -> bool:
        """True when this event is the other channel's copy of an occurrence already counted."""
        for other, times in self.unpaired.items():
            if other == source:
                continue
            for t in times:
                if abs(at - t) <= DEDUP_S:
                    times.remove(t)
                    return True
        return False

    def remember(self, source: str, at: float) -> None:
        times = self.unpaired.setdefault(source, [])
        times[:] = [t for t in times if at - t <= DEDUP_S]  # older ones can no longer pair
        times.append(at)

    def already_counted(self, event: XidEvent) -> bool:
        # Only a kernel log is ever read twice (a restarted agent reads it from the start). /dev/kmsg
        # records carry a sequence number and are filtered by it before they get here (the collector's
        # cursor); this time test is for logs without one. NVML delivers each event once.
        return (event.source == "kmsg" and event.seq is None
                and event.timestamp <= self.seen_until.get(event.source, float("-inf")) + SAME_OCCURRENCE_S)

    def saw(self, source: str, at: float) -> None:
        self.seen_until[source] = max(at, self.seen_until.get(source, float("-inf")))

    def to_state(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "sources": sorted(self.sources)}

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> XidEntry:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["sources"] = set(kwargs.get("sources", ()))
        return cls(**kwargs)

    def snapshot(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu_key, "gpu_index": self.gpu_index, "xid": self.xid,
            "first_seen": self.first_seen, "last_seen": self.last_seen, "count": self.count,
            "sources": sorted(self.sources), "pci": self.pci, "detail": self.detail, "raw": self.raw,
            "repeats_after_reset": self.repeats_after_reset, "recent": list(self.recent),
        }


def _keep_text(entry: XidEntry, event: XidEvent) -> bool:
    """Keep the newest message (True when the entry changed), except that an NVLink XID (144-150) keeps its
    worst one: a fatal RLW error on one link is not undone by a harmless one on another."""
    if not event.detail or (event.detail == entry.detail and (event.raw or entry.raw) == entry.raw):
        return False
    if entry.detail and entry.xid in NVLINK_XIDS and _nvlink_rank(event.detail, entry.xid) < _nvlink_rank(
            entry.detail, entry.xid):
        return False
    entry.detail, entry.raw = event.detail, event.raw or entry.raw
    return True


def _nvlink_rank(detail: str, xid: int) -> tuple[int, int]:
    decoded = decode_nvlink(xid, detail)
    judged = decoded.judgement() if decoded is not None else None
    if judged is None:  # undocumented: the catalog's judgement, as severe as the code gets
        info = xid_info(xid)
        return int(info.severity), int(info.action)
    return int(judged[0]), int(judged[1])


class XidLedger:
    """Bookkeeping of XID occurrences and GPU resets, with explicit times (testable without clocks)."""

    def __init__(self, retention_s: float = 86400.0, app_retention_s: float = 3600.0) -> None:
        self.retention_s = retention_s
        self.app_retention_s = app_retention_s
        self._entries: dict[tuple[str, int], XidEntry] = {}
        self.resets: dict[str, float] = {}
        self.changes = 0  # bumped on every change: the owner saves when it moved

    def add(self, event: XidEvent, gpu_key: str) -> XidEntry:
        key = (gpu_key, event.xid)
        entry = self._entries.get(key)
        self.changes += 1
        if entry is None:
            entry = XidEntry(gpu_key=gpu_key, gpu_index=event.gpu_index, xid=event.xid,
                             first_seen=event.timestamp, last_seen=event.timestamp, sources={event.source},
                             pci=event.pci_bus_id, detail=event.detail, raw=event.raw)
            self._entries[key] = entry
            entry.remember(event.source, event.timestamp)
            entry.saw(event.source, event.timestamp)
            entry.occurred(event.timestamp)
            return entry
        if entry.already_counted(event):  # not counted again; its text may still be the one to keep
            if not _keep_text(entry, event):
                self.changes -= 1
            return entry
        entry.saw(event.source, event.timestamp)
        if entry.active and entry.pair(event.source, event.timestamp):
            entry.sources.add(event.source)  # the same XID seen through the other channel
            _keep_text(entry, event)
            return entry
        if not entry.active and entry.cleared_by_reset_at is not None:
            if event.timestamp <= entry.cleared_by_reset_at:
                return entry  # a late copy of an occurrence from before the reset
            uncertain = entry.reset_uncertain_until
            if uncertain is None or event.timestamp > uncertain:
                entry.repeats_after_reset += 1  # the reset did not cure it
        if not entry.active:
            entry.first_seen = event.timestamp
        entry.active = True
        entry.count += 1
        entry.occurred(event.timestamp)
        entry.remember(event.source, event.timestamp)
        entry.last_seen = max(entry.last_seen, event.timestamp)
        entry.sources.add(event.source)
        entry.gpu_index = event.gpu_index if event.gpu_index is not None else entry.gpu_index
        entry.pci = event.pci_bus_id or entry.pci
        _keep_text(entry, event)
        return entry

    def note_reset(self, gpu_key: str, at: float, uncertain_until: float | None = None) -> None:
        """The GPU was reset at ``at`` (or at some time from ``at`` up to ``uncertain_until``): its XIDs seen
        before ``at`` are resolved (but remembered)."""
        self.resets[gpu_key] = at
        self.changes += 1
        for entry in self._entries.values():
            if entry.gpu_key == gpu_key and entry.active and entry.last_seen <= at:
                entry.active = False
                entry.cleared_by_reset_at = at
                entry.reset_uncertain_until = uncertain_until

    def note_reboot(self, at: float) -> None:
        """The node booted (at ``at``, by this boot's clock): every GPU was reset. Unconditional — the
        old boot's timestamps need not compare with this boot's clock — and any recurrence of an XID
        counts as having survived the reset (``cleared_by_reset_at`` 0)."""
        self.changes += 1
        for entry in self._entries.values():
            self.resets[entry.gpu_key] = at
            if entry.active:
                entry.active = False
                entry.cleared_by_reset_at = 0.0
            entry.seen_until.clear()
            entry.unpaired.clear()

    def expire(self, now: float, is_application: Callable[[int], bool]) -> None:
        for entry in self._entries.values():
            keep = self.app_retention_s if is_application(entry.xid) else self.retention_s
            if entry.active and now - entry.last_seen > keep:
                entry.active = False
                self.changes += 1

    def active(self) -> list[XidEntry]:
        return [e for e in self._entries.values() if e.active]

    def counts(self) -> dict[tuple[str, int], int]:
        return {k: e.count for k, e in self._entries.items()}

    def to_state(self, boot_id: str, booted_at: float | None = None) -> dict[str, Any]:
        return {"version": LEDGER_VERSION, "boot_id": boot_id, "booted_at": booted_at, "resets": dict(self.resets),
                "entries": [e.to_state() for e in self._entries.values()]}

    def load_state(self, doc: Mapping[str, Any], boot_id: str, booted_at: float) -> bool:
        """Replace the ledger with a saved one; ValueError when it is not one of ours. Returns whether
        it was saved in this boot (False: the node rebooted since, and every GPU counts as reset). The
        boot is known by its id, else (no id readable) by its boot time."""
        if not isinstance(doc, Mapping) or doc.get("version") != LEDGER_VERSION:
            raise ValueError(f"not an XID ledger of version {LEDGER_VERSION}")
        try:
            entries = [XidEntry.from_state(d) for d in doc.get("entries", [])]
            resets = {str(k): float(v) for k, v in dict(doc.get("resets", {})).items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed XID ledger: {exc}") from exc
        self._entries = {(e.gpu_key, e.xid): e for e in entries}
        self.resets = resets
        if boot_id:
            same = doc.get("boot_id") == boot_id
        else:  # no boot id (unreadable /proc): the boot time must match, within a minute of clock drift
            saved = doc.get("booted_at")
            same = isinstance(saved, int | float) and abs(float(saved) - booted_at) < 60.0
        if not same:
            self.note_reboot(booted_at)
        return same


# How long one ``wait_xid_events`` call may block. An event ends the wait at once, so this is no detection delay:
# only how often an idle pump wakes (every wake-up is CPU on every node, all day: 2 a second at 500 ms) and how
# long stopping it can take (the agent waits this long before NVML is shut down: ``daemon.EVENT_WAIT_DRAIN_S``).
EVENT_WAIT_MS = 2000


class _EventPump:
    """Blocks in ``wait_xid_events`` on its own thread and queues what arrives."""

    def __init__(self, backend: NvmlBackend, on_event: Callable[[XidEvent], None] | None) -> None:
        self._backend = backend
        self._on_event = on_event
        self._lock = threading.Lock()
        self._queue: list[XidEvent] = []
        self._stop = threading.Event()
        self.error: str | None = None
        self.unsupported = False
        self._thread = threading.Thread(target=self._loop, name="gpuhealth-xid-events", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def drain(self) -> list[XidEvent]:
        with self._lock:
            out, self._queue = self._queue, []
        return out

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._backend.wait_xid_events(EVENT_WAIT_MS)
                self.error = None
            except NvmlError as exc:
                if exc.not_supported:
                    self.unsupported = True
                    return
                self.error = exc.message
                self._stop.wait(5.0)  # driver gone or re-initialising: try again later
                continue
            except Exception as exc:  # never let the thread die silently in a loop
                self.error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(5.0)
                continue
            if events:
                with self._lock:
                    self._queue.extend(events)
                for ev in events:
                    if self._on_event is not None:
                        try:
                            self._on_event(ev)
                        except Exception:  # a listener's bug must not stop XID collection
                            pass


_RECOVERY = re.compile(r"to 0x[0-9a-fA-F]+ \((?P<to>[^)]*)\)")


def recovery_action(detail: str) -> Action | None:
    """XID 154 names the action the driver now needs ("… to 0x1 (GPU Reset Required)")."""
    m = _RECOVERY.search(detail)
    target = (m.group("to") if m else detail).lower()
    if "reboot" in target:
        return Action.REBOOT
    if "drain" in target:
        return Action.DRAIN
    if "reset" in target:
        return Action.RESET_GPU
    if "none" in target:
        return Action.NONE
    return None


def policy_info(info: XidInfo, policy: XidPolicy) -> XidInfo:
    """The catalog entry with the policy's overrides for its code (severity, action, repeat_action)."""
    rule = policy.rule(info.code)
    return dataclasses.replace(
        info,
        severity=rule.severity if rule.severity is not None else info.severity,
        action=rule.action if rule.action is not None else info.action,
        repeat_action=rule.repeat_action if rule.repeat_action is not None else info.repeat_action,
    )


def in_window(entry: Mapping[str, Any], window_s: float) -> int:
    """Occurrences of an entry within ``window_s`` before its latest one."""
    times = [t for t in entry.get("recent") or () if isinstance(t, (int, float))]
    if not times:
        return int(entry.get("count", 1))
    newest = max(times)
    return sum(1 for t in times if newest - t <= window_s)


def judge(entry: Mapping[str, Any], info: XidInfo, policy: XidPolicy | None = None) -> tuple[Severity, Action, str]:
    """Severity, action and why it escalated ("" when it did not), for one active ledger entry.
    ``info`` is the catalog entry with the policy's overrides already applied (``policy_info``)."""
    severity, action = info.severity, info.action
    rule = (policy or default_thresholds().xid).rule(info.code)
    decoded = decode_nvlink(info.code, str(entry.get("detail", "")))
    judged = decoded.judgement() if decoded is not None else None
    if judged is not None and rule.severity is None and rule.action is None:  # a site's own rule wins
        severity, action = judged
        if judged == (Severity.INFO, Action.NONE):  # NVIDIA: ignore it, nothing to investigate: no escalation
            return severity, action, ""
    if info.code == 154:
        needed = recovery_action(str(entry.get("detail", "")))
        if needed is Action.NONE:
            severity, action = Severity.INFO, Action.NONE
        elif needed is not None:
            severity, action = Severity.CRITICAL, needed
    if entry.get("repeats_after_reset") and info.hardware:
        return Severity.CRITICAL, max(action, info.repeat_action), "after_reset"
    esc = (policy or default_thresholds().xid).escalation(info.code, info.hardware)
    if esc.count > 0 and in_window(entry, esc.window_s) >= esc.count:
        escalated_action = esc.action if esc.action is not None else info.repeat_action
        return max(severity, esc.severity), max(action, escalated_action), "count"
    return severity, action, ""


class XidCollector:
    name = "xid"
    lane = Lane.FAST

    def __init__(
        self,
        *,
        event_thread: bool = True,
        retention_s: float = 86400.0,
        app_retention_s: float = 3600.0,
        on_event: Callable[[XidEvent], None] | None = None,
    ) -> None:
        self.event_thread = event_thread
        self.on_event = on_event  # the agent may hook this to sweep at once on an XID
        self.ledger = XidLedger(retention_s, app_retention_s)
        self._pump: _EventPump | None = None
        self._pump_lock = threading.Lock()
        self._lock = threading.Lock()
        self._prev_counters: dict[str, dict[str, int]] = {}
        self._counters_seen_at: float | None = None  # when _prev_counters were last read (or saved, if loaded)
        self._gone: set[str] = set()
        self._seen_uuids: set[str] = set()
        self._state_path: Path | None = None
        self._read_only = False  # one-shot: the agent's ledger is read, never written
        self._saved_changes = -1
        self._saved_extra: Any = None
        self._kmsg_cursor: int | None = None  # newest /dev/kmsg record counted, this boot
        self._kmsg_lines = 0  # lines read from the kernel log so far, and how many read as kernel records
        self._kmsg_records = 0
        self._sxids: dict[tuple[str, int], dict[str, Any]] = {}  # (switch PCI, SXid) → what was seen
        self._new_sxids: list[SxidEvent] = []
        self._view: tuple[float, PciView] | None = None  # when read, and the bus as this view sees it

    # ------------------------------------------------------------------ protocol
    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(collector=self.name, time=ctx.now)
        with self._lock:
            self._load_once(ctx, obs)
            self._watch_resets(ctx, obs)
            events = self._nvml_events(ctx, obs) + self._kmsg_events(ctx, obs)
            by_index = {g.index: g.uuid for g in ctx.gpus}
            for ev in sorted(events, key=lambda e: e.timestamp):
                gpu_key = by_index.get(ev.gpu_index, "") if ev.gpu_index is not None else ""
                self.ledger.add(ev, gpu_key or f"pci:{ev.pci_bus_id or 'unknown'}")
            self.ledger.expire(ctx.now, lambda code: not xid_info(code).hardware)
            obs.node["events"] = [_event_dict(ev) for ev in events]
            obs.node["active"] = [e.snapshot() for e in self.ledger.active()]
            self._mark_not_watched(ctx, obs, obs.node["active"])
            obs.node["counts"] = [{"gpu": k[0], "xid": k[1], "count": c} for k, c in self.ledger.counts().items()]
            obs.node["sxids"] = self._note_sxids(ctx.now)
            self._save_if_changed(obs)
        return obs

    def _mark_not_watched(self, ctx: CollectContext, obs: Observations, active: list[dict[str, Any]]) -> None:
        """Say why an XID at an address of none of NVML's GPUs belongs to a GPU this agent does not watch
        (``not_watched``); the PCI bus is read only while there is such an XID."""
        unmatched = [e for e in active if str(e["gpu"]).startswith("pci:")]
        if not unmatched:
            return
        cached = self._view
        if cached is None or not 0 <= ctx.now - cached[0] < VIEW_RESCAN_S:
            try:
                cached = self._view = (ctx.now, pci_view(ctx))
            except OSError as exc:  # sysfs unreadable: nothing known, the catalog's action stands
                obs.errors.append(CollectError(None, "pci_view", None, f"cannot read the PCI bus: {exc}"))
                return
        nvml = {_address(g.pci_bus_id) for g in ctx.gpus if g.pci_bus_id}
        for entry in unmatched:
            why = _not_watched(_address(str(entry.get("pci") or "")), cached[1], nvml)
            if why:
                entry["not_watched"] = why

    # ------------------------------------------------------------------ persistence (agent only)
    def _load_once(self, ctx: CollectContext, obs: Observations) -> None:
        state_dir = ctx.extras.get("state_dir")
        if self._state_path is not None or not state_dir:
            return
        # ``gpuhealth status`` (one-shot: the Slurm check while the agent is down) reads the agent's ledger and
        # never writes it: the whole kernel log it re-reads must not bring back an XID a GPU reset cleared.
        self._read_only = bool(ctx.extras.get("one_shot"))
        self._state_path = Path(state_dir) / LEDGER_FILE
        try:
            doc = json.loads(self._state_path.read_text())
            saved_at = self._state_path.stat().st_mtime  # written whole by a rename: the time of its counters
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self._unreadable(obs, f"cannot read {self._state_path}: {exc}")
            return
        try:
            same_boot = self.ledger.load_state(doc, _boot_id(), boot_time())
        except ValueError as exc:
            self._unreadable(obs, f"{self._state_path}: {exc}; set aside")
            return
        if same_boot:  # the kernel log and the volatile ECC counters continue from where we were
            cursor = doc.get("kmsg_seq")
            self._kmsg_cursor = cursor if isinstance(cursor, int) and not isinstance(cursor, bool) else None
            baseline = doc.get("ecc_baseline")
            if isinstance(baseline, dict):
                self._prev_counters = {str(u): {str(k): int(v) for k, v in dict(c).items() if isinstance(v, int)}
                                       for u, c in baseline.items() if isinstance(c, dict)}
                self._counters_seen_at = saved_at

    def _unreadable(self, obs: Observations, why: str) -> None:
        if self._read_only:  # the agent's file, not this check's: the kernel log alone is judged, as with none
            obs.node["ledger"] = f"not used: {why}"
            return
        obs.errors.append(CollectError(None, "xid_ledger", None, why))
        self._set_aside()

    def _set_aside(self) -> None:
        """Keep an unreadable ledger for a human instead of overwriting it."""
        assert self._state_path is not None
        with contextlib.suppress(OSError):
            self._state_path.rename(self._state_path.with_suffix(f".unreadable-{int(time.time())}"))

    def _save_if_changed(self, obs: Observations) -> None:
        extra = (self._kmsg_cursor, self._prev_counters)
        if self._state_path is None or self._read_only or (
                self.ledger.changes == self._saved_changes and extra == self._saved_extra):
            return
        try:
            self._state_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".xid-ledger.", dir=self._state_path.parent)
            with os.fdopen(fd, "w") as fh:
                doc = self.ledger.to_state(_boot_id(), boot_time())
                doc.update(kmsg_seq=self._kmsg_cursor, ecc_baseline=self._prev_counters)
                json.dump(doc, fh)
                fh.flush()
                os.fsync(fh.fileno())  # a crash right after must not leave an empty ledger behind
            os.replace(tmp, self._state_path)
            with contextlib.suppress(OSError):
                dfd = os.open(self._state_path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            self._saved_changes = self.ledger.changes
            self._saved_extra = (self._kmsg_cursor, {u: dict(c) for u, c in self._prev_counters.items()})
        except OSError as exc:
            obs.errors.append(CollectError(None, "xid_ledger", None, f"cannot save {self._state_path}: {exc}"))
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        out: list[Finding] = []
        kmsg_state = str(obs.node.get("kmsg", ""))
        if kmsg_state.startswith("unavailable"):
            # Without the kernel log, XIDs from before this process started are invisible (NVML only
            # reports events that happen while it listens): say so, without changing health.
            code = obs.node.get("kmsg_errno")
            why = _KMSG_WHY.get(code, "") if isinstance(code, int) else ""
            out.append(Finding(
                code="kmsg.unavailable", severity=Severity.INFO, entity=Entity.node(ctx.node_name),
                message=f"kernel log {kmsg_state}: earlier XIDs are not visible{why}; NVML events still count",
                action=Action.NONE, evidence={"kmsg": kmsg_state}, source=self.name,
            ))
        elif kmsg_state.startswith(("unreadable", "unparsed")):
            # A log named to be read that gives no kernel record: the XIDs it holds are unknown, not absent.
            out.append(Finding(
                code="kmsg.unreadable", severity=Severity.WARNING, entity=Entity.node(ctx.node_name),
                message=f"kernel log {kmsg_state}: its XIDs could not be checked",
                action=Action.NONE, evidence={"kmsg": kmsg_state, COULD_NOT_CHECK: True}, source=self.name,
            ))
        policy = thresholds_from(ctx).xid
        for entry in obs.node.get("active", []):
            info = policy_info(xid_info(int(entry["xid"])), policy)
            if entry.get("not_watched"):
                out.append(_not_watched_finding(entry, info, ctx))
                continue
            severity, action, escalated = judge(entry, info, policy)
            if escalated == "count":
                esc = policy.escalation(info.code, info.hardware)
                escalated = f"{in_window(entry, esc.window_s)}× within {esc.window_s:g} s"
            decoded = decode_nvlink(info.code, str(entry.get("detail", "")))
            evidence = {
                "xid": info.code, "name": info.name, "count": entry["count"],
                "first_seen": entry["first_seen"], "last_seen": entry["last_seen"],
                "sources": entry["sources"], "pci": entry["pci"], "detail": entry["detail"],
                "raw": entry.get("raw") or None,
                "hardware": info.hardware, "repeats_after_reset": entry["repeats_after_reset"],
                "catalog_source": info.source, "escalated": escalated or None, "known": info.known,
                "mnemonic": info.mnemonic or None, "nvidia_resolution": info.resolution or None,
                "nvidia_investigatory": info.investigatory or None,
            }
            if decoded is not None:
                evidence["nvlink"] = decoded.evidence()
            out.append(Finding(
                code=f"xid.{info.code}",
                severity=severity,
                entity=_entity(entry, ctx),
                message=_message(entry, info, escalated, decoded.summary() if decoded is not None else ""),
                action=action,
                evidence=evidence,
                source=self.name,
            ))
        out.extend(_sxid_findings(obs.node.get("sxids", []), policy, ctx))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        index_of = {g.uuid: g.index for g in ctx.gpus}
        last: dict[int, tuple[float, int]] = {}
        for entry in obs.node.get("active", []):
            idx = index_of.get(entry["gpu"])
            if idx is not None and entry["last_seen"] >= last.get(idx, (-1.0, 0))[0]:
                last[idx] = (entry["last_seen"], int(entry["xid"]))
        for g in ctx.gpus:
            yield Sample("gpu_xid_last", float(last.get(g.index, (0.0, 0))[1]),
                         "Code of the most recent active XID on the GPU (0: none)", gpu=g.index)
        for row in obs.node.get("counts", []):
            idx = index_of.get(row["gpu"])
            if idx is not None:
                yield Sample("gpu_xid_errors", float(row["count"]), "XID errors seen since the agent started",
                             MetricKind.COUNTER, gpu=idx, labels=(("xid", str(row["xid"])),))

    # ------------------------------------------------------------------ extra API
    def note_reset(self, uuid: str, at: float | None = None) -> None:
        """Tell the collector a GPU was reset (e.g. after ``nvidia-smi -r`` run by the operator)."""
        with self._lock:
            self.ledger.note_reset(uuid, time.time() if at is None else at)

    def close(self) -> None:
        # Serialised with a collect that starts a pump: none is orphaned (a later collect starts a new
        # one, which the next close stops — the agent closes us around every NVML re-init).
        with self._pump_lock:
            pump, self._pump = self._pump, None
        if pump is not None:
            pump.stop()

    # ------------------------------------------------------------------ helpers
    def _nvml_events(self, ctx: CollectContext, obs: Observations) -> list[XidEvent]:
        if self.event_thread and not ctx.extras.get("one_shot"):
            with self._pump_lock:
                pump = self._pump
                if pump is None or (not pump.alive and not pump.unsupported):
                    pump = self._pump = _EventPump(ctx.backend, self.on_event)
            if pump.unsupported:
                obs.unsupported.add((None, "xid_events"))
            elif pump.error:
                obs.node["nvml_events_error"] = pump.error
            return pump.drain()
        out: list[XidEvent] = []
        try:
            for _ in range(_MAX_EVENTS_PER_POLL):
                got = ctx.backend.wait_xid_events(0)
                if not got:
                    break
                out.extend(got)
        except NvmlError as exc:
            obs.note_error(None, "xid_events", exc)
        return out

    def _kmsg_events(self, ctx: CollectContext, obs: Observations) -> list[XidEvent]:
        if ctx.kmsg is None:
            obs.node["kmsg"] = "none"
            return []
        named = bool(getattr(ctx.kmsg, "named", False))
        try:
            records = ctx.kmsg.read_new()
        except KmsgUnavailable as exc:
            if named:  # the log someone asked to be read: the XID check they asked for is not made
                obs.node["kmsg"] = f"unreadable: {exc.strerror or exc}"
                return []
            # /dev/kmsg absent or refused (a container, no CAP_SYSLOG): XIDs still come from NVML. Say so
            # once, as data, not a failure.
            obs.node["kmsg"] = f"unavailable: {exc.strerror or exc}"
            obs.node["kmsg_errno"] = exc.errno
            obs.unsupported.add((None, "kmsg"))
            return []
        obs.node["kmsg"] = getattr(ctx.kmsg, "description", "kmsg")
        self._kmsg_lines += len(records)
        self._kmsg_records += sum(1 for r in records if is_kernel_record(r))
        if named and not self._kmsg_records:  # random bytes, another file, an empty one: not a clean log
            obs.node["kmsg"] = (f"unparsed: {obs.node['kmsg']} holds {self._kmsg_lines} line(s), none of them a "
                                "kernel-log record" if self._kmsg_lines else f"unparsed: {obs.node['kmsg']} is empty")
        # SXids live only in this process (a switch has no reset to remember): every record of this boot
        # read, the first read after a restart or a one-shot's included, rebuilds them.
        self._new_sxids = sxid_events(records, now=ctx.now)
        if self._kmsg_cursor is not None:  # XIDs the ledger counted before an agent restart, this boot
            records = [r for r in records if r.seq is None or r.seq > self._kmsg_cursor]
        seqs = [r.seq for r in records if r.seq is not None]
        if seqs:
            self._kmsg_cursor = max(seqs + ([self._kmsg_cursor] if self._kmsg_cursor is not None else []))
        bus_ids = [(g.index, g.pci_bus_id) for g in ctx.gpus]
        return xid_events(records, bus_ids, now=ctx.now)

    def _note_sxids(self, now: float) -> list[dict[str, Any]]:
        """NVSwitch SXids seen in the kernel log, kept SXID_RETENTION_S after the last occurrence
        (a switch has no reset the agent can watch; a reboot starts a new kernel log)."""
        for ev in self._new_sxids:
            key = (ev.pci, ev.sxid)
            seen = self._sxids.get(key)
            if seen is None:
                self._sxids[key] = {"switch": ev.switch, "pci": ev.pci, "sxid": ev.sxid, "fatal": ev.fatal,
                                    "message": ev.message, "first_seen": ev.timestamp, "last_seen": ev.timestamp,
                                    "count": 1}
            else:
                seen.update(count=seen["count"] + 1, last_seen=max(seen["last_seen"], ev.timestamp),
                            fatal=seen["fatal"] or ev.fatal, message=ev.message or seen["message"])
        self._new_sxids = []
        for key in [k for k, v in self._sxids.items() if now - v["last_seen"] > SXID_RETENTION_S]:
            del self._sxids[key]
        return [dict(v) for v in self._sxids.values()]

    def _watch_resets(self, ctx: CollectContext, obs: Observations) -> None:
        present = set()
        for g in ctx.gpus:
            values: dict[str, int] = {}
            gone = False
            for key in _RESET_COUNTERS:
                try:
                    v = ctx.backend.query(g.index, key)
                except NvmlError as exc:
                    if exc.gpu_gone:
                        gone = True
                        break
                    continue  # unsupported / other: the ECC collector reports real failures
                if isinstance(v, int):
                    values[key] = v
            if gone:
                self._gone.add(g.uuid)
                obs.gpu(g.index)["gone"] = True
                continue
            present.add(g.uuid)
            prev = self._prev_counters.get(g.uuid, {})
            if any(values.get(k, 0) < prev[k] for k in prev if k in values):
                # Reset some time after the counters were last read (across an agent restart or a one-shot:
                # maybe long ago): what the log says since then is not known to predate the reset.
                since = self._counters_seen_at if self._counters_seen_at is not None else ctx.now
                self.ledger.note_reset(g.uuid, min(since, ctx.now), uncertain_until=ctx.now)
                obs.gpu(g.index)["reset_seen"] = True
            elif g.uuid in self._gone:  # answered "lost" or left the enumeration, and is back
                self.ledger.note_reset(g.uuid, ctx.now)
                obs.gpu(g.index)["reset_seen"] = True
            self._gone.discard(g.uuid)
            self._prev_counters[g.uuid] = values
            obs.gpu(g.index).update(values)
        # A GPU that left the enumeration and comes back later was re-initialised: count as reset.
        self._gone |= self._seen_uuids - present - {g.uuid for g in ctx.gpus}
        self._seen_uuids |= present
        self._counters_seen_at = ctx.now


def _event_dict(ev: XidEvent) -> dict[str, Any]:
    return {"gpu_index": ev.gpu_index, "xid": ev.xid, "time": ev.timestamp, "source": ev.source,
            "pci": ev.pci_bus_id, "detail": ev.detail}


def _address(bus_id: str) -> str:
    """NVML "00000000:B8:00.0", sysfs "0000:b8:00.0" or the kernel log's "0000:b8:00" → "0000:b8:00"."""
    parts = bus_id.strip().lower().rsplit(".", 1)[0].split(":")
    if len(parts) != 3:
        return bus_id.strip().lower()
    return f"{parts[0][-4:].zfill(4)}:{parts[1]}:{parts[2]}"


def _not_watched(address: str, view: PciView, nvml: set[str]) -> str | None:
    """Why the GPU at ``address`` is not this agent's to judge, or None where this view holds every GPU on
    the bus (or the bus could not be read): then an unmatched address keeps the catalog's action."""
    if view.in_view is None:
        return None
    for bdf, why in sorted(view.outside.items()):
        if _address(bdf) == address:
            return f"outside this view: {why}"
    if any(_address(bdf) == address and _address(bdf) not in nvml for bdf in view.in_view):
        return "on the PCI bus but not listed by NVML (gpu.missing judges it)"
    if view.outside:
        return f"no GPU of this view; {len(view.outside)} GPU(s) on the PCI bus are outside it"
    return None


def _not_watched_finding(entry: Mapping[str, Any], info: XidInfo, ctx: CollectContext) -> Finding:
    address = entry.get("pci") or "?"
    times = f" ({entry['count']}×)" if entry["count"] > 1 else ""
    return Finding(
        code="xid.outside_view", severity=Severity.INFO, entity=Entity(EntityKind.NODE, ctx.node_name),
        message=(f"XID {info.code}{times} at PCI {address}: {info.name} — it belongs to a GPU this agent does "
                 f"not watch ({entry['not_watched']}); not judged here"
                 + (f" [{entry['detail']}]" if entry.get("detail") else "")),
        action=Action.NONE,
        evidence={"xid": info.code, "name": info.name, "pci": address, "count": entry["count"],
                  "first_seen": entry["first_seen"], "last_seen": entry["last_seen"], "sources": entry["sources"],
                  "detail": entry["detail"], "raw": entry.get("raw") or None, "why": entry["not_watched"],
                  "catalog_action": str(info.action)},
        source="xid",
    )


def _entity(entry: Mapping[str, Any], ctx: CollectContext) -> Entity:
    key = str(entry["gpu"])
    if key.startswith("pci:"):
        return Entity(EntityKind.NODE, ctx.node_name)
    return Entity.gpu(key, entry.get("gpu_index"))


def _sxid_findings(sxids: Iterable[Mapping[str, Any]], policy: XidPolicy, ctx: CollectContext) -> list[Finding]:
    """``nvswitch.sxid`` per (switch, SXid): the driver's Fatal → critical/drain, Non-fatal →
    warning/monitor, unless the policy's ``sxid_codes`` rule for that SXid says otherwise."""
    out = []
    for sx in sxids:
        rule = policy.sxid_rule(int(sx["sxid"]))
        fatal = bool(sx["fatal"])
        severity = rule.severity if rule.severity is not None else (Severity.CRITICAL if fatal else Severity.WARNING)
        action = rule.action if rule.action is not None else (Action.DRAIN if fatal else Action.MONITOR)
        times = f" ({sx['count']}×)" if sx["count"] > 1 else ""
        out.append(Finding(
            code="nvswitch.sxid", severity=severity,
            entity=Entity(EntityKind.NODE, f"{ctx.node_name}/nvswitch/{sx['pci']}"),
            message=f"NVSwitch {sx['switch']} (PCI {sx['pci']}): {'fatal' if fatal else 'non-fatal'} SXid "
                    f"{sx['sxid']}{times}: {sx['message'] or 'see the kernel log'}",
            action=action,
            evidence={"sxid": sx["sxid"], "switch": sx["switch"], "pci": sx["pci"], "fatal": fatal,
                      "count": sx["count"], "first_seen": sx["first_seen"], "last_seen": sx["last_seen"]},
            source="xid",
        ))
    return out


def _message(entry: Mapping[str, Any], info: XidInfo, escalated: str, nvlink: str = "") -> str:
    where = f"GPU {entry['gpu_index']}" if entry.get("gpu_index") is not None else f"PCI {entry.get('pci') or '?'}"
    times = f" ({entry['count']}×)" if entry["count"] > 1 else ""
    text = f"XID {info.code} on {where}{times}: {info.name}"
    if not info.hardware:
        text += " — caused by the application, not the GPU"
    if nvlink:
        text += f"; {nvlink}"
    if escalated == "after_reset":
        text += f"; came back after a GPU reset ({entry['repeats_after_reset']}×): escalated"
    elif escalated:
        text += f"; {escalated}: escalated"
    if not info.known and entry.get("raw"):  # nothing to say about the code: the kernel's own words
        text += f" [kernel: {entry['raw']}]"
    elif entry.get("detail"):
        text += f" [{entry['detail']}]"
    return text


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def xid_message(code: int) -> str:
    """The catalog's name of an XID, for labels (dcgm-exporter's ``err_msg``); 0 means none."""
    return "No Error" if code == 0 else xid_info(code).name


def create() -> XidCollector:
    return XidCollector()


