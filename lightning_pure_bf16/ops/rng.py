"""Counter-based random bits for stochastic rounding, shared bit for bit by every backend, and the seed mixers.

The bits for one element are a pure function of ``(seed, param_index, step, buffer, element index)``: no generator
state exists, so the Triton kernel and the PyTorch path draw the same bits, and a resumed run draws the same bits as an
uninterrupted one. The mixing function is the ``lowbias32`` integer hash published by Chris Wellons (hash-prospector),
chosen because it is a handful of 32-bit multiplies and shifts that every backend computes exactly.

Element ``i`` of a stream keyed ``key`` gets ``mix32(lo32(i) ^ mix32(key ^ hi32(i)))``. Backends process blocks that
do not cross a multiple of ``2**32``, so ``hi32(i)`` is constant in a block and the inner mix is computed once per
block.
"""

from __future__ import annotations

from enum import IntEnum

import torch

MASK32 = 0xFFFFFFFF
# lowbias32 constants (bias 0.17 in hash-prospector's measure): two odd multipliers and three xor-shifts.
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
MIX_SHIFT1 = 16
MIX_SHIFT2 = 15
MIX_SHIFT3 = 16
# Keys are kept below 2**31 so that launchers always pass them as the same integer type (no kernel recompilation).
KEY_MASK = 0x7FFFFFFF


class Buffer(IntEnum):
    """Which buffer a stream of random bits rounds; each gets an independent stream, but for bf16 moments, which share
    the ``EXP_AVG`` stream: each element's 32-bit word rounds ``exp_avg`` with its low 16 bits and ``exp_avg_sq`` with
    its high 16 (one hash per element for both; 8-bit moments, which take 24 bits each, draw from their own)."""

    PARAM = 0
    EXP_AVG = 1
    EXP_AVG_SQ = 2


def mix32(x: int) -> int:
    """The 32-bit mixing function on a Python int (the reference every backend must equal)."""
    x &= MASK32
    x ^= x >> MIX_SHIFT1
    x = (x * MIX_MUL1) & MASK32
    x ^= x >> MIX_SHIFT2
    x = (x * MIX_MUL2) & MASK32
    x ^= x >> MIX_SHIFT3
    return x


def stream_key(seed: int, param_index: int, step: int, buffer: int) -> int:
    """The 31-bit key of one (seed, parameter, step, buffer) stream.

    Args:
        seed: the optimizer's seed (any non-negative int; only its low 64 bits matter).
        param_index: position of the parameter in the optimizer's parameter order.
        step: the step counter after the increment of this step (1 on the first step).
        buffer: a :class:`Buffer` value.
    """
    k = mix32(seed & MASK32)
    k = mix32(k ^ ((seed >> 32) & MASK32))
    k = mix32(k ^ (param_index & MASK32))
    k = mix32(k ^ (step & MASK32))
    k = mix32(k ^ ((step >> 32) & MASK32))
    k = mix32(k ^ int(buffer))
    return k & KEY_MASK


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A 63-bit seed drawn from ``generator`` (default: torch's default CPU generator), like any torch random op.

    So ``torch.manual_seed(s)`` or ``lightning.seed_everything(s)`` before building decides the seed, in one process
    or in two, and seeds drawn one after the other differ. The draw advances the generator by one 64-bit value.
    """
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))


def rank_seed(seed: int, rank: int) -> int:
    """The rounding seed of one data-parallel rank: each rank's partition gets an independent noise stream."""
    return (mix32((seed ^ mix32(rank + 0x9E3779B9)) & 0xFFFFFFFF) << 32) | mix32((seed >> 32) ^ rank)


def block_key(key: int, start: int) -> int:
    """The per-block key for a block starting at element ``start`` (the high 32 bits of the index folded in)."""
    return mix32(key ^ ((start >> 32) & MASK32))


def element_bits(key: int, index: int) -> int:
    """32 random bits of element ``index`` in stream ``key`` (Python reference)."""
    return mix32((index & MASK32) ^ block_key(key, index))


def _to_int32(c: int) -> int:
    return c - (1 << 32) if c >= (1 << 31) else c


_MUL1_I32 = _to_int32(MIX_MUL1)
_MUL2_I32 = _to_int32(MIX_MUL2)


def _mix32_int32_(x: torch.Tensor) -> torch.Tensor:
    """In-place ``mix32`` on an int32 tensor holding uint32 bit patterns.

    int32 multiplication wraps modulo 2**32, which is exactly uint32 multiplication; right shifts of int32 are
    arithmetic, so each shift is masked to make it logical.
    """
    x ^= (x >> MIX_SHIFT1) & (MASK32 >> MIX_SHIFT1)
    x *= _MUL1_I32
    x ^= (x >> MIX_SHIFT2) & (MASK32 >> MIX_SHIFT2)
    x *= _MUL2_I32
    x ^= (x >> MIX_SHIFT3) & (MASK32 >> MIX_SHIFT3)
    return x


def random_bits(key: int, start: int, local_index: torch.Tensor) -> torch.Tensor:
    """32 random bits (as int32) for elements ``start + local_index`` of stream ``key``.

    Args:
        key: a stream key from :func:`stream_key`.
        start: index of the first element, any non-negative int such that ``start`` and the last element share the
            high 32 bits of their index (the range does not cross a multiple of ``2**32``).
        local_index: ``torch.arange(n, dtype=torch.int32)`` on the target device, ``n <= 2**31``, reused across calls.
    """
    # The low index word is start's plus the local index, modulo 2**32 (int32 addition wraps, as the multiplications
    # of the mix do); where start is a multiple of a power of two no smaller than the range, that is start | j.
    lo = local_index + _to_int32(start & MASK32)
    return _mix32_int32_(lo.bitwise_xor_(_to_int32(block_key(key, start))))


def next_high_word(start: int) -> int:
    """The first index after ``start`` whose high 32 bits differ from ``start``'s (a range of :func:`random_bits`
    ends there at the latest)."""
    return ((start >> 32) + 1) << 32


__all__ = [
    "Buffer",
    "block_key",
    "draw_seed",
    "element_bits",
    "mix32",
    "next_high_word",
    "random_bits",
    "rank_seed",
    "stream_key",
]
