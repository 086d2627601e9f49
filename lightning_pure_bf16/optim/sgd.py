"""Pure-bf16 SGD with ``torch.optim.SGD``'s semantics: L2 weight decay added to the gradient, momentum with
dampening and Nesterov, the momentum buffer starting at the first step's gradient. Without momentum it keeps no
state (the weights and their gradients only: 4 bytes/param); with it, one buffer per element (2 bytes in bf16, 1 in
8 bits).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_pure_bf16.ops.algorithms import SGDArgs
from lightning_pure_bf16.optim.base import PureBF16Optimizer
from lightning_pure_bf16.optim.options import check_lr, check_non_negative


class SGD(PureBF16Optimizer):
    """SGD whose bf16 parameters and momentum lose nothing to rounding on average.

    Args:
        params: parameters or parameter groups; groups may override ``lr``, ``momentum``, ``dampening``,
            ``weight_decay``, ``nesterov`` and ``rounding``.
        lr: learning rate (default: ``1e-3``).
        momentum: momentum factor; ``0`` keeps no state (default: ``0.0``).
        dampening: dampening of the momentum (default: ``0.0``).
        weight_decay: L2 penalty added to the gradient (default: ``0.0``).
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0`` (default: ``False``).
        **options: the options every optimizer of the package shares
            (:class:`~lightning_pure_bf16.optim.base.PureBF16Optimizer`).
    """

    state_names = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults, **options)

    @classmethod
    def check_group(cls, who: str, group: dict[str, Any]) -> None:
        check_lr(who, group["lr"])
        for key in ("momentum", "dampening", "weight_decay"):
            check_non_negative(who, key, group[key])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                f"`{who}(nesterov=True)` needs momentum > 0 and dampening == 0 (got momentum={group['momentum']!r},"
                f" dampening={group['dampening']!r}), as torch.optim.SGD."
            )
        super().check_group(who, group)

    def state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self.state_names if group["momentum"] != 0 else ()

    @staticmethod
    def from_torch_state(state: dict[str, Any]) -> dict[str, Any]:
        # torch.optim.SGD counts no steps; a saved momentum buffer has taken at least one (the next step continues it
        # instead of starting it at the gradient).
        kept = {k: v for k, v in state.items() if v is not None}  # torch may keep a None buffer
        return {**kept, "step": torch.tensor(1 if "momentum_buffer" in kept else 0)}

    def update_args(
        self, group: dict[str, Any], *, step: int, keys: tuple[int, int, int], grad_scale: float
    ) -> SGDArgs:
        return SGDArgs(
            lr=float(group["lr"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            step=step,
            rounding=group["rounding"],
            keys=keys,
            grad_scale=float(grad_scale),
        )


__all__ = ["SGD"]
