"""InfiniBand / RoCE ports from sysfs (``/sys/class/infiniband/<dev>/ports/<n>/``).

- A port that is not ACTIVE / LinkUp → ``ib.port_down``. A port that was up earlier in the
  history and went down (Polling, LinkDown, …) is critical (``drain``: multi-node jobs on this node will
  hang or crawl); a port an administrator disabled (physical state Disabled) is info, up before or not — a
  choice, not a fault; a port with a physical link that the subnet manager has not activated (INIT/ARMED)
  is a warning; a port never seen up (not cabled) is info only — nothing says it should carry traffic.
- Error counters (symbol errors, link downed, receive errors, link error recovery, …) growing over
  the history window → ``ib.errors`` warning.
- An active port whose rate (speed × width, "400 Gb/sec (4X NDR)") is below its expected rate → ``ib.link_degraded``
  warning: the link trained down (a bad cable or transceiver, a dirty connector). sysfs has no "maximum" file, so
  the expected rate is ``collectors.expected_ib_rate_gbps`` when set, else the fastest active port of the same HCA
  model and link layer on this node; a port with no such peer and no setting is not judged.
- ``port_xmit_wait`` (ticks with data to send and no credits: congestion) per second above
  ``xmit_wait_peer_ratio_warning`` × the median of the node's other ports of the same model, and above
  ``xmit_wait_min_per_second`` → ``ib.congestion`` warning. Tick lengths differ per device, so only peers are
  compared.
A host without InfiniBand has no ports: no observations, no findings.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from gpuhealth.catalog.thresholds import thresholds_from
from gpuhealth.collectors._shared import counter_delta, is_number, sysfs_of
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Entity, EntityKind, Finding, MetricKind, Sample, Severity

NAME = "infiniband"

# Counters that mean trouble when they grow (the rest are traffic, exported only).
ERROR_COUNTERS = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_xmit_discards",
)


def _port_key(port_id: str, counter: str) -> Any:
    return lambda o: (o.node.get("ports", {}).get(port_id) or {}).get("counters", {}).get(counter)


def _is_up(p: dict[str, Any]) -> bool:
    return p.get("state") == "ACTIVE" and p.get("phys_state") in ("LINKUP", "")


class InfinibandCollector:
    name = NAME
    lane = Lane.SLOW
    needs_nvml = False  # keeps running (and reporting) while the GPU driver is down

    def __init__(self) -> None:
        # Ports seen up at any time in this agent's life: a port that went down stays critical however
        # long ago it went (the history window is ~1 h at the slow lane's interval).
        self._ever_up: set[str] = set()

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        ports: dict[str, dict[str, Any]] = {}
        for p in sysfs_of(ctx).infiniband_ports():
            ports[p.id] = {
                "device": p.device,
                "port": p.port,
                "state": p.state_name,
                "phys_state": p.phys_state_name,
                "rate": p.rate,
                "rate_gbps": p.rate_gbps,
                "link_layer": p.link_layer,
                "counters": dict(p.counters),
                "model": p.model,
                "width": p.width,
            }
        self._ever_up.update(pid for pid, p in ports.items() if _is_up(p))
        obs.node["ports"] = ports
        obs.node["ever_up"] = sorted(self._ever_up)
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).infiniband
        out: list[Finding] = []
        ports: dict[str, dict[str, Any]] = obs.node.get("ports") or {}
        expected = expected_rates(ports, ctx.config.collectors.expected_ib_rate_gbps)
        waits = xmit_wait_rates(ports, history, obs)
        for pid, p in sorted(ports.items()):
            ent = Entity(EntityKind.LINK, f"{ctx.node_name}/ib/{pid}")
            ev = {"port": pid, "state": p.get("state"), "phys_state": p.get("phys_state"), "rate": p.get("rate"),
                  "link_layer": p.get("link_layer")}
            if not _is_up(p):
                was_up = pid in (obs.node.get("ever_up") or ()) or any(
                    _is_up((o.node.get("ports") or {}).get(pid) or {}) for o in history if o is not obs)
                if p.get("phys_state") == "DISABLED":  # someone turned it off (ibportstate, the switch): a choice
                    sev, action, how = Severity.INFO, Action.NONE, "is administratively disabled"
                elif was_up:
                    sev, action, how = Severity.CRITICAL, Action.DRAIN, "went down"
                elif p.get("phys_state") == "LINKUP":
                    sev, action, how = Severity.WARNING, Action.MONITOR, "has a physical link but is not active"
                else:  # never up: possibly just not cabled; nothing says this port should carry traffic
                    sev, action, how = Severity.INFO, Action.NONE, "is not up (not connected?)"
                out.append(Finding(
                    "ib.port_down", sev, ent,
                    f"{pid} {how}: state {p.get('state') or '?'}, physical {p.get('phys_state') or '?'}",
                    action, {**ev, "was_up": was_up}, NAME,
                ))
            want = expected.get(pid)
            if _is_up(p) and want is not None and is_number(p.get("rate_gbps")) and p["rate_gbps"] < want - 1e-9:
                why = ("configured" if ctx.config.collectors.expected_ib_rate_gbps
                       else f"its fastest peer of model {p.get('model') or '?'}")
                out.append(Finding(
                    "ib.link_degraded", Severity.WARNING, ent,
                    f"{pid} trained down: {p.get('rate') or '?'} where {want:g} Gb/s is expected ({why})",
                    Action.MONITOR, {**ev, "rate_gbps": p["rate_gbps"], "expected_gbps": want, "width": p.get("width"),
                                     "model": p.get("model")}, NAME,
                ))
            congested = _congested(pid, ports, waits, th.xmit_wait_peer_ratio_warning, th.xmit_wait_min_per_second)
            if congested is not None:
                rate, peers_median = congested
                out.append(Finding(
                    "ib.congestion", Severity.WARNING, ent,
                    f"{pid}: port_xmit_wait {rate:.3g}/s, {rate / max(peers_median, 1.0):.0f}× its peers' median "
                    f"{peers_median:.3g}/s (no credits to send: congestion past this port)", Action.MONITOR,
                    {**ev, "xmit_wait_per_second": round(rate, 1), "peers_median_per_second": round(peers_median, 1)},
                    NAME,
                ))
            grown: dict[str, int] = {}
            window = 0.0
            for counter in ERROR_COUNTERS:
                d = counter_delta(history, obs, _port_key(pid, counter))
                if d is None or d[1] < th.min_window_s or d[0] <= 0:
                    continue
                window = d[1]
                per_hour = d[0] / d[1] * 3600.0
                if counter == "symbol_error" and per_hour < th.symbol_error_per_hour_warning:
                    continue
                if counter == "port_rcv_errors" and per_hour < th.rcv_errors_per_hour_warning:
                    continue
                if counter == "link_downed" and d[0] < th.link_downed_per_window_warning:
                    continue
                grown[counter] = int(d[0])
            if grown:
                parts = ", ".join(f"{k} +{v}" for k, v in grown.items())
                out.append(Finding(
                    "ib.errors", Severity.WARNING, ent, f"{pid}: error counters grew over {window:.0f} s: {parts}",
                    Action.MONITOR, {**ev, "window_s": round(window, 1), "increase": grown}, NAME,
                ))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        out: list[Sample] = []
        for _pid, p in sorted((obs.node.get("ports") or {}).items()):
            labels = (("device", str(p.get("device"))), ("port", str(p.get("port"))))
            out.append(Sample("ib_port_up", 1.0 if _is_up(p) else 0.0,
                              "1 when the InfiniBand/RoCE port is ACTIVE and LinkUp.", labels=labels))
            if is_number(p.get("rate_gbps")):
                out.append(Sample("ib_port_rate_bits_per_second", float(p["rate_gbps"]) * 1e9,
                                  "Negotiated port rate.", labels=labels))
            if is_number(p.get("width")):
                out.append(Sample("ib_port_width", float(p["width"]), "Negotiated port width in lanes.",
                                  labels=labels))
            if is_number(p.get("counters", {}).get("port_xmit_wait")):
                out.append(Sample("ib_port_xmit_wait", float(p["counters"]["port_xmit_wait"]),
                                  "Ticks the port had data to send but no credits (congestion); device tick length.",
                                  MetricKind.COUNTER, labels=labels))
            for counter, v in sorted((p.get("counters") or {}).items()):
                if counter in ERROR_COUNTERS:
                    out.append(Sample("ib_port_errors", float(v), "Port error counters from sysfs by counter.",
                                      MetricKind.COUNTER, labels=(*labels, ("counter", counter))))
        return out


def expected_rates(ports: dict[str, dict[str, Any]], configured: float | None) -> dict[str, float]:
    """Port → the rate it should run at: the configured one, else the fastest active port of the same HCA
    model and link layer on the node (a port alone in its group is left out: nothing to compare with)."""
    if configured:
        return {pid: float(configured) for pid in ports}
    groups: dict[tuple[Any, Any], list[str]] = {}
    for pid, p in ports.items():
        if _is_up(p) and is_number(p.get("rate_gbps")):
            groups.setdefault((p.get("model"), p.get("link_layer")), []).append(pid)
    out: dict[str, float] = {}
    for members in groups.values():
        if len(members) > 1:
            best = max(float(ports[m]["rate_gbps"]) for m in members)
            out.update({m: best for m in members})
    return out


def xmit_wait_rates(ports: dict[str, dict[str, Any]], history: History, obs: Observations) -> dict[str, float]:
    """Port → port_xmit_wait ticks per second since the previous sweep (ports with an earlier reading)."""
    out: dict[str, float] = {}
    for pid in ports:
        d = counter_delta(history, obs, _port_key(pid, "port_xmit_wait"), latest=True)
        if d is not None and d[1] > 0:
            out[pid] = d[0] / d[1]
    return out


def _congested(pid: str, ports: dict[str, dict[str, Any]], waits: dict[str, float], ratio: float, floor: float
               ) -> tuple[float, float] | None:
    """(rate, peers' median) when ``pid`` waits far more than the other ports of its model, else None."""
    rate = waits.get(pid)
    if rate is None or rate < floor:
        return None
    model = ports[pid].get("model")
    peers = [waits[q] for q in waits if q != pid and ports[q].get("model") == model]
    if not peers:
        return None
    median = statistics.median(peers)
    return (rate, median) if rate > ratio * max(median, 1.0) else None


def create() -> Collector:
    return InfinibandCollector()
