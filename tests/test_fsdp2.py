"""This package's AdamW over FSDP2 (``fully_shard``) parameters: 2 CPU ranks per format, a DCP checkpoint, a resume in
fresh objects, a resume on 1 rank, one rank's inf, and the same model trained unsharded on one process
(tests/scripts/fsdp2_adamw.py; two launches shared by every test here)."""

from __future__ import annotations

import json

import pytest
import torch
from strategy_runs import run_script

FORMATS = {
    "stochastic": ({}, 8.0),
    "kahan": ({"rounding": "kahan"}, 10.0),
    "int8": ({"moments": "int8"}, 6.03),
    "int8_kahan": ({"moments": "int8", "rounding": "kahan", "compensation": "int8"}, 7.03),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    two = [{"name": name, "save_at": 3, **opts} for name, (opts, _) in FORMATS.items()]
    two += [{"name": "inf", "inf_at": 2}, {"name": "release_inf", "inf_at": 2, "release": True}]
    two += [{"name": "hsdp", "hsdp": True, "moments": "int8"}]
    run_script("fsdp2_adamw.py", out, json.dumps({"world": 2, "runs": two}))
    one = [{**run, "resume_from": str(out / run["name"])} for run in two[:4]]
    one += [{"name": "plain", "plain": True}, {"name": "plain_seed2", "plain": True, "seed": 5678}]
    one += [{"name": f"sharded_{name}", **opts} for name, (opts, _) in FORMATS.items()]
    one += [{"name": f"plain_{name}", "plain": True, **opts} for name, (opts, _) in FORMATS.items()]
    run_script("fsdp2_adamw.py", out / "one", json.dumps({"world": 1, "runs": one}))

    def load(name: str, rank: int = 0) -> dict:
        return torch.load(out / name / f"rank{rank}.pt", weights_only=False)

    return load


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_trains_with_states_sharded_like_their_parameters(runs, fmt):
    ranks = [runs(fmt, r) for r in range(2)]
    expected = FORMATS[fmt][1]
    for result in ranks:
        final = result["final"]
        # Local bytes per local element: bf16 parameter and gradient shards, the states of this rank's shard only.
        assert sum(final["bytes"].values()) / final["elements"] == pytest.approx(expected, abs=0.01)
        assert all(v for k, v in final["states"].items() if k.endswith(".placements"))
    assert ranks[0]["final"]["elements"] + ranks[1]["final"]["elements"] == sum(
        p.numel() for p in ranks[0]["final"]["params"].values()
    )
    # The same model and data on one process with plain tensors: within the spread of two seeds there (or 1%).
    losses = ranks[0]["losses"]
    plain, other_seed = runs("one/plain")["losses"], runs("one/plain_seed2")["losses"]
    spread = abs(plain[-1] - other_seed[-1])
    assert losses[-1] < 0.2 * losses[0]
    assert abs(losses[-1] - plain[-1]) <= max(2 * spread, 0.01 * plain[-1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dcp_checkpoint_resumes_bit_for_bit(runs, fmt):
    for rank in range(2):
        result = runs(fmt, rank)
        assert result["resumed_seed"] == 1234  # the saved seed, not the fresh optimizer's
        assert result["resumed_losses"] == result["losses"][3:]
        final, resumed = result["final"], result["resumed"]
        for part in ("params", "states"):
            for key, value in final[part].items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, resumed[part][key]), (part, key)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dcp_checkpoint_of_two_ranks_resumes_on_one(runs, fmt):
    saved, loaded = runs(fmt)["saved"], runs(f"one/{fmt}")["loaded"]
    assert runs(f"one/{fmt}")["seed"] == 1234
    for key, value in saved["params"].items():
        assert torch.equal(value, loaded["params"][key]), key
    int8 = "int8" in fmt
    for key, value in saved["states"].items():
        if not isinstance(value, torch.Tensor) or key.endswith(".local") or "_scale" in key:
            continue
        name = key.rsplit(".", 1)[0]
        # A shard of 2 ranks starts on an 8-bit scale block for the weights (32 rows of 16 or 64), not for the biases
        # (32 elements): their blocks are re-encoded on one rank, within the codes' resolution.
        if int8 and name.endswith("bias") and key.endswith(("exp_avg", "exp_avg_sq")):
            whole = torch.cat([runs(fmt, r)["saved"]["states"][f"{key}.float.local"] for r in range(2)])
            again = loaded["states"][f"{key}.float.local"]
            assert torch.allclose(again, whole, rtol=0.05, atol=1e-3 * whole.abs().max().item())
        else:
            assert torch.equal(value, loaded["states"][key]), key
    losses = runs(f"one/{fmt}")["losses"]
    assert losses == pytest.approx(runs(fmt)["losses"][3:], rel=0.02)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fully_shard_on_one_rank_trains_bit_for_bit_as_plain_tensors(runs, fmt):
    """Each element draws its bits by its index in the whole tensor, so a tensor under ``fully_shard`` trains as the
    plain tensor does (on more ranks, only the gradients' reduction order differs)."""
    sharded, plain = runs(f"one/sharded_{fmt}"), runs(f"one/plain_{fmt}")
    assert sharded["losses"] == plain["losses"]
    for key, value in plain["final"]["params"].items():
        assert torch.equal(value, sharded["final"]["params"][key]), key


@pytest.mark.parametrize("release", [False, True])
def test_an_inf_on_one_rank_skips_the_update_on_every_rank(runs, release):
    """With every gradient at the step, the step is skipped everywhere; with each gradient applied as FSDP2
    reduce-scatters it (``step_parameter``), each parameter is left as it is everywhere."""
    ranks = [runs("release_inf" if release else "inf", r) for r in range(2)]
    assert [r["inf_step_changed"] for r in ranks] == [[], []]
    if release:
        assert [r["skipped_parameter_updates"] for r in ranks] == [6, 6]  # every parameter, once
    else:
        assert [r["skipped_steps"] for r in ranks] == [1, 1]
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


# ------------------------------------------------------------------------------------------- Trainer(strategy=...)
LIGHTNING = ("fsdp2_pure_bf16", "fsdp2_pure_bf16_int8_kahan", "fsdp2_pure_bf16_release")


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_lightning")
    opts = {"strategies": list(LIGHTNING), "refusals": True, "clip": 1e-3, "optimizers": ["torch_adafactor", "muon"]}
    run_script("fsdp2_lightning.py", out, json.dumps(opts))
    return out


@pytest.mark.parametrize(("strategy", "expected"), [(LIGHTNING[0], 8.0), (LIGHTNING[1], 7.03), (LIGHTNING[2], 6.0)])
def test_the_trainer_strategy_converts_the_optimizer_and_resumes_mid_epoch_bit_for_bit(fits, strategy, expected):
    for rank in range(2):
        result = torch.load(fits / strategy / f"rank{rank}.pt", weights_only=False)
        whole, resumed = result["whole"], result["resumed"]
        assert whole["optimizer"] == "lightning_pure_bf16.optim.adamw.AdamW" and whole["scheduler_bound"] == [True]
        # Measured after each backward, from the live shards of parameters, gradients and states.
        grad = 0.0 if strategy.endswith("_release") else 2.0  # released: no gradient shard left at the step
        assert all(r["total"] == pytest.approx(expected, abs=0.01) and r["grad"] == grad for r in whole["reports"])
        # The checkpoint at step 2 (a DCP folder) resumes the shuffled epoch's third batch and every bit after it.
        assert resumed["batches"] == whole["batches"][2:] and resumed["losses"] == whole["losses"][2:]
        assert resumed["lrs"] == whole["lrs"][2:]
        for part in ("params", "states"):
            assert whole[part].keys() == resumed[part].keys()
            for key, value in whole[part].items():
                assert torch.equal(value, resumed[part][key]), (part, key)


def test_the_trainer_strategys_clipping_reaches_the_update_as_a_factor(fits):
    # Trainer(gradient_clip_val=1e-3): at every step the precision plugin hands the optimizer a factor below 1 (the
    # norm is above 1e-3 here), the same on both ranks (a global norm); the step puts it back to 1.0.
    ranks = [torch.load(fits / f"clip_rank{rank}.pt", weights_only=False) for rank in range(2)]
    no_clip = torch.load(fits / LIGHTNING[0] / "rank0.pt", weights_only=False)["whole"]
    for rank in ranks:
        assert len(rank["factors"]) == len(rank["losses"]) and all(0 < f < 1 for f in rank["factors"])
        assert rank["stepped"] == [(f, True) for f in rank["factors"]]  # each step given its factor, unchecked
    assert ranks[0]["factors"] == ranks[1]["factors"]
    name = next(iter(no_clip["params"]))
    assert not torch.equal(ranks[0]["params"][name], no_clip["params"][name])


@pytest.mark.parametrize(
    ("name", "algorithm", "per_element"),
    [("torch_adafactor", "Adafactor", set()), ("muon", "Muon", {"exp_avg", "exp_avg_sq"})],
)
def test_adafactor_and_muon_train_over_fsdp2s_row_shards(fits, name, algorithm, per_element):
    # The Trainer strategy adopts torch.optim.Adafactor and takes the package's Muon (AdamW on the biases); each rank
    # steps its rows of every parameter with the collectives the whole-parameter algorithms need, and every
    # per-element state is bf16 and sharded like its parameter (Adafactor keeps none: its statistics are float32).
    # (Their arithmetic over two ranks' rows is tested against torch's in test_whole_parameter.py.)
    ranks = [torch.load(fits / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in ranks:
        assert rank["optimizer"].endswith(f".{algorithm}")
        for key, initial in rank["initial_params"].items():  # every parameter stepped, to finite values
            assert not torch.equal(rank["params"][key], initial) and rank["params"][key].isfinite().all(), key
        for key, (dtype, local, param_local) in rank["local_states"].items():
            assert key.rsplit(".", 1)[1] in per_element, key
            assert dtype == torch.bfloat16 and local == param_local, key
        if name == "muon":  # the matrices keep one state, the biases AdamW's two
            assert {k.rsplit(".", 1)[1] for k in rank["local_states"] if k.endswith("weight.exp_avg_sq")} == set()
    for key in ranks[0]["params"]:  # the ranks agree on the whole model
        assert torch.equal(ranks[0]["params"][key], ranks[1]["params"][key]), key


def test_gradient_release_under_fsdp2_gives_the_bits_of_the_step(fits):
    """Each parameter updated from FSDP2's post-accumulate-grad hook, its gradient freed there: the same run."""
    for rank in range(2):
        released = torch.load(fits / LIGHTNING[2] / f"rank{rank}.pt", weights_only=False)["whole"]
        stepped = torch.load(fits / LIGHTNING[0] / f"rank{rank}.pt", weights_only=False)["whole"]
        assert released["losses"] == stepped["losses"]
        for part in ("params", "states"):
            for key, value in stepped[part].items():
                assert torch.equal(value, released[part][key]), (part, key)


def test_the_trainer_strategy_refuses_what_it_cannot_do(fits):
    for rank in range(2):
        errors = torch.load(fits / f"refusals_rank{rank}.pt", weights_only=False)
        assert (
            errors["unsharded"] is not None and "not sharded (for example 'model.net.0.weight')" in errors["unsharded"]
        )
        assert "fully_shard" in errors["unsharded"] and "configure_model" in errors["unsharded"]
        assert errors["release_clip"] is not None
        assert "gradient_release=True" in errors["release_clip"] and "gradient_clip_val=1.0" in errors["release_clip"]


def test_the_trainer_strategy_refuses_mixed_precision():
    from lightning.pytorch import Trainer

    import lightning_pure_bf16  # noqa: F401

    with pytest.raises(ValueError, match=r"strategy='fsdp2_pure_bf16', precision='bf16-mixed'.*pure bf16"):
        Trainer(accelerator="cpu", devices=2, strategy="fsdp2_pure_bf16", precision="bf16-mixed")


def test_a_dcp_checkpoint_that_would_run_code_is_refused_before_any_loader_reads_it(fits, tmp_path):
    import os
    import pickle
    import shutil

    from lightning_pure_bf16.fsdp2 import FSDP2PureBF16Strategy
    from lightning_pure_bf16.safe_load import UntrustedCheckpointError, check_dcp_checkpoint

    saved = fits / LIGHTNING[0] / "ckpts" / "step=2.ckpt"
    check_dcp_checkpoint(saved)  # what DCP and Lightning wrote reads with the allowlist

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    shared = tmp_path / "shared.ckpt"
    shutil.copytree(saved, shared)
    (shared / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UntrustedCheckpointError, match=r"names posix.system.*could run code.*trust_checkpoint=True"):
        check_dcp_checkpoint(shared)
    strategy = FSDP2PureBF16Strategy()
    strategy.broadcast = lambda obj, src=0: obj  # one process, no group
    with pytest.raises(UntrustedCheckpointError):
        strategy.load_checkpoint(shared)
    assert not (tmp_path / "ran").exists()


def test_fabric_with_fsdp2_trains_this_optimizer_in_bf16_and_resumes_bit_for_bit(tmp_path):
    """Fabric's own ModelParallelStrategy, `precision="bf16-true"`, this package's AdamW built over the sharded
    parameters: no strategy of this package is needed."""
    run_script("fsdp2_fabric.py", tmp_path)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["dtypes"] == ["torch.bfloat16"]
        # After the first step the states exist: 8 bytes per parameter of this rank's shards.
        assert result["reports"][-1]["total"] == pytest.approx(8.0)
        assert result["resumed"] == result["losses"][2:]
        for key, value in result["params"].items():
            assert torch.equal(value, result["resumed_params"][key]), key


def test_hsdp_replicas_draw_the_same_bits_and_stay_equal(runs):
    """Two ranks as two replicas of one shard (a 2 x 1 mesh): placements (Replicate, Shard(0)); every update must be
    the same on both, or the replicas drift apart."""
    ranks = [runs("hsdp", r) for r in range(2)]
    assert ranks[0]["placements"] == "(Replicate(), Shard(dim=0))"
    assert ranks[0]["losses"][-1] < 0.2 * ranks[0]["losses"][0]
    for name, value in ranks[0]["local"].items():
        assert torch.equal(value, ranks[1]["local"][name]), name


def test_the_fsdp2_strategys_clipping_hands_its_factor_to_the_update(tmp_path):
    """``gradient_clip_val`` under the FSDP2 strategy: the global norm and clip factor as torch's ``clip_grad_norm_``
    computes them, handed to the optimizer (no pass that scales the gradients) with the word that every gradient is
    finite (no pass that checks them); the step applies both and puts them back; another optimizer, or an inf/NaN
    norm, takes torch's own clipping (and the step its check). On a 1-rank mesh, in this process."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from lightning_pure_bf16 import AdamW
    from lightning_pure_bf16.fsdp2 import FSDP2PureBF16Precision

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        gen = torch.Generator().manual_seed(0)
        values = [torch.randn(8, 4, generator=gen).bfloat16() for _ in range(2)]
        grads = [torch.randn(8, 4, generator=gen).bfloat16() for _ in range(2)]

        def model(optimizer_cls, **kw):
            params = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, [Shard(0)])) for v in values]
            for p, g in zip(params, grads):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            return params, optimizer_cls(params, lr=1e-2, **kw)

        precision = FSDP2PureBF16Precision()
        params, opt = model(AdamW, seed=3)
        precision.clip_gradients(opt, clip_val=0.1)
        norm = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads]))
        factor, finite = precision.clipped(opt)
        assert factor == pytest.approx(0.1 / (float(norm) + 1e-6), rel=1e-3)
        assert all(torch.equal(p.grad.to_local(), g) for p, g in zip(params, grads))  # not scaled in place
        assert finite  # the norm is finite: the step skips its own pass over the gradients

        def no_check():
            raise AssertionError("the step checked the gradients for inf/NaN again")

        opt.nonfinite_grads = no_check
        # Lightning's closure: the backward, the hooks, then the clipping (here the clipping alone: no Trainer).
        precision._after_closure = lambda model, optimizer: precision.clip_gradients(optimizer, clip_val=0.1)
        precision.optimizer_step(opt, None, lambda: None)
        assert precision.clipped(opt) == (1.0, False)  # the step took what the clipping established
        reference, ref_opt = model(AdamW, seed=3)
        ref_opt.step(grad_scale=factor)
        assert all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(params, reference))

        params, sgd = model(torch.optim.SGD)
        precision.clip_gradients(sgd, clip_val=0.1)  # torch's clipping scales the gradients
        assert not torch.equal(params[0].grad.to_local(), grads[0])
        params, opt = model(AdamW, seed=3)
        params[1].grad.to_local()[0, 0] = float("nan")
        precision.clip_gradients(opt, clip_val=0.1)
        assert precision.clipped(opt) == (1.0, False) and params[0].grad.to_local().isnan().all()
        opt.step()  # checked, and skipped
        assert opt.skipped_steps == 1
    finally:
        dist.destroy_process_group()
