"""fp32 -> bf16 rounding on torch tensors: stochastic (from given random bits) and round-to-nearest-even.

Both work on the integer bit pattern so they agree bit for bit with the Triton kernel, which cannot rely on its
float-to-bf16 cast (the Triton interpreter truncates).
"""

from __future__ import annotations

import torch

_LOW16 = 0xFFFF


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


def nearest_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round a float32 tensor to bf16, to nearest with ties to even (torch's own cast, same bits for finite values)."""
    return x.to(torch.bfloat16)


__all__ = ["nearest_round_bf16", "stochastic_round_bf16"]
