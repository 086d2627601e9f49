"""Plain DeepSpeed users: ``lightning_pure_bf16.deepspeed.initialize`` gives them the strategies' 8 bytes/param, the
same optimizer options, inf/NaN skips everywhere and the durable checkpoints, and refuses what contradicts pure bf16."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.strategy_runs import SCRIPTS, _env, load_ranks, run_script


def ds_run(out, **opts):
    return run_script("ds_mlp.py", out, json.dumps(opts))


# 6 steps with a checkpoint after 3 and an inf/NaN gradient at step 1.
WHOLE = {"steps": 6, "save_at": 3, "nan_step": 1}


# The optimizer from the config's section, with the front end's options.
SECTION = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.99], "weight_decay": 0.01}}}


@pytest.fixture(scope="module")
def ds_out(tmp_path_factory):
    """One after the other in the same 2 processes: the whole run, its resume from the step-3 checkpoint, a run
    with the config's optimizer section, and DeepSpeed's own initialize with bf16 mixed precision at ZeRO stages 1 and
    3 (last: this package's initialize is not around them)."""
    out = tmp_path_factory.mktemp("ds")
    ckpt = out / "whole" / "mid"
    whole = {"name": "whole", "save_path": str(ckpt), **WHOLE}
    resumed = {"name": "resumed", "steps": 6, "resume": str(ckpt), "nan_step": 1}
    options = {"moments": "int8", "rounding": "kahan"}
    section = {"name": "section", "steps": 2, "optimizer": "none", "config": SECTION, "options": options}
    plain = [{"name": f"stage{stage}", "plain_deepspeed": True, "stage": stage} for stage in (1, 3)]
    ds_run(out, runs=[whole, resumed, section, *plain])
    return out


@pytest.fixture(scope="module")
def runs(ds_out):
    return load_ranks(ds_out / "whole"), load_ranks(ds_out / "resumed")


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


def test_torchrun_over_two_nodes_trains_and_saves_what_two_spawned_ranks_do(runs, tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 1``, one launch per node with its ``--node-rank``, as a cluster runs it:
    the same losses, weights, moments and checkpoint, bit for bit, as the 2 ranks spawned on one node."""
    from lightning_pure_bf16 import consolidate_checkpoint
    from lightning_pure_bf16.checkpoint import consolidate_optimizer_state

    env = _env()
    opts = json.dumps({**WHOLE, "save_path": str(tmp_path / "mid")})
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *rendezvous, env["MASTER_PORT"], "--node-rank", str(node)]
            + [str(SCRIPTS / "ds_mlp.py"), str(tmp_path), opts],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in range(2)
    ]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace")[-3000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    spawned, _ = runs
    for a, b in zip(spawned, load_ranks(tmp_path)):
        assert repr(b["losses"]) == repr(a["losses"]) and b["engine_skipped_steps"] == 1  # exact, NaN at step 1
        # Where the partitions hold parameters (ZeRO-3 leaves its padding uninitialized).
        assert all(torch.equal(x[m], y[m]) for x, y, m in zip(a["flat_params"], b["flat_params"], a["real"]))
        for sa, sb, m in zip(a["state"].values(), b["state"].values(), a["real"]):
            assert torch.equal(sa["exp_avg"][m], sb["exp_avg"][m]) and torch.equal(
                sa["exp_avg_sq"][m], sb["exp_avg_sq"][m]
            )
    ours, theirs = consolidate_checkpoint(tmp_path / "mid"), consolidate_checkpoint(spawned[0]["save_path"])
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ours, theirs = consolidate_optimizer_state(tmp_path / "mid"), consolidate_optimizer_state(spawned[0]["save_path"])
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name][k], theirs[name][k]) for name in ours for k in ("exp_avg", "exp_avg_sq", "step"))


def test_the_configs_optimizer_section_and_options_are_honoured(ds_out):
    for r in load_ranks(ds_out / "section"):
        assert r["optimizer_class"] == "AdamW" and r["lr"] == [3e-3]
        assert r["rounding"] == ["kahan"]
        assert r["memory_report"]["total"] == pytest.approx(2 + 2 + 2 * (1 + 2 / 128) + 2, abs=0.02)  # + Kahan


@pytest.mark.parametrize(
    ("config", "options", "match"),
    [
        ({"fp16": {"enabled": True}}, {}, "fp16.enabled"),
        ({"zero_optimization": {"stage": 2}}, {}, "stage: 2"),
        ({"optimizer": {"type": "SGD"}}, {}, "pure bf16 builds Adam, AdamW, Lion and Muon from the config"),
        ({"data_types": {"grad_accum_dtype": "fp32"}}, {}, "grad_accum_dtype"),
        ({}, {"rounding": "up"}, "rounding"),
        ({}, {"trust_checkpoint": "yes"}, "trust_checkpoint='yes'"),
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


def test_deepspeeds_own_initialize_with_float32_masters_is_refused_not_trained_wide(ds_out):
    # The silent path: the package's optimizer inside DeepSpeed's bf16 mixed precision gets float32 master
    # partitions (16 bytes/param): refused at the first step, before any weight or state changes. ZeRO stages 1 and 3.
    for stage in (1, 3):
        for r in load_ranks(ds_out / f"stage{stage}"):
            assert r["error"] is not None and "float32 master weights" in r["error"], stage
            assert "16 bytes/param" in r["error"] and "lightning_pure_bf16.deepspeed.initialize" in r["error"]


def test_checkpoint_functions_refuse_an_engine_they_did_not_make():
    import lightning_pure_bf16.deepspeed as pure_bf16

    with pytest.raises(ValueError, match="needs an engine made by"):
        pure_bf16.save_checkpoint(object(), "anywhere")


@pytest.mark.parametrize("trust", [False, True])
def test_the_engines_own_load_checkpoint_reads_as_trusted_only_where_initialize_was_told(monkeypatch, tmp_path, trust):
    # The Hugging Face Trainer and Accelerate resume through engine.load_checkpoint: trust_checkpoint reaches it.
    import lightning_pure_bf16.deepspeed as pure_bf16

    seen = {}
    monkeypatch.setattr(pure_bf16, "load_checkpoint", lambda engine, path, **kw: seen.update(kw) or {"step": 3})
    monkeypatch.setattr(pure_bf16.checkpoint, "is_checkpoint", lambda path: True)
    engine = type("Engine", (), {})()
    pure_bf16._route_checkpoint_methods(engine, trust_checkpoint=trust)
    path, client_state = engine.load_checkpoint(tmp_path)
    assert seen["trust_checkpoint"] is trust and client_state == {"step": 3} and path == str(tmp_path)


def test_the_hugging_face_front_ends_take_trust_checkpoint_and_refuse_a_non_bool():
    import lightning_pure_bf16.deepspeed as pure_bf16

    kwargs = {"trust_checkpoint": True, "output_dir": "x"}
    options = pure_bf16.take_options("PureBF16Trainer", kwargs)
    assert options["trust_checkpoint"] is True and kwargs == {"output_dir": "x"}
    with pytest.raises(ValueError, match=r"`PureBF16Accelerator\(trust_checkpoint=1\)` must be True or False"):
        pure_bf16.take_options("PureBF16Accelerator", {"trust_checkpoint": 1})


def test_a_config_optimizer_section_of_type_muon_splits_the_parameters_by_deepspeeds_rule():
    # DeepSpeed's Muon orthogonalizes the parameters of two or more dimensions whose names hold neither "embed" nor
    # "lm_head", under zero.Init too (ds_shape); the rest is AdamW's, each half with its own lr.
    from lightning_pure_bf16 import Muon
    from lightning_pure_bf16.deepspeed import _optimizer_from_config
    from lightning_pure_bf16.optim.options import OptimizerOptions

    model = torch.nn.ModuleDict(
        {
            "embed_tokens": torch.nn.Embedding(16, 8),
            "hidden": torch.nn.Linear(8, 8),
            "lm_head": torch.nn.Linear(8, 16, bias=False),
        }
    ).to(torch.bfloat16)
    partitioned = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))  # as zero.Init leaves a 4 x 8 matrix
    partitioned.ds_shape = torch.Size([4, 8])
    model.register_parameter("partitioned", partitioned)
    params = [p for p in model.parameters()]
    section = {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 2e-2, "momentum": 0.9, "betas": [0.8, 0.9]}}
    built = _optimizer_from_config(section, params, OptimizerOptions(rounding="kahan"), model)
    muon, adam = built.param_groups
    assert type(built) is Muon and built.defaults["rounding"] == "kahan"
    assert {id(p) for p in muon["params"]} == {id(model["hidden"].weight), id(partitioned)}
    assert muon["use_muon"] and muon["lr"] == 2e-2 and muon["momentum"] == 0.9
    assert {id(p) for p in adam["params"]} == {
        id(model["embed_tokens"].weight),
        id(model["hidden"].bias),
        id(model["lm_head"].weight),
    }
    assert not adam["use_muon"] and adam["lr"] == 1e-3 and adam["betas"] == (0.8, 0.9)
    with pytest.raises(ValueError, match=r"params \['ns_method'\] are not supported.*quintic Newton-Schulz"):
        _optimizer_from_config({"type": "Muon", "params": {"ns_method": "gram"}}, params, OptimizerOptions(), model)
    with pytest.raises(ValueError, match="splits the model's parameters by their names"):
        _optimizer_from_config({"type": "Muon"}, [{"params": params}], OptimizerOptions(), model)


def test_a_config_optimizer_section_of_type_lion_builds_this_packages_lion():
    from lightning_pure_bf16 import Lion
    from lightning_pure_bf16.deepspeed import _optimizer_from_config
    from lightning_pure_bf16.optim.options import OptimizerOptions

    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    section = {"type": "Lion", "params": {"lr": 3e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}}
    built = _optimizer_from_config(section, params, OptimizerOptions(rounding="kahan"))
    assert type(built) is Lion and built.defaults["betas"] == (0.95, 0.98) and built.defaults["rounding"] == "kahan"
    assert built.defaults["lr"] == 3e-4 and built.defaults["weight_decay"] == 0.1
    with pytest.raises(ValueError, match=r"params \['eps'\] are not supported"):
        _optimizer_from_config({"type": "Lion", "params": {"eps": 1e-8}}, params, OptimizerOptions())
