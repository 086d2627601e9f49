"""Pure-bf16 Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), with the semantics of the
``lion-pytorch`` package: the update is the sign of ``beta1 * m + (1 - beta1) * g`` times ``-lr``, with decoupled
weight decay, and the momentum follows ``m = beta2 * m + (1 - beta2) * g``. One state per element: 2 bytes/param in
bf16, 1 in 8 bits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_pure_bf16.ops.algorithms import LionArgs
from lightning_pure_bf16.optim.base import PureBF16Optimizer
from lightning_pure_bf16.optim.options import check_lr, check_non_negative


class Lion(PureBF16Optimizer):
    """Lion whose bf16 parameters and momentum lose nothing to rounding on average.

    Args:
        params: parameters or parameter groups; groups may override ``lr``, ``betas``, ``weight_decay`` and
            ``rounding``.
        lr: learning rate, typically 3-10x smaller than AdamW's (default: ``1e-4``).
        betas: ``beta1`` interpolates the update's direction, ``beta2`` is the momentum's decay (default:
            ``(0.9, 0.99)``).
        weight_decay: decoupled weight decay coefficient, typically 3-10x AdamW's (default: ``0.0``).
        **options: the options every optimizer of the package shares
            (:class:`~lightning_pure_bf16.optim.base.PureBF16Optimizer`).
    """

    state_names = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay}, **options)

    @classmethod
    def check_group(cls, who: str, group: dict[str, Any]) -> None:
        check_lr(who, group["lr"])
        betas = group["betas"]
        if len(betas) != 2 or not all(0.0 <= float(b) <= 1.0 for b in betas):
            raise ValueError(f"`{who}(betas={betas!r})`: both betas must be in [0, 1].")
        check_non_negative(who, "weight_decay", group["weight_decay"], "weight decay")
        super().check_group(who, group)

    def update_args(
        self, group: dict[str, Any], *, step: int, keys: tuple[int, int, int], grad_scale: float
    ) -> LionArgs:
        beta1, beta2 = group["betas"]
        return LionArgs(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            step=step,
            rounding=group["rounding"],
            keys=keys,
            grad_scale=float(grad_scale),
        )


__all__ = ["Lion"]
