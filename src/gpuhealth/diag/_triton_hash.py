"""The fused hash kernel (imported only where triton is installed; see ``hashing.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

K_POS: tl.constexpr = tl.constexpr(0x9E3779B1)
C1: tl.constexpr = tl.constexpr(0x85EBCA6B)
C2: tl.constexpr = tl.constexpr(0xC2B2AE35)


@triton.jit
def _xor(a, b):  # type: ignore[no-untyped-def]  # triton resolves annotations: keep them off
    return a ^ b


@triton.jit
def hash_words(words_ptr, n_words, out_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Each program strides over the words, mixes each one (position + murmur3 fmix32) and keeps
    a wrapping sum and an xor; two atomics per program fold them into ``out_ptr[0:2]``."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc_sum = tl.zeros([BLOCK], dtype=tl.uint32)
    acc_xor = tl.zeros([BLOCK], dtype=tl.uint32)
    k_pos = tl.full([BLOCK], K_POS, tl.uint32)
    c1 = tl.full([BLOCK], C1, tl.uint32)
    c2 = tl.full([BLOCK], C2, tl.uint32)
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n_words, step):
        offs = start + lanes
        mask = offs < n_words
        w = tl.load(words_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
        x = w ^ (offs.to(tl.uint32) * k_pos)
        x = x ^ (x >> 16)
        x = x * c1
        x = x ^ (x >> 13)
        x = x * c2
        x = x ^ (x >> 16)
        x = tl.where(mask, x, tl.zeros_like(x))
        acc_sum += x
        acc_xor ^= x
    s = tl.sum(acc_sum, axis=0).to(tl.uint32)
    xr = tl.reduce(acc_xor, 0, _xor)
    tl.atomic_add(out_ptr, s.to(tl.int32, bitcast=True))
    tl.atomic_xor(out_ptr + 1, xr.to(tl.int32, bitcast=True))
