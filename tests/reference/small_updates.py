"""The small-update sweep shared by tests/test_small_updates.py and benchmarks/small_updates.py.

Many sub-ulp updates of bf16 weights, for update / weight ratios 1e-4 ... 1e-7 (fine-tuning: lr 1e-5 x weight decay
0.01 is 1e-7 a step) and weights of magnitudes 1e-3 ... 1e2, with weight decay alone or a constant gradient alone;
the mean final weight of each (ratio, magnitude) group is compared with float64 arithmetic. One optimizer holds a
group per (ratio, magnitude), so one run covers the sweep.
"""

import math

import torch

from lightning_pure_bf16 import AdamW

RATIOS = [1e-4, 1e-5, 1e-6, 1e-7]
MAGNITUDES = [1e-3, 1e-1, 1.0, 1e2]
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.999)
EPS = 1e-8
# Half-width of the check in standard deviations of stochastic rounding's own noise (the run is seeded, so the
# outcome is fixed; 4 sigma keeps it far from a coin toss).
SIGMAS = 4.0
# With a gradient the Adam direction itself comes from bf16 moments: the second moment's rounding noise, through the
# square root's curvature, makes steps about 3e-4 ... 5e-4 longer than float64 Adam's (seen with either rounding).
# The check allows 2e-3 of the drift for it on top of the rounding noise.
MOMENT_BIAS = 2e-3


def _initial(magnitude: float, elements: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(-math.log10(magnitude) * 7) + 100)
    w = (magnitude * (1 + torch.rand(elements, generator=g))).to(torch.bfloat16)
    w[0] = magnitude  # an exact power of two or close to it, where the spacing below halves
    w[1::2] = -w[1::2]
    return w


def _adam_steps_fp64(lr: float, steps: int) -> float:
    """Total movement of Adam with a constant unit gradient, in float64 (the reference of the gradient-only case)."""
    m = v = total = 0.0
    for t in range(1, steps + 1):
        m = BETAS[0] * m + (1 - BETAS[0])
        v = BETAS[1] * v + (1 - BETAS[1])
        total += lr * (m / (1 - BETAS[0] ** t)) / (math.sqrt(v / (1 - BETAS[1] ** t)) + EPS)
    return total


def drift_sweep(
    mode: str, rounding: str, *, elements: int = 4096, steps: int = 1000, backend: str = "cpu"
) -> list[tuple[float, float, float, float, float]]:
    """Per (ratio, magnitude) group: the mean error of the final weights over the group (> 0: moved too little), the
    tolerance of that mean, and the root-mean-square error of a single weight, each as a fraction of the mean drift.

    With Kahan, the error is that of the value it carries, weight + compensation; the weight itself is that value
    rounded to nearest, so its own error is at most half a bf16 spacing more.

    Args:
        mode: ``"decay"`` (weight decay alone) or ``"gradient"`` (a constant unit gradient alone).
        rounding: the optimizer's ``rounding``.
        elements: weights per (ratio, magnitude) group (default: ``4096``).
        steps: optimizer steps (default: ``1000``).
        backend: the optimizer's backend (default: ``"cpu"``; all are bit-identical).
    """
    groups, cases = [], []
    for ratio in RATIOS:
        for magnitude in MAGNITUDES:
            p = _initial(magnitude, elements).requires_grad_()
            if mode == "decay":
                groups.append({"params": [p], "lr": ratio / WEIGHT_DECAY, "weight_decay": WEIGHT_DECAY})
            else:
                groups.append({"params": [p], "lr": ratio * magnitude, "weight_decay": 0.0})
            cases.append((ratio, magnitude, p))
    opt = AdamW(groups, betas=BETAS, eps=EPS, rounding=rounding, seed=2024, backend=backend)
    w0 = [p.detach().double().clone() for _, _, p in cases]
    for _ in range(steps):
        for _, _, p in cases:
            # Weight decay alone: a zero gradient keeps Adam's term at 0. Gradient alone: a constant unit gradient
            # pointing away from zero, so both make |w| smaller.
            p.grad = torch.zeros_like(p) if mode == "decay" else torch.sign(p.detach())
        opt.step()
    out = []
    for (ratio, magnitude, p), start in zip(cases, w0):
        if mode == "decay":
            reference = start * (1 - ratio / WEIGHT_DECAY * WEIGHT_DECAY) ** steps
        else:
            reference = start - torch.sign(start) * _adam_steps_fp64(ratio * magnitude, steps)
        value = p.detach().double()
        if rounding == "kahan":
            value = value + opt.state[p]["kahan_comp"].double()  # the value Kahan carries
        drift = (reference - start).abs()
        error = ((value - reference) * torch.sign(start)).mean().item()  # > 0: moved too little
        # Stochastic rounding of an update u per step onto a spacing s moves a weight by whole spacings with
        # probability u/s: variance at most N u s per weight (s = the bf16 spacing, at most 2**-7 |w|).
        spacing = start.abs() * 2.0**-7
        if rounding == "kahan":
            # Kahan's value p + c is off only by the compensation's own stochastic writes: each unbiased and at most
            # its spacing, 2**-9 of the weight's (|c| <= half the weight's spacing).
            sigma = math.sqrt(steps * ((spacing * 2.0**-10) ** 2).sum().item()) / elements
        else:
            sigma = math.sqrt((steps * (drift / steps) * spacing).sum().item()) / elements
        tolerance = SIGMAS * sigma / drift.mean().item() + (MOMENT_BIAS if mode == "gradient" else 0.0)
        rms = ((p.detach().double() - reference) ** 2).mean().sqrt().item()  # the weight the model uses
        out.append((ratio, magnitude, error / drift.mean().item(), tolerance, rms / drift.mean().item()))
    return out


__all__ = ["MAGNITUDES", "RATIOS", "drift_sweep"]
