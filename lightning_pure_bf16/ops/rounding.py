"""fp32 -> bf16 rounding on torch tensors: stochastic (of a value, or of an exact sum of two values, from given
random bits) and round-to-nearest-even.

Both work on the integer bit pattern so they agree bit for bit with the Triton kernel, which cannot rely on its
float-to-bf16 cast (the Triton interpreter truncates).
"""

from __future__ import annotations

import torch

_LOW16 = 0xFFFF
_MASK32 = 0xFFFFFFFF


def stochastic_round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Round a float32 tensor to bf16, up with probability equal to the discarded fraction.

    Adding 16 uniform random bits to the 16 bits that bf16 discards carries into the kept part with exactly that
    probability; the sign is separate (sign-magnitude), so the rounding is unbiased for negative values too.

    Args:
        x: contiguous float32 tensor.
        bits: int32 tensor of random bits, same shape; only the low 16 bits are used.
    """
    b = x.view(torch.int32) + (bits & _LOW16)
    # Arithmetic shift then narrowing keeps exactly the upper 16 bits of the pattern, which is the bf16 encoding.
    return (b >> 16).to(torch.int16).view(torch.bfloat16)


def stochastic_round_sum_bf16(a: torch.Tensor, b: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Round the exact sum ``a + b`` of two float32 tensors to bf16 stochastically, at 2**-32 of a bf16 ulp.

    Rounding the float32 sum first would decide from a value that already lost the small addend: an update of 1e-7
    of the weight is less than one float32 ulp of the sum, so ``stochastic_round_bf16(a + b)`` is biased exactly where
    fine-tuning lives (lr 1e-5 x weight decay 0.01). Here the float32 sum ``s`` and its exact error ``e`` (Knuth's
    TwoSum, so ``s + e == a + b`` for any magnitudes) both take part: ``e`` is measured in units of 2**-32 bf16 ulp
    of ``s`` and added, with 32 random bits, below ``s``'s 16 discarded bits. The carry out of that fraction decides the
    rounding.

    Every backend performs these exact integer and float32 operations (no fused multiply-add), so all draw the same
    result from the same bits.

    Args:
        a: contiguous float32 tensor (the bf16 parameter, widened, in the optimizer).
        b: contiguous float32 tensor of the same shape (the update).
        bits: int32 tensor of random bits, same shape; all 32 bits are used.
    """
    s = a + b
    # TwoSum: e is what float32 rounding took from a + b, exactly.
    bb = s - a
    e = (a - (s - bb)).add_(b - bb)
    sb = s.view(torch.int32).to(torch.int64) & _MASK32
    eb = e.view(torch.int32).to(torch.int64) & _MASK32
    mag = sb & 0x7FFFFFFF
    e_exp = (eb >> 23) & 0xFF
    e_mant = (eb & 0x7FFFFF) | torch.where(e_exp != 0, 0x800000, 0)
    # |e| = e_mant * 2**(max(e_exp, 1) - 150) and one float32 ulp of s is 2**(max(s_exp, 1) - 150), so in units of
    # 2**-16 float32 ulp (= 2**-32 bf16 ulp) |e| is e_mant * 2**16 shifted right by the exponent gap (>= 0 for finite
    # s; clamped for a non-finite one). Truncation loses less than one unit.
    gap = ((mag >> 23).clamp_(min=1) - e_exp.clamp(min=1)).clamp_(0, 63)
    frac = (e_mant << 16) >> gap
    frac = torch.where(((sb ^ eb) >> 31) != 0, -frac, frac)
    # Below a normal power of two (s's mantissa all zero) the bf16 spacing halves: a step down from s counts double.
    frac = torch.where((frac < 0) & ((mag & 0x7FFFFF) == 0) & (mag >= 0x01000000), frac * 2, frac)
    hi = mag >> 16
    z = ((mag & 0xFFFF) << 16) + frac + (bits.to(torch.int64) & _MASK32)
    out = hi + (z >> 32)
    # inf stays inf and NaN stays NaN (quiet), whatever the random bits.
    out = torch.where(mag >= 0x7F800000, hi | torch.where(mag > 0x7F800000, 0x40, 0), out)
    out = torch.where(sb >= 0x80000000, out - 0x8000, out)
    return out.to(torch.int16).view(torch.bfloat16)


def nearest_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round a float32 tensor to bf16, to nearest with ties to even (torch's own cast, same bits for finite values)."""
    return x.to(torch.bfloat16)


__all__ = ["nearest_round_bf16", "stochastic_round_bf16", "stochastic_round_sum_bf16"]
