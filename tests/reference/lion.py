"""A reference Lion for the tests, written from the paper's update rule with the ``lion-pytorch`` package's
conventions (Chen et al. 2023; https://github.com/lucidrains/lion-pytorch): weight decay multiplies the weight by
``1 - lr * weight_decay`` first, then the sign of ``beta1 * m + (1 - beta1) * g`` is applied with step ``lr``, then
``m`` moves towards ``g`` with ``beta2``. Plain torch ops, any dtype (the tests use float64)."""

from __future__ import annotations

import torch


class ReferenceLion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
