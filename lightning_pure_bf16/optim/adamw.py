"""Pure-bf16 Adam and AdamW: bf16 parameters and moments, stochastic rounding or Kahan compensation on every write.

The optimizer owns state, hyperparameters and dispatch; the arithmetic lives in ``ops`` (one fused Triton kernel for
CUDA tensors, a chunked PyTorch path everywhere else), which draw identical random bits from ``ops.rng``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from lightning_utilities.core.imports import RequirementCache
from torch.optim import Optimizer

from lightning_pure_bf16.ops.adamw_cpu import (
    adamw_update_cpu_,
    any_nonfinite_cpu,
    can_use_fused_cpu,
    fused_cpu_available,
)
from lightning_pure_bf16.ops.adamw_torch import DEFAULT_CHUNK, ROUNDING_MODES, UpdateArgs, adamw_update_torch_
from lightning_pure_bf16.ops.rng import Buffer, mix32, stream_key

_TRITON_AVAILABLE = RequirementCache("triton")

Rounding = Literal["stochastic", "kahan", "nearest"]
Backend = Literal["auto", "triton", "cpu", "torch"]

_BACKENDS = ("auto", "triton", "cpu", "torch")
# torch.optim options this optimizer does not implement, with the value that means "off".
_UNSUPPORTED_OFF: dict[str, Any] = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
_STATE_EXTRA_KEY = "pure_bf16"


def default_seed() -> int:
    """The seed used when ``seed=None``: derived from ``torch.initial_seed()`` without drawing from any generator.

    So ``lightning.seed_everything(s)`` or ``torch.manual_seed(s)`` makes the rounding reproducible, and the user's
    random stream (dropout, data order) is the same as with ``torch.optim.AdamW``.
    """
    s = torch.initial_seed()
    return (mix32(s & 0xFFFFFFFF) << 32) | mix32((s >> 32) ^ 0x5BD1E995)


def _triton_update() -> Callable[..., None]:
    if not _TRITON_AVAILABLE:
        raise ModuleNotFoundError(
            f"`backend='triton'` needs Triton: {_TRITON_AVAILABLE.message}. `pip install triton`."
        )
    from lightning_pure_bf16.ops.adamw_triton import adamw_update_triton_

    return adamw_update_triton_


def _triton_can_run(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


class AdamW(Optimizer):
    """AdamW whose bf16 parameters and moments lose nothing to rounding on average.

    Every buffer the size of the parameter has the parameter's dtype: with bf16 parameters the optimizer state is
    4 bytes per parameter (6 with Kahan). All arithmetic is fp32, each buffer is read and written once per step, and
    decoupled weight decay is part of the same rounded write. float32 parameters get plain float32 AdamW.

    Args:
        params: parameters or parameter groups; groups may override ``lr``, ``betas``, ``eps``, ``weight_decay`` and
            ``rounding``.
        lr: learning rate (default: ``1e-3``).
        betas: coefficients of the moment averages (default: ``(0.9, 0.999)``).
        eps: added to the denominator (default: ``1e-8``).
        weight_decay: decoupled weight decay coefficient (default: ``1e-2``).
        rounding: how bf16 values are written (default: ``"stochastic"``). ``"stochastic"`` rounds the parameter and
            both moments stochastically; ``"kahan"`` keeps the part of the parameter update lost to rounding in a bf16
            compensation buffer (+2 bytes/param) and rounds the moments stochastically; ``"nearest"`` rounds
            everything to nearest-even, as other pure-bf16 optimizers do (small updates vanish).
        seed: seed of the counter-based rounding noise (default: ``None``, derived from ``torch.initial_seed()``).
            Saved in ``state_dict()``.
        backend: ``"triton"`` (one fused kernel per tensor, CUDA), ``"cpu"`` (one fused C++ loop per tensor, CPU,
            compiled on first use), ``"torch"`` (chunked PyTorch, any device) or ``"auto"``: Triton for CUDA tensors
            when it imports, the fused loop for CPU tensors when it compiles, else PyTorch (default: ``"auto"``). All
            give the same results bit for bit on the CPU; float32 parameters always take the PyTorch path.
        chunk_size: elements per chunk of the PyTorch path, a power of two (default: ``2**18``).

    Attributes:
        skipped_steps: steps skipped because a gradient was inf/NaN (saved in ``state_dict()``).
        check_nonfinite: whether :meth:`step` checks gradients itself (default: ``True``). A distributed caller that
            makes the decision for all ranks sets it to ``False`` and uses :meth:`nonfinite_grads` and
            :meth:`record_skipped_step`.
        nonfinite_reduce: optional function applied to the local non-finite flag before deciding (for example an
            all-reduce with ``MAX``), so every rank skips together.
    """

    _decoupled_default = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        rounding: Rounding = "stochastic",
        seed: int | None = None,
        backend: Backend = "auto",
        chunk_size: int = DEFAULT_CHUNK,
        foreach: bool | None = None,
        fused: bool | None = None,
        **unsupported: Any,
    ) -> None:
        name = type(self).__name__
        for option, value in unsupported.items():
            if option not in _UNSUPPORTED_OFF:
                raise TypeError(f"{name}() got an unexpected keyword argument {option!r}.")
            if value != _UNSUPPORTED_OFF[option]:
                raise ValueError(
                    f"`{name}({option}={value!r})` is not supported by the pure-bf16 optimizer. Remove `{option}` or"
                    " use a torch.optim optimizer with fp32 master weights."
                )
        if foreach or fused:
            flag = "foreach" if foreach else "fused"
            raise ValueError(
                f"`{name}({flag}=True)` selects a torch.optim implementation; the pure-bf16 optimizer picks its own."
                " Use `backend='triton'` or `backend='torch'` instead."
            )
        if backend not in _BACKENDS:
            raise ValueError(f"`backend={backend!r}` is not one of {_BACKENDS}.")
        if chunk_size <= 0 or chunk_size & (chunk_size - 1):
            raise ValueError(f"`chunk_size` must be a positive power of two, got {chunk_size}.")
        if seed is not None and (not isinstance(seed, int) or seed < 0):
            raise ValueError(f"`seed` must be a non-negative int or None, got {seed!r}.")
        if backend == "triton" and not _TRITON_AVAILABLE:
            raise ModuleNotFoundError(
                f"`backend='triton'` needs Triton: {_TRITON_AVAILABLE.message}. `pip install triton`."
            )
        _check_hyperparameters(name, lr, betas, eps, weight_decay, rounding)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "rounding": rounding,
            "decoupled_weight_decay": self._decoupled_default,
        }
        self.seed = default_seed() if seed is None else seed
        self.backend = backend
        self.chunk_size = chunk_size
        self.skipped_steps = 0
        self.check_nonfinite = True
        self.nonfinite_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._next_stream = 0
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its hyperparameters and that its parameters are bf16 or float32."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if p.dtype not in (torch.bfloat16, torch.float32):
                raise TypeError(
                    f"{type(self).__name__} supports bfloat16 and float32 parameters, got a {p.dtype} parameter of"
                    f" shape {tuple(p.shape)}. Convert the model with `model.to(torch.bfloat16)`."
                )
        merged = {**self.defaults, **param_group}
        _check_hyperparameters(
            type(self).__name__,
            merged["lr"],
            merged["betas"],
            merged["eps"],
            merged["weight_decay"],
            merged["rounding"],
        )
        super().add_param_group(param_group)

    @torch.no_grad()
    def nonfinite_grads(self) -> torch.Tensor:
        """A 0-dim float32 tensor: 1.0 if any gradient of this optimizer holds inf or NaN, else 0.0 (one reduction)."""
        flags = []
        cpu_found = False
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.backend in ("auto", "cpu") and can_use_fused_cpu(p, p.grad) and fused_cpu_available():
                    # One read-only pass; torch's isfinite on bf16 CPU tensors costs more than the update itself.
                    cpu_found = cpu_found or any_nonfinite_cpu(p.grad)
                else:
                    flags.append(torch.logical_not(torch.isfinite(p.grad).all()).to(torch.float32).reshape(1))
        if cpu_found:
            return torch.ones((), dtype=torch.float32)
        if not flags:
            return torch.zeros((), dtype=torch.float32)
        devices = {f.device for f in flags}
        if len(devices) > 1:
            flags = [f.cpu() for f in flags]
        return torch.cat(flags).amax()

    def record_skipped_step(self) -> None:
        """Count a step that a caller skipped because of non-finite gradients (nothing else changes)."""
        self.skipped_steps += 1

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step; skipped entirely (no buffer or counter changes) when any gradient is inf/NaN."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.check_nonfinite:
            flag = self.nonfinite_grads()
            if self.nonfinite_reduce is not None:
                flag = self.nonfinite_reduce(flag)
            if bool(flag.item()):
                self.record_skipped_step()
                return loss

        # Validate everything first, so a bad gradient or device fails before any buffer or counter changes.
        plan = [
            (p, group, self._pick_backend(p))
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        for p, group, backend in plan:
            self._update(p, group, backend)
        return loss

    def init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Allocate the state of ``p`` (a parameter of ``group``) now instead of at its first step.

        Callers that own the parameters (the ZeRO-3 strategy) use it so that memory is allocated, reported and, if
        short, fails at setup rather than at the first step. Idempotent.
        """
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.int64)
            # The stream id decorrelates the rounding noise of different tensors; it is fixed at first use and saved.
            state["stream"] = self._next_stream
            self._next_stream += 1
            state["exp_avg"] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        if group["rounding"] == "kahan" and p.dtype == torch.bfloat16 and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        return state

    def _update(self, p: torch.Tensor, group: dict[str, Any], backend: str) -> None:
        grad = p.grad
        state = self.init_state(p, group)
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]
        rounding = group["rounding"]
        kahan_comp = state.get("kahan_comp") if rounding == "kahan" else None
        args = UpdateArgs(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group["decoupled_weight_decay"]),
            step=step,
            rounding=rounding,
            keys=tuple(stream_key(self.seed, state["stream"], step, b) for b in Buffer),  # type: ignore[arg-type]
        )
        buffers = (p, grad, state["exp_avg"], state["exp_avg_sq"], kahan_comp)
        if backend == "triton":
            _triton_update()(*buffers, args)
        elif backend == "cpu":
            adamw_update_cpu_(*buffers, args)
        else:
            adamw_update_torch_(*buffers, args, chunk_size=self.chunk_size)

    def _pick_backend(self, p: torch.Tensor) -> str:
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients.")
        if grad.shape != p.shape:
            raise RuntimeError(f"Gradient shape {tuple(grad.shape)} does not match parameter shape {tuple(p.shape)}.")
        if p.dtype != torch.bfloat16 or self.backend == "torch":
            return "torch"
        if self.backend == "triton":
            if not _triton_can_run(p):
                raise RuntimeError(
                    f"`backend='triton'` needs CUDA tensors (got a tensor on {p.device}); use `backend='torch'` or set"
                    " TRITON_INTERPRET=1 before importing to run the kernel on the CPU."
                )
            return "triton"
        fused_cpu_ok = can_use_fused_cpu(p, grad)
        if self.backend == "cpu":
            if not fused_cpu_ok:
                raise RuntimeError(
                    "`backend='cpu'` needs contiguous bf16 CPU tensors for the parameter and its gradient (got"
                    f" {p.dtype} on {p.device}, gradient {grad.dtype}); use `backend='auto'` or `backend='torch'`."
                )
            if not fused_cpu_available():
                raise RuntimeError(
                    "`backend='cpu'`: the fused CPU loop did not compile (see the warning above); use"
                    " `backend='torch'`."
                )
            return "cpu"
        if p.is_cuda and _TRITON_AVAILABLE:
            return "triton"
        if fused_cpu_ok and fused_cpu_available():
            return "cpu"
        return "torch"

    def state_dict(self) -> dict[str, Any]:
        """The torch state dict plus the rounding seed, the stream counter and the skipped-step count."""
        sd = super().state_dict()
        sd[_STATE_EXTRA_KEY] = {
            "seed": self.seed,
            "skipped_steps": self.skipped_steps,
            "next_stream": self._next_stream,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`; restores the seed, so the run continues bit for bit."""
        state_dict = dict(state_dict)
        extra = state_dict.pop(_STATE_EXTRA_KEY, None)
        if extra is None:
            raise KeyError(
                f"This state dict has no {_STATE_EXTRA_KEY!r} entry: it was not saved by a lightning_pure_bf16"
                " optimizer, so its rounding seed and counters are unknown."
            )
        super().load_state_dict(state_dict)
        self.seed = int(extra["seed"])
        self.skipped_steps = int(extra["skipped_steps"])
        self._next_stream = int(extra["next_stream"])
        for state in self.state.values():
            if "step" in state:
                # torch may cast or move "step"; keep it an exact int64 CPU counter.
                state["step"] = torch.as_tensor(state["step"]).detach().to("cpu", torch.int64).reshape(())


class Adam(AdamW):
    """Adam with L2 weight decay added to the gradient (``torch.optim.Adam`` semantics), pure bf16.

    Same arguments as :class:`AdamW`, except ``weight_decay`` defaults to ``0`` and is coupled unless
    ``decoupled_weight_decay=True``.
    """

    _decoupled_default = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        **kwargs: Any,
    ) -> None:
        self._decoupled_default = decoupled_weight_decay
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)


def _check_hyperparameters(name: str, lr: Any, betas: Any, eps: Any, weight_decay: Any, rounding: Any) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"`{name}(lr=...)` must be a float or a one-element tensor, got shape {tuple(lr.shape)}.")
        lr = float(lr)
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0.0:
        raise ValueError(f"`{name}(lr={lr!r})`: the learning rate must be a finite number >= 0.")
    if not math.isfinite(eps) or eps < 0.0:
        raise ValueError(f"`{name}(eps={eps!r})`: eps must be a finite number >= 0.")
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"`{name}(betas={betas!r})`: both betas must be in [0, 1).")
    if not math.isfinite(weight_decay) or weight_decay < 0.0:
        raise ValueError(f"`{name}(weight_decay={weight_decay!r})`: weight decay must be a finite number >= 0.")
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"`{name}(rounding={rounding!r})` is not one of {ROUNDING_MODES}.")


__all__ = ["Adam", "AdamW", "default_seed"]
