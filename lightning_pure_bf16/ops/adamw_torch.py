"""The PyTorch path of the pure-bf16 Adam/AdamW update: CPU or GPU, in bounded chunks.

Each chunk is read once, updated in float32, and written back once with the requested rounding. Temporaries are a
fixed number of float32/int32 chunk-sized tensors, so extra memory stays bounded whatever the parameter size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_pure_bf16.ops import quant
from lightning_pure_bf16.ops.rng import next_high_word, random_bits
from lightning_pure_bf16.ops.rounding import nearest_round_bf16, stochastic_round_bf16, stochastic_round_sum_bf16

# 2**18 elements: about a dozen float32/int32 temporaries of 1 MiB each (well under 64 MiB), large enough that the
# per-chunk Python overhead is small against the arithmetic, and a power of two (a multiple of the 8-bit scale block).
DEFAULT_CHUNK = 1 << 18

ROUNDING_MODES = ("stochastic", "kahan", "nearest")


class KernelScalars(NamedTuple):
    """The float scalars every backend's update uses, derived once in float64 (each backend then rounds them to
    float32, as torch does with a Python scalar in a float32 op). Order = the kernels' argument order."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    decay: float  # lr * weight_decay, the decoupled decay factor
    neg_step_size: float  # -lr / bias_correction1
    inv_bias_correction2_sqrt: float
    grad_scale: float  # the gradient's factor (a caller's clipping folded into the update); 1.0: no product


