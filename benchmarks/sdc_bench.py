"""SDC check on real GPUs: matmul throughput vs plain torch, hash cost, full-pass GPU time, agreement.

Run on a CUDA machine from the repo root:  PYTHONPATH=src python benchmarks/sdc_bench.py [--out FILE]
Prints a table; writes every number as JSON to --out. Goals (issue 5): SDC matmul ≥ 95% of plain
torch.matmul throughput on the same GPU and shape; hash ≤ 5% of the matmul (also timed as GPU time only,
in CUDA graphs, so host launch gaps do not count); a full SDC pass
≤ 1 s of GPU time per GPU; all GPUs agree bitwise; the Triton and torch hashes agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from gpuhealth.diag import hashing, sdc
from gpuhealth.diag.compare import DeviceRef


def bench_ms(fn: Any, reps: int = 20, warmup: int = 3) -> float:
    """Median of per-call device-event times."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def alternating_ms(first: Any, second: Any, reps: int = 24, warmup: int = 3) -> tuple[tuple[float, float],
                                                                                     tuple[float, float]]:
    """Per-call device times of two functions called in ABBA order; returns (median, p25) for each."""
    for _ in range(warmup):
        first()
        second()
    torch.cuda.synchronize()
    times: dict[int, list[float]] = {0: [], 1: []}
    order = [0, 1, 1, 0]
    for i in range(reps):
        which = order[i % 4]
        fn = first if which == 0 else second
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times[which].append(s.elapsed_time(e))

    def stats(xs: list[float]) -> tuple[float, float]:
        return statistics.median(xs), statistics.quantiles(xs, n=4)[0]

    return stats(times[0]), stats(times[1])


def _capture(fn: Any, inner: int) -> Any:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_alternating_ms(first: Any, second: Any, inner: int = 4, reps: int = 40) -> tuple[float, float]:
    """GPU time per call of two functions, each captured ``inner`` times in a CUDA graph and the
    graphs replayed in ABBA order: no host launch gaps, and drift hits both. Returns the medians."""
    graphs = (_capture(first, inner), _capture(second, inner))
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(reps):
        which = (0, 1, 1, 0)[i % 4]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graphs[which].replay()
        e.record()
        e.synchronize()
        times[which].append(s.elapsed_time(e) / inner)
    return statistics.median(times[0]), statistics.median(times[1])


def hash_agreement(dev: torch.device) -> list[dict[str, Any]]:
    """Triton kernel vs torch reference on varied dtypes and sizes (including ragged tails)."""
    rows = []
    g = torch.Generator(device=dev).manual_seed(7)
    for dtype, shape in [(torch.bfloat16, (8192, 8192)), (torch.float16, (1000, 1002)), (torch.float32, (3, 5)),
                         (torch.float64, (4096, 4096)), (torch.float32, (12345, 77)), (torch.bfloat16, (2, 2))]:
        t = torch.randn(shape, generator=g, device=dev).to(dtype)
        a, b = hashing.digest(t, impl="triton"), hashing.digest(t, impl="torch")
        rows.append({"dtype": str(dtype), "shape": list(shape), "triton": a, "torch": b, "agree": a == b})
    return rows


def per_case(dev: torch.device, seed: int) -> list[dict[str, Any]]:
    rows = []
    for case in sdc.plan_cases(dev):
        rows.append(one_case(case, dev, seed))
        torch.cuda.empty_cache()
    return rows


