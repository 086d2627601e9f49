"""fp32 -> bf16 rounding on torch tensors: stochastic (of a value, or of an exact sum of two values, from given
random bits) and round-to-nearest-even.

Both work on the integer bit pattern so they agree bit for bit with the Triton kernel, which cannot rely on its
float-to-bf16 cast (the Triton interpreter truncates).
"""

from __future__ import annotations

import torch

_LOW16 = 0xFFFF
_MASK32 = 0xFFFFFFFF
_SIGN = -0x80000000  # the sign bit of an int32


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
    TwoSum, so ``s + e == a + b`` for any magnitudes) both take part.

    On magnitudes, in units of 2**-32 bf16 ulp of ``s``: the 16 discarded bits ``D`` (worth ``D * 2**16``), the 32
    random bits ``r`` and the error ``F`` (``e`` over a float32 spacing, times 2**16: ``|F| <= 2**16``) carry into the
    kept bits with the exact odds. With ``u = D * 2**16 + r`` modulo 2**32, the carry is that of the integer sum, plus
    one where ``u``'s top bit is set, less one where ``F < -int32(u)``; that comparison is made as
    ``e * 2**16 < -int32(u) * spacing``, with the float32 spacing on the side ``e`` points to (it halves below a power
    of two). Both products are exact wherever the comparison can go either way (``|int32(u)| <= 2**16``: a power of
    two times a float, an integer of 17 bits times a power of two). 32-bit integers and float32 only: the Triton
    kernel's instruction count.

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
    sb = s.view(torch.int32)
    mag = (sb & 0x7FFFFFFF).long()
    # The error with s's sign taken out: positive away from zero.
    err = (e.view(torch.int32) ^ (sb & _SIGN)).view(torch.float32)
    toward = torch.where(err < 0, mag - 1, mag + 1)
    spacing = (_as_float(toward) - _as_float(mag)).abs_()
    z = ((mag & _LOW16) << 16) + (bits.long() & _MASK32)
    u = z & _MASK32
    u_signed = u - ((u >> 31) << 32)
    carry = (z >> 32) + (u >> 31) - (err * 65536.0 < -u_signed.int().float() * spacing).long()
    kept = mag >> 16
    # inf stays inf and NaN stays NaN (quiet), whatever the random bits.
    out = torch.where(mag >= 0x7F800000, kept | torch.where(mag > 0x7F800000, 0x40, 0), kept + carry)
    out = torch.where(sb < 0, out - 0x8000, out)
    return out.to(torch.int16).view(torch.bfloat16)


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    """The float32 values of 32-bit patterns held in an int64 tensor (taken modulo 2**32)."""
    return (bits & _MASK32).int().view(torch.float32)


def nearest_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round a float32 tensor to bf16, to nearest with ties to even (torch's own cast, same bits for finite values)."""
    return x.to(torch.bfloat16)


__all__ = ["nearest_round_bf16", "stochastic_round_bf16", "stochastic_round_sum_bf16"]
