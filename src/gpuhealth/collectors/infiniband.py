"""InfiniBand / RoCE ports from sysfs (``/sys/class/infiniband/<dev>/ports/<n>/``).

- A port that is not ACTIVE / LinkUp → ``ib.port_down``. A port that was up earlier in the
  history and went down (Polling, LinkDown, …) is critical (``drain``: multi-node jobs on this node will
  hang or crawl); a port an administrator disabled (physical state Disabled) is info, up before or not — a
  choice, not a fault; a port with a physical link that the subnet manager has not activated (INIT/ARMED)
  is a warning; a port never seen up (not cabled) is info only — nothing says it should carry traffic.
- Error counters (symbol errors, link downed, receive errors, link error recovery, …) growing over
  the history window → ``ib.errors`` warning.
A host without InfiniBand has no ports: no observations, no findings.
"""

from __future__ import annotations

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
            }
        self._ever_up.update(pid for pid, p in ports.items() if _is_up(p))
        obs.node["ports"] = ports
        obs.node["ever_up"] = sorted(self._ever_up)
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).infiniband
        out: list[Finding] = []
        ports: dict[str, dict[str, Any]] = obs.node.get("ports") or {}
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
            for counter, v in sorted((p.get("counters") or {}).items()):
                if counter in ERROR_COUNTERS:
                    out.append(Sample("ib_port_errors", float(v), "Port error counters from sysfs by counter.",
                                      MetricKind.COUNTER, labels=(*labels, ("counter", counter))))
        return out


def create() -> Collector:
    return InfinibandCollector()
