"""The pure-bf16 updates of one tensor as functions: :func:`adamw`, :func:`lion` and :func:`sgd` write ``param`` and
its states in place with the bits the step of :class:`lightning_pure_bf16.AdamW`, ``Lion`` and ``SGD`` writes, for a
caller that keeps the state itself, as torchao's and optimi's functional forms. Also what every optimizer's step
uses: the choice of backend and its update function (one per backend for every algorithm, ``ops``), and the checks of
parameters, gradients and gradient factors."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning_utilities.core.imports import RequirementCache

from lightning_pure_bf16.ops.algorithms import ROUNDING_MODES, Args, LionArgs, SGDArgs, UpdateArgs
from lightning_pure_bf16.ops.rng import Buffer, stream_key
from lightning_pure_bf16.ops.update_cpu import any_nonfinite_cpu, can_use_fused_cpu, fused_cpu_available, update_cpu_
from lightning_pure_bf16.ops.update_torch import DEFAULT_CHUNK, intercepts_operations, update_torch_
from lightning_pure_bf16.optim import sharded
from lightning_pure_bf16.optim.options import check_choice, check_lr, check_non_negative

_TRITON_AVAILABLE = RequirementCache("triton")


@torch.no_grad()
def adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    decoupled_weight_decay: bool = True,
    rounding: str = "stochastic",
    kahan_comp: torch.Tensor | None = None,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    seed: int = 0,
    stream: int = 0,
    index_offset: int = 0,
    backend: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW (or, with ``decoupled_weight_decay=False``, Adam) update of ``param`` in place, from ``grad``.

    Args:
        param, grad: the tensor (bf16 or float32) and its gradient, of one shape.
        exp_avg, exp_avg_sq: its moments, updated in place: the parameter's dtype, or int8/uint8 codes with their
            block scales ``exp_avg_scale``/``exp_avg_sq_scale`` (:mod:`lightning_pure_bf16.ops.quant`).
        step: this update's step, counted from 1 (the bias corrections and the rounding noise use it).
        lr, betas, eps, weight_decay: as :class:`lightning_pure_bf16.AdamW`'s.
        rounding: ``"stochastic"``, ``"kahan"`` (with ``kahan_comp``, bf16 or int8) or ``"nearest"``.
        seed, stream: the rounding noise: an optimizer's seed and the tensor's stream (its position among the tensors
            it updates); the same seed, stream, step and ``index_offset`` draw the same bits on every backend.
        index_offset: the index of ``param``'s first element in the tensor it is a slice of (its random bits belong to
            its elements).
        backend, chunk_size: as :class:`lightning_pure_bf16.AdamW`'s.
        grad_scale: a factor every gradient element is multiplied by, in float32, before the update (a clip factor
            the caller computed; default ``1.0``: none); a finite number > 0.
    """
    check_hyperparameters("adamw", lr, betas, eps, weight_decay, rounding)
    check_grad_scale("`adamw(...)`", grad_scale)
    args = update_args(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        rounding=rounding,
        step=step,
        seed=seed,
        stream=stream,
        grad_scale=grad_scale,
    )
    scales = (exp_avg_scale, exp_avg_sq_scale) if exp_avg_scale is not None else ()
    states = [exp_avg, exp_avg_sq]
    _update_one("adamw", param, grad, states, kahan_comp, args, scales, backend, chunk_size, index_offset)


@torch.no_grad()
def lion(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    rounding: str = "stochastic",
    kahan_comp: torch.Tensor | None = None,
    exp_avg_scale: torch.Tensor | None = None,
    seed: int = 0,
    stream: int = 0,
    index_offset: int = 0,
    backend: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
    grad_scale: float = 1.0,
) -> None:
    """One Lion update of ``param`` in place, from ``grad`` (:class:`lightning_pure_bf16.Lion`'s step, the same bits).

    Args:
        exp_avg: the momentum, updated in place: the parameter's dtype, or int8 codes with their block scales
            ``exp_avg_scale``.
        step, rounding, kahan_comp, seed, stream, index_offset, backend, chunk_size, grad_scale: as
            :func:`adamw`'s.
        lr, betas, weight_decay: as :class:`~lightning_pure_bf16.Lion`'s.
    """
    check_lr("lion", lr)
    check_grad_scale("`lion(...)`", grad_scale)
    if len(betas) != 2 or not all(0.0 <= float(b) <= 1.0 for b in betas):
        raise ValueError(f"`lion(betas={betas!r})`: both betas must be in [0, 1].")
    check_non_negative("lion", "weight_decay", weight_decay, "weight decay")
    args = LionArgs(
        lr=float(lr),
        beta1=float(betas[0]),
        beta2=float(betas[1]),
        weight_decay=float(weight_decay),
        step=step,
        rounding=rounding,
        keys=_keys(seed, stream, step),
        grad_scale=float(grad_scale),
    )
    scales = (exp_avg_scale,) if exp_avg_scale is not None else ()
    _update_one("lion", param, grad, [exp_avg], kahan_comp, args, scales, backend, chunk_size, index_offset)


