"""Pure-bf16 AdamW on a small regression task: fp32 reference against bf16 with nearest, stochastic and Kahan rounding.

Trains the same MLP from the same initialisation four ways and prints the final training loss of each. With a small
learning rate, round-to-nearest bf16 loses most updates; stochastic rounding and Kahan compensation track fp32.

    python examples/optimizer_demo.py [--steps 1500] [--lr 3e-4]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from lightning_pure_bf16 import AdamW


def make_data(n: int, d_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    teacher = nn.Sequential(nn.Linear(d_in, 64), nn.Tanh(), nn.Linear(64, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        y = teacher(x)
    return x, y


def train(arm: str, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, batch: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(x.shape[1], 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    if arm == "fp32":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        dtype = torch.float32
    else:
        model = model.to(torch.bfloat16)
        opt = AdamW(model.parameters(), lr=lr, weight_decay=0.01, rounding=arm, seed=0)
        dtype = torch.bfloat16
    order = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=order)
        loss = nn.functional.mse_loss(model(x[idx].to(dtype)).float(), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return nn.functional.mse_loss(model(x.to(dtype)).float(), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    x, y = make_data(8192, 32, seed=0)
    print(f"MLP regression, {args.steps} steps of AdamW at lr={args.lr}, batch {args.batch}")
    reference = None
    for arm in ("fp32", "nearest", "stochastic", "kahan"):
        start = time.perf_counter()
        loss = train(arm, x, y, args.steps, args.lr, args.batch)
        reference = loss if reference is None else reference
        label = "fp32 torch.optim.AdamW" if arm == "fp32" else f"pure bf16, rounding={arm!r}"
        print(
            f"{label:34s} final loss {loss:.5f}  ({loss / reference:5.2f}x fp32)  {time.perf_counter() - start:5.1f} s"
        )


if __name__ == "__main__":
    main()
