"""8-bit optimizer states: the codes, and their PyTorch twins of what the Triton kernel and the C++ loop compute.

Moments (``moments="int8"``) are stored per block of :data:`QBLOCK` elements of the flat tensor: one byte per element
and one bf16 scale per block (the block's largest magnitude, rounded up to bf16), 2/128 bytes per element. The codes
put their levels where Adam's moments live, close to zero relative to the block's largest element:

* first moment, int8 ``k`` in [-127, 127]: ``m = scale * sign(k) * (|k| / 127)**2``. The smallest non-zero level is
  ``scale / 16129``, the relative spacing ``2 / |k|``.
* second moment, uint8 ``k`` in [0, 255]: ``v = scale * (k / 255)**4``. The smallest non-zero level is
  ``scale * 2.4e-10`` (a gradient 65,000 times smaller than the block's largest still has a non-zero ``v``; a zero
  ``v`` under a non-zero ``m`` would blow the update up), the relative spacing ``4 / k``.

Every write is stochastically rounded in the value domain: between the two neighbouring levels ``lo <= x <= hi``, up
with probability ``(x - lo) / (hi - lo)``, so the stored moment is unbiased (a second moment that changes by 0.1% a
step moves on average as it should, as with bf16 states). The random word is the element's own (``ops.rng``), its
top 24 bits compared with the probability.

Kahan compensation in 8 bits (``compensation="int8"``): the remainder of the weight's round-to-nearest write, which
is at most half a bf16 spacing of the stored weight, in units of 1/256 of that spacing (int8, clamped to +-127),
also written with stochastic rounding.

All arithmetic is float32 with one rounding per operation (divisions and square roots correctly rounded), so the
three backends produce the same bytes.
"""

from __future__ import annotations

import torch

QBLOCK = 128
M_LEVELS = 127
V_LEVELS = 255
_TWO_M24 = 2.0**-24


def scale_blocks(numel: int) -> int:
    """Number of scales of a flat tensor of ``numel`` elements."""
    return -(-numel // QBLOCK)


def bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """Non-negative finite float32 ``x`` rounded up to bf16 (as bf16)."""
    b = x.view(torch.int32).to(torch.int64)
    up = (b + 0xFFFF) & 0x7FFF0000
    return (up >> 16).to(torch.int16).view(torch.bfloat16)


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """The top 24 of 32 random bits as a float32 in [0, 1), exactly."""
    return ((bits >> 8) & 0xFFFFFF).to(torch.float32) * _TWO_M24


def _level(k: torch.Tensor, levels: int, power: int) -> torch.Tensor:
    """(k / levels) ** power, normalized to the block scale, for float32 ``k >= 0``."""
    # Divided by a tensor on k's device, not a Python number: CUDA torch turns a division by a CPU scalar into a
    # multiplication by its reciprocal (not correctly rounded), and the other backends divide.
    t = k / k.new_full((), levels)
    t2 = t * t
    return t2 * t2 if power == 4 else t2


def _encode(a: torch.Tensor, u: torch.Tensor, levels: int, power: int) -> torch.Tensor:
    """Stochastic code of normalized magnitudes ``a`` in [0, 1] (float32), as int32 in [0, levels]."""
    y = torch.sqrt(a.double()).float()
    if power == 4:
        y = torch.sqrt(y.double()).float()
    k0 = torch.clamp((y * levels).to(torch.int32), max=levels - 1).to(torch.float32)
    lo = _level(k0, levels, power)
    hi = _level(k0 + 1.0, levels, power)
    frac = torch.clamp((a - lo) / (hi - lo), 0.0, 1.0)
    return (k0 + (u < frac).to(torch.float32)).to(torch.int32)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """The bf16 scale of every block of a flat float32 ``x`` (its largest magnitude, rounded up)."""
    n = x.numel()
    pad = scale_blocks(n) * QBLOCK - n
    blocks = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, QBLOCK)
    return bf16_ceil(blocks.amax(dim=1))


def _expand(scales: torch.Tensor, n: int) -> torch.Tensor:
    return scales.float().repeat_interleave(QBLOCK)[:n]


def _normalized(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, x.abs() / safe, torch.zeros_like(x))


