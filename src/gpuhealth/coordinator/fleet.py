"""The fleet view: node inventory, each node's current findings, version drift across nodes, SDC
digests voted across nodes with the same golden key, and the unhealthy-GPU list. Pure judgement
over plain data (the service keeps the data current; ``store`` persists it)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.model import Action, Entity, EntityKind, Finding, Health, Severity, health_of

# Versions compared across nodes. Per-GPU VBIOS is compared among GPUs of the same model.
DRIFT_KEYS = ("driver", "cuda_driver", "nccl", "torch")
SDC_MIN_VOTERS = 3  # a majority needs at least three GPUs with the same key


@dataclass(slots=True)
class NodeView:
    name: str
    versions: dict[str, str] = field(default_factory=dict)
    gpus: list[dict[str, Any]] = field(default_factory=list)  # GpuInfo as dicts
    findings: list[Finding] = field(default_factory=list)
    findings_at: float = 0.0
    connected: bool = False
    last_seen: float = 0.0
    health: str = "unknown"
    simulated: bool = False  # its agent replays a recording: not a real node's GPUs
    backend: str = ""

    def gpu(self, *, uuid: str | None = None, index: int | None = None) -> dict[str, Any] | None:
        for g in self.gpus:
            if (uuid and g.get("uuid") == uuid) or (uuid is None and index is not None and g.get("index") == index):
                return g
        return None


@dataclass(frozen=True, slots=True)
class SdcVote:
    gpu_uuid: str
    node: str
    key: str
    digest: str


def gpu_of(finding: Finding) -> str | None:
    """The GPU (UUID) a finding is about: the GPU itself, or one of its links (PCIe, NVLink: entity
    ``<uuid>/pcie``, ``<uuid>/nvlink/3``) — a degraded link is that GPU's problem; None otherwise."""
    if finding.entity.kind is EntityKind.GPU:
        return finding.entity.id
    if finding.entity.kind is EntityKind.LINK and finding.entity.id.startswith(("GPU-", "MIG-")):
        return finding.entity.id.split("/", 1)[0]
    return None


def gpu_findings(node: NodeView, gpu_uuid: str | None) -> list[Finding]:
    """Findings about one GPU (or its links) from the node's current snapshot."""
    if not gpu_uuid:
        return []
    return [f for f in node.findings if gpu_of(f) == gpu_uuid]


def culprit_line(rank: int, node: str, gpu_index: int | None, findings: Sequence[Finding]) -> str:
    """"rank 3, node n2 GPU 1: HW slowdown active" — what an on-call engineer reads first."""
    where = f"rank {rank}, node {node}" + (f" GPU {gpu_index}" if gpu_index is not None else "")
    if gpu_index is None and not findings:
        return f"{where}: no GPU known for this rank"
    if not findings:
        return f"{where}: no health findings on this GPU"
    worst = sorted(findings, key=lambda f: (-int(f.severity), f.code))
    return f"{where}: " + "; ".join(f.message or f.code for f in worst)


def version_drift(nodes: Iterable[NodeView]) -> list[Finding]:
    """``version.drift`` for every node whose version of a key differs from the fleet majority
    (node-level keys), and for VBIOS among GPUs of the same model."""
    nodes = list(nodes)
    findings: list[Finding] = []
    for key in DRIFT_KEYS:
        values = {n.name: n.versions[key] for n in nodes if n.versions.get(key)}
        findings += _minority(values, key, lambda name: Entity.node(name))
    by_model: dict[str, dict[str, str]] = defaultdict(dict)
    gpu_node: dict[str, tuple[str, int | None]] = {}
    for n in nodes:
        for g in n.gpus:
            if g.get("vbios") and g.get("uuid"):
                by_model[str(g.get("name", ""))][g["uuid"]] = g["vbios"]
                gpu_node[g["uuid"]] = (n.name, g.get("index"))
    for model, values in sorted(by_model.items()):
        for f in _minority(values, "vbios", lambda uuid: Entity.gpu(uuid, gpu_node[uuid][1])):
            node_name = gpu_node[f.entity.id][0]
            findings.append(Finding(
                f.code, f.severity, f.entity, f"{model} on {node_name}: {f.message}", f.action,
                {**f.evidence, "node": node_name, "model": model}, f.source))
    return findings


