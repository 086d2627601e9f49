import pytest
import torch

from lightning_pure_bf16.ops.rng import Buffer, element_bits, mix32, random_bits, stream_key


def _reference_lowbias32(x: int) -> int:
    # Written out from the published lowbias32 definition with explicit uint32 wrap-around.
    x = x % 2**32
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    x ^= x >> 16
    return x


def test_mix32_matches_published_hash():
    for x in (0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1):
        assert mix32(x) == _reference_lowbias32(x)


@pytest.mark.parametrize("start", [0, 1 << 12, 3 << 12, (1 << 32), (5 << 32) + (1 << 12)])
def test_torch_bits_equal_python_reference(start):
    key = stream_key(seed=987654321, param_index=3, step=17, buffer=Buffer.EXP_AVG)
    local = torch.arange(1 << 12, dtype=torch.int32)
    got = random_bits(key, start, local).to(torch.int64) & 0xFFFFFFFF
    expected = torch.tensor([element_bits(key, start + j) for j in range(local.numel())], dtype=torch.int64)
    assert torch.equal(got, expected)


def test_stream_keys_differ_in_every_coordinate():
    base = dict(seed=1, param_index=0, step=1, buffer=Buffer.PARAM)
    keys = {stream_key(**base)}
    for change in (
        {"seed": 2},
        {"seed": 1 + (1 << 32)},
        {"param_index": 1},
        {"step": 2},
        {"step": 1 + (1 << 32)},
        {"buffer": Buffer.EXP_AVG},
        {"buffer": Buffer.EXP_AVG_SQ},
    ):
        keys.add(stream_key(**{**base, **change}))
    assert len(keys) == 8
    assert all(0 <= k < 2**31 for k in keys)


def test_low_16_bits_are_uniform():
    n = 1 << 18
    bits = random_bits(stream_key(7, 0, 1, Buffer.PARAM), 0, torch.arange(n, dtype=torch.int32)) & 0xFFFF
    counts = torch.bincount((bits >> 12).long(), minlength=16).double()
    expected = n / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 15 degrees of freedom: the 99.9th percentile is 37.7.
    assert chi2 < 37.7
    assert abs(bits.double().mean().item() - 32767.5) < 200