def encode_m(x: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """int8 codes of a flat float32 first moment, given its block scales and one random word per element."""
    s = _expand(scales, x.numel())
    k = _encode(_normalized(x, s), _uniform(bits), M_LEVELS, 2)
    return torch.where(x < 0, -k, k).to(torch.int8)


def decode_m(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 first moment of int8 ``codes``."""
    k = codes.to(torch.int32)
    value = _expand(scales, codes.numel()) * _level(k.abs().to(torch.float32), M_LEVELS, 2)
    return torch.where(k < 0, -value, value)


def encode_v(x: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """uint8 codes of a flat non-negative float32 second moment."""
    s = _expand(scales, x.numel())
    return _encode(_normalized(x, s), _uniform(bits), V_LEVELS, 4).to(torch.uint8)


def decode_v(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 second moment of uint8 ``codes``."""
    return _expand(scales, codes.numel()) * _level(codes.to(torch.float32), V_LEVELS, 4)


def encode_states(x: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor, slot: int) -> torch.Tensor:
    """The codes of state slot ``slot`` of an algorithm: slot 0 signed (:func:`encode_m`), slot 1 non-negative
    (:func:`encode_v`)."""
    return (encode_v if slot else encode_m)(x, scales, bits)


def decode_states(codes: torch.Tensor, scales: torch.Tensor, slot: int) -> torch.Tensor:
    """The float32 values of state slot ``slot``'s codes (see :func:`encode_states`)."""
    return (decode_v if slot else decode_m)(codes, scales)


def reblock(
    codes: torch.Tensor, scales: torch.Tensor, *, second: bool, bits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit moment codes each written under its own scale (float32, one per element: NaN where an element has none,
    its code 0, as a partition's padding), in blocks of :data:`QBLOCK` from the first element: the codes and one bf16
    scale per block. A block whose elements share one scale keeps its codes and that scale, bit for bit; any other
    block is decoded and encoded again under its own scale (stochastically, ``bits`` one random word per element).
    ``second``: the codes are the second moment's (uint8), else the first's (int8)."""
    n = codes.numel()
    blocks = scale_blocks(n)
    per_block = torch.nn.functional.pad(scales.float(), (0, blocks * QBLOCK - n), value=float("nan")).view(blocks, -1)
    hi = per_block.nan_to_num(nan=-1.0).amax(dim=1)
    lo = per_block.nan_to_num(nan=float("inf")).amin(dim=1)
    kept = (hi == lo) | (hi < 0)  # one scale, or none (every element padding)
    kept_scales = hi.clamp(min=0).to(torch.bfloat16)
    if bool(kept.all()):
        return codes, kept_scales
    unit = torch.ones(blocks, dtype=torch.bfloat16, device=codes.device)
    own = scales.float().nan_to_num(nan=0.0)
    values = (decode_v(codes, unit) if second else decode_m(codes, unit)) * own
    new_scales = block_scales(values)
    encoded = (encode_v if second else encode_m)(values, new_scales, bits)
    keep = _expand(kept.to(torch.bfloat16), n).bool()
    return torch.where(keep, codes, encoded), torch.where(kept, kept_scales, new_scales)


def residual_unit(p: torch.Tensor) -> torch.Tensor:
    """1/256 of the bf16 spacing of each bf16 ``p`` (float32, a power of two): the unit of the int8 remainder."""
    e = torch.clamp((p.view(torch.int16).to(torch.int32) >> 7) & 0xFF, min=1)
    # spacing 2**(e - 134), unit 2**(e - 142): a normal float32 for e >= 16, else a subnormal one.
    normal = ((e - 15).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 7).clamp(max=30)).view(torch.float32)
    return torch.where(e >= 16, normal, subnormal)


def encode_residual(c: torch.Tensor, p_out: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """int8 remainder of float32 ``c`` under the written bf16 weight ``p_out``, stochastically rounded."""
    t = c / residual_unit(p_out)
    k0 = torch.floor(t)
    frac = t - k0
    k = k0 + (_uniform(bits) < frac).to(torch.float32)
    return torch.clamp(k, -127.0, 127.0).to(torch.int8)


def decode_residual(codes: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """float32 remainder of int8 ``codes`` under the bf16 weight ``p``."""
    return codes.to(torch.float32) * residual_unit(p)


__all__ = [
    "M_LEVELS",
    "QBLOCK",
    "V_LEVELS",
    "bf16_ceil",
    "block_scales",
    "decode_m",
    "decode_residual",
    "decode_states",
    "decode_v",
    "encode_m",
    "encode_residual",
    "encode_states",
    "encode_v",
    "reblock",
    "residual_unit",
    "scale_blocks",
]
