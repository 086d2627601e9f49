"""The fused Triton kernel of the pure-bf16 update, for every algorithm of the family: one launch per parameter
tensor or flat partition.

Reads p, g and the states (and the Kahan buffer) once, computes in fp32 registers, writes each buffer once with
stochastic rounding (random bits from ``ops.rng``) or round-to-nearest-even. Rounding is done on integer bit patterns,
because the Triton interpreter (how the CPU tests run this kernel) truncates in its float-to-bf16 cast. Each
algorithm is one ``@triton.jit`` helper (``_adam_update``, ``_lion_update``, ``_sgd_update``, ``_direction_update``),
chosen at compile time.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from lightning_pure_bf16.ops import quant, rng
from lightning_pure_bf16.ops.algorithms import ROUNDING_CODES, Algorithm, Args, hyper_scalars
from lightning_pure_bf16.ops.update_torch import intercepts_operations

# 1024 elements per program: 2 warps x 32 lanes x 16 elements, two 16-byte bf16 vectors per lane and buffer on the
# GPU. Sixteen elements a thread rather than eight: the per-thread setup and the slow paths of the correctly rounded
# division and square root (one copy per kernel) are shared by twice the elements (benchmarks/kernel_resources.md).
BLOCK_SIZE = 1024
NUM_WARPS = 2

_MUL1: tl.constexpr = tl.constexpr(rng.MIX_MUL1)
_MUL2: tl.constexpr = tl.constexpr(rng.MIX_MUL2)
_SHIFT1: tl.constexpr = tl.constexpr(rng.MIX_SHIFT1)
_SHIFT2: tl.constexpr = tl.constexpr(rng.MIX_SHIFT2)
_SHIFT3: tl.constexpr = tl.constexpr(rng.MIX_SHIFT3)

_ROUND_NEAREST: tl.constexpr = tl.constexpr(ROUNDING_CODES["nearest"])
_ROUND_STOCHASTIC: tl.constexpr = tl.constexpr(ROUNDING_CODES["stochastic"])
_ROUND_KAHAN: tl.constexpr = tl.constexpr(ROUNDING_CODES["kahan"])
_ADAM: tl.constexpr = tl.constexpr(int(Algorithm.ADAM))
_LION: tl.constexpr = tl.constexpr(int(Algorithm.LION))
_DIRECTION: tl.constexpr = tl.constexpr(int(Algorithm.DIRECTION))


@triton.jit
def _round_with_bits(x, r):
    # r: 16 random bits (uint32 below 2**16), added below the 16 bits bf16 keeps.
    b = x.to(tl.uint32, bitcast=True) + r
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _stochastic_round_sum(a, b, word, folded):
    return _stochastic_round_sum_bits(a, b, _random_word(word, folded))


@triton.jit
def _stochastic_round_sum_bits(a, b, r):
    # Stochastic rounding of the exact a + b at 2**-32 of a bf16 ulp with the 32 random bits r (uint32)
    # (rounding.stochastic_round_sum_bf16 explains each step): the fp32 sum alone would already have lost an update of
    # 1e-7 of the weight. 32-bit integers and float32 only: the TwoSum error enters through one float comparison.
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    # The same operations as the PyTorch path on the magnitude, written on the signed pattern sb: a finite magnitude
    # never carries into or borrows from the sign bit (a sum that rounds to zero is exactly zero, so it has no error).
    sb = s.to(tl.uint32, bitcast=True)
    err = (e.to(tl.uint32, bitcast=True) ^ (sb & 0x80000000)).to(tl.float32, bitcast=True)
    toward = tl.where(err < 0.0, -1, 1).to(tl.uint32)
    spacing = tl.abs((sb + toward).to(tl.float32, bitcast=True) - s)
    u = (sb << 16) + r
    u_signed = u.to(tl.int32, bitcast=True)
    below = (err * 65536.0 < -u_signed.to(tl.float32) * spacing).to(tl.int32)
    # The kept bits plus the carry out of u's sum, (kept << 16 | D) + (r >> 16) >> 16: r's low half cannot carry.
    up = ((sb + (r >> 16)) >> 16).to(tl.int32)
    kept = (sb >> 16).to(tl.int32)
    # inf stays inf and NaN stays NaN (quiet), whatever the random bits.
    finite = up + (u_signed < 0).to(tl.int32) - below
    out = tl.where(tl.abs(s) < float("inf"), finite, kept | tl.where(s != s, 0x40, 0))
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _widen(x):
    # bf16 -> float32 as the bit pattern shifted up: one instruction per element on the GPU.
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _nearest_round(x):
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adam_update(
    p,
    g,
    m,
    v,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    decay,
    neg_step_size,
    inv_bias_correction2_sqrt,
    DECOUPLED: tl.constexpr,
):
    """The fp32 Adam/AdamW step of both kernels: the new moments and the parameter update."""
    if not DECOUPLED:
        g = g + weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    # The denominator uses the fp32 moments: rounding happens only on the final writes. Square root and division
    # are the correctly rounded ones (tl.sqrt and "/" are approximate on GPUs), as in the other backends.
    delta = tl.div_rn(m, tl.sqrt_rn(v) * inv_bias_correction2_sqrt + eps) * neg_step_size
    if DECOUPLED:
        # Weight decay inside the same fp32 update and the same rounded write, so a sub-ulp lr*wd*p still counts.
        delta = delta - decay * p
    return m, v, delta


@triton.jit
def _lion_update(p, g, m, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, decay, DECAY: tl.constexpr):
    """Lion's fp32 step: the new momentum and the update, the sign of the interpolation (0 for 0 and NaN)."""
    c = beta1 * m + one_minus_beta1 * g
    m = beta2 * m + one_minus_beta2 * g
    delta = tl.where(c > 0.0, 1.0, tl.where(c < 0.0, -1.0, 0.0)) * neg_lr
    if DECAY:
        delta = delta - decay * p
    return m, delta


