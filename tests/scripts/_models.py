"""The small MLP, its data and its two param groups, shared by the scripts under tests/scripts (each a fresh process
with this folder on its path), so checkpoints written by one load into another by parameter name."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


class MLP(nn.Module):
    def __init__(self, hidden: int = 64, depth: int = 1, bias: bool = True) -> None:
        super().__init__()
        h = hidden
        # Built in order (the first layer, then the middle ones, then the last), so that the random initial weights
        # are the same for every depth's shared layers.
        layers = [nn.Linear(16, h, bias=bias), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Linear(h, h, bias=bias), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(h, 1, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def param_groups(module: nn.Module) -> list[dict]:
    """Weights with weight decay 0.1, biases without."""
    named = list(module.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def data(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :1] * 0.5 + torch.sin(x[:, 1:2])).float()
    return TensorDataset(x, y)


def partitions(module: nn.Module) -> dict[str, tuple[torch.Tensor | None, int]]:
    """Each parameter's local ZeRO-3 partition as it is now (None where it is not partitioned) and its length."""
    out = {}
    for name, param in module.named_parameters():
        partitioned = hasattr(param, "ds_id")
        out[name] = (
            param.ds_tensor.detach().clone() if partitioned else None,
            int(param.partition_numel()) if partitioned else param.numel(),
        )
    return out