@torch.no_grad()
def sgd(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
    *,
    step: int,
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    rounding: str = "stochastic",
    kahan_comp: torch.Tensor | None = None,
    momentum_buffer_scale: torch.Tensor | None = None,
    seed: int = 0,
    stream: int = 0,
    index_offset: int = 0,
    backend: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
    grad_scale: float = 1.0,
) -> None:
    """One SGD update of ``param`` in place, from ``grad`` (:class:`lightning_pure_bf16.SGD`'s step, the same bits).

    Args:
        momentum_buffer: the momentum, updated in place (with ``momentum > 0``; its first step, ``step=1``, starts it
            at the gradient, as ``torch.optim.SGD`` does): the parameter's dtype, or int8 codes with their block scales
            ``momentum_buffer_scale``. ``None`` without momentum.
        step, rounding, kahan_comp, seed, stream, index_offset, backend, chunk_size, grad_scale: as :func:`adamw`'s.
        lr, momentum, dampening, weight_decay, nesterov: as :class:`~lightning_pure_bf16.SGD`'s.
    """
    check_lr("sgd", lr)
    check_grad_scale("`sgd(...)`", grad_scale)
    for name, value in (("momentum", momentum), ("dampening", dampening), ("weight_decay", weight_decay)):
        check_non_negative("sgd", name, value)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("`sgd(nesterov=True)` needs a momentum > 0 and zero dampening, as torch.optim.SGD.")
    if (momentum_buffer is None) != (momentum == 0):
        raise ValueError(
            f"`sgd(momentum={momentum!r})` "
            + ("needs `momentum_buffer` (zeros to start)." if momentum_buffer is None else "keeps no momentum_buffer.")
        )
    args = SGDArgs(
        lr=float(lr),
        momentum=float(momentum),
        dampening=float(dampening),
        weight_decay=float(weight_decay),
        nesterov=bool(nesterov),
        step=step,
        rounding=rounding,
        keys=_keys(seed, stream, step),
        grad_scale=float(grad_scale),
    )
    states = [momentum_buffer] if momentum_buffer is not None else []
    scales = (momentum_buffer_scale,) if momentum_buffer_scale is not None else ()
    _update_one("sgd", param, grad, states, kahan_comp, args, scales, backend, chunk_size, index_offset)


def _keys(seed: int, stream: int, step: int) -> tuple[int, int, int]:
    """The noise keys of one tensor's update: the optimizer's seed, the tensor's stream, the step (every buffer)."""
    return tuple(stream_key(seed, stream, step, b) for b in Buffer)  # type: ignore[return-value]


def _update_one(
    name: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    kahan_comp: torch.Tensor | None,
    args: Args,
    scales: tuple[torch.Tensor, ...],
    backend: str,
    chunk_size: int,
    index_offset: int,
) -> None:
    """The shared end of the functional forms (each checks its own scalars and gradient factor first): the rounding
    and the Kahan buffer checked, the backend chosen, one update."""
    check_choice(name, "rounding", args.rounding, ROUNDING_MODES)
    if args.rounding == "kahan" and kahan_comp is None and param.dtype == torch.bfloat16:
        raise ValueError(f"{name}(rounding='kahan') needs `kahan_comp`, the buffer of the remainders (zeros to start).")
    update = update_function(resolve_backend(backend, param, grad, name=name), chunk_size)
    comp = kahan_comp if args.rounding == "kahan" else None
    update(param, grad, states, comp, args, scales=scales, index_offset=index_offset)