@triton.jit
def _sgd_update(p, g, buf, weight_decay, keep, take, momentum, neg_lr, MOMENTUM: tl.constexpr, VARIANT: tl.constexpr):
    """SGD's fp32 step: the new momentum buffer (with ``MOMENTUM``) and the update; ``VARIANT`` bit 0: L2 weight decay,
    bit 1: Nesterov."""
    if VARIANT % 2 == 1:
        g = g + weight_decay * p
    d = g
    if MOMENTUM:
        buf = keep * buf + take * g
        if VARIANT // 2 == 1:
            d = g + momentum * buf
        else:
            d = buf
    return buf, d * neg_lr


@triton.jit
def _direction_update(p, g, neg_step_size, decay, DECAY: tl.constexpr):
    """The write of a direction computed beforehand (Muon's orthogonalized momentum), handed as the gradient."""
    delta = g * neg_step_size
    if DECAY:
        delta = delta - decay * p
    return delta


# ------------------------------------------------------------------------------------------------ 8-bit state codes
# ops/quant.py specifies the codes; these are its operations, in its order, one rounding each.
_QBLOCK: tl.constexpr = tl.constexpr(quant.QBLOCK)


@triton.jit
def _random_word(word, folded):
    # rng.element_bits: mix32(lo ^ block key). Its first step, x ^ (x >> SHIFT1), distributes over the xor, so it is
    # taken on the index once per element (``folded``, shared by every stream) and on the block key once per launch,
    # by the launcher (``word``: see _stream_word). uint32 arithmetic wraps modulo 2**32, as rng.mix32 specifies.
    x = folded ^ word.to(tl.uint32, bitcast=True)
    x = x * _MUL1
    x = x ^ (x >> _SHIFT2)
    x = x * _MUL2
    return x ^ (x >> _SHIFT3)


@triton.jit
def _uniform24(r):
    return ((r >> 8) & 0xFFFFFF).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _level(k, LEVELS: tl.constexpr, POWER: tl.constexpr):
    t = tl.div_rn(k, tl.full(k.shape, LEVELS, tl.float32))
    t2 = t * t
    if POWER == 4:
        t2 = t2 * t2
    return t2


@triton.jit
def _encode(x, scale, r, LEVELS: tl.constexpr, POWER: tl.constexpr):
    positive = scale > 0.0
    a = tl.where(positive, tl.div_rn(tl.abs(x), tl.where(positive, scale, 1.0)), 0.0)
    y = tl.sqrt_rn(a)
    if POWER == 4:
        y = tl.sqrt_rn(y)
    k0 = tl.minimum((y * LEVELS).to(tl.int32), LEVELS - 1)
    k0f = k0.to(tl.float32)
    lo_level = _level(k0f, LEVELS, POWER)
    hi_level = _level(k0f + 1.0, LEVELS, POWER)
    frac = tl.minimum(tl.maximum(tl.div_rn(a - lo_level, hi_level - lo_level), 0.0), 1.0)
    return k0 + (_uniform24(r) < frac).to(tl.int32)


