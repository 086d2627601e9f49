import pytest
import torch

from lightning_pure_bf16.ops.rng import Buffer, random_bits, stream_key
from lightning_pure_bf16.ops.rounding import nearest_round_bf16, stochastic_round_bf16
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