@dataclass(frozen=True)
class UpdateArgs:
    """Scalars of one Adam/AdamW step for one tensor (everything except the buffers)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    step: int
    rounding: str
    keys: tuple[int, int, int]  # stream keys for param, exp_avg, exp_avg_sq (rng.Buffer order)
    # Every gradient element is multiplied by this factor in float32 before the update (a clipping factor computed
    # by the caller, folded into the update's one pass); 1.0: the gradient as it is, and no product at all.
    grad_scale: float = 1.0

    @property
    def bias_correction1(self) -> float:
        return 1.0 - self.beta1**self.step

    @property
    def bias_correction2_sqrt(self) -> float:
        return (1.0 - self.beta2**self.step) ** 0.5

    @property
    def scalars(self) -> KernelScalars:
        return KernelScalars(
            beta1=self.beta1,
            one_minus_beta1=1.0 - self.beta1,
            beta2=self.beta2,
            one_minus_beta2=1.0 - self.beta2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            decay=self.lr * self.weight_decay,
            neg_step_size=-(self.lr / self.bias_correction1),
            inv_bias_correction2_sqrt=1.0 / self.bias_correction2_sqrt,
            grad_scale=self.grad_scale,
        )


def intercepts_operations(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass that routes operations through its own ``__torch_dispatch__`` (a DTensor of
    FSDP2 or tensor parallelism, for one): it may hold no memory of its own, so no kernel may write its raw memory."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def adamw_update_torch_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    kahan_comp: torch.Tensor | None,
    args: UpdateArgs,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    index_offset: int = 0,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
) -> None:
    """Apply one Adam/AdamW step in place to ``param``, ``exp_avg``, ``exp_avg_sq`` (and ``kahan_comp``).

    bf16 buffers get the requested rounding on every write; float32 buffers are written exactly (plain AdamW).
    8-bit states (:mod:`lightning_pure_bf16.ops.quant`): ``exp_avg`` int8 and ``exp_avg_sq`` uint8 codes with their
    block scales ``exp_avg_scale``/``exp_avg_sq_scale`` (bf16, one per 128 elements of the piece), and an int8
    ``kahan_comp``, are decoded, updated and re-encoded with stochastic rounding in the same pass.

    Args:
        param: the parameter, bf16 or float32.
        grad: its gradient, any float dtype, same number of elements.
        exp_avg: first moment, same dtype and shape as ``param``.
        exp_avg_sq: second moment, same dtype and shape as ``param``.
        kahan_comp: bf16 compensation buffer when ``args.rounding == "kahan"`` and ``param`` is bf16, else ``None``.
        args: the step's scalars.
        chunk_size: elements per chunk; a power of two (default: ``2**18``).
        index_offset: index of the first element within the whole tensor, when the buffers are one piece of it (the
            random bits belong to the element's index in the whole tensor); any non-negative int, a multiple of
            ``QBLOCK`` with 8-bit moments (their scale blocks are counted from the piece's start) (default: ``0``).
    """
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"`chunk_size` must be a positive power of two, got {chunk_size}.")
    int8_moments = exp_avg_scale is not None
    if int8_moments and (chunk_size < quant.QBLOCK or index_offset % quant.QBLOCK):
        raise ValueError(
            f"8-bit moments need a chunk size and index offset that are multiples of {quant.QBLOCK}, got"
            f" {chunk_size} and {index_offset}."
        )
    if index_offset < 0:
        raise ValueError(f"`index_offset={index_offset}` must be non-negative.")
    n = param.numel()
    if n == 0:
        return
    p_flat = _flat(param)
    g_flat, m_flat, v_flat = _flat(grad), _flat(exp_avg), _flat(exp_avg_sq)
    c_flat = _flat(kahan_comp) if kahan_comp is not None else None
    bf16 = param.dtype == torch.bfloat16
    local = torch.arange(min(chunk_size, n), dtype=torch.int32, device=param.device) if bf16 else None

    s = args.scalars
    start = 0
    while start < n:
        # A chunk ends where the index's high word changes (its random bits take one block key); with 8-bit moments
        # that is a multiple of QBLOCK too, since the offset is.
        end = min(start + chunk_size, n, next_high_word(index_offset + start) - index_offset)
        # Compute in fp32 whatever the storage dtype: bf16 arithmetic would round every intermediate.
        p = p_flat[start:end].float()
        # A copy even of a float32 gradient (.float() would return the gradient itself): the update works in place.
        g = g_flat[start:end].to(torch.float32, copy=True)
        if s.grad_scale != 1.0:
            g.mul_(s.grad_scale)
        if int8_moments:
            blocks = slice(start // quant.QBLOCK, -(-end // quant.QBLOCK))
            m = quant.decode_m(m_flat[start:end], exp_avg_scale[blocks])
            v = quant.decode_v(v_flat[start:end], exp_avg_sq_scale[blocks])  # type: ignore[index]
        else:
            m = m_flat[start:end].float()
            v = v_flat[start:end].float()
        if not args.decoupled and s.weight_decay != 0.0:
            g.add_(torch.mul(p, s.weight_decay))
        # Each product is rounded on its own (no fused multiply-add), in the kernels' order, so all backends land on
        # the same side of bf16 rounding ties, which moments of bf16 inputs hit often.
        v.mul_(s.beta2).add_(torch.mul(g, g).mul_(s.one_minus_beta2))
        m.mul_(s.beta1).add_(g.mul_(s.one_minus_beta1))
        # The denominator uses the fp32 moments: rounding happens only on the final writes. The square root goes
        # through float64 to be correctly rounded (torch's CPU float32 sqrt is not), as in the other backends.
        delta = v.double().sqrt_().float().mul_(s.inv_bias_correction2_sqrt).add_(s.eps)
        torch.div(m, delta, out=delta).mul_(s.neg_step_size)
        if args.decoupled and s.decay != 0.0:
            # Weight decay is part of the same fp32 update and the same rounded write: rounded on its own, a sub-ulp
            # lr*wd*p would vanish.
            delta.sub_(g.copy_(p).mul_(s.decay))

        if not bf16:
            p_flat[start:end] = p.add_(delta)
            m_flat[start:end] = m
            v_flat[start:end] = v
            start = end
            continue

        idx = local[: end - start]
        if args.rounding == "nearest":
            p_out = nearest_round_bf16(p.add_(delta))
            m_out = nearest_round_bf16(m)
            v_out = nearest_round_bf16(v)
        else:
            bits_p = random_bits(args.keys[0], index_offset + start, idx)
            if args.rounding == "kahan" and c_flat.dtype == torch.int8:
                # An 8-bit remainder, in units of 1/256 of the stored weight's spacing, stochastically rounded.
                c = quant.decode_residual(c_flat[start:end], p_flat[start:end])
                p_out = nearest_round_bf16(p + (delta + c))
                c_flat[start:end] = quant.encode_residual(c.sub_(p_out.float().sub_(p)).add_(delta), p_out, bits_p)
            elif args.rounding == "kahan":
                # Kahan: add the carried remainder to this step's update and round the sum to nearest; the new
                # remainder (old one, less what the write took, plus the update) is written with stochastic rounding
                # of its exact sum, so an update far below the remainder's own bf16 spacing still counts on average.
                c = c_flat[start:end].float()
                p_out = nearest_round_bf16(p + (delta + c))
                c_flat[start:end] = stochastic_round_sum_bf16(c.sub_(p_out.float().sub_(p)), delta, bits_p)
            else:
                # SR of the exact p + delta: the float32 sum alone would round away an update of 1e-7 of the weight.
                p_out = stochastic_round_sum_bf16(p, delta, bits_p)
            if not int8_moments:
                # One word of random bits for both moments: m rounds with its low half, v with its high half.
                bits_mv = random_bits(args.keys[1], index_offset + start, idx)
                m_out = stochastic_round_bf16(m, bits_mv)
                v_out = stochastic_round_bf16(v, bits_mv >> 16)
        if int8_moments:
            # The block scales of the new moments, then their codes (nearest rounding has no 8-bit form: 8-bit
            # writes are always stochastic).
            m_scale, v_scale = quant.block_scales(m), quant.block_scales(v)
            exp_avg_scale[blocks] = m_scale
            exp_avg_sq_scale[blocks] = v_scale  # type: ignore[index]
            m_out = quant.encode_m(m, m_scale, random_bits(args.keys[1], index_offset + start, idx))
            v_out = quant.encode_v(v, v_scale, random_bits(args.keys[2], index_offset + start, idx))
        p_flat[start:end] = p_out
        m_flat[start:end] = m_out
        v_flat[start:end] = v_out
        start = end

    for t, flat in ((param, p_flat), (exp_avg, m_flat), (exp_avg_sq, v_flat), (kahan_comp, c_flat)):
        if t is not None and not t.is_contiguous():
            t.copy_(flat.view(t.shape))


__all__ = [
    "DEFAULT_CHUNK",
    "ROUNDING_MODES",
    "KernelScalars",
    "UpdateArgs",
    "adamw_update_torch_",
    "intercepts_operations",
]
