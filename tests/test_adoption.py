"""Optimizer adoption and the shared options, without DeepSpeed, a process group or a Trainer."""

import warnings

import pytest
import torch

from lightning_pure_bf16 import Adam, AdamW, DeepSpeedPureBF16Strategy
from lightning_pure_bf16.adoption import adopt_optimizer, prepare_for_zero3, rebind_scheduler
from lightning_pure_bf16.ops.rng import rank_seed
from lightning_pure_bf16.optim.options import OptimizerOptions, check_seed, unsupported_torch_options

WHO = "Trainer(strategy='deepspeed_pure_bf16')"


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(3))]


def _adopt(optimizer, **options):
    return adopt_optimizer(optimizer, OptimizerOptions(**options), who=WHO, source="configure_optimizers")


def test_torch_adamw_groups_and_hyperparameters_are_kept():
    w, b = _params()
    torch_opt = torch.optim.AdamW(
        [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0, "lr": 5e-3}],
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-6,
        foreach=False,
    )
    new = _adopt(torch_opt, rounding="kahan", seed=7, backend="torch")
    assert type(new) is AdamW and new.seed == 7 and new.backend == "torch"
    assert [g["params"] for g in new.param_groups] == [[w], [b]]
    for ours, theirs in zip(new.param_groups, torch_opt.param_groups):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert ours[key] == theirs[key], key
        assert ours["rounding"] == "kahan" and "foreach" not in ours


@pytest.mark.parametrize("decoupled", [False, True])
def test_torch_adam_keeps_its_weight_decay_kind(decoupled):
    torch_opt = torch.optim.Adam(_params(), lr=1e-3, weight_decay=0.01, decoupled_weight_decay=decoupled)
    new = _adopt(torch_opt)
    assert type(new) is Adam and new.param_groups[0]["decoupled_weight_decay"] is decoupled


def test_a_pure_bf16_optimizer_is_used_as_is():
    ours = AdamW(_params())
    assert _adopt(ours) is ours


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p: torch.optim.RMSprop(p, lr=0.1), TypeError, r"got `torch\.optim\.rmsprop\.RMSprop` from"),
        (lambda p: torch.optim.SGD(p, lr=0.1, differentiable=True), ValueError, r"SGD\(differentiable=True\)"),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), ValueError, r"AdamW\(amsgrad=True\)` cannot be converted"),
        (lambda p: torch.optim.Adam(p, maximize=True), ValueError, r"Adam\(maximize=True\)"),
    ],
)
def test_what_cannot_be_adopted_is_refused(make, error, match):
    with pytest.raises(error, match=match):
        _adopt(make(_params()))


def test_a_torch_optimizer_with_state_is_refused():
    params = _params()
    torch_opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    torch_opt.step()
    with pytest.raises(ValueError, match="already holds state"):
        _adopt(torch_opt)


def test_adoption_for_states_in_files_refuses_an_optimizer_with_states_in_memory(tmp_path):
    with pytest.raises(ValueError, match="memory-mapped files.*state_storage='memory'"):
        _adopt(AdamW(_params()), state_storage="mmap", state_dir=str(tmp_path))


def test_mmap_options_reach_the_converted_optimizer(tmp_path):
    new = _adopt(torch.optim.AdamW(_params()), state_storage="mmap", state_dir=str(tmp_path))
    try:
        assert new.state_storage == "mmap"
        prepare_for_zero3(new, base_seed=None, global_rank=3)
        new.init_states([(p, new.param_groups[0]) for p in new.param_groups[0]["params"]])
        assert "rank3" in new.state_dir
    finally:
        new.close()


def test_the_rebound_scheduler_drives_the_new_optimizer_without_a_warning():
    torch_opt = torch.optim.AdamW(_params(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda step: 0.5**step)
    new = _adopt(torch_opt, backend="torch")
    rebind_scheduler(scheduler, new)
    for p in new.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when the scheduler steps before the optimizer
        new.step()
        scheduler.step()
    assert new.param_groups[0]["lr"] == 0.5


def test_each_rank_gets_its_own_seed_and_zero3_decides_on_nonfinite():
    seeds = []
    for rank in range(3):
        new = _adopt(torch.optim.AdamW(_params()), seed=11)
        prepare_for_zero3(new, base_seed=11, global_rank=rank)
        assert new.check_nonfinite is False
        seeds.append(new.seed)
    assert seeds == [rank_seed(11, r) for r in range(3)] and len(set(seeds)) == 3


# --------------------------------------------------------------------------------------- one definition of options
@pytest.mark.parametrize(
    ("option", "value"),
    [("rounding", "up"), ("backend", "gpu"), ("seed", -1), ("seed", True), ("state_storage", "nvme")],
)
def test_strategy_and_optimizer_refuse_an_option_alike(option, value):
    with pytest.raises(ValueError) as from_strategy:
        DeepSpeedPureBF16Strategy(**{option: value})
    with pytest.raises(ValueError) as from_optimizer:
        AdamW(_params(), **{option: value})
    # The same check, the same words: only the call the user made differs.
    assert str(from_strategy.value).replace("DeepSpeedPureBF16Strategy", "X") == str(from_optimizer.value).replace(
        "AdamW", "X"
    )


def test_unsupported_torch_options_are_found_only_when_on():
    assert unsupported_torch_options({"amsgrad": False, "maximize": True, "lr": 1.0}) == {"maximize": True}
    with pytest.raises(ValueError, match="non-negative int"):
        check_seed("AdamW", 1.5)
    with pytest.raises(ValueError, match="needs `state_dir`"):
        OptimizerOptions(state_storage="mmap").check("AdamW")


def test_an_8_bit_kahan_buffer_without_kahan_rounding_is_refused_everywhere():
    from lightning_pure_bf16 import DeepSpeedPureBF16FabricStrategy

    messages = []
    for make, who in (
        (lambda: AdamW(_params(), compensation="int8"), "AdamW"),
        (lambda: DeepSpeedPureBF16Strategy(compensation="int8"), "DeepSpeedPureBF16Strategy"),
        (lambda: DeepSpeedPureBF16FabricStrategy(compensation="int8"), "DeepSpeedPureBF16FabricStrategy"),
    ):
        with pytest.raises(ValueError, match="only `rounding='kahan'` keeps") as err:
            make()
        messages.append(str(err.value).replace(who, "X"))
    assert len(set(messages)) == 1
    AdamW(_params(), rounding="kahan", compensation="int8")  # with Kahan rounding it is the 8-bit buffer