def _minority(values: Mapping[str, str], key: str, entity: Any) -> list[Finding]:
    counts = Counter(values.values())
    if len(counts) < 2:
        return []
    majority, majority_n = counts.most_common(1)[0]
    tied = [v for v, c in counts.items() if c == majority_n]
    out = []
    for who, value in sorted(values.items()):
        if value == majority and len(tied) == 1:
            continue
        out.append(Finding(
            code="version.drift", severity=Severity.WARNING, entity=entity(who),
            message=f"{key} {value} differs from the fleet's {majority} ({majority_n} of {len(values)})"
            if len(tied) == 1 else f"{key} {value}: no fleet majority ({dict(counts)})",
            action=Action.MONITOR,
            evidence={"key": key, "value": value, "majority": majority if len(tied) == 1 else None,
                      "counts": dict(counts)},
            source="coordinator.fleet"))
    return out


SDC_MIN_OTHER_NODES = 2  # a verdict across nodes needs at least two other nodes that agree


def _strict_majority(values: Iterable[str]) -> tuple[str, int, int] | None:
    """(value, its count, total) when one value has more than half of ``values``; else None."""
    counts = Counter(values)
    total = sum(counts.values())
    if not counts:
        return None
    value, n = counts.most_common(1)[0]
    return (value, n, total) if n * 2 > total else None


def sdc_votes(votes: Iterable[SdcVote]) -> list[Finding]:
    """GPUs whose digest disagrees with a majority of those that computed the same key.

    One credential must not be able to drain another node's GPU, so a node's own votes weigh only on
    its own devices: a GPU is a mismatch when its node's other devices outvote it (at least
    ``SDC_MIN_VOTERS`` voters, a strict majority: the node is the authority on its own GPUs), or across
    nodes, where every node has ONE vote — its devices' majority digest, or none when they split — and
    the fleet's strict majority of at least ``SDC_MIN_VOTERS`` nodes includes at least
    ``SDC_MIN_OTHER_NODES`` nodes other than the GPU's. Pseudo devices (a CPU run: ``cpu0``) and GPUs a
    node made up therefore never outvote a GPU elsewhere: however many a node reports, they are one vote."""
    by_key: dict[str, list[SdcVote]] = defaultdict(list)
    for v in votes:
        by_key[v.key].append(v)
    out: list[Finding] = []
    for key, vs in sorted(by_key.items()):
        by_node: dict[str, list[SdcVote]] = defaultdict(list)
        for v in vs:
            by_node[v.node].append(v)
        node_digest = {node: m[0] for node, nv in by_node.items() if (m := _strict_majority(x.digest for x in nv))}
        fleet = _strict_majority(node_digest.values())
        for v in vs:
            local = _strict_majority(x.digest for x in by_node[v.node])
            agree_nodes = sorted(n for n, d in node_digest.items() if fleet and d == fleet[0] and n != v.node)
            if local is not None and local[2] >= SDC_MIN_VOTERS and local[0] != v.digest:
                majority, n, voters, scope = local[0], local[1], local[2], "of its node's devices"
            elif (fleet is not None and fleet[2] >= SDC_MIN_VOTERS and fleet[0] != v.digest
                  and len(agree_nodes) >= SDC_MIN_OTHER_NODES):
                majority, n, voters, scope = fleet[0], fleet[1], fleet[2], "nodes"
            else:
                continue
            out.append(Finding(
                code="sdc.mismatch", severity=Severity.CRITICAL, entity=Entity.gpu(v.gpu_uuid),
                message=f"node {v.node}: result digest differs from {n} of {voters} {scope} with the same key",
                action=Action.DRAIN,
                evidence={"node": v.node, "key": key, "digest": v.digest, "majority_digest": majority,
                          "voters": voters, "agree": n, "scope": "node" if scope != "nodes" else "fleet",
                          "agreeing_nodes": agree_nodes[:16]},
                source="coordinator.fleet"))
    return out


