"""The fabric probe's cost and quality (issue 31 item 3).

    PYTHONPATH=src python benchmarks/fabric_probe.py [--nodes 4,8] [--faults 24] [--json OUT]

Needs root, ``ip`` and ``tc``: nodes are network namespaces on a bridge (tests/integration/fabric_netns.py), each
running the shipped ``gpuhealth diag fabric --from-env`` as torchrun/srun would.

1. Cost, measured: a healthy probe at each ``--nodes`` size (full schedule, the test's options: 1 MiB, best of 4);
   rounds, the wall time of each round, retests, the whole probe.
2. Cost, modelled for 64 and 256 nodes from the measured rounds: a round's time fitted as a + b·N over the
   measured sizes (the barrier that ends a round grows with N), times the rounds (full: N−1; "nodes": the
   halving schedule), plus the retest budget (2 passes × 16 directions alone, at the measured per-direction
   time). A real fabric moves the bytes faster; the per-round overhead is what dominates here.
3. Quality over ``--faults`` random faults (a node's link, a NIC's send or receive side, one direction of one
   pair; severity 1/2 to 1/20) injected into the healthy matrices measured at the largest size — each
   slowed direction's reading × severity, as a shaper caps a link — then judged as the probe judges
   (``fabric.judge``, default slow line 0.6 and the test's 0.3). Precision: named culprits that are the fault;
   recall: faults named as what they are. Also a few faults shaped for real with tc (``--real``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fabric_netns import NetnsCluster, run_probe  # noqa: E402

from gpuhealth.diag import fabric  # noqa: E402

CLI = [sys.executable, "-m", "gpuhealth.cli.main"]
ARGS = ["--size-bytes", str(1 << 20), "--iters", "4", "--slow-fraction", "0.3", "--latency-floor-us", "20000"]


def probe(n: int, work: Path, port: int, shape: Any = None, args: list[str] = ARGS) -> dict[str, Any]:
    with NetnsCluster(n, prefix=f"gh31b{port}") as c:
        if shape:
            shape(c)
        t0 = time.monotonic()
        _, doc, tails = run_probe(c, work, CLI, args, port=port, timeout=600)
        wall = time.monotonic() - t0
    if doc.get("status") != "ok":
        raise SystemExit("probe failed:\n" + "\n".join(tails))
    r = doc["result"]
    return {"nodes": n, "rounds": len(r["round_s"]), "round_s": r["round_s"], "retest_s": r["retest_s"],
            "retested": len(r["retested"]), "probe_s": r["probe_s"], "command_wall_s": round(wall, 1),
            "named": sorted((f["code"], f["entity"]["id"]) for f in doc["findings"]),
            "measurements": r["measurements"]}


def model(measured: list[dict[str, Any]]) -> dict[str, Any]:
    xs = [m["nodes"] for m in measured]
    ys = [statistics.median(m["round_s"]) for m in measured]
    if len(set(xs)) >= 2:
        b = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        a = ys[0] - b * xs[0]
    else:
        a, b = ys[0], 0.0
    b = max(b, 0.0)
    per_direction = max(m["retest_s"] / max(m["retested"], 1) for m in measured)
    retest = 2 * 16 * per_direction
    out = {"round_s_fit": {"a": round(a, 4), "b_per_node": round(b, 5)}, "retest_budget_s": round(retest, 2)}
    for n in (8, 64, 256):
        t = a + b * n
        full, halving = len(fabric.schedule(n, "full")), len(fabric.schedule(n, "nodes"))
        out[str(n)] = {"full_rounds": full, "full_s": round(full * t + retest, 1),
                       "nodes_rounds": halving, "nodes_s": round(halving * t + retest, 1)}
    return out


def inject(m: fabric.Measurements, kind: str, who: tuple[int, ...], severity: float) -> fabric.Measurements:
    out = fabric.Measurements(list(m.names), dict(m.bandwidth), dict(m.rtt_us))
    for (s, d) in out.bandwidth:
        hit = ((kind == "node" and who[0] in (s, d)) or (kind == "send" and s == who[0])
               or (kind == "recv" and d == who[0]) or (kind == "pair" and (s, d) == who))
        if hit:
            out.bandwidth[(s, d)] *= severity
    return out


EXPECT = {"node": "node_slow", "send": "nic_send_slow", "recv": "nic_recv_slow"}


def quality(healthy: list[fabric.Measurements], faults: int, slow_fraction: float, seed: int = 31) -> dict[str, Any]:
    rng = random.Random(seed)
    tp = fp = fn = 0
    misses: list[str] = []
    for k in range(faults):
        base = healthy[k % len(healthy)]
        n = len(base.names)
        kind = ("node", "send", "recv", "pair")[k % 4]
        who = tuple(rng.sample(range(n), 2)) if kind == "pair" else (rng.randrange(n),)
        severity = 1 / rng.uniform(2, 20)
        v = fabric.judge(inject(base, kind, who, severity), fabric.Thresholds(slow_fraction=slow_fraction))
        named = {(name, word) for name, word in v.nodes.items()} | {(f"{s}->{d}", "link") for s, d in v.links}
        want = ((base.names[who[0]], EXPECT[kind]) if kind != "pair"
                else (f"{base.names[who[0]]}->{base.names[who[1]]}", "link"))
        hit = want in named
        tp += hit
        fn += not hit
        fp += len(named - {want})
        if not hit or len(named) > 1:
            misses.append(f"{kind} {want[0]} ×{severity:.3f}: named {sorted(named)}")
    return {"faults": faults, "slow_fraction": slow_fraction, "precision": round(tp / max(tp + fp, 1), 3),
            "recall": round(tp / max(tp + fn, 1), 3), "true_positives": tp, "false_positives": fp,
            "missed": fn, "notes": misses}


def real_random(n: int, work: Path, port: int, healthy: list[fabric.Measurements], faults: int,
                slow_fraction: float, seed: int = 3131) -> dict[str, Any]:
    """Random faults shaped with tc: a node's link, a NIC's send or receive side, one direction of one pair, at
    severity × the healthy reference (tbf/htb rates), each probed through the shipped command."""
    rng = random.Random(seed)
    ref_bps = statistics.median(ref for m in healthy if (ref := fabric.reference(m))) * 8
    args = [*ARGS[:ARGS.index("--slow-fraction")], "--slow-fraction", str(slow_fraction),
            *ARGS[ARGS.index("--slow-fraction") + 2:]]
    tp = fp = fn = 0
    runs = []
    for k in range(faults):
        kind = ("node", "send", "recv", "pair")[k % 4]
        who = rng.sample(range(n), 2)
        severity = 1 / rng.uniform(2, 20)
        rate = f"{max(1, int(ref_bps * severity / 1000))}kbit"
        if kind == "node":
            def shape(c: NetnsCluster, w: list[int] = who, r: str = rate) -> None:
                c.slow_node(w[0], r)
            want = ("netprobe.node_slow", f"n{who[0]}")
        elif kind == "send":
            def shape(c: NetnsCluster, w: list[int] = who, r: str = rate) -> None:
                c.slow_sends(w[0], r)
            want = ("netprobe.nic_send_slow", f"n{who[0]}")
        elif kind == "recv":
            def shape(c: NetnsCluster, w: list[int] = who, r: str = rate) -> None:
                c.slow_receives(w[0], r)
            want = ("netprobe.nic_recv_slow", f"n{who[0]}")
        else:
            def shape(c: NetnsCluster, w: list[int] = who, r: str = rate) -> None:
                c.slow_pair(w[0], w[1], r)
            want = ("netprobe.link_slow", f"n{who[0]}->n{who[1]}")
        port += 1
        t0 = time.monotonic()
        r = probe(n, work, port, shape, args)
        named = {tuple(x) for x in r["named"] if x[0] != "netprobe.latency_high"}
        hit = want in named
        tp, fn, fp = tp + hit, fn + (not hit), fp + len(named - {want})
        runs.append({"fault": kind, "severity": round(severity, 3), "rate": rate, "want": want,
                     "named": sorted(named), "probe_s": r["probe_s"], "command_s": round(time.monotonic() - t0, 1)})
        print(f"real {kind} ×{severity:.3f} ({rate}): want {want}, named {sorted(named)}, probe {r['probe_s']} s",
              flush=True)
    return {"faults": faults, "slow_fraction": slow_fraction, "precision": round(tp / max(tp + fp, 1), 3),
            "recall": round(tp / max(tp + fn, 1), 3), "true_positives": tp, "false_positives": fp, "missed": fn,
            "median_probe_s": statistics.median(x["probe_s"] for x in runs), "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="4,8")
    ap.add_argument("--faults", type=int, default=24)
    ap.add_argument("--healthy-runs", type=int, default=2, help="healthy probes at the largest size")
    ap.add_argument("--real", action="store_true", help="also shape three faults for real at the largest size")
    ap.add_argument("--real-faults", type=int, default=0,
                    help="random faults shaped for real with tc (severity 1/2..1/20 of the healthy reference)")
    ap.add_argument("--real-slow-fraction", type=float, default=0.6)
    ap.add_argument("--json", dest="out")
    args = ap.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="gh31b-bench-"))
    measured, port = [], 29700
    for n in sizes:
        port += 1
        measured.append(probe(n, work, port))
        print(f"{n} nodes: {measured[-1]['rounds']} rounds, median round {statistics.median(measured[-1]['round_s'])}"
              f" s, probe {measured[-1]['probe_s']} s, command {measured[-1]['command_wall_s']} s, "
              f"named {measured[-1]['named']}", flush=True)
    healthy = [measured[-1]]
    for _ in range(args.healthy_runs - 1):
        port += 1
        healthy.append(probe(sizes[-1], work, port))
        print(f"{sizes[-1]} nodes again: named {healthy[-1]['named']}", flush=True)
    mats = [fabric.Measurements.from_dict(h["measurements"]) for h in healthy]
    doc: dict[str, Any] = {"measured": [{k: v for k, v in m.items() if k != "measurements"} for m in measured],
                           "healthy_named": [h["named"] for h in healthy], "model": model(measured),
                           "quality": [quality(mats, args.faults, 0.6), quality(mats, args.faults, 0.3)]}
    if args.real:
        n = sizes[-1]
        real = []
        for name, shape, want in (("node", lambda c: c.slow_node(2, "100mbit"), ("netprobe.node_slow", "n2")),
                                  ("send", lambda c: c.slow_sends(5, "100mbit"), ("netprobe.nic_send_slow", "n5")),
                                  ("pair", lambda c: c.slow_pair(6, 1, "100mbit"), ("netprobe.link_slow", "n6->n1"))):
            port += 1
            r = probe(n, work, port, shape)
            real.append({"fault": name, "want": want, "named": r["named"], "probe_s": r["probe_s"]})
            print(f"real {name}: named {r['named']}", flush=True)
        doc["real"] = real
    if args.real_faults:
        doc["real_random"] = real_random(sizes[-1], work, port, mats, args.real_faults, args.real_slow_fraction)
    print(json.dumps({k: v for k, v in doc.items()}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
