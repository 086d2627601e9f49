"""Independent references for bf16 rounding, written with float64 and torch.nextafter, not bit tricks."""

from dataclasses import dataclass

import torch


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest bf16 value <= x and the smallest bf16 value >= x, as float64."""
    x64 = x.double()
    nearest = x.to(torch.bfloat16)
    up = torch.nextafter(nearest, torch.full_like(nearest, float("inf")))
    down = torch.nextafter(nearest, torch.full_like(nearest, float("-inf")))
    n64 = nearest.double()
    lower = torch.where(n64 <= x64, n64, down.double())
    upper = torch.where(n64 >= x64, n64, up.double())
    return lower, upper


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


# Tolerances of the optimizer math against a float64 torch.optim reference, per parameter dtype.
TOLERANCES = {
    torch.float32: Tolerance(rtol=1e-5, atol=1e-6),
    # A few bf16 ulps (2**-8 relative) after several rounded steps: stochastic rounding moves a weight by up to one
    # ulp a step, so after 5 steps of lr 3e-2 the largest of ~3000 deviations reaches 2e-2 for a quarter of seeds
    # and 2.4e-2 at most (60 seeds tried).
    torch.bfloat16: Tolerance(rtol=3e-2, atol=2e-3),
}
