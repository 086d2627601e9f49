"""Plain DeepSpeed users: ``lightning_pure_bf16.deepspeed.initialize`` gives them the strategies' 8 bytes/param, the
same optimizer options, inf/NaN skips everywhere and the durable checkpoints, and refuses what contradicts pure bf16."""

from __future__ import annotations

import pytest
import torch

from tests.strategy_runs import load_ranks, run_script


def ds_run(out, **opts):
    import json

    return run_script("ds_mlp.py", out, json.dumps(opts))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    whole, resumed = tmp_path_factory.mktemp("ds_whole"), tmp_path_factory.mktemp("ds_resumed")
    ckpt = whole / "mid"
    ds_run(whole, steps=6, save_at=3, save_path=str(ckpt), nan_step=1)
    ds_run(resumed, steps=6, resume=str(ckpt), nan_step=1)
    return load_ranks(whole), load_ranks(resumed)


def test_a_torch_adamw_becomes_pure_bf16_at_8_bytes_per_param(runs):
    whole, _ = runs
    for r in whole:
        assert r["optimizer_class"] == "AdamW" and r["returned_is_inner"]
        assert r["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
        assert r["memory_report"]["master"] == 0  # the master partition is the parameter partition
        assert r["lr"] == [1e-2, 1e-2] and r["weight_decay"] == [0.1, 0.0]  # the user's groups, kept
        assert r["rounding"] == ["stochastic", "stochastic"]
        for st in r["state"].values():
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert r["peak_memory"]["peak_gib"] >= r["peak_memory"]["at_setup_gib"] > 0


def test_an_independent_walk_of_zero3s_buffers_agrees(runs):
    whole, _ = runs
    for r in whole:
        skip = (".ipg_buckets.", ".persistent_parameters.")  # the reduce bucket; whole copies of small parameters
        walked = [b for n, _, b, f in r["zero_buffers"] if b > 16 and not any(k in n for k in skip) and not f]
        assert sum(walked) / r["memory_report"]["params_on_rank"] == pytest.approx(8.0, rel=0.01)


def test_a_checkpoint_of_2_ranks_resumes_on_1_and_its_weights_load_into_a_fresh_model(runs, tmp_path):
    import sys
    from pathlib import Path

    from lightning_pure_bf16 import consolidate_checkpoint

    ckpt = Path(runs[0][0]["save_path"])
    ds_run(tmp_path, world=1, steps=6, resume=str(ckpt))
    (one,) = load_ranks(tmp_path, world_size=1)
    assert len(one["losses"]) == 3 and all(torch.isfinite(torch.tensor(one["losses"])))
    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from _models import MLP

    weights = consolidate_checkpoint(ckpt)
    fresh = MLP().to(torch.bfloat16)
    fresh.load_state_dict(weights)  # strict: every name and shape
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items())


def test_an_inf_nan_gradient_on_one_rank_is_skipped_everywhere_and_counted(runs):
    whole, _ = runs
    for r in whole:
        assert r["engine_skipped_steps"] == 1 and r["skipped_steps"] == 1
        assert r["overflows"] == [False, True, False, False, False, False]  # what Accelerate's step_was_skipped reads
        assert all(torch.isfinite(t.float()).all() for t in r["flat_params"])


def test_the_checkpoint_resumes_bit_for_bit(runs):
    whole, resumed = runs
    for a, b in zip(whole, resumed):
        assert b["losses"] == a["losses"][3:]
        for x, y in zip(a["flat_params"], b["flat_params"]):
            assert torch.equal(x, y)
        for sa, sb in zip(a["state"].values(), b["state"].values()):
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_the_configs_optimizer_section_and_options_are_honoured(tmp_path):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.99], "weight_decay": 0.01}}}
    ds_run(tmp_path, steps=2, optimizer="none", config=config, options={"moments": "int8", "rounding": "kahan"})
    for r in load_ranks(tmp_path):
        assert r["optimizer_class"] == "AdamW" and r["lr"] == [3e-3]
        assert r["rounding"] == ["kahan"]
        assert r["memory_report"]["total"] == pytest.approx(2 + 2 + 2 * (1 + 2 / 128) + 2, abs=0.02)  # + Kahan


@pytest.mark.parametrize(
    ("config", "options", "match"),
    [
        ({"fp16": {"enabled": True}}, {}, "fp16.enabled"),
        ({"zero_optimization": {"stage": 2}}, {}, "stage: 2"),
        ({"optimizer": {"type": "SGD"}}, {}, "pure bf16 trains with Adam or AdamW"),
        ({"data_types": {"grad_accum_dtype": "fp32"}}, {}, "grad_accum_dtype"),
        ({}, {"rounding": "up"}, "rounding"),
    ],
)
def test_what_contradicts_pure_bf16_is_refused_before_anything_is_set_up(config, options, match, monkeypatch):
    import torch.distributed as dist

    import lightning_pure_bf16.deepspeed as pure_bf16

    with pytest.raises(ValueError, match=match):
        pure_bf16.initialize(
            model=torch.nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1, **config}, **options
        )
    assert not dist.is_initialized()  # refused before the process group


@pytest.mark.parametrize("stage", [3, 1])
def test_deepspeeds_own_initialize_with_float32_masters_is_refused_not_trained_wide(tmp_path, stage):
    # The silent path: the package's optimizer inside DeepSpeed's bf16 mixed precision gets float32 master
    # partitions (16 bytes/param): refused at the first step, before any weight or state changes.
    ds_run(tmp_path, plain_deepspeed=True, stage=stage)
    for r in load_ranks(tmp_path):
        assert r["error"] is not None and "float32 master weights" in r["error"]
        assert "16 bytes/param" in r["error"] and "lightning_pure_bf16.deepspeed.initialize" in r["error"]


def test_checkpoint_functions_refuse_an_engine_they_did_not_make():
    import lightning_pure_bf16.deepspeed as pure_bf16

    with pytest.raises(ValueError, match="needs an engine made by"):
        pure_bf16.save_checkpoint(object(), "anywhere")