def one_case(case: sdc.Case, dev: torch.device, seed: int) -> dict[str, Any]:
    """Plain torch call vs the SDC call on the same inputs (interleaved twice), then the hash."""
    with sdc.math_mode(case.datapath):
        a, b = sdc._inputs(case, dev, seed)  # fp8: b is (n, k); else (k, n)
        if case.datapath is sdc.Datapath.FP8:
            one = torch.ones((), device=dev)
            b_col = b.t()  # _scaled_mm's required layout: the plain call is the same op

            def plain() -> Any:
                return torch._scaled_mm(a, b_col, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        else:
            b_kn = b.clone()  # its own copy, so the two calls do not share a warm L2

            def plain() -> Any:
                return torch.matmul(a, b_kn)

        def sdc_mm() -> Any:
            return sdc.matmul(case, a, b)

        # Alternate the two call by call (ABBA), so clock and power drift over the run hit both equally;
        # measured in blocks (A block then B block) the 8192³ cases drifted 5-10 % between blocks.
        pa, sa = alternating_ms(plain, sdc_mm)
        p1, p2 = pa
        s1, _s2 = sa
        out = sdc_mm()
        words = hashing.words_of(out)
        buf = torch.zeros(2, dtype=torch.int32, device=dev)
        h_triton = bench_ms(lambda: hashing.lanes_triton(words, buf))
        row: dict[str, Any] = {"case": case.case_id, "plain_ms": p1, "sdc_ms": s1,
                               "plain_spread": abs(p1 - p2) / min(p1, p2), "hash_ms": h_triton,
                               "out_mib": words.numel() * 4 / 2**20}
        if case.datapath is sdc.Datapath.BF16 and case.shape == "square":
            weights = torch.arange(1, words.numel() + 1, device=dev, dtype=torch.int64)
            row["plain_torch_hash_ms"] = bench_ms(lambda: (words.to(torch.int64) * weights).sum(), reps=10)
        row["tflops_plain"] = case.flops / (row["plain_ms"] * 1e-3) / 1e12
        row["tflops_sdc"] = case.flops / (row["sdc_ms"] * 1e-3) / 1e12
        row["throughput_ratio"] = row["plain_ms"] / row["sdc_ms"]
        row["hash_fraction"] = h_triton / row["sdc_ms"]

        # The hash as the check runs it: queued right behind the matmul, so its launch overlaps the
        # matmul and only its GPU time counts. (matmul + hash) vs matmul alone, alternated.
        def checked() -> Any:
            return hashing.lanes_triton(hashing.words_of(sdc_mm()), buf)

        (p_only, _), (p_and_h, _) = alternating_ms(plain, checked)
        row["hash_pipelined_fraction"] = max(0.0, p_and_h - p_only) / p_only
        row["hash_gbps"] = words.numel() * 4 / (h_triton * 1e-3) / 1e9
        # GPU time only (CUDA graphs): the hash kernel by itself, and matmul+hash vs matmul.
        g_hash = graph_alternating_ms(lambda: hashing.lanes_triton(words, buf),
                                      lambda: hashing.lanes_triton(words, buf), inner=20, reps=8)[0]
        g_mm, g_checked = graph_alternating_ms(plain, checked)
        row["graph_hash_ms"] = g_hash
        row["graph_hash_gbps"] = words.numel() * 4 / (g_hash * 1e-3) / 1e9
        row["graph_matmul_ms"] = g_mm
        row["graph_checked_ms"] = g_checked
        row["graph_hash_fraction"] = g_hash / g_mm
        row["graph_inline_fraction"] = max(0.0, g_checked - g_mm) / g_mm
        return row


def full_pass(seed: int, selftest: bool) -> dict[str, Any]:
    specs = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        specs.append(sdc.DeviceSpec(DeviceRef(f"cuda:{i}", f"GPU-{p.uuid}", i, p.name), torch.device("cuda", i)))
    with tempfile.TemporaryDirectory() as gold:
        t0 = time.perf_counter()
        rep = sdc.run_sdc(specs, seed=seed, golden_dir=gold, selftest=selftest)
        wall = time.perf_counter() - t0
    digests = [{c["case"]: c["digest"] for c in d["cases"]} for d in rep.devices]
    return {"wall_s": wall, "gpu_seconds": {d["device"]: d["gpu_seconds"] for d in rep.devices},
            "wall_per_device": {d["device"]: d["wall_seconds"] for d in rep.devices},
            "all_agree": all(x == digests[0] for x in digests), "findings": [f.to_dict() for f in rep.findings],
            "golden": rep.golden, "selftest": rep.selftest, "key": rep.key, "digests": digests[0]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--seed", type=int, default=sdc.DEFAULT_SEED)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpus": smi,
                           "torch": torch.__version__, "cuda": torch.version.cuda,
                           "driver": sdc._driver_version()}
    doc["hash_agreement"] = hash_agreement(dev)
    doc["cases"] = per_case(dev, args.seed)
    doc["full_pass_cold"] = full_pass(args.seed, selftest=False)  # includes cuBLAS/Triton first use
    doc["full_pass"] = full_pass(args.seed, selftest=False)
    doc["selftest"] = full_pass(args.seed, selftest=True)["selftest"]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    print(smi)
    print(f"torch {doc['torch']} CUDA {doc['cuda']} driver {doc['driver']}")
    print(f"triton==torch hash on {len(doc['hash_agreement'])} tensors: "
          f"{all(r['agree'] for r in doc['hash_agreement'])}")
    print(f"{'case':34} {'plain ms':>9} {'sdc ms':>9} {'ratio':>6} {'TF/s':>6} {'hash ms':>8} {'hash%':>6} {'GB/s':>6}"
          f" {'in-line%':>8} | GPU-time only: {'hash us':>7} {'GB/s':>6} {'hash%':>6} {'in-line%':>8}")
    for r in doc["cases"]:
        print(f"{r['case']:34} {r['plain_ms']:9.3f} {r['sdc_ms']:9.3f} {r['throughput_ratio']:6.3f} "
              f"{r['tflops_sdc']:6.0f} {r['hash_ms']:8.4f} {100 * r['hash_fraction']:5.1f}% {r['hash_gbps']:6.0f}"
              f" {100 * r['hash_pipelined_fraction']:7.1f}% | {'':14} {r['graph_hash_ms'] * 1e3:7.1f}"
              f" {r['graph_hash_gbps']:6.0f} {100 * r['graph_hash_fraction']:5.1f}%"
              f" {100 * r['graph_inline_fraction']:7.1f}%")
        if "plain_torch_hash_ms" in r:
            print(f"   plain-torch weighted-sum hash on the same output: {r['plain_torch_hash_ms']:.3f} ms")
    fp = doc["full_pass"]
    cold = doc["full_pass_cold"]["wall_s"]
    print(f"full pass: GPU seconds {fp['gpu_seconds']}, wall {fp['wall_s']:.2f} s (cold {cold:.2f} s)")
    print(f"all GPUs agree: {fp['all_agree']}, findings: {len(fp['findings'])}")
    st = doc["selftest"]
    print(f"self-test: {st['detected']}/{st['injected']} detected, passed={st['passed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
