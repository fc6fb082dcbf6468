"""A 64-bit digest of a tensor's bytes, computed where the tensor lives, in one pass.

Every 32-bit word ``w`` at word index ``i`` is mixed non-linearly:

    x = w ^ (i * 0x9E3779B1)          # position enters (a swap of two words changes the digest)
    h = fmix32(x)                     # murmur3 finaliser: a bijection with full avalanche

and the digest combines two lanes, ``S = Σ h mod 2^32`` and ``X = ⊕ h``. Because ``fmix32`` is a
bijection, a change to ONE word always changes ``S`` (a guarantee, not a probability). For two or
more changed words to go unseen, their changes in ``h`` must cancel in the sum AND in the xor at
once; ``h`` is an avalanche mix of the word and its position, so that is a ~2^-64 accident, unlike a
weighted sum of raw words where flipping the same bit in two words can cancel exactly.

On CUDA a fused Triton kernel reads the words once and only the 8-byte result leaves the device;
the torch implementation (``digest_torch``) is the reference and the CPU path. They agree bit for
bit (checked on the GPU machine by ``python -m gpuhealth.diag selftest`` and the SDC benchmark).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

GOLDEN_RATIO_32 = 0x9E3779B1
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
MASK32 = 0xFFFFFFFF
# Words per chunk in the torch path: bounds its int64 temporaries (~8 × 8 bytes per word).
_TORCH_CHUNK = 1 << 22


class HashError(ValueError):
    """The tensor cannot be hashed as 32-bit words (odd byte count, too large)."""


def words_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int32 view (no copy when it is contiguous)."""
    flat = t.contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes % 4:
        raise HashError(f"{nbytes} bytes is not a whole number of 32-bit words")
    if nbytes // 4 >= 2**31 - 2**16:  # the kernel's int32 offsets must not wrap past the last block
        raise HashError("tensors of 8 GiB or more are not hashed in one call")
    return flat.view(torch.uint8).view(torch.int32)


def finalize(lane_sum: int, lane_xor: int, n_words: int) -> str:
    """Fold the two lanes and the length into 16 hex characters (host side, 3 integers)."""
    lane_sum &= MASK32
    lane_xor &= MASK32
    h = (lane_sum << 32) | lane_xor
    h ^= (n_words * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    # splitmix64 finaliser so the printed digest does not expose the lanes' structure.
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 31
    return f"{h:016x}"


def _fmix32_i64(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 on non-negative int64 values below 2^32 (torch has no uint32 arithmetic)."""
    x = x ^ (x >> 16)
    x = (x * FMIX_C1) & MASK32  # int64 product wraps; its low 32 bits are exact
    x = x ^ (x >> 13)
    x = (x * FMIX_C2) & MASK32
    return x ^ (x >> 16)


def lanes_torch(words: torch.Tensor) -> tuple[int, int]:
    """Reference implementation with torch ops, chunked. Returns (sum lane, xor lane)."""
    n = words.numel()
    total = 0
    xor_acc = torch.zeros((), dtype=torch.int64, device=words.device)
    sum_acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, n, _TORCH_CHUNK):
        chunk = words[start : start + _TORCH_CHUNK].to(torch.int64) & MASK32
        idx = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=words.device)
        h = _fmix32_i64(chunk ^ ((idx * GOLDEN_RATIO_32) & MASK32))
        sum_acc = (sum_acc + h.sum()) & MASK32
        # xor-reduce by folding halves (torch has no xor reduction)
        while h.numel() > 1:
            if h.numel() % 2:
                h = torch.cat([h, h.new_zeros(1)])
            half = h.numel() // 2
            h = h[:half] ^ h[half:]
        xor_acc = xor_acc ^ h.reshape(())
        total += chunk.numel()
    return int(sum_acc.item()), int(xor_acc.item())


def digest_torch(t: torch.Tensor) -> str:
    words = words_of(t)
    s, x = lanes_torch(words)
    return finalize(s, x, words.numel())


@functools.cache
def _triton_kernel() -> Any:
    """The fused kernel, imported on first use (triton exists only on CUDA machines)."""
    from gpuhealth.diag._triton_hash import hash_words_fast

    return hash_words_fast


# Launch shape, tuned on an H200 by benchmarks/hash_tune.py (GPU time only, CUDA-graph replay).
HASH_BLOCK = 2048
HASH_WARPS = 8
HASH_PROGRAMS_PER_SM = 4


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def lanes_triton(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the fused kernel; returns the 2-word int32 lane tensor ON THE DEVICE (no sync)."""
    kernel = _triton_kernel()
    if out is None:
        out = torch.zeros(2, dtype=torch.int32, device=words.device)
    else:
        out.zero_()
    n = words.numel()
    sms = _sm_count(words.device.index if words.device.index is not None else torch.cuda.current_device())
    # A persistent grid: a few programs per SM, each striding over the tensor (no tail effects).
    # 4 per SM measured best on H200 (benchmarks/hash_tune.py: 2,330 GB/s vs 1,660 GB/s at 8 per SM).
    grid = (max(1, min(sms * HASH_PROGRAMS_PER_SM, (n + HASH_BLOCK - 1) // HASH_BLOCK)),)
    kernel[grid](words, n, out, BLOCK=HASH_BLOCK, num_warps=HASH_WARPS)
    return out


def lanes_to_digest(lanes: torch.Tensor, n_words: int) -> str:
    s, x = (int(v) & MASK32 for v in lanes.tolist())
    return finalize(s, x, n_words)


def digest(t: torch.Tensor, *, impl: str = "auto") -> str:
    """The digest of ``t``: the fused kernel on CUDA (when triton is present), else torch ops."""
    words = words_of(t)
    if impl == "triton" or (impl == "auto" and words.is_cuda and triton_available()):
        return lanes_to_digest(lanes_triton(words), words.numel())
    s, x = lanes_torch(words)
    return finalize(s, x, words.numel())


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
