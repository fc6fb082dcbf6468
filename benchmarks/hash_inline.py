"""Where does the in-line cost of the hash come from? GPU time per call of the matmul alone and the
matmul followed by: the hash of its output, the hash of an older buffer (no fresh data), the zeroing only.

    PYTHONPATH=src:benchmarks python benchmarks/hash_inline.py
Each condition is captured 4 times in a CUDA graph; graphs are replayed round-robin (order rotated
each round) 40 times, so clock and power drift hit all conditions alike. Prints medians and quartiles.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from sdc_bench import _capture

from gpuhealth.diag import hashing, sdc


def round_robin_ms(fns: dict[str, Callable[[], Any]], inner: int = 4, rounds: int = 40) -> dict[str, list[float]]:
    graphs = {name: _capture(fn, inner) for name, fn in fns.items()}
    names = list(graphs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graphs[name].replay()
            e.record()
            e.synchronize()
            times[name].append(s.elapsed_time(e) / inner)
    return times


def main() -> None:
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(dev), "torch", torch.__version__)
    for case in sdc.plan_cases(dev, [sdc.Datapath.FP8, sdc.Datapath.BF16]):
        with sdc.math_mode(case.datapath):
            a, b = sdc._inputs(case, dev, 1)
            stale = hashing.words_of(sdc.matmul(case, a, b)).clone()
            buf = torch.zeros(2, dtype=torch.int32, device=dev)
            fns: dict[str, Callable[[], Any]] = {
                "matmul": lambda: sdc.matmul(case, a, b),  # noqa: B023
                "matmul+hash(out)": lambda: hashing.lanes_triton(hashing.words_of(sdc.matmul(case, a, b)), buf),  # noqa: B023
                "matmul+hash(old buffer)": lambda: (sdc.matmul(case, a, b), hashing.lanes_triton(stale, buf)),  # noqa: B023
                "matmul+zero": lambda: (sdc.matmul(case, a, b), buf.zero_()),  # noqa: B023
                "hash(old buffer)": lambda: hashing.lanes_triton(stale, buf),  # noqa: B023
            }
            times = round_robin_ms(fns)
        base = statistics.median(times["matmul"])
        print(case.case_id)
        for name, xs in times.items():
            q = statistics.quantiles(xs, n=4)
            med = statistics.median(xs)
            print(f"  {name:26} median {med * 1e3:8.1f} us  (q1 {q[0] * 1e3:8.1f}, q3 {q[2] * 1e3:8.1f})"
                  f"  {100 * (med - base) / base:+6.1f} % of the matmul")


if __name__ == "__main__":
    main()
