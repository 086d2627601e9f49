import pytest
import torch

from lightning_pure_bf16.ops.rng import Buffer, random_bits, stream_key
from lightning_pure_bf16.ops.rounding import nearest_round_bf16, stochastic_round_bf16, stochastic_round_sum_bf16
from tests.reference.bf16 import bf16_neighbours


def _bits(n: int, step: int = 1) -> torch.Tensor:
    return random_bits(stream_key(11, 0, step, Buffer.PARAM), 0, torch.arange(n, dtype=torch.int32))


@pytest.mark.parametrize("value", [1.0 + 0.3 * 2**-7, -1.0 - 0.3 * 2**-7, 0.632, -3.7e-5, 1234.567, 1e-30, 0.9999])
def test_sr_is_unbiased(value):
    n = 1 << 18
    x = torch.full((n,), value, dtype=torch.float32)
    rounded = stochastic_round_bf16(x, _bits(n)).double()
    assert rounded.mean().item() == pytest.approx(float(x[0]), rel=3e-5)


def test_sr_only_returns_neighbouring_values():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(50_000) * 10.0 ** torch.randint(-20, 20, (50_000,)), torch.tensor([0.0, -0.0, 1.0])])
    rounded = stochastic_round_bf16(x, _bits(x.numel())).double()
    lower, upper = bf16_neighbours(x)
    assert torch.all((rounded == lower) | (rounded == upper))
    # Both neighbours occur: it is not a disguised truncation or nearest rounding.
    inexact = lower != upper
    assert (rounded[inexact] == lower[inexact]).any() and (rounded[inexact] == upper[inexact]).any()


def test_sr_of_exact_bf16_value_is_exact():
    x = torch.randn(10_000).to(torch.bfloat16)
    assert torch.equal(stochastic_round_bf16(x.float(), _bits(x.numel())), x)


def test_nearest_is_round_to_nearest_even():
    torch.manual_seed(0)
    x = torch.randn(10_000, dtype=torch.float64)
    lower, upper = bf16_neighbours(x.float())
    got = nearest_round_bf16(x.float()).double()
    xf = x.float().double()
    assert torch.all((got == lower) | (got == upper))
    assert torch.all((got - xf).abs() <= (torch.where(got == lower, upper, lower) - xf).abs())


def _probability_up(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two results of ``stochastic_round_sum_bf16(a, b, r)`` and the exact probability of the upper one, found by
    bisection over the 32-bit random word (the result is monotone in it)."""
    n = a.numel()

    def at(r: torch.Tensor) -> torch.Tensor:
        return stochastic_round_sum_bf16(a, b, torch.where(r >= 2**31, r - 2**32, r).to(torch.int32)).double()

    low = at(torch.zeros(n, dtype=torch.int64))
    high = at(torch.full((n,), 2**32 - 1, dtype=torch.int64))
    lo, hi = torch.zeros(n, dtype=torch.int64), torch.full((n,), 2**32 - 1, dtype=torch.int64)
    for _ in range(33):
        mid = (lo + hi) // 2
        up = at(mid) == high
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid + 1)
    p = torch.where(low == high, 0.0, (2**32 - hi).double() / 2**32)
    return low, high, p


# Update/weight ratios where fine-tuning lives (lr 1e-5 x weight decay 0.01 = 1e-7), both signs, and larger ones.
RATIOS = [1e-2, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, -1e-4, -1e-6, -1e-7, -1e-8]


@pytest.mark.parametrize("ratio", RATIOS)
def test_sr_of_a_sum_rounds_up_with_the_exact_probability(ratio):
    # Weights of magnitudes 1e-3 ... 1e2 and exact powers of two (where the spacing below halves), both signs.
    g = torch.Generator().manual_seed(0)
    mags = torch.tensor([1e-3, 0.014, 0.5, 0.7, 1.0, 3.0, 100.0, 2.0**-7, 2.0**-125])
    a = (mags[:, None] * (1 + torch.rand(len(mags), 24, generator=g))).to(torch.bfloat16).float()
    a[:, 0] = mags.to(torch.bfloat16).float()
    a = torch.cat([a, -a]).reshape(-1)
    b = (a * ratio * (1 + 0.37 * torch.rand(a.shape, generator=g))).float()
    low, high, p = _probability_up(a, b)
    exact = a.double() + b.double()  # exact: the operands are at most 2**31 apart in magnitude
    lower, upper = bf16_neighbours(exact)  # as float64; neighbours of the exact sum, not of its float32 rounding
    assert torch.all((torch.minimum(low, high) == lower) & (torch.maximum(low, high) == upper))
    expected = torch.where(lower == upper, 0.0, (exact - low) / (high - low))
    # Resolution 2**-32 of the spacing (2**-31 below a power of two, where the fraction counts double).
    assert (p - expected).abs().max().item() <= 2 * 2**-32


def test_sr_of_a_sum_keeps_exact_values_signs_and_non_finite_values():
    a = torch.tensor([1.0, -2.0, 0.0, float("inf"), float("-inf"), float("nan"), 3.0, -0.0])
    b = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, -3.0, -0.0])
    for r in (0, -1, 12345):
        got = stochastic_round_sum_bf16(a, b, torch.full((8,), r, dtype=torch.int32)).float()
        assert got[:5].tolist() == [1.0, -2.0, 0.0, float("inf"), float("-inf")]
        assert torch.isnan(got[5]) and got[6] == 0.0 and got[7] == 0.0
