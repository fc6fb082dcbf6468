"""Tune the fused SDC hash kernel on a real GPU: kernel variants and launch shapes, timed without host gaps.

    PYTHONPATH=src python benchmarks/hash_tune.py
Each variant is captured 20 times in a CUDA graph (with the accumulator zeroing) and replayed, so the
numbers are GPU time only; a raw read kernel (no mixing) and a device copy give the memory ceiling.
Every variant must give the same lanes as the torch reference. Prints GB/s per shape, best first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from sdc_bench import _capture

from gpuhealth.diag import hashing
from gpuhealth.diag._triton_hash import _fold, hash_words, hash_words_fast


@triton.jit
def _read_only(words_ptr, n_words, out_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """The memory ceiling: sum the raw words, no mixing (not a usable hash)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.uint32)
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n_words // BLOCK * BLOCK, step):
        acc += tl.load(words_ptr + start + lanes).to(tl.uint32, bitcast=True)
    _fold(acc, acc, out_ptr)


def graph_ms(fn: Callable[[], object], inner: int = 20, replays: int = 5) -> float:
    """GPU time per call: ``inner`` calls captured in one CUDA graph, replayed (no host gaps)."""
    graph = _capture(fn, inner)
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / inner)
    return sorted(times)[len(times) // 2]


# A variant loading two blocks per round ("fast_x2") was tried and gave nothing over "fast"
# (benchmarks/results/hash_tune_h200_2026-11-26b.txt); it is no longer carried here.
KERNELS = {"v1 (first shipped)": hash_words, "fast (shipped)": hash_words_fast, "read-only ceiling": _read_only}


def main() -> None:
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(dev), f"{sms} SMs", "torch", torch.__version__, "triton", triton.__version__)
    for mib in (128, 8):
        n = mib * 2**20 // 4 + 3  # a ragged tail on purpose
        words = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device=dev)
        ref = torch.tensor(hashing.lanes_torch(words), dtype=torch.int64).to(torch.int32)
        nbytes = n * 4
        src = words.clone()
        copy_ms = graph_ms(lambda: words.copy_(src))  # noqa: B023
        print(f"{mib} MiB: device copy {2 * nbytes / (copy_ms * 1e-3) / 1e9:.0f} GB/s (read+write)")
        out = torch.zeros(2, dtype=torch.int32, device=dev)
        shipped_ms = graph_ms(lambda: hashing.lanes_triton(words, out))  # noqa: B023
        print(f"  shipped lanes_triton: {shipped_ms * 1e3:.1f} us = {nbytes / (shipped_ms * 1e-3) / 1e9:.0f} GB/s,"
              f" same as torch: {bool(torch.equal(out.cpu(), ref))}")
        rows = []
        for (name, kernel), block, warps, per_sm in itertools.product(KERNELS.items(), (1024, 2048, 4096),
                                                                      (4, 8), (2, 4, 8)):
            grid = (max(1, min(sms * per_sm, (n + block - 1) // block)),)

            def run(kernel: object = kernel, grid: tuple[int] = grid, block: int = block, warps: int = warps,
                    out: torch.Tensor = out, words: torch.Tensor = words, n: int = n) -> None:
                out.zero_()
                kernel[grid](words, n, out, BLOCK=block, num_warps=warps)  # type: ignore[index]

            try:
                ms = graph_ms(run)
            except Exception as exc:  # a shape the compiler refuses
                print(f"  {name} block {block} warps {warps} per_sm {per_sm}: {type(exc).__name__}: {exc}"[:200])
                continue
            run()
            ok = bool(torch.equal(out.cpu(), ref))
            rows.append((nbytes / (ms * 1e-3) / 1e9, ms, name, block, warps, per_sm, ok))
        for name in KERNELS:
            best = sorted((r for r in rows if r[2] == name), reverse=True)[:4]
            for gbps, ms, _, block, warps, per_sm, ok in best:
                print(f"  {name:20} {gbps:6.0f} GB/s {ms * 1e3:7.1f} us BLOCK={block} warps={warps} "
                      f"programs/SM={per_sm} same={ok}")


if __name__ == "__main__":
    main()
