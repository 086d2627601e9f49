"""The PyTorch path of the pure-bf16 update, for every algorithm of the family: CPU or GPU, in bounded chunks.

Each chunk is read once, updated in float32 by the algorithm's step (``ops.algorithms``), and written back once with
the requested rounding. Temporaries are a fixed number of float32/int32 chunk-sized tensors, so extra memory stays
bounded whatever the parameter size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_pure_bf16.ops import quant
from lightning_pure_bf16.ops.algorithms import ROUNDING_MODES, TORCH_STEPS, Args
from lightning_pure_bf16.ops.rng import next_high_word, random_bits
from lightning_pure_bf16.ops.rounding import nearest_round_bf16, stochastic_round_bf16, stochastic_round_sum_bf16

# 2**18 elements: about a dozen float32/int32 temporaries of 1 MiB each (well under 64 MiB), large enough that the
# per-chunk Python overhead is small against the arithmetic, and a power of two (a multiple of the 8-bit scale block).
DEFAULT_CHUNK = 1 << 18


def intercepts_operations(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass that routes operations through its own ``__torch_dispatch__`` (a DTensor of
    FSDP2 or tensor parallelism, for one): it may hold no memory of its own, so no kernel may write its raw memory."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def round_states(
    values: Sequence[torch.Tensor], rounding: str, key: int, first_index: int, index: torch.Tensor
) -> list[torch.Tensor]:
    """The bf16 writes of an element range's per-element states (float32 ``values``, one per slot, of elements
    ``first_index + index``): to nearest under ``rounding="nearest"``, else stochastically with one word of random
    bits per element from the stream ``key`` (slot 0 rounds with its low half, slot 1 with its high half). Every
    algorithm's state writes on the PyTorch path, the elementwise update's and Muon's momentum alike."""
    if rounding == "nearest":
        return [nearest_round_bf16(value) for value in values]
    bits = random_bits(key, first_index, index)
    return [stochastic_round_bf16(value, bits >> (16 * slot)) for slot, value in enumerate(values)]


def update_torch_(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: Sequence[torch.Tensor],
    kahan_comp: torch.Tensor | None,
    args: Args,
    *,
    scales: Sequence[torch.Tensor | None] = (),
    chunk_size: int = DEFAULT_CHUNK,
    index_offset: int = 0,
) -> None:
    """Apply one step of ``args.algorithm`` in place to ``param``, its ``states`` (and ``kahan_comp``).

    bf16 buffers get the requested rounding on every write; float32 buffers are written exactly (the plain float32
    algorithm). 8-bit states (:mod:`lightning_pure_bf16.ops.quant`): slot 0 int8 and slot 1 uint8 codes with their
    block scales in ``scales`` (bf16, one per 128 elements of the piece), and an int8 ``kahan_comp``, are decoded,
    updated and re-encoded with stochastic rounding in the same pass.

    Args:
        param: the parameter, bf16 or float32.
        grad: its gradient, any float dtype, same number of elements.
        states: the algorithm's per-element states (Adam: ``exp_avg``, ``exp_avg_sq``), each of ``param``'s size,
            its dtype or 8-bit codes.
        kahan_comp: the compensation buffer when ``args.rounding == "kahan"`` and ``param`` is bf16, else ``None``.
        args: the step's scalars (``ops.algorithms``).
        scales: the block scales of 8-bit states, one per state (default: none, bf16 or float32 states).
        chunk_size: elements per chunk; a power of two (default: ``2**18``).
        index_offset: index of the first element within the whole tensor, when the buffers are one piece of it (the
            random bits belong to the element's index in the whole tensor); any non-negative int, a multiple of
            ``QBLOCK`` with 8-bit states (their scale blocks are counted from the piece's start) (default: ``0``).
    """
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"`chunk_size` must be a positive power of two, got {chunk_size}.")
    int8_states = any(sc is not None for sc in scales)
    if int8_states and (chunk_size < quant.QBLOCK or index_offset % quant.QBLOCK):
        raise ValueError(
            f"8-bit states need a chunk size and index offset that are multiples of {quant.QBLOCK}, got"
            f" {chunk_size} and {index_offset}."
        )
    if index_offset < 0:
        raise ValueError(f"`index_offset={index_offset}` must be non-negative.")
    n = param.numel()
    if n == 0:
        return
    p_flat, g_flat = _flat(param), _flat(grad)
    s_flat = [_flat(t) for t in states]
    c_flat = _flat(kahan_comp) if kahan_comp is not None else None
    bf16 = param.dtype == torch.bfloat16
    local = torch.arange(min(chunk_size, n), dtype=torch.int32, device=param.device) if bf16 else None
    algorithm_step = TORCH_STEPS[args.algorithm]
    s = args.scalars
    start = 0
    while start < n:
        # A chunk ends where the index's high word changes (its random bits take one block key); with 8-bit states
        # that is a multiple of QBLOCK too, since the offset is.
        end = min(start + chunk_size, n, next_high_word(index_offset + start) - index_offset)
        # Compute in fp32 whatever the storage dtype: bf16 arithmetic would round every intermediate.
        p = p_flat[start:end].float()
        # A copy even of a float32 gradient (.float() would return the gradient itself): the update works in place.
        g = g_flat[start:end].to(torch.float32, copy=True)
        if s.grad_scale != 1.0:
            g.mul_(s.grad_scale)
        blocks = slice(start // quant.QBLOCK, -(-end // quant.QBLOCK))
        values = [
            quant.decode_states(flat[start:end], scale[blocks], slot) if int8_states else flat[start:end].float()
            for slot, (flat, scale) in enumerate(zip(s_flat, scales or (None,) * len(s_flat)))
        ]
        delta = algorithm_step(p, g, values, s, args.variant)

        if not bf16:
            p_flat[start:end] = p.add_(delta)
            for flat, value in zip(s_flat, values):
                flat[start:end] = value
            start = end
            continue

        idx = local[: end - start]
        if values and not int8_states:
            outs = round_states(values, args.rounding, args.keys[1], index_offset + start, idx)
        if args.rounding == "nearest":
            p_out = nearest_round_bf16(p.add_(delta))
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
        if int8_states:
            # The block scales of the new states, then their codes (nearest rounding has no 8-bit form: 8-bit
            # writes are always stochastic).
            outs = []
            for slot, (value, scale) in enumerate(zip(values, scales)):
                scale[blocks] = new_scale = quant.block_scales(value)
                bits = random_bits(args.keys[1 + slot], index_offset + start, idx)
                outs.append(quant.encode_states(value, new_scale, bits, slot))
        p_flat[start:end] = p_out
        for flat, out in zip(s_flat, outs if values else ()):
            flat[start:end] = out
        start = end

    for t, flat in ((param, p_flat), *zip(states, s_flat), (kahan_comp, c_flat)):
        if t is not None and not t.is_contiguous():
            t.copy_(flat.view(t.shape))


__all__ = ["DEFAULT_CHUNK", "ROUNDING_MODES", "intercepts_operations", "round_states", "update_torch_"]
