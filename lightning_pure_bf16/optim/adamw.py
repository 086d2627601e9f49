"""Pure-bf16 Adam and AdamW: bf16 parameters and moments, stochastic rounding or Kahan compensation on every write.

Thin classes over :class:`~lightning_pure_bf16.optim.base.PureBF16Optimizer`, which owns the state, the checks and
the dispatch; the arithmetic is :class:`lightning_pure_bf16.ops.algorithms.UpdateArgs`' (Adam's) in every backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_pure_bf16.ops.algorithms import UpdateArgs
from lightning_pure_bf16.optim import functional
from lightning_pure_bf16.optim.base import PureBF16Optimizer


class AdamW(PureBF16Optimizer):
    """AdamW whose bf16 parameters and moments lose nothing to rounding on average.

    With bf16 parameters the optimizer state is 4 bytes per parameter (6 with Kahan, 2 with 8-bit moments). All
    arithmetic is fp32, each buffer is read and written once per step, and decoupled weight decay is part of the
    same rounded write. float32 parameters get plain float32 AdamW.

    Args:
        params: parameters or parameter groups; groups may override ``lr``, ``betas``, ``eps``, ``weight_decay`` and
            ``rounding``.
        lr: learning rate (default: ``1e-3``).
        betas: coefficients of the moment averages (default: ``(0.9, 0.999)``).
        eps: added to the denominator (default: ``1e-8``).
        weight_decay: decoupled weight decay coefficient (default: ``1e-2``).
        **options: ``rounding``, ``seed``, ``backend``, ``chunk_size``, ``state_storage``, ``state_dir``,
            ``state_chunk_size``, ``moments``, ``compensation``: the options every optimizer of the package shares
            (:class:`~lightning_pure_bf16.optim.base.PureBF16Optimizer`).
    """

    state_names = ("exp_avg", "exp_avg_sq")
    _decoupled_default = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": self._decoupled_default,
        }
        super().__init__(params, defaults, **options)

    @classmethod
    def check_group(cls, who: str, group: dict[str, Any]) -> None:
        functional.check_hyperparameters(who, *(group[k] for k in ("lr", "betas", "eps", "weight_decay", "rounding")))

    def update_args(
        self, group: dict[str, Any], *, step: int, keys: tuple[int, int, int], grad_scale: float
    ) -> UpdateArgs:
        return functional.update_args(
            **{k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "rounding")},
            step=step,
            keys=keys,
            grad_scale=grad_scale,
        )


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
        **options: Any,
    ) -> None:
        self._decoupled_default = decoupled_weight_decay
        super().__init__(params, lr, betas, eps, weight_decay, **options)


__all__ = ["Adam", "AdamW"]