def uuid_conflicts(claims: Mapping[str, Iterable[str]]) -> list[Finding]:
    """GPU UUIDs that more than one node registered (``claims``: node → its UUIDs). A UUID is unique to one
    GPU, so two claims mean a node is wrong or lying; neither claim may vote for that GPU."""
    owners: dict[str, set[str]] = defaultdict(set)
    for node, uuids in claims.items():
        for uuid in uuids:
            owners[uuid].add(node)
    return [Finding(
        code="gpu.uuid_conflict", severity=Severity.WARNING, entity=Entity.gpu(uuid),
        message=f"GPU {uuid} is registered by {len(nodes)} nodes ({', '.join(sorted(nodes)[:8])}): its SDC digests "
                "are not counted until one node's claim goes",
        action=Action.MONITOR, evidence={"nodes": sorted(nodes)[:16]}, source="coordinator.fleet")
        for uuid, nodes in sorted(owners.items()) if len(nodes) > 1]


def sdc_votes_from_findings(node: NodeView) -> list[SdcVote]:
    """Digests an agent reported inside findings: any GPU finding whose evidence has a digest and
    a golden key (``digest``/``sdc_digest`` and ``key``/``golden_key``/``sdc_key``)."""
    out = []
    for f in node.findings:
        ev = f.evidence
        digest = ev.get("digest") or ev.get("sdc_digest")
        key = ev.get("key") or ev.get("golden_key") or ev.get("sdc_key")
        if f.entity.kind is EntityKind.GPU and isinstance(digest, str) and isinstance(key, str) and digest and key:
            out.append(SdcVote(f.entity.id, node.name, key, digest))
    return out


def _about(node: str, f: Finding) -> bool:
    """A fabric-probe finding a node's agent may report: about itself, one of its rails, or a link it sends on."""
    ident = f.entity.id
    if f.entity.kind is EntityKind.LINK:
        ident = ident.split("->", 1)[0]
    return ident == node or ident.startswith(node + "/")


def fabric_findings(nodes: Iterable[NodeView]) -> list[dict[str, Any]]:
    """The fabric probe's word (``netprobe.*``) as each node's agent reported it about itself — a finding
    about another node is not taken from it — slow ones first."""
    rows = []
    for n in nodes:
        for f in n.findings:
            if f.code.startswith("netprobe.") and _about(n.name, f):
                rows.append({"node": n.name, **f.to_dict()})
    return sorted(rows, key=lambda r: (r["severity"] != "warning", r["node"], r["code"], r["entity"]["id"]))


def unhealthy_gpus(nodes: Iterable[NodeView]) -> list[dict[str, Any]]:
    """GPUs whose current findings — on the GPU or on its links — make them degraded or unhealthy, worst first."""
    rows = []
    for n in nodes:
        per_gpu: dict[str, list[Finding]] = defaultdict(list)
        for f in n.findings:
            uuid = gpu_of(f)
            if uuid is not None:
                per_gpu[uuid].append(f)
        for uuid, fs in per_gpu.items():
            health = health_of(fs)
            if health in (Health.HEALTHY, Health.UNKNOWN):
                continue
            g = n.gpu(uuid=uuid) or {}
            index = g.get("index", next((f.entity.gpu_index for f in fs if f.entity.gpu_index is not None), None))
            rows.append({
                "node": n.name, "gpu": index, "uuid": uuid, "pci_bus_id": g.get("pci_bus_id"),
                "model": g.get("name"), "health": str(health),
                "codes": sorted({f.code for f in fs}),
                "action": str(max((f.action for f in fs), default=Action.NONE)),
            })
    return sorted(rows, key=lambda r: (r["health"] != "unhealthy", r["node"], r["gpu"] if r["gpu"] is not None else -1))