def update_args(
    *,
    lr: Any,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    rounding: str,
    step: int,
    seed: int = 0,
    stream: int = 0,
    keys: tuple[int, int, int] | None = None,
    grad_scale: float = 1.0,
) -> UpdateArgs:
    """The scalars of one Adam update (:class:`~lightning_pure_bf16.ops.algorithms.UpdateArgs`); ``keys``: its noise
    keys, else those of ``seed``, ``stream`` and ``step``."""
    beta1, beta2 = betas
    return UpdateArgs(
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        decoupled=bool(decoupled_weight_decay),
        step=step,
        rounding=rounding,
        keys=keys or _keys(seed, stream, step),
        grad_scale=float(grad_scale),
    )


def triton_available() -> bool:
    """Whether Triton imports here."""
    return bool(_TRITON_AVAILABLE)


def update_function(backend: str, chunk_size: int = DEFAULT_CHUNK) -> Callable[..., None]:
    """The update of a resolved backend (``"triton"``, ``"cpu"``, ``"torch"``), for every algorithm: called as
    ``update(param, grad, states, kahan_comp, args, scales=..., index_offset=...)``."""
    if backend == "triton":
        return _triton_update()
    if backend == "cpu":
        return update_cpu_
    return partial(update_torch_, chunk_size=chunk_size)


