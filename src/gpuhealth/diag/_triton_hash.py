"""The fused hash kernels (imported only where triton is installed; see ``hashing.py``).

Both kernels compute the same lanes. ``hash_words`` is the straightforward form (one masked loop);
``hash_words_fast`` is what ships: full blocks load unmasked, the position key ``i * K`` is carried
forward by one add per word instead of a multiply, and only program 0 touches the ragged tail. At
~15 integer operations per word the first form is close to compute-bound on an H200 (the words
arrive at ~4 TB/s, ~1 word per SM lane per cycle), so each operation saved is time saved.
"""

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
def _fmix(x, c1, c2):  # type: ignore[no-untyped-def]
    # c1, c2 arrive as uint32 tensors: a bare constexpr above 2**31 would promote the product to int64
    x = x ^ (x >> 16)
    x = x * c1
    x = x ^ (x >> 13)
    x = x * c2
    return x ^ (x >> 16)


@triton.jit
def _fold(acc_sum, acc_xor, out_ptr):  # type: ignore[no-untyped-def]
    s = tl.sum(acc_sum, axis=0).to(tl.uint32)
    xr = tl.reduce(acc_xor, 0, _xor)
    tl.atomic_add(out_ptr, s.to(tl.int32, bitcast=True))
    tl.atomic_xor(out_ptr + 1, xr.to(tl.int32, bitcast=True))


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
        x = _fmix(w ^ (offs.to(tl.uint32) * k_pos), c1, c2)
        x = tl.where(mask, x, tl.zeros_like(x))
        acc_sum += x
        acc_xor ^= x
    _fold(acc_sum, acc_xor, out_ptr)


@triton.jit
def hash_words_fast(words_ptr, n_words, out_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Same lanes as ``hash_words`` with fewer operations per word (see the module docstring)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    step = programs * BLOCK
    n_full = n_words // BLOCK * BLOCK
    lanes = tl.arange(0, BLOCK)
    acc_sum = tl.zeros([BLOCK], dtype=tl.uint32)
    acc_xor = tl.zeros([BLOCK], dtype=tl.uint32)
    k_pos = tl.full([BLOCK], K_POS, tl.uint32)
    c1 = tl.full([BLOCK], C1, tl.uint32)
    c2 = tl.full([BLOCK], C2, tl.uint32)
    # (pid*BLOCK + lane) * K, advanced by step * K each round: uint32 arithmetic wraps like the spec.
    key = (pid * BLOCK + lanes).to(tl.uint32) * k_pos
    key_step = k_pos * step.to(tl.uint32)
    ptrs = words_ptr + pid * BLOCK + lanes
    for _ in range(pid * BLOCK, n_full, step):
        w = tl.load(ptrs).to(tl.uint32, bitcast=True)
        x = _fmix(w ^ key, c1, c2)
        acc_sum += x
        acc_xor ^= x
        key += key_step
        ptrs += step
    if pid == programs - 1:
        offs = n_full + lanes
        mask = offs < n_words
        w = tl.load(words_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
        x = _fmix(w ^ (offs.to(tl.uint32) * k_pos), c1, c2)
        x = tl.where(mask, x, tl.zeros_like(x))
        acc_sum += x
        acc_xor ^= x
    _fold(acc_sum, acc_xor, out_ptr)
