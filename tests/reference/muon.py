"""Muon for matrices and AdamW for the rest, as DeepSpeed's ``MuonWithAuxAdam`` and nanochat's ``MuonAdamW`` pair
them, from torch's own optimizers: ``torch.optim.Muon`` steps the groups with ``use_muon=True`` (the default),
``torch.optim.AdamW`` the others (betas ``(0.9, 0.95)`` and eps ``1e-10`` unless a group sets them). The groups are
shared with the two inner optimizers, so a scheduler that changes a group's ``lr`` changes the step."""

from __future__ import annotations

from typing import Any

import torch

AUX_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-10}
MUON_OPTIONS = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn")


class ReferenceMuonAdamW(torch.optim.Optimizer):
    def __init__(self, groups: list[dict[str, Any]], lr: float = 1e-3, weight_decay: float = 0.1, **muon: Any):
        groups = [g if g.get("use_muon", True) else {**AUX_DEFAULTS, **g} for g in groups]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "use_muon": True})
        matrices = [g for g in self.param_groups if g["use_muon"]]
        others = [g for g in self.param_groups if not g["use_muon"]]
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, **muon) if matrices else None
        self.adamw = torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay) if others else None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.step()
