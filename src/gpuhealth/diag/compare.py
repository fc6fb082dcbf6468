"""Pure SDC judgement: golden digests, peer votes, re-run classification → findings (no torch).

A case is one matmul (datapath + shape). Every device computes the same case from the same seed;
identical GPUs (same model, SM count, driver, libraries, flags) must produce identical digests.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.model import Action, Entity, EntityKind, Finding, Severity

SOURCE = "diag.sdc"


class Basis(enum.StrEnum):
    """What a device's digest was judged against."""

    GOLDEN = "golden"  # the stored digest for this environment key
    PEERS = "peers"  # the strict majority of devices on the node
    UNDECIDED = "undecided"  # no golden and no majority (e.g. two GPUs that disagree)
    SELF = "self"  # repeated runs on the same device disagreed


class Persistence(enum.StrEnum):
    PERSISTENT = "persistent"  # every re-run reproduced the wrong digest
    TRANSIENT = "transient"  # every re-run gave the expected digest
    NONDETERMINISTIC = "nondeterministic"  # re-runs disagree among themselves
    UNKNOWN = "unknown"  # no re-run was made


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """A device as findings name it."""

    key: str  # "cuda:0" / "cpu:1": how the child addresses it
    uuid: str
    index: int | None = None
    name: str = ""

    def entity(self) -> Entity:
        if self.key.startswith("cuda") or self.uuid.startswith("GPU-"):
            return Entity.gpu(self.uuid, self.index)
        return Entity(EntityKind.GPU, self.uuid, self.index)


@dataclass(frozen=True, slots=True)
class Suspect:
    device: str
    case_id: str
    observed: str
    expected: str | None
    basis: Basis
    peers: Mapping[str, int] = field(default_factory=dict)  # digest → how many devices gave it


@dataclass(frozen=True, slots=True)
class CaseInfo:
    case_id: str
    datapath: str
    shape: str  # "square" / "large_k"
    mnk: tuple[int, int, int]


def majority(digests: Sequence[str]) -> str | None:
    """The digest more than half the devices gave, or None."""
    if not digests:
        return None
    digest, count = Counter(digests).most_common(1)[0]
    return digest if count * 2 > len(digests) else None


def find_suspects(
    results: Mapping[str, Mapping[str, str]],
    golden: Mapping[str, str] | None,
) -> tuple[list[Suspect], list[str]]:
    """``results``: device → case id → digest. Returns (suspects, case ids where every device
    agreed with each other but not with the golden: a stale golden or a node-wide fault)."""
    suspects: list[Suspect] = []
    golden_disagrees: list[str] = []
    case_ids = sorted({c for per_dev in results.values() for c in per_dev})
    for case_id in case_ids:
        by_dev = {dev: per[case_id] for dev, per in results.items() if case_id in per}
        counts = dict(Counter(by_dev.values()))
        peer_majority = majority(list(by_dev.values())) if len(by_dev) >= 2 else None
        expected = golden.get(case_id) if golden else None
        if expected is not None:
            if len(by_dev) >= 2 and len(counts) == 1 and expected not in counts:
                golden_disagrees.append(case_id)
                continue
            basis = Basis.GOLDEN
        elif peer_majority is not None:
            expected, basis = peer_majority, Basis.PEERS
        elif len(counts) > 1:
            expected, basis = None, Basis.UNDECIDED
        else:
            continue  # one device, no golden: only its re-runs can judge it
        for dev, observed in sorted(by_dev.items()):
            if expected is None or observed != expected:
                suspects.append(Suspect(dev, case_id, observed, expected, basis, counts))
    return suspects, golden_disagrees


def classify(observed: str, expected: str | None, reruns: Sequence[str]) -> Persistence:
    """Tell a transient fault from a persistent one by re-running the case on the same device."""
    if not reruns:
        return Persistence.UNKNOWN
    if len(set(reruns)) > 1 or (reruns[0] != observed and reruns[0] != expected):
        return Persistence.NONDETERMINISTIC
    if reruns[0] == observed:
        return Persistence.PERSISTENT
    return Persistence.TRANSIENT


def suspect_finding(
    suspect: Suspect,
    device: DeviceRef,
    case: CaseInfo,
    persistence: Persistence,
    reruns: Sequence[str],
    *,
    injected: bool = False,
) -> Finding:
    """``sdc.mismatch``: names the GPU, the datapath and the shape."""
    m, n, k = case.mnk
    where = f"GPU {device.index if device.index is not None else device.key} ({device.uuid})"
    what = f"{case.datapath} {case.shape} {m}x{n}x{k} matmul"
    if suspect.basis is Basis.UNDECIDED:
        why = f"peers disagree and no golden digest decides ({dict(suspect.peers)})"
    else:
        why = f"digest {suspect.observed} != {suspect.basis.value} {suspect.expected}"
    decisive = suspect.basis in (Basis.GOLDEN, Basis.PEERS)
    if persistence is Persistence.NONDETERMINISTIC or (persistence is Persistence.PERSISTENT and decisive):
        severity, action = Severity.CRITICAL, Action.DRAIN
    else:
        severity, action = Severity.WARNING, Action.MONITOR
    evidence: dict[str, Any] = {
        "device": device.key, "datapath": case.datapath, "shape": case.shape, "m": m, "n": n, "k": k,
        "case": case.case_id, "observed": suspect.observed, "expected": suspect.expected,
        "basis": suspect.basis.value, "persistence": persistence.value, "reruns": list(reruns),
        "peer_digests": dict(suspect.peers),
    }
    if injected:
        evidence["injected"] = True
    return Finding(
        code="sdc.mismatch",
        severity=severity,
        entity=device.entity(),
        message=f"{where}: {what}: {why}; re-run: {persistence.value}",
        action=action,
        evidence=evidence,
        source=SOURCE,
    )


def self_inconsistency_finding(device: DeviceRef, case: CaseInfo, digests: Sequence[str]) -> Finding:
    """Repeated runs of one case on one device gave different digests: never normal."""
    m, n, k = case.mnk
    return Finding(
        code="sdc.mismatch",
        severity=Severity.CRITICAL,
        entity=device.entity(),
        message=(f"GPU {device.index if device.index is not None else device.key} ({device.uuid}): "
                 f"{case.datapath} {case.shape} {m}x{n}x{k} matmul is not reproducible: "
                 f"{len(set(digests))} different digests in {len(digests)} runs"),
        action=Action.DRAIN,
        evidence={"device": device.key, "datapath": case.datapath, "shape": case.shape, "m": m, "n": n, "k": k,
                  "case": case.case_id, "digests": list(digests), "basis": Basis.SELF.value,
                  "persistence": Persistence.NONDETERMINISTIC.value},
        source=SOURCE,
    )


def golden_disagreement_finding(node: str, case_ids: Sequence[str], key_id: str) -> Finding:
    """Every GPU agrees with the others but not with the golden: most likely the environment
    changed in a way the key does not capture (or the golden came from a different build)."""
    return Finding(
        code="sdc.golden_mismatch",
        severity=Severity.WARNING,
        entity=Entity.node(node),
        message=(f"all GPUs agree with each other but not with the golden digests for {len(case_ids)} case(s) "
                 f"(key {key_id}); re-record the golden if the software stack changed on purpose"),
        action=Action.MONITOR,
        evidence={"cases": list(case_ids), "golden_key": key_id},
        source=SOURCE,
    )
