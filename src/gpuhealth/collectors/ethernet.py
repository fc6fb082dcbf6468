"""Ethernet NICs from sysfs (``/sys/class/net/<if>/``): link, speed, duplex, flaps, errors and drops.

Which NICs: ``collectors.net_interfaces`` when set (any interface named there, veths included), else every
physical one — an interface with a ``device`` link that is not a bridge, so lo, veth, docker0, bridges,
bonds and tunnels are left out (their speed and errors belong to what they sit on).

- A NIC that was up in this agent's life and is no longer (operstate down, or no carrier) →
  ``net.link_down`` warning; one never seen up is not judged (possibly not cabled).
- Speed below the expected one → ``net.speed_degraded`` warning: the link negotiated down (a bad cable, a
  port forced slower). sysfs has no maximum: the expected speed is ``collectors.expected_net_speed_mbps``
  when set, else the fastest up NIC of the same driver on the node; a NIC alone with its driver and no
  setting is not judged.
- Half duplex on an up link → ``net.half_duplex`` warning (autonegotiation failed on one side).
- ``carrier_changes`` growing by ``carrier_changes_per_window_warning`` within the window → ``net.link_flaps``
  warning (each down-and-up adds 2).
- Errors (``rx_errors``, ``tx_errors``, ``rx_crc_errors``) or drops as rates per hour over the window above
  their thresholds → ``net.errors`` warning.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuhealth.catalog.thresholds import thresholds_from
from gpuhealth.collectors._shared import counter_delta, is_number, sysfs_of
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Entity, EntityKind, Finding, MetricKind, Sample, Severity

NAME = "ethernet"
ERRORS = ("rx_errors", "tx_errors", "rx_crc_errors")
DROPS = ("rx_dropped", "tx_dropped")


def _is_up(n: dict[str, Any]) -> bool:
    return n.get("operstate") == "up"


def _nic_key(name: str, *path: str) -> Any:
    def get(o: Observations) -> Any:
        v: Any = (o.node.get("nics") or {}).get(name) or {}
        for part in path:
            v = v.get(part) if isinstance(v, dict) else None
        return v

    return get


class EthernetCollector:
    name = NAME
    lane = Lane.SLOW
    needs_nvml = False  # the NICs matter whether or not the GPU driver answers

    def __init__(self) -> None:
        self._ever_up: set[str] = set()

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        wanted = set(ctx.config.collectors.net_interfaces)
        nics: dict[str, dict[str, Any]] = {}
        for nic in sysfs_of(ctx).net_interfaces():
            if (nic.name not in wanted) if wanted else not nic.physical:
                continue
            nics[nic.name] = {"operstate": nic.operstate, "speed_mbps": nic.speed_mbps, "duplex": nic.duplex,
                              "carrier_changes": nic.carrier_changes, "driver": nic.driver,
                              "statistics": dict(nic.statistics)}
        self._ever_up.update(name for name, n in nics.items() if _is_up(n))
        obs.node["nics"] = nics
        obs.node["ever_up"] = sorted(self._ever_up)
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).ethernet
        nics: dict[str, dict[str, Any]] = obs.node.get("nics") or {}
        expected = expected_speeds(nics, ctx.config.collectors.expected_net_speed_mbps)
        out: list[Finding] = []
        for name, n in sorted(nics.items()):
            ent = Entity(EntityKind.LINK, f"{ctx.node_name}/net/{name}")
            ev = {"interface": name, "operstate": n.get("operstate"), "speed_mbps": n.get("speed_mbps"),
                  "duplex": n.get("duplex"), "driver": n.get("driver")}
            if not _is_up(n):
                if name in (obs.node.get("ever_up") or ()):
                    out.append(Finding("net.link_down", Severity.WARNING, ent,
                                       f"{name} went down (operstate {n.get('operstate') or '?'})",
                                       Action.MONITOR, ev, NAME))
                continue
            want = expected.get(name)
            speed = n.get("speed_mbps")
            if want is not None and is_number(speed) and speed < want:
                why = "configured" if ctx.config.collectors.expected_net_speed_mbps else \
                    f"its fastest peer with driver {n.get('driver') or '?'}"
                out.append(Finding("net.speed_degraded", Severity.WARNING, ent,
                                   f"{name} runs at {speed} Mb/s where {want} Mb/s is expected ({why})",
                                   Action.MONITOR, {**ev, "expected_mbps": want}, NAME))
            if n.get("duplex") == "half":
                out.append(Finding("net.half_duplex", Severity.WARNING, ent,
                                   f"{name} negotiated half duplex (autonegotiation failed on one side?)",
                                   Action.MONITOR, ev, NAME))
            flaps = counter_delta(history, obs, _nic_key(name, "carrier_changes"))
            flapped = flaps is not None and flaps[1] >= th.min_window_s
            if flaps is not None and flapped and flaps[0] >= th.carrier_changes_per_window_warning:
                out.append(Finding("net.link_flaps", Severity.WARNING, ent,
                                   f"{name}: carrier changed {int(flaps[0])} times in {flaps[1]:.0f} s (link flaps)",
                                   Action.MONITOR, {**ev, "carrier_changes": int(flaps[0]),
                                                    "window_s": round(flaps[1], 1)}, NAME))
            rates = _rates(name, history, obs, th.min_window_s)
            limits = {**dict.fromkeys(ERRORS, th.errors_per_hour_warning),
                      **dict.fromkeys(DROPS, th.drops_per_hour_warning)}
            bad = {k: round(v, 1) for k, v in rates.items() if v > limits[k]}
            if bad:
                parts = ", ".join(f"{k} {v:g}/h" for k, v in sorted(bad.items()))
                out.append(Finding("net.errors", Severity.WARNING, ent, f"{name}: {parts}", Action.MONITOR,
                                   {**ev, "per_hour": bad}, NAME))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        out: list[Sample] = []
        for name, n in sorted((obs.node.get("nics") or {}).items()):
            labels = (("interface", name),)
            out.append(Sample("net_up", 1.0 if _is_up(n) else 0.0, "1 when the NIC's operstate is up.",
                              labels=labels))
            if is_number(n.get("speed_mbps")):
                out.append(Sample("net_speed_bits_per_second", float(n["speed_mbps"]) * 1e6,
                                  "Negotiated link speed.", labels=labels))
            if n.get("duplex") in ("full", "half"):
                out.append(Sample("net_full_duplex", 1.0 if n["duplex"] == "full" else 0.0,
                                  "1 for full duplex, 0 for half.", labels=labels))
            if is_number(n.get("carrier_changes")):
                out.append(Sample("net_carrier_changes", float(n["carrier_changes"]),
                                  "Link carrier changes (2 per flap).", MetricKind.COUNTER, labels=labels))
            for counter, v in sorted((n.get("statistics") or {}).items()):
                if counter in ERRORS or counter in DROPS:
                    out.append(Sample("net_errors", float(v), "NIC error and drop counters from sysfs by counter.",
                                      MetricKind.COUNTER, labels=(*labels, ("counter", counter))))
        return out


def expected_speeds(nics: dict[str, dict[str, Any]], configured: int | None) -> dict[str, int]:
    """NIC → the speed it should run at: the configured one, else the fastest up NIC of its driver (a NIC
    alone with its driver is left out: nothing to compare with)."""
    if configured:
        return {name: int(configured) for name in nics}
    groups: dict[Any, list[str]] = {}
    for name, n in nics.items():
        if _is_up(n) and is_number(n.get("speed_mbps")) and n.get("driver"):
            groups.setdefault(n["driver"], []).append(name)
    out: dict[str, int] = {}
    for members in groups.values():
        if len(members) > 1:
            best = max(int(nics[m]["speed_mbps"]) for m in members)
            out.update({m: best for m in members})
    return out


def _rates(name: str, history: History, obs: Observations, min_window_s: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for counter in (*ERRORS, *DROPS):
        d = counter_delta(history, obs, _nic_key(name, "statistics", counter))
        if d is not None and d[1] >= min_window_s and d[0] > 0:
            out[counter] = d[0] / d[1] * 3600.0
    return out


def create() -> Collector:
    return EthernetCollector()
