"""The digest: what it must catch (every injected fault class) and what it must not flag."""

from __future__ import annotations

import pytest
import torch

from gpuhealth.diag import hashing
from gpuhealth.diag.sdc import FaultKind, inject_fault


def _ref_lanes(words: torch.Tensor) -> tuple[int, int]:
    """An independent, slow, pure-Python rendering of the documented mixing (the spec)."""
    s = x = 0
    for i, w in enumerate(words.tolist()):
        v = (w & 0xFFFFFFFF) ^ ((i * 0x9E3779B1) & 0xFFFFFFFF)
        v ^= v >> 16
        v = (v * 0x85EBCA6B) & 0xFFFFFFFF
        v ^= v >> 13
        v = (v * 0xC2B2AE35) & 0xFFFFFFFF
        v ^= v >> 16
        s = (s + v) & 0xFFFFFFFF
        x ^= v
    return s, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_torch_lanes_match_the_specification(dtype: torch.dtype) -> None:
    t = torch.randn(37, 18, generator=torch.Generator().manual_seed(3)).to(dtype)
    words = hashing.words_of(t)
    assert hashing.lanes_torch(words) == _ref_lanes(words)


def test_chunked_path_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(1000, 9)
    whole = hashing.digest_torch(t)
    monkeypatch.setattr(hashing, "_TORCH_CHUNK", 97)  # many uneven chunks, odd fold lengths
    assert hashing.digest_torch(t) == whole


def test_same_bytes_same_digest_and_length_matters() -> None:
    t = torch.randn(64, 64)
    assert hashing.digest(t) == hashing.digest(t.clone())
    z = torch.zeros(8, dtype=torch.int32)
    assert hashing.digest(z) != hashing.digest(torch.zeros(16, dtype=torch.int32))


def test_swapping_two_words_changes_the_digest() -> None:
    t = torch.arange(100, dtype=torch.int32)
    swapped = t.clone()
    swapped[[3, 70]] = swapped[[70, 3]]
    assert hashing.digest(t) != hashing.digest(swapped)


def test_every_single_bit_flip_of_a_small_output_is_detected() -> None:
    """fmix32 is a bijection, so any one-word change must move the sum lane: exhaustively."""
    t = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    clean = hashing.digest(t)
    words = hashing.words_of(t)
    for i in range(words.numel()):
        for bit in range(32):
            mask = (1 << bit) - (1 << 32) if bit == 31 else 1 << bit
            words[i] ^= mask
            assert hashing.digest(t) != clean, (i, bit)
            words[i] ^= mask
    assert hashing.digest(t) == clean


def test_paired_flips_of_the_same_bit_are_detected_where_a_weighted_sum_is_not() -> None:
    """The docs/measurements.md plain-torch hash (Σ word × weight) cancels for a pair of flips chosen
    against it; the mixed digest does not."""
    words = torch.zeros(64, dtype=torch.int32)
    weights = torch.arange(1, 65, dtype=torch.int64)

    def weighted(w: torch.Tensor) -> int:
        return int((w.to(torch.int64) * weights).sum())

    clean_w, clean_d = weighted(words), hashing.digest(words)
    # word 1 (weight 2) gains 2 (bit 1 set) and word 3 (weight 4) loses 1 (all 32 bits flipped to
    # -1): the weighted sum moves by 2·2 − 4·1 = 0, so that hash cannot see the corruption.
    bad = words.clone()
    bad[1] = 2
    bad[3] = -1
    assert weighted(bad) == clean_w
    assert hashing.digest(bad) != clean_d


@pytest.mark.parametrize("kind", list(FaultKind))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_injected_faults_are_always_detected_and_undone(kind: FaultKind, dtype: torch.dtype) -> None:
    out = torch.randn(96, 80, generator=torch.Generator().manual_seed(5)).to(dtype)
    clean = hashing.digest(out)
    for seed in range(25):
        undo = inject_fault(out, kind, rng_seed=seed)
        assert hashing.digest(out) != clean, (kind, seed)
        undo()
        assert hashing.digest(out) == clean


def test_a_tensor_that_is_not_whole_words_is_refused() -> None:
    with pytest.raises(hashing.HashError):
        hashing.words_of(torch.zeros(3, dtype=torch.int8))
