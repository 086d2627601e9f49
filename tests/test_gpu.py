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
