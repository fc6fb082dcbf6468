"""NVLink: per-link state and error counters, and the NVSwitch fabric state.

Cost: the per-link getters cost ~1 ms per link per counter (18 links × 5 counters ≈ 90 ms per GPU,
docs/measurements.md). Everything per-link is read here in ONE ``field_values`` batch per GPU (scope =
link number), on the slow lane. Inside a batch the error counters cost ~0.9 ms per *link* (all
counters of a link come together), so 18 links would still be ~16 ms: every sweep reads all link
states (cheap) and the counters of four links in rotation (all links at the first look at a GPU);
each link's last counters are carried with the time they were read, so rates and findings stay
steady between its reads.

Link state: NVML's per-link state field (``NVML_FI_DEV_NVLINK_GET_STATE``) in the batch; where the
driver does not serve that field (INVALID_ARGUMENT, or "Not Supported" on a GPU that reports links),
the per-link ``nvmlDeviceGetNvLinkState`` instead (~1 ms a link, only on such drivers).

Down links: ``nvlink.link_down`` (critical, reboot; entity = that link) only for a link *read
inactive* that there is evidence should be up: this agent saw it active earlier, or the GPU has
other links active now (they train together: 17 of 18 up and one inactive is a fault). A link whose
state cannot be read is not called down. A GPU none of whose links has been active since the agent
started (a 1-GPU slice of an HGX board in a VM, whose links the host never trained; a PCIe card
without its bridge) is ``nvlink.untrained`` (info); one that reports links whose state nobody can read
is ``nvlink.state_unknown`` (info). A GPU whose every NVLink query answers "Not Supported" (a PCIe
card alone in a VM, like the H100 recording) has no NVLink: no finding.
``config.collectors.expected_nvlinks``, when set, is the operator's word that the links are there:
then each of those links not read active is down, and a GPU that reports none is too.

Errors: CRC (flit), replay and recovery counters as growth over the history window →
``nvlink.errors``, judged as DCGM's NVLink health watch does: any CRC growth → warning, CRC at
≥ 100/s → critical, any replay or recovery growth → critical (action ``drain``).

Fabric (``GpuFabricInfo``; GPUs on NVSwitch): registration finished with an error, or never
started, → ``fabric.degraded`` critical; still in progress → warning. NOT_SUPPORTED → nothing.

Fabric Manager: on a node whose GPUs have NVSwitch links (``NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT``
> 0) *and that owns the switches*, ``nv-fabricmanager`` must be running (``backends/fabricmanager.py``; a
recording says what the recorder saw). Not running → ``fabric.manager_down`` (critical, drain): the GPUs'
fabric state stays "completed" after the manager dies, so only this check sees it. The drain needs proof
that the manager belongs here and would be seen (``backends/environment.py``): NVSwitch PCI devices visible
to this host (bare metal, or a guest given the switches) and the host's PID namespace. Elsewhere — a VM
guest given only GPUs (the host runs the fabric), a container without ``hostPID``, a replay that does not
record its environment, ``/proc`` unreadable or hiding other users' processes (``hidepid``) — the manager
cannot be seen: ``fabric.manager_unobserved``
(info) says why, and the GPUs' own fabric state (above) is what is judged.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from gpuhealth.backends import errors
from gpuhealth.backends.base import NVLINK_MAX_LINKS
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.fabricmanager import RUNNING, STOPPED, fabric_manager_state
from gpuhealth.catalog.thresholds import NvlinkThresholds, thresholds_from
from gpuhealth.collectors._shared import (
    earlier_reading,
    environment_of,
    fetch,
    gpu_entity,
    gpu_key,
    increase,
    is_number,
    link_entity,
    read_fields,
)
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Entity, Finding, MetricKind, Sample, Severity

NAME = "nvlink"

LINK_COUNT_FIELD = "NVML_FI_DEV_NVLINK_LINK_COUNT"
NVSWITCH_LINKS_FIELD = "NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT"
STATE_FIELD = "NVML_FI_DEV_NVLINK_GET_STATE"
# counter label → per-link field (scope = link)
COUNTER_FIELDS = {
    "crc": "NVML_FI_DEV_NVLINK_ERROR_DL_CRC",
    "replay": "NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY",
    "recovery": "NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY",
}

# NVLink traffic since the driver loaded, in KiB (header + payload), summed over links: scope
# ALL_LINKS asks NVML for the sum (nvml.h: "a scopeId of UINT_MAX returns aggregate value").
THROUGHPUT_FIELDS = {"tx": "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX", "rx": "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX"}
ALL_LINKS = 0xFFFFFFFF

# Reading one link's error counters costs ~0.9-1.3 ms on H200 whatever the number of counters
# (measured: 18 links × 3 counters in one batch 16 ms, 18 links × 1 counter 15.8 ms; 6 links 4-8 ms
# on two hosts). Four links per sweep keep the slow lane under 10 ms per GPU; every link is read
# at least every fifth sweep (5 min at the default 60 s).
COUNTER_LINKS_PER_SWEEP = 4

# nvmlGpuFabricState_t
FABRIC_NOT_SUPPORTED, FABRIC_NOT_STARTED, FABRIC_IN_PROGRESS, FABRIC_COMPLETED = 0, 1, 2, 3
_FABRIC_STATE_NAMES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
# healthMask: bits 0-1 = degraded bandwidth (1 = true)
_HEALTH_DEGRADED_BW_TRUE = 1


def _manager_unseen_because(env: dict[str, Any], fm: str | None) -> str | None:
    """Why this host cannot judge the Fabric Manager, or None when it can (it owns the switches and sees the
    host's processes)."""
    switches = env.get("nvswitches_visible")
    if switches is None:
        return "it is unknown whether this host owns the NVSwitches (no recorded or readable PCI bus)"
    if switches == 0:
        if env.get("kind") in ("VM guest", "container in a VM guest"):
            return "no NVSwitch is visible to this VM guest: the host runs the fabric and its Fabric Manager"
        return "no NVSwitch is visible to this host: the switches and their Fabric Manager are elsewhere"
    if env.get("host_pid_namespace") is False:
        return "this container does not share the host's PID namespace, so the host's processes are invisible"
    if env.get("host_pid_namespace") is None:
        return "it is unknown whether /proc shows the host's processes"
    if fm is None:
        return ("/proc does not show this agent the host's other processes (mounted hidepid for an unprivileged "
                "agent, or unreadable)")
    return None


def _state_counts(obs: Observations, gpus: list[int]) -> str:
    counts: dict[str, int] = {}
    for i in gpus:
        rec = obs.per_gpu[i]
        state = _FABRIC_STATE_NAMES.get(int(rec["fabric_state"]), "?") if is_number(rec.get("fabric_state")) else "?"
        status = rec.get("fabric_status")
        text = state + ("/success" if status == 0 else f"/error {status}" if is_number(status) else "")
        counts[text] = counts.get(text, 0) + 1
    return ", ".join(f"{n} GPU(s) {text}" for text, n in sorted(counts.items()))


def _field_unserved(exc: NvmlError | None, rec: dict[str, Any]) -> bool:
    """The driver does not serve the state field, though the link may well answer the per-link
    getter: INVALID_ARGUMENT (field ids newer than the driver), or "Not Supported" from a GPU that
    reports NVLinks (a GPU without NVLink answers "Not Supported" to both: not worth the calls)."""
    if exc is None:
        return False
    return exc.code == errors.INVALID_ARGUMENT or (exc.not_supported and (rec.get("link_count") or 0) > 0)


def expected_links(rec: dict[str, Any], ctx: CollectContext) -> int | None:
    configured = ctx.config.collectors.expected_nvlinks
    if configured is not None:
        return int(configured)
    own = rec.get("link_count")
    return int(own) if is_number(own) else None


class NvlinkCollector:
    name = NAME
    lane = Lane.SLOW

    def __init__(self, counter_links_per_sweep: int | None = COUNTER_LINKS_PER_SWEEP) -> None:
        # None: every link's counters every sweep (tests of the judgement; small GPUs).
        self._chunk = counter_links_per_sweep
        self._caps: dict[str, dict[str, int]] = {}  # GPU UUID → link_count/nvswitch_links (static)
        self._cursor: dict[str, int] = {}  # GPU UUID → first link of the next counter chunk
        self._counters: dict[str, dict[int, tuple[float, dict[str, int]]]] = {}  # UUID → link → (read at, values)
        # UUID → links read active at some sweep of this process: the evidence that an inactive link should be up
        self._seen_active: dict[str, set[int]] = {}

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def _capabilities(self, ctx: CollectContext, obs: Observations, index: int, uuid: str) -> dict[str, int]:
        caps = self._caps.get(uuid)
        if caps is not None:
            return caps
        head = read_fields(ctx, obs, index, [(LINK_COUNT_FIELD, 0), (NVSWITCH_LINKS_FIELD, 0)])
        caps = {}
        for key, field in (("link_count", LINK_COUNT_FIELD), ("nvswitch_links", NVSWITCH_LINKS_FIELD)):
            v = head.get((field, 0))
            if is_number(v):
                caps[key] = int(v)
        if "link_count" in caps:  # cache only a real answer; "Not Supported" is cheap to ask again
            self._caps[uuid] = caps
        return caps

    def _counter_links(self, uuid: str, n: int) -> list[int]:
        if n <= 0:
            return []
        if self._chunk is None or self._chunk >= n or not self._counters.get(uuid):
            # First look at a GPU (and one-shot ``status``): every link, so metrics are complete and
            # every link has a baseline from the start; the rotation follows.
            return list(range(n))
        start = self._cursor.get(uuid, 0) % n
        self._cursor[uuid] = (start + self._chunk) % n
        return [(start + k) % n for k in range(self._chunk)]

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        obs.node["fabric_manager"] = self._fabric_manager(ctx)
        env = environment_of(ctx)
        obs.node["environment"] = {"kind": env.kind, "host_pid_namespace": env.host_pid_namespace,
                                   "nvswitches_visible": env.nvswitches_visible}
        for g in ctx.gpus:
            i = g.index
            rec = obs.gpu(i)
            rec.update(self._capabilities(ctx, obs, i, g.uuid))
            wanted = expected_links(rec, ctx)
            n = min(max(wanted or 0, 0), NVLINK_MAX_LINKS) if wanted is not None else NVLINK_MAX_LINKS
            chunk = self._counter_links(g.uuid, n)
            # One batch: every link's state (cheap) + the error counters of this sweep's links.
            requests: list[tuple[str, int]] = [(STATE_FIELD, link) for link in range(n)]
            for link in chunk:
                requests.extend((f, link) for f in COUNTER_FIELDS.values())
            if n:
                requests.extend((f, ALL_LINKS) for f in THROUGHPUT_FIELDS.values())
            failed: dict[tuple[str, int], NvmlError] = {}
            values = read_fields(ctx, obs, i, requests, failed)
            if any(e.gpu == i and e.key == "field_values" for e in obs.errors):
                # The whole batch failed (GPU lost, driver gone): the runner/presence report that;
                # "no link answered" here must not read as "every link is down".
                rec["unreadable"] = True
                continue
            states: dict[int, int] = {}
            unserved: list[int] = []
            for link in range(n):
                s = values.get((STATE_FIELD, link))
                if is_number(s):
                    states[link] = int(s)
                elif _field_unserved(failed.get((STATE_FIELD, link)), rec):
                    unserved.append(link)
            if unserved:
                states.update(self._states_by_getter(ctx, obs, i, unserved))
                rec["state_source"] = "nvmlDeviceGetNvLinkState"
            seen = self._seen_active.setdefault(g.uuid, set())
            seen.update(link for link, s in states.items() if s == 1)
            rec["links_seen_active"] = sorted(seen)
            cache = self._counters.setdefault(g.uuid, {})
            for link in chunk:
                got = {label: int(v) for label, f in COUNTER_FIELDS.items() if is_number(v := values.get((f, link)))}
                if got:
                    cache[link] = (ctx.now, got)
            for link, (read_at, got) in cache.items():
                if link >= n:
                    continue
                rec[f"link{link}.read_at"] = read_at
                for label, v in got.items():
                    rec[f"link{link}.{label}"] = v
            for direction, f in THROUGHPUT_FIELDS.items():
                if is_number(v := values.get((f, ALL_LINKS))):
                    rec[f"traffic_kib.{direction}"] = v
            rec["links_queried"] = n
            rec["counter_links_read"] = chunk
            rec["link_states"] = states
            fabric = fetch(ctx, obs, i, "GpuFabricInfo")
            if isinstance(fabric, dict) and is_number(fabric.get("state")):
                rec["fabric_state"] = int(fabric["state"])
                if is_number(fabric.get("status")):
                    rec["fabric_status"] = int(fabric["status"])
                if is_number(fabric.get("healthMask")):
                    rec["fabric_health_mask"] = int(fabric["healthMask"])
        return obs

    @staticmethod
    def _states_by_getter(ctx: CollectContext, obs: Observations, index: int, links: list[int]) -> dict[int, int]:
        """Link states from the per-link getter, for links whose state field the driver does not serve."""
        out: dict[int, int] = {}
        for link in links:
            try:
                v = ctx.backend.nvlink(index, link, "state")
            except NvmlError as exc:
                key = f"nvlink.state@{link}"
                if exc.code == errors.INVALID_ARGUMENT:
                    obs.unsupported.add((index, key))  # no such link on this GPU, or not served either
                else:
                    obs.note_error(index, key, exc)
                continue
            if is_number(v):
                out[link] = int(v)
        return out

    @staticmethod
    def _fabric_manager(ctx: CollectContext) -> str | None:
        try:  # a recording (or a backend that knows) says it
            return str(ctx.backend.system("fabric_manager"))
        except NvmlError:
            pass
        if ctx.backend.simulated:  # a replayed node is not this host: never judge it by our /proc
            return None
        return fabric_manager_state(os.path.join(ctx.config.collectors.sysfs_root, "proc"))

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).nvlink
        out: list[Finding] = []
        switched = [i for i, rec in sorted(obs.per_gpu.items()) if (rec.get("nvswitch_links") or 0) > 0]
        if switched:
            out.extend(self._fabric_manager_findings(switched, obs, ctx))
        for i, rec in sorted(obs.per_gpu.items()):
            if rec.get("unreadable"):
                continue
            states: dict[int, int] = rec.get("link_states") or {}
            configured = ctx.config.collectors.expected_nvlinks
            wanted = int(configured) if configured is not None else None
            if wanted is None:
                out.extend(self._down_links(i, rec, ctx))
            elif wanted:  # the operator's word: every one of these links is there
                if not states:
                    out.append(Finding(
                        "nvlink.link_down", Severity.CRITICAL, gpu_entity(ctx, i),
                        f"GPU {i}: {wanted} NVLinks expected, the GPU reports none",
                        Action.REBOOT, {"expected": wanted, "up": 0}, NAME,
                    ))
                else:
                    up = sum(1 for s in states.values() if s == 1)
                    for link in range(min(wanted, NVLINK_MAX_LINKS)):
                        if states.get(link) == 1:
                            continue
                        state = states.get(link)
                        out.append(Finding(
                            "nvlink.link_down", Severity.CRITICAL, link_entity(ctx, i, "nvlink", link),
                            f"GPU {i}: NVLink {link} is "
                            f"{'inactive' if state == 0 else 'not reporting'} ({up} of {wanted} up)",
                            Action.REBOOT, {"link": link, "state": state, "expected": wanted, "up": up}, NAME,
                        ))
            for link in sorted(states):
                f = self._error_finding(i, link, obs, history, ctx, th)
                if f is not None:
                    out.append(f)
            out.extend(self._fabric_findings(i, rec, ctx))
        return out

    @staticmethod
    def _down_links(i: int, rec: dict[str, Any], ctx: CollectContext) -> list[Finding]:
        """Links read inactive that should be up (seen active earlier, or the GPU's other links are up)."""
        states: dict[int, int] = rec.get("link_states") or {}
        count = rec.get("link_count")
        if not states:
            if not is_number(count) or count <= 0:
                return []  # no NVLink on this GPU (every query "Not Supported")
            return [Finding(
                "nvlink.state_unknown", Severity.INFO, gpu_entity(ctx, i),
                f"GPU {i}: reports {int(count)} NVLinks but the state of none can be read (neither NVML's "
                "link-state field nor the per-link query answers): not judged",
                Action.NONE, {"link_count": int(count)}, NAME)]
        seen = set(rec.get("links_seen_active") or ())
        if not seen:
            return [Finding(
                "nvlink.untrained", Severity.INFO, gpu_entity(ctx, i),
                f"GPU {i}: none of its {len(states)} NVLinks is active, and none has been at any reading since "
                "gpuhealth started: they were never trained here (a VM given part of an NVLink board, whose host "
                "trains the fabric; a card without its NVLink bridge); not judged as down",
                Action.NONE, {"links_inactive": sorted(link for link, s in states.items() if s == 0),
                              "link_count": count}, NAME)]
        up = sum(1 for s in states.values() if s == 1)
        expected = int(count) if is_number(count) and count > 0 else len(states)
        out: list[Finding] = []
        for link, state in sorted(states.items()):
            if state != 0 or (link not in seen and up == 0):
                continue  # active, or nothing says this one should be up (its peers that were are down too)
            out.append(Finding(
                "nvlink.link_down", Severity.CRITICAL, link_entity(ctx, i, "nvlink", link),
                f"GPU {i}: NVLink {link} is inactive ({up} of {expected} up"
                f"{'' if up else '; it was active earlier'})",
                Action.REBOOT, {"link": link, "state": state, "expected": expected, "up": up}, NAME,
            ))
        return out

    @staticmethod
    def _error_finding(
        i: int, link: int, obs: Observations, history: History, ctx: CollectContext, th: NvlinkThresholds
    ) -> Finding | None:
        """DCGM's NVLink watch: CRC growth → warning, ≥ 100/s → critical; replay or recovery
        growth → critical."""
        grown: dict[str, Any] = {}
        severity = Severity.WARNING
        read_at = gpu_key(i, f"link{link}.read_at")
        # Growth since the link's newest read at least min_window_s older (reads of one link are a
        # rotation apart; with a fast lane the previous read can be too recent, and skipping it
        # would compare the next read with one already past the growth: the growth is never seen).
        t_now = read_at(obs)
        if not is_number(t_now):
            return None
        past = earlier_reading(history, obs, time_of=read_at, latest=True,
                               has=lambda o: is_number(t := read_at(o)) and t_now - t >= th.min_window_s)
        if past is None:
            return None
        window = past[1]
        before = past[0].per_gpu.get(i, {})
        now_rec = obs.per_gpu.get(i, {})
        for label in COUNTER_FIELDS:
            key = f"link{link}.{label}"
            d = increase(now_rec.get(key), before.get(key))
            if d is None or d <= 0:
                continue
            if label == "crc":
                if d < th.crc_per_window_warning:
                    continue
                grown["crc_increase"] = int(d)
                grown["crc_per_second"] = round(d / window, 2)
                if d / window >= th.crc_per_second_critical:
                    severity = Severity.CRITICAL
            else:
                limit = th.replay_per_window_critical if label == "replay" else th.recovery_per_window_critical
                if d < limit:
                    continue
                grown[f"{label}_increase"] = int(d)
                severity = Severity.CRITICAL
        if not grown:
            return None
        parts = ", ".join(f"{k}={v}" for k, v in grown.items())
        return Finding(
            "nvlink.errors", severity, link_entity(ctx, i, "nvlink", link),
            f"GPU {i}: NVLink {link} errors growing over {window:.0f} s: {parts}",
            Action.DRAIN if severity is Severity.CRITICAL else Action.MONITOR,
            {"link": link, "window_s": round(window, 1), **grown}, NAME,
        )

    @staticmethod
    def _fabric_manager_findings(switched: list[int], obs: Observations, ctx: CollectContext) -> list[Finding]:
        fm = obs.node.get("fabric_manager")
        if fm == RUNNING:
            return []
        why = _manager_unseen_because(obs.node.get("environment") or {}, fm)
        if why is None and fm == STOPPED:
            return [Finding(
                "fabric.manager_down", Severity.CRITICAL, Entity.node(ctx.node_name),
                f"{len(switched)} GPU(s) are on NVSwitches but the NVIDIA Fabric Manager (nv-fabricmanager) is "
                "not running: NVLink traffic across the switches fails for new jobs",
                Action.DRAIN, {"gpus_on_nvswitch": switched, "environment": obs.node.get("environment")}, NAME)]
        states = {i: _FABRIC_STATE_NAMES.get(int(s), str(s)) for i in switched
                  if is_number(s := obs.per_gpu[i].get("fabric_state"))}
        judged = (f"; the GPUs' own fabric state is judged instead ({_state_counts(obs, switched)})" if states
                  else "; NVML gives no fabric state to judge instead")
        return [Finding(
            "fabric.manager_unobserved", Severity.INFO, Entity.node(ctx.node_name),
            f"Fabric Manager not checked: {why}{judged}", Action.NONE,
            {"gpus_on_nvswitch": switched, "reason": why, "fabric_manager_seen": fm, "fabric_states": states,
             "environment": obs.node.get("environment")}, NAME)]

    @staticmethod
    def _fabric_findings(i: int, rec: dict[str, Any], ctx: CollectContext) -> list[Finding]:
        state = rec.get("fabric_state")
        if not is_number(state) or state == FABRIC_NOT_SUPPORTED:
            return []
        status = rec.get("fabric_status")
        ev = {"state": _FABRIC_STATE_NAMES.get(int(state), str(state)), "status": status,
              "health_mask": rec.get("fabric_health_mask")}
        ent = gpu_entity(ctx, i)
        if state == FABRIC_COMPLETED and is_number(status) and status != 0:
            return [Finding("fabric.degraded", Severity.CRITICAL, ent,
                            f"GPU {i}: NVSwitch fabric registration finished with error {status}",
                            Action.REBOOT, ev, NAME)]
        if state == FABRIC_NOT_STARTED:
            return [Finding("fabric.degraded", Severity.CRITICAL, ent,
                            f"GPU {i}: NVSwitch fabric registration has not started (is the fabric manager "
                            "running?)", Action.REBOOT, ev, NAME)]
        if state == FABRIC_IN_PROGRESS:
            return [Finding("fabric.degraded", Severity.WARNING, ent,
                            f"GPU {i}: NVSwitch fabric registration still in progress", Action.MONITOR, ev, NAME)]
        mask = rec.get("fabric_health_mask")
        if is_number(mask) and (int(mask) & 0x3) == _HEALTH_DEGRADED_BW_TRUE:
            return [Finding("fabric.degraded", Severity.WARNING, ent,
                            f"GPU {i}: NVSwitch fabric reports degraded bandwidth", Action.DRAIN, ev, NAME)]
        return []

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        out: list[Sample] = []
        for i, rec in sorted(obs.per_gpu.items()):
            states: dict[int, int] = rec.get("link_states") or {}
            for link, s in sorted(states.items()):
                out.append(Sample("gpu_nvlink_state", float(s), "NVLink state: 1 active, 0 inactive.",
                                  gpu=i, labels=(("link", str(link)),)))
                for label in COUNTER_FIELDS:
                    v = rec.get(f"link{link}.{label}")
                    if is_number(v):
                        out.append(Sample(
                            "gpu_nvlink_errors", float(v),
                            "NVLink data-link errors by counter (crc=flit CRC, replay, recovery).",
                            MetricKind.COUNTER, i, (("link", str(link)), ("counter", label)),
                        ))
            for direction in THROUGHPUT_FIELDS:
                if is_number(v := rec.get(f"traffic_kib.{direction}")):
                    out.append(Sample("gpu_nvlink_traffic_bytes", float(v) * 1024.0,
                                      "NVLink traffic (header and payload) over all links since the driver loaded.",
                                      MetricKind.COUNTER, i, (("direction", direction),)))
            wanted = expected_links(rec, ctx)
            if wanted is not None:
                out.append(Sample("gpu_nvlink_links", float(wanted),
                                  "NVLinks by which=expected|active.", gpu=i, labels=(("which", "expected"),)))
            if states:
                out.append(Sample("gpu_nvlink_links", float(sum(1 for s in states.values() if s == 1)),
                                  "NVLinks by which=expected|active.", gpu=i, labels=(("which", "active"),)))
            if is_number(rec.get("fabric_state")):
                out.append(Sample("gpu_fabric_state", float(rec["fabric_state"]),
                                  "NVSwitch fabric registration state (0 n/a, 1 not started, 2 in progress, "
                                  "3 completed).", gpu=i))
            if is_number(rec.get("fabric_status")):
                out.append(Sample("gpu_fabric_status", float(rec["fabric_status"]),
                                  "NVSwitch fabric registration result (0 = success, else an NVML error code).",
                                  gpu=i))
        return out


def create() -> Collector:
    return NvlinkCollector()
