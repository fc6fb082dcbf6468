"""Tune the fused SDC hash kernel's launch shape on a real GPU (BLOCK, warps, programs per SM).

    PYTHONPATH=src python benchmarks/hash_tune.py
Times ``hash_words`` over a 128 MiB output (the 8192² bf16 case) and a 16 MiB one, per launch shape,
and checks every shape gives the same lanes as the shipped launch. Prints GB/s per shape, best first.
"""

from __future__ import annotations

import itertools

import torch
from sdc_bench import bench_ms

from gpuhealth.diag import hashing
from gpuhealth.diag._triton_hash import hash_words


def main() -> None:
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for mib in (128, 16):
        words = torch.randint(-2**31, 2**31 - 1, (mib * 2**20 // 4,), dtype=torch.int32, device=dev)
        ref = hashing.lanes_triton(words).clone()
        n = words.numel()
        rows = []
        for block, warps, per_sm in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16), (2, 4, 8, 16)):
            out = torch.zeros(2, dtype=torch.int32, device=dev)
            grid = (max(1, min(sms * per_sm, (n + block - 1) // block)),)

            def run(out: torch.Tensor = out, grid: tuple[int] = grid, block: int = block, warps: int = warps) -> None:
                out.zero_()
                hash_words[grid](words, n, out, BLOCK=block, num_warps=warps)  # noqa: B023

            try:
                ms = bench_ms(run, reps=50, warmup=5)
            except Exception as exc:  # a shape the compiler refuses
                print(f"block {block} warps {warps} per_sm {per_sm}: {type(exc).__name__}")
                continue
            run()
            ok = bool(torch.equal(out, ref))
            rows.append((mib * 2**20 / (ms * 1e-3) / 1e9, ms, block, warps, per_sm, ok))
        rows.sort(reverse=True)
        shipped = bench_ms(lambda: hashing.lanes_triton(words, torch.zeros(2, dtype=torch.int32, device=dev)))  # noqa: B023
        print(f"{mib} MiB: shipped launch {shipped:.4f} ms = {mib * 2**20 / (shipped * 1e-3) / 1e9:.0f} GB/s")
        for gbps, ms, block, warps, per_sm, ok in rows[:8]:
            print(f"  {gbps:6.0f} GB/s  {ms:.4f} ms  BLOCK={block} warps={warps} programs/SM={per_sm} same={ok}")


if __name__ == "__main__":
    main()
