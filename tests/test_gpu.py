"""On a CUDA machine: the strategy on one GPU, with the Triton kernel doing the update (skipped without CUDA)."""

import pytest
import torch

from tests.strategy_runs import fit, load_ranks


@pytest.mark.gpu
@pytest.mark.parametrize(("rounding", "expected"), [("stochastic", 8.0), ("kahan", 10.0)])
def test_strategy_on_one_gpu(tmp_path, rounding, expected):
    strategy = {"rounding": rounding, "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    fit(tmp_path, accelerator="gpu", devices=1, steps=4, strategy=strategy, count_updates=True)
    (r,) = load_ranks(tmp_path, world_size=1)
    assert r["memory_report"]["total"] == pytest.approx(expected)
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in r["flat_params"])
    assert r["update_calls"] == r["sub_group_numels"] * 4
    assert torch.isfinite(torch.tensor(r["losses"])).all()


@pytest.mark.gpu
def test_torch_path_temporaries_stay_bounded():
    from lightning_pure_bf16.ops.adamw_torch import UpdateArgs, adamw_update_torch_

    n = 1 << 26  # 128 MiB per bf16 buffer
    p, g, m, v = (torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(4))
    m.zero_()
    v.zero_()
    args = UpdateArgs(1e-3, 0.9, 0.999, 1e-8, 0.01, True, 1, "stochastic", (1, 2, 3))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    adamw_update_torch_(p, g, m, v, None, args)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 64 * 2**20
