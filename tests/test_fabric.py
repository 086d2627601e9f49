"""``Fabric(strategy="deepspeed_pure_bf16")``: registration, a plain Fabric loop on 2 CPU processes (memory, adoption,
schedulers, clipping, accumulation, non-finite skips), save -> load -> continue bit for bit, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from lightning_pure_bf16 import consolidate_checkpoint
from lightning_pure_bf16.checkpoint import MANIFEST, consolidate_optimizer_state
from tests import warm
from tests.strategy_runs import SCRIPTS, TIMEOUT_S, _env, assert_same_partitions, load_ranks, state_buffers


def fabric_run(out, check: bool = True, **opts) -> subprocess.CompletedProcess:
    command, env = warm.command([sys.executable, str(SCRIPTS / "fabric_mlp.py"), str(out), json.dumps(opts)], _env())
    proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"fabric_mlp.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def test_every_preset_is_registered_for_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import lightning_pure_bf16
    from lightning_pure_bf16.presets import PRESETS

    for name in PRESETS:
        assert STRATEGY_REGISTRY[name]["strategy"] is lightning_pure_bf16.DeepSpeedPureBF16FabricStrategy, name
    assert (
        STRATEGY_REGISTRY["deepspeed_pure_bf16_int8_kahan"]["init_params"]
        == PRESETS["deepspeed_pure_bf16_int8_kahan"][1]
    )


def test_fabric_strategy_options_and_precision():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy="deepspeed_pure_bf16_kahan")
    assert fabric.strategy.optimizer_options.rounding == "kahan"
    assert type(fabric.strategy.precision).__name__ == "PureBF16FabricPrecision"
    assert fabric.strategy.config["bf16"]["bf16_master_weights_and_grads"] is True
    fabric = Fabric(accelerator="cpu", devices=1, strategy="deepspeed_pure_bf16", precision="bf16-true")
    assert type(fabric.strategy.precision).__name__ == "PureBF16FabricPrecision"


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "16-true"])
def test_wrong_precision_is_refused_with_what_to_pass(precision):
    from lightning.fabric import Fabric

    with pytest.raises(ValueError, match=rf"precision='{precision}'\)` is not supported.*precision='bf16-true'"):
        Fabric(accelerator="cpu", devices=1, strategy="deepspeed_pure_bf16", precision=precision)


def test_bad_options_are_refused_like_the_trainers():
    from lightning_pure_bf16 import DeepSpeedPureBF16FabricStrategy, DeepSpeedPureBF16Strategy

    for kwargs in ({"rounding": "up"}, {"stage": 2}, {"moments": "int4"}, {"offload_optimizer": True}):
        with pytest.raises(ValueError) as fabric_err:
            DeepSpeedPureBF16FabricStrategy(**kwargs)
        with pytest.raises(ValueError) as trainer_err:
            DeepSpeedPureBF16Strategy(**kwargs)
        # The same words, naming each class.
        assert str(fabric_err.value).replace("DeepSpeedPureBF16FabricStrategy", "X") == str(trainer_err.value).replace(
            "DeepSpeedPureBF16Strategy", "X"
        )


# The gradient norms (ZeRO-3's, for its clipping, and the one clip_gradients returns) read the partitions in pieces
# of 1000 elements: each partition is read in several.
RUN = {
    "devices": 2,
    "steps": 8,
    "scheduler": True,
    "clip": 0.05,
    "accumulate": 2,
    "nan_rank": 0,
    "nan_step": 2,
    "norm_row": 1000,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """In one launch: stochastic rounding plain; Kahan with a scheduler, clipping, accumulation of 2, an inf/NaN step
    on rank 0 and a checkpoint at step 4; the same resumed from that checkpoint."""
    from tests.strategy_runs import fit_runs

    out = tmp_path_factory.mktemp("fabric")
    ckpt = out / "step4.ckpt"
    kahan = {"strategy": {"rounding": "kahan"}, **RUN}
    runs = [
        {"name": "plain", "devices": 2, "steps": 4, "record_exit": True},
        {"name": "whole", "save_at": 4, "save_path": str(ckpt), **kahan},
        {"name": "resumed", "resume": str(ckpt), **kahan},
    ]
    fit_runs(out, runs, script="fabric_mlp.py", exact=True)
    exits = [(out / "plain" / f"exit_rank{r}.txt").read_text() for r in range(2)]
    return FabricRuns(load_ranks(out / "plain"), load_ranks(out / "whole"), load_ranks(out / "resumed"), ckpt, exits)


class FabricRuns(NamedTuple):
    """What the module's launch left: each fit's ranks, the step-4 checkpoint, and whether each rank of the plain
    fit still had a process group when its interpreter was about to finalize."""

    plain: list[dict]
    whole: list[dict]
    resumed: list[dict]
    checkpoint: Path
    exits: list[str]


def test_fabric_loop_holds_8_bytes_per_param_and_10_with_kahan(runs):
    plain, whole, _, _, _ = runs
    for rank in plain:
        assert rank["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
        assert rank["precision"] == "PureBF16FabricPrecision"
        assert all(dtype == torch.bfloat16 for _, dtype, _ in state_buffers(rank)), state_buffers(rank)
    for rank in whole:
        assert rank["memory_report"]["total"] == pytest.approx(10.0, abs=0.01)
        assert rank["memory_report"]["kahan_comp"] == pytest.approx(2.0)


def test_independent_walk_of_zero_buffers_agrees(runs):
    plain, whole, _, _, _ = runs
    for rank in plain + whole:
        walked = sum(b for _, _, b in state_buffers(rank)) / rank["memory_report"]["params_on_rank"]
        assert walked == pytest.approx(rank["memory_report"]["total"], rel=0.01), state_buffers(rank)


def test_torch_adamw_is_adopted_with_its_groups_and_a_scheduler_on_the_returned_optimizer(runs):
    _, whole, _, _, _ = runs
    for rank in whole:
        assert rank["optimizer_class"] == "AdamW" and rank["returned_is_inner"]
        assert rank["rounding"] == ["kahan", "kahan"] and rank["group_wd"] == [0.1, 0.0]
        assert rank["lrs"] == pytest.approx([1e-2 / (1 + s) for s in range(8)])  # LambdaLR stepped each step


def test_clipping_is_wired_and_returns_the_norm(runs):
    _, whole, _, _, _ = runs
    for rank in whole:
        norms = rank["norms"]
        assert len(norms) == 8
        finite = [n for n in norms if n == n and n != float("inf")]
        assert len(finite) == 7 and all(n > 0.05 for n in finite)  # the clip was active
        # ZeRO-3 clipped to the norm asked for, in the step, and computed the same norm; its clip factor reached the
        # update (folded into it, ZeRO-3's own pass over the gradient skipped).
        clip_values = {c for c, _, _ in rank["clip_seen"]}
        assert clip_values == {0.05}
        ds_norms = [n for _, n, _ in rank["clip_seen"]][::2]  # two sub-groups per step
        assert ds_norms == pytest.approx(finite, rel=1e-3)
        factors = [f for _, _, f in rank["clip_seen"]]
        assert factors == pytest.approx([0.05 / (n + 1e-6) for _, n, _ in rank["clip_seen"]], rel=1e-6)


def test_accumulation_steps_once_per_two_backwards(runs):
    _, whole, _, _, _ = runs
    for rank in whole:
        assert len(rank["losses"]) == 16  # 8 steps x 2 micro-batches
        assert rank["engine_global_steps"] == 8


def test_nonfinite_gradient_on_one_rank_skips_on_both_and_is_counted(runs):
    _, whole, _, _, _ = runs
    for rank in whole:
        assert rank["skipped_steps"] == 1
        assert all(int(st["step"]) == 7 for st in rank["state"].values())
    assert whole[0]["seed"] != whole[1]["seed"]  # each rank its own noise


def test_save_load_continue_equals_uninterrupted_bit_for_bit(runs):
    _, whole, resumed, ckpt, _ = runs
    assert (ckpt / MANIFEST).is_file()
    for a, b in zip(whole, resumed):
        assert b["step"] == a["step"] == 8
        assert b["losses"] == a["losses"][8:]
        assert b["lrs"] == a["lrs"][4:]
        assert all({"exp_avg", "exp_avg_sq", "kahan_comp"} <= set(st) for st in a["state"].values())
        assert_same_partitions(a, b)
        assert b["seed"] == a["seed"] and b["skipped_steps"] == a["skipped_steps"] == 1


def test_fabric_checkpoints_consolidate(runs):
    weights = consolidate_checkpoint(runs.checkpoint)
    assert set(weights) == {f"net.{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")}
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    state = consolidate_optimizer_state(runs.checkpoint)
    assert {k for st in state.values() for k in st} == {"exp_avg", "exp_avg_sq", "kahan_comp", "step"}


def test_an_optimizer_it_cannot_adopt_is_a_clear_error(tmp_path):
    proc = fabric_run(tmp_path, check=False, devices=1, steps=1, optimizer="rmsprop")
    assert proc.returncode != 0
    assert "Fabric(strategy='deepspeed_pure_bf16')" in proc.stderr and "RMSprop" in proc.stderr


def test_the_process_group_the_fabric_strategy_made_is_destroyed_before_the_interpreter_finalizes(runs):
    assert runs.exits == ["False", "False"]