def resolve_backend(backend: str, p: torch.Tensor, grad: torch.Tensor, *, name: str = "adamw") -> str:
    """The backend that updates ``p`` (``"triton"``, ``"cpu"`` or ``"torch"``) for the choice ``backend``, after
    checking that ``p`` and ``grad`` can be updated in place (plain dense tensors of one shape, not on the meta device);
    ``name`` is who asks, for the messages."""
    refuse_subclass(name, p, "a parameter")
    refuse_subclass(name, grad, "the gradient of a parameter")
    if p.is_meta or grad.is_meta:
        what = "a parameter" if p.is_meta else "the gradient of a parameter"
        raise RuntimeError(
            f"{name}: {what} of shape {tuple(p.shape)} is on the meta device and has no values to update."
            " Materialize the model first (`model.to_empty(device=...)`, then initialize its weights) and build"
            " the optimizer over its parameters."
        )
    if grad.is_sparse:
        raise RuntimeError(
            f"{name} does not support sparse gradients (a parameter of shape {tuple(p.shape)} has"
            " one): use dense gradients (`nn.Embedding(..., sparse=False)`) or `torch.optim.SparseAdam`."
        )
    if grad.shape != p.shape:
        raise RuntimeError(f"Gradient shape {tuple(grad.shape)} does not match parameter shape {tuple(p.shape)}.")
    if p.dtype != torch.bfloat16 or backend == "torch":
        return "torch"
    if backend == "triton":
        if not (p.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise RuntimeError(
                f"`backend='triton'` needs CUDA tensors (got a tensor on {p.device}); use `backend='torch'` or set"
                " TRITON_INTERPRET=1 before importing to run the kernel on the CPU."
            )
        return "triton"
    fused_cpu_ok = can_use_fused_cpu(p, grad)
    if backend == "cpu":
        if not fused_cpu_ok:
            raise RuntimeError(
                "`backend='cpu'` needs contiguous bf16 CPU tensors for the parameter and its gradient (got"
                f" {p.dtype} on {p.device}, gradient {grad.dtype}); use `backend='auto'` or `backend='torch'`."
            )
        if not fused_cpu_available():
            raise RuntimeError(
                "`backend='cpu'`: the fused CPU loop did not compile (see the warning above); use `backend='torch'`."
            )
        return "cpu"
    if p.is_cuda and _TRITON_AVAILABLE:
        return "triton"
    if fused_cpu_ok and fused_cpu_available():
        return "cpu"
    return "torch"


def _triton_update() -> Callable[..., None]:
    if not _TRITON_AVAILABLE:
        raise ModuleNotFoundError(
            f"`backend='triton'` needs Triton: {_TRITON_AVAILABLE.message}. `pip install triton`."
        )
    from lightning_pure_bf16.ops.update_triton import update_triton_

    return update_triton_


def refuse_subclass(name: str, t: torch.Tensor, what: str) -> None:
    """The update writes each element in place, through raw memory on the CPU and in Triton: a tensor subclass that
    intercepts operations and holds no memory of its own would be written past, or crash the CPU loop. DTensors are
    taken apart before this check (their local shard is a plain tensor)."""
    if intercepts_operations(t):
        raise TypeError(
            f"{name} updates plain tensors and DTensors in place; {what} of shape {tuple(t.shape)} is a"
            f" {type(t).__name__}, a tensor subclass that intercepts operations and may hold no memory of its own."
            " Give the optimizer plain tensors or DTensors (FSDP2's `fully_shard`, tensor parallelism), or train with"
            " `strategy='deepspeed_pure_bf16'`, which shards the parameters itself."
        )


def check_param(name: str, p: torch.Tensor) -> None:
    """A parameter the optimizer can update in place: a bf16 or float32 plain tensor, or a DTensor of one with
    placements that can be trained (``name``: who asks, for the messages)."""
    refuse_subclass(name, *sharded.checked_local(name, p))
    if p.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(
            f"{name} supports bfloat16 and float32 parameters, got a {p.dtype} parameter of shape {tuple(p.shape)}."
            " Convert the model with `model.to(torch.bfloat16)`."
        )


def nonfinite_flags(tensors: list[torch.Tensor], backend: str) -> list[bool | torch.Tensor]:
    """Per tensor, whether it holds inf or NaN: a bool from the fused CPU loop's read-only pass (torch's isfinite on
    bf16 CPU tensors costs more than the update itself; with ``backend`` ``"auto"`` or ``"cpu"``), else a 1-element
    bool tensor on its device (no sync)."""
    return [
        any_nonfinite_cpu(t)
        if backend in ("auto", "cpu") and can_use_fused_cpu(t, t) and fused_cpu_available()
        else torch.logical_not(torch.isfinite(t).all()).reshape(1)
        for t in tensors
    ]


def nonfinite(tensors: list[torch.Tensor], backend: str) -> list[bool]:
    """:func:`nonfinite_flags` as bools (one device synchronization in all)."""
    found = nonfinite_flags(tensors, backend)
    flags = [f for f in found if isinstance(f, torch.Tensor)]
    if flags:
        rest = iter(torch.cat([f.cpu() for f in flags] if len({f.device for f in flags}) > 1 else flags).tolist())
        found = [next(rest) if isinstance(f, torch.Tensor) else f for f in found]
    return [bool(f) for f in found]


def any_nonfinite(tensors: list[torch.Tensor], backend: str) -> torch.Tensor:
    """A 0-dim float32 tensor: 1.0 if any of ``tensors`` holds inf or NaN, else 0.0 (one reduction, no sync)."""
    found = nonfinite_flags(tensors, backend)
    if any(f is True for f in found):
        return torch.ones((), dtype=torch.float32)
    flags = [f.to(torch.float32) for f in found if isinstance(f, torch.Tensor)]
    if not flags:
        return torch.zeros((), dtype=torch.float32)
    return torch.cat([f.cpu() for f in flags] if len({f.device for f in flags}) > 1 else flags).amax()


def check_hyperparameters(name: str, lr: Any, betas: Any, eps: Any, weight_decay: Any, rounding: Any) -> None:
    """Adam's hyperparameters, each refused by name."""
    check_lr(name, lr)
    check_non_negative(name, "eps", eps)
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"`{name}(betas={betas!r})`: both betas must be in [0, 1).")
    check_non_negative(name, "weight_decay", weight_decay, "weight decay")
    check_choice(name, "rounding", rounding, ROUNDING_MODES)


def check_grad_scale(where: str, grad_scale: Any) -> None:
    """A gradient factor is a finite number > 0 (a clip factor is in (0, 1]); anything else is refused, naming
    ``where`` it was given, before any buffer changes."""
    if (
        isinstance(grad_scale, bool)
        or not isinstance(grad_scale, (int, float))
        or not math.isfinite(grad_scale)
        or grad_scale <= 0
    ):
        raise ValueError(
            f"{where}: grad_scale={grad_scale!r}; the gradient's factor must be a finite number > 0 (a clip factor is"
            " in (0, 1]; 1.0 leaves the gradient as it is)."
        )


__all__ = [
    "adamw",
    "any_nonfinite",
    "check_grad_scale",
    "check_hyperparameters",
    "check_param",
    "nonfinite",
    "nonfinite_flags",
    "refuse_subclass",
    "resolve_backend",
    "lion",
    "sgd",
    "update_args",
    "update_function",
]