@triton.jit
def _bf16_ceil(x):
    return ((x.to(tl.uint32, bitcast=True) + 0xFFFF) & 0x7FFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _residual_unit(p):
    # p: float32 holding a bf16 value; 1/256 of its bf16 spacing, a normal or subnormal power of two.
    e = tl.maximum((p.to(tl.uint32, bitcast=True) >> 23) & 0xFF, 1)
    normal = (tl.maximum(e, 16) - 15) << 23
    subnormal = tl.full(e.shape, 1, tl.uint32) << (tl.minimum(e, 15) + 7)
    return tl.where(e >= 16, normal, subnormal).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------------------------------- the kernel
@triton.jit(do_not_specialize=["word_p", "word_m", "word_v", "index_offset"])
def _update_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    ms_ptr,
    vs_ptr,
    c_ptr,
    n_elements,
    h0,
    h1,
    h2,
    h3,
    h4,
    h5,
    h6,
    h7,
    h8,
    grad_scale,
    word_p,
    word_m,
    word_v,
    index_offset,
    ALGORITHM: tl.constexpr,
    STATES: tl.constexpr,
    VARIANT: tl.constexpr,
    ROUNDING: tl.constexpr,
    Q8M: tl.constexpr,
    C8: tl.constexpr,
    INDEX8: tl.constexpr,
    SCALE_G: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One kernel for every algorithm (ALGORITHM, its STATES slots m and v, VARIANT its compile-time switch; h0-h8 its
    # scalars, ops.algorithms) and every state format: Q8M (8-bit states with block scales) and C8 (an 8-bit Kahan
    # remainder) are compile-time switches; with both off it reads and writes bf16 states only. A tile of
    # BLOCK // QBLOCK scale blocks (rows) of QBLOCK elements. int64 offsets: a ZeRO-3 flat partition can hold more
    # than 2**31 elements. The launcher splits a piece where the index's high word changes, so the high word is one
    # per launch and enters through the stream words (see ops.rng); index_offset is otherwise any non-negative int (a
    # multiple of QBLOCK with 8-bit states). INDEX8: it is a multiple of 8, so each run of 8 elements shares its
    # index's high 16 bits.
    NB: tl.constexpr = BLOCK // _QBLOCK
    start = tl.program_id(0).to(tl.int64) * BLOCK
    rows = tl.arange(0, NB)
    local = rows[:, None] * _QBLOCK + tl.arange(0, _QBLOCK)[None, :]
    offsets = start + local
    mask = offsets < n_elements
    global_start = start + index_offset
    # The first step of every stream's hash of the index's low word (_random_word): lo ^ (lo >> 16).
    if INDEX8:
        # lo = run + j with run a multiple of 8 and j < 8: the same as run ^ j, and lo >> 16 is run >> 16.
        run = (global_start + (local & ~7)).to(tl.uint32)
        folded = (run ^ (run >> _SHIFT1)) ^ (local & 7).to(tl.uint32)
    else:
        lo = (global_start + local).to(tl.uint32)
        folded = lo ^ (lo >> _SHIFT1)
    block_ids = start // _QBLOCK + rows
    block_mask = block_ids * _QBLOCK < n_elements

    # Upcast to fp32: every intermediate in bf16 would round.
    p = _widen(tl.load(p_ptr + offsets, mask=mask, other=0.0))
    g = _widen(tl.load(g_ptr + offsets, mask=mask, other=0.0))
    if SCALE_G:  # a caller's clipping factor, in float32 as the other backends apply it
        g = g * grad_scale
    m = g  # an algorithm without states reads none (m and v are then unused)
    v = g
    if Q8M:
        if STATES >= 1:
            m_scale = tl.load(ms_ptr + block_ids, mask=block_mask, other=0.0).to(tl.float32)[:, None]
            mk = tl.load(m_ptr + offsets, mask=mask, other=0).to(tl.int32)
            m_abs = m_scale * _level(tl.abs(mk).to(tl.float32), 127, 2)
            m = tl.where(mk < 0, -m_abs, m_abs)
        if STATES >= 2:
            v_scale = tl.load(vs_ptr + block_ids, mask=block_mask, other=0.0).to(tl.float32)[:, None]
            vk = tl.load(v_ptr + offsets, mask=mask, other=0).to(tl.int32)
            v = v_scale * _level(vk.to(tl.float32), 255, 4)
    else:
        if STATES >= 1:
            m = _widen(tl.load(m_ptr + offsets, mask=mask, other=0.0))
        if STATES >= 2:
            v = _widen(tl.load(v_ptr + offsets, mask=mask, other=0.0))

    if ALGORITHM == _ADAM:
        m, v, delta = _adam_update(p, g, m, v, h0, h1, h2, h3, h4, h5, h6, h7, h8, VARIANT)
    elif ALGORITHM == _LION:
        m, delta = _lion_update(p, g, m, h0, h1, h2, h3, h4, h5, VARIANT)
    elif ALGORITHM == _DIRECTION:
        delta = _direction_update(p, g, h0, h1, VARIANT)
    else:
        m, delta = _sgd_update(p, g, m, h0, h1, h2, h3, h4, STATES >= 1, VARIANT)

    if ROUNDING == _ROUND_KAHAN:
        if C8:
            c = tl.load(c_ptr + offsets, mask=mask, other=0).to(tl.float32) * _residual_unit(p)
            p_out = _nearest_round(p + (delta + c))
            p_new = p_out.to(tl.float32)
            t = tl.div_rn((c - (p_new - p)) + delta, _residual_unit(p_new))
            k0 = tl.floor(t)
            k = k0 + (_uniform24(_random_word(word_p, folded)) < t - k0).to(tl.float32)
            tl.store(c_ptr + offsets, tl.minimum(tl.maximum(k, -127.0), 127.0).to(tl.int8), mask=mask)
        else:
            c = tl.load(c_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            p_out = _nearest_round(p + (delta + c))
            # The new remainder (old one, less what the write took, plus the update) is written with stochastic
            # rounding of its exact sum: rounded to nearest, an update below half its own spacing would be lost.
            c_new = _stochastic_round_sum(c - (p_out.to(tl.float32) - p), delta, word_p, folded)
            tl.store(c_ptr + offsets, c_new, mask=mask)
    elif ROUNDING == _ROUND_STOCHASTIC:
        # SR of the exact p + delta: the fp32 sum would round away an update of 1e-7 of the weight.
        p_out = _stochastic_round_sum(p, delta, word_p, folded)
    else:
        p_out = _nearest_round(p + delta)
    tl.store(p_ptr + offsets, p_out, mask=mask)

    if Q8M:
        if STATES >= 1:
            new_m_scale = _bf16_ceil(tl.max(tl.abs(m), axis=1))
            tl.store(ms_ptr + block_ids, new_m_scale.to(tl.bfloat16), mask=block_mask)
            mk = _encode(m, new_m_scale[:, None], _random_word(word_m, folded), 127, 2)
            tl.store(m_ptr + offsets, tl.where(m < 0, -mk, mk).to(tl.int8), mask=mask)
        if STATES >= 2:
            new_v_scale = _bf16_ceil(tl.max(tl.abs(v), axis=1))
            tl.store(vs_ptr + block_ids, new_v_scale.to(tl.bfloat16), mask=block_mask)
            vk = _encode(v, new_v_scale[:, None], _random_word(word_v, folded), 255, 4)
            tl.store(v_ptr + offsets, vk.to(tl.uint8), mask=mask)
    elif ROUNDING == _ROUND_NEAREST:
        if STATES >= 1:
            tl.store(m_ptr + offsets, _nearest_round(m), mask=mask)
        if STATES >= 2:
            tl.store(v_ptr + offsets, _nearest_round(v), mask=mask)
    elif STATES >= 1:
        # One word of random bits for both slots: m rounds with its low half, v with its high half.
        r = _random_word(word_m, folded)
        tl.store(m_ptr + offsets, _round_with_bits(m, r & 0xFFFF), mask=mask)
        if STATES >= 2:
            tl.store(v_ptr + offsets, _round_with_bits(v, r >> 16), mask=mask)


def _stream_word(key: int, index_offset: int) -> int:
    """What the kernel xors into each element's folded index to start its hash: the block key of the launch (the
    index's high word is one per launch) after the hash's first step, as an int32 (one kernel signature)."""
    block = rng.block_key(key, index_offset)
    word = block ^ (block >> rng.MIX_SHIFT1)
    return word - (1 << 32) if word >= 1 << 31 else word


def update_triton_(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: Sequence[torch.Tensor],
    kahan_comp: torch.Tensor | None,
    args: Args,
    *,
    scales: Sequence[torch.Tensor | None] = (),
    index_offset: int = 0,
) -> None:
    """Apply one step of ``args.algorithm`` in place with one kernel launch (bf16 ``param`` and states, or 8-bit
    states with their ``scales``).

    Same contract and same random bits as :func:`lightning_pure_bf16.ops.update_torch.update_torch_`; all buffers
    must be contiguous. ``index_offset`` is the index of the first element in the whole tensor when the buffers are
    one piece of it (a multiple of ``QBLOCK`` with 8-bit states).
    """
    n = param.numel()
    if n == 0:
        return
    if index_offset < 0:
        raise ValueError(f"`index_offset={index_offset}` must be non-negative.")
    q8m = any(sc is not None for sc in scales)
    if q8m and index_offset % quant.QBLOCK:
        raise ValueError(
            f"8-bit states need an `index_offset` that is a multiple of {quant.QBLOCK}, got {index_offset}."
        )
    if args.rounding == "kahan" and kahan_comp is None:
        raise ValueError("`rounding='kahan'` needs the compensation buffer.")
    c8 = args.rounding == "kahan" and kahan_comp is not None and kahan_comp.dtype == torch.int8
    # The kernel indexes raw pointers: every buffer must match the parameter's size and device and be contiguous.
    names = ("exp_avg", "exp_avg_sq") if len(states) == 2 else tuple(f"state {i}" for i in range(len(states)))
    expected: dict[str, tuple[torch.Tensor | None, torch.dtype | None, int]] = {
        "param": (param, torch.bfloat16, n),
        "grad": (grad, None, n),
    }
    for slot, (name, t) in enumerate(zip(names, states)):
        expected[name] = (t, (torch.uint8 if slot else torch.int8) if q8m else torch.bfloat16, n)
        if q8m:
            expected[f"{name}_scale"] = (scales[slot], torch.bfloat16, quant.scale_blocks(n))
    if args.rounding == "kahan":
        expected["kahan_comp"] = (kahan_comp, torch.int8 if c8 else torch.bfloat16, n)
    for name, (t, dtype, numel) in expected.items():
        if t is None:
            raise ValueError(f"The Triton update kernel needs `{name}`.")
        if intercepts_operations(t):
            raise ValueError(
                f"The Triton update kernel writes raw memory; `{name}` is a {type(t).__name__}, a tensor subclass"
                " without memory of its own (pass its local tensor, `.to_local()`, or a plain tensor)."
            )
        if not t.is_contiguous():
            raise ValueError(f"The Triton update kernel needs contiguous buffers; `{name}` is not.")
        if t.numel() != numel:
            raise ValueError(f"The Triton update kernel: `{name}` has {t.numel()} elements, it needs {numel}.")
        if t.device != param.device:
            raise ValueError(f"The Triton update kernel: `{name}` is on {t.device}, the parameter on {param.device}.")
        if dtype is not None and t.dtype != dtype:
            want, got = (str(d).removeprefix("torch.") for d in (dtype, t.dtype))
            raise ValueError(f"The Triton update kernel needs {want} `{name}`, got {got}.")
    end = rng.next_high_word(index_offset) - index_offset
    if end < n:
        # The index's high word changes inside the piece: one launch on each side (2**32 is a multiple of QBLOCK).
        cut = end // quant.QBLOCK

        def part(t: torch.Tensor | None, where: slice) -> torch.Tensor | None:
            return t[where] if t is not None else None

        for where, blocks, offset in (
            (slice(end), slice(cut), index_offset),
            (slice(end, n), slice(cut, None), index_offset + end),
        ):
            update_triton_(
                part(param, where),
                part(grad, where),
                [part(t, where) for t in states],
                part(kahan_comp, where),
                args,
                scales=[part(t, blocks) for t in scales],
                index_offset=offset,
            )
        return
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    m, v = (*states, param, param)[:2]  # placeholders of absent states: never read or written
    ms, vs = (*(sc for sc in scales if sc is not None), param, param)[:2]
    # Launch on the parameter's GPU, not the current one (a multi-GPU process may have another one current).
    with torch.cuda.device(param.device) if param.is_cuda else nullcontext():
        _update_kernel[grid](
            param,
            grad,
            m,
            v,
            ms,
            vs,
            kahan_comp if kahan_comp is not None else param,
            n,
            *hyper_scalars(args),
            *(_stream_word(key, index_offset) for key in args.keys),
            index_offset,
            ALGORITHM=int(args.algorithm),
            STATES=len(states),
            VARIANT=args.variant,
            ROUNDING=ROUNDING_CODES[args.rounding],
            Q8M=q8m,
            C8=c8,
            INDEX8=index_offset % 8 == 0,
            SCALE_G=args.grad_scale != 1.0,
            BLOCK=BLOCK_SIZE,
            num_warps=NUM_WARPS,
            # No fused multiply-add: each product rounded on its own, exactly as the PyTorch and CPU paths do.
            enable_fp_fusion=False,
        )


__all__ = ["BLOCK_SIZE", "update_triton_"]
