"""One log line per change of a GPU's or the node's health, with the finding(s) that made it.

Operators read the journal, not ``/health``: when an XID takes a GPU out, the agent's log must say
so, once, with the finding's code, entity, message and action; and again when it recovers. The
state compared is (health, action) per GPU and for the node, taken from the same report ``/health``
serves (``node.report_of_snapshot``), so the log and the endpoint never disagree. A finding whose
message changes only its numbers (a temperature, a count) changes neither: no line.

The first state logged is the one of the first complete sweep (``ready``): a line for each GPU, and
for the node, that starts out not healthy. Before that, half a sweep would log changes that are only
collectors reporting in. GPUs come first, the node (which sums them up) last.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from gpuhealth.model import Action, Finding, Health, Severity, worst_action
from gpuhealth.node import NodeReport

__all__ = ["HealthChange", "HealthLog"]

MAX_CAUSES = 3  # findings quoted in one line; the rest are counted
_RANK = {Health.HEALTHY: 0, Health.UNKNOWN: 1, Health.DEGRADED: 2, Health.UNHEALTHY: 3}


@dataclass(frozen=True, slots=True)
class _State:
    health: Health
    action: Action
    findings: tuple[Finding, ...]  # what judged it: the worst-severity findings (or the node's, for unknown)


@dataclass(frozen=True, slots=True)
class HealthChange:
    """One line for the log: ``level`` (warning when worse, info when better), ``text`` and ``extra``."""

    level: int
    text: str
    extra: dict[str, object]


class HealthLog:
    """Remembers the last (health, action) of the node and of each GPU; ``observe`` says what changed."""

    def __init__(self) -> None:
        self._last: dict[str, _State] | None = None

    def observe(self, report: NodeReport) -> list[HealthChange]:
        now = _states(report)
        labels = _labels(report)
        if self._last is None:
            self._last = now
            return _at_start(now, labels)
        before, self._last = self._last, now
        out = []
        for key, state in now.items():
            was = before.get(key)
            if was is not None and (was.health, was.action) == (state.health, state.action):
                continue
            out.append(_change(key, labels[key], was, state))
        for key in before.keys() - now.keys():  # a GPU that left the enumeration: its findings say why
            out.append(HealthChange(logging.WARNING, f"{key} is no longer enumerated (was {before[key].health})",
                                    {"event": "health_change", "subject": key, "health": "gone",
                                     "was": str(before[key].health)}))
        return out


def _states(report: NodeReport) -> dict[str, _State]:
    out: dict[str, _State] = {}
    for gpu in report.gpus:
        own = _causes(gpu.findings, gpu.health)
        if gpu.health is Health.UNKNOWN and not own:
            own = _causes(report.findings, report.health)  # NVML down: the node's finding says why
        out[gpu.identity.uuid or f"gpu{gpu.identity.index}"] = _State(gpu.health, worst_action(gpu.findings), own)
    out["node"] = _State(report.health, report.action, _causes(report.all_findings(), report.health))
    return out


def _labels(report: NodeReport) -> dict[str, str]:
    out = {"node": f"node {report.node}"}
    for gpu in report.gpus:
        ident = gpu.identity
        out[ident.uuid or f"gpu{ident.index}"] = f"GPU {ident.index}" + (f" ({ident.uuid})" if ident.uuid else "")
    return out


def _causes(findings: Sequence[Finding], health: Health) -> tuple[Finding, ...]:
    """The findings that set this health: those of the worst severity above info."""
    judged = [f for f in findings if f.severity > Severity.INFO]
    if not judged:
        return ()
    worst = max(f.severity for f in judged)
    return tuple(sorted((f for f in judged if f.severity == worst), key=lambda f: (f.code, f.entity.id)))


def _quote(findings: Sequence[Finding]) -> str:
    parts = [f"{f.code} [{f.severity}] on {f.entity.kind} {f.entity.id}: {f.message} (action {f.action})"
             for f in findings[:MAX_CAUSES]]
    if len(findings) > MAX_CAUSES:
        parts.append(f"and {len(findings) - MAX_CAUSES} more")
    return "; ".join(parts)


def _extra(key: str, state: _State, was: _State | None, findings: Sequence[Finding]) -> dict[str, object]:
    return {"event": "health_change", "subject": key, "health": str(state.health),
            "was": str(was.health) if was is not None else "start", "action": str(state.action),
            "codes": sorted({f.code for f in findings})}


def _change(key: str, label: str, was: _State | None, state: _State) -> HealthChange:
    if was is None:  # a GPU that appeared
        return _start_line(key, label, state)
    worse = _RANK[state.health] > _RANK[was.health] or (
        state.health is was.health and state.action > was.action)
    head = f"{label} {state.health}" + (f" (action {state.action})" if state.action is not Action.NONE else "")
    head += f", was {was.health}" + (f" (action {was.action})" if was.action is not Action.NONE else "")
    if state.health is Health.HEALTHY:
        gone = [f for f in was.findings if f not in state.findings]
        text = f"{head}: recovered" + (f"; cleared {_quote(gone)}" if gone else "")
        return HealthChange(logging.INFO, text, _extra(key, state, was, gone))
    text = f"{head}: {_quote(state.findings)}" if state.findings else head
    return HealthChange(logging.WARNING if worse else logging.INFO, text, _extra(key, state, was, state.findings))


def _start_line(key: str, label: str, state: _State) -> HealthChange:
    head = f"{label} {state.health} at start" + (f" (action {state.action})" if state.action is not Action.NONE
                                                 else "")
    text = f"{head}: {_quote(state.findings)}" if state.findings else head
    level = logging.INFO if state.health is Health.HEALTHY else logging.WARNING
    return HealthChange(level, text, _extra(key, state, None, state.findings))


def _at_start(states: dict[str, _State], labels: dict[str, str]) -> list[HealthChange]:
    """A line for each GPU, and for the node, that is not healthy at the first full sweep (the agent's
    "first sweep done" line already gives the counts; a healthy start is no news)."""
    return [_start_line(key, labels[key], state) for key, state in states.items() if state.health is not Health.HEALTHY]
