"""The pure-bf16 strategy end to end: 2 CPU processes (gloo), small MLP, a few steps each."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_pure_bf16
from lightning_pure_bf16 import DeepSpeedPureBF16Strategy, PureBF16Precision, StateStorageError
from lightning_pure_bf16.plan import plan
from lightning_pure_bf16.strategy import STATE_DIR_ENV
from tests.strategy_runs import _env, fit_runs, load_ranks, output, run_script, state_buffers

# Every parameter partitioned (no gathered "persistent" small parameters) and small buckets, so that every buffer the
# ZeRO optimizer holds is model state or a small fixed communication bucket.
EXACT = {"config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}, "reduce_bucket_size": 10_000}


GATHERED = {"steps": 3, "hidden": 384, "depth": 4, "bias": False, "freeze_layers": 3, "record_gathered": True}
GATHER_BUCKET = 100_000


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank fit of this module, one after the other in one launch (one process group), under Python's default
    warning filters (known third-party warnings are silenced; a warning of the user's own at step 0 shows)."""
    out = tmp_path_factory.mktemp("two_ranks")
    for name in ("mmap_states", "int8_mmap_states"):
        (out / name).mkdir()
    mmap = {**EXACT, "state_storage": "mmap"}
    runs = [
        {
            "name": "default",
            "steps": 8,
            "scheduler": True,
            "eval_loops": True,
            "record_exit": True,
            "record_grad_storage": True,
            "user_warning": True,
        },
        {
            "name": "kahan",
            "steps": 4,
            # gather_cache="keep": DeepSpeed's own cache of gathered parameters.
            "strategy": {**EXACT, "rounding": "kahan", "gather_cache": "keep"},
            "optimizer": "torch_adam",
            "clip": 0.5,
            "accumulate": 2,
            "freeze_first": True,
            "record_grad_storage": True,
        },
        # Two identical fits, each with an inf/NaN gradient on rank 1 at step 2; the same with the states in files.
        *({"name": f"exact{i}", "steps": 5, "strategy": EXACT, "nan_rank": 1, "nan_step": 2} for i in range(2)),
        {
            "name": "mmap",
            "steps": 5,
            "strategy": {**mmap, "state_dir": str(out / "mmap_states")},
            "nan_rank": 1,
            "nan_step": 2,
        },
        {
            "name": "int8_mmap",
            "steps": 3,
            "strategy": {**mmap, "state_dir": str(out / "int8_mmap_states"), "moments": "int8"},
        },
        *(
            {
                "name": f"gathered_{cache}",
                **GATHERED,
                "strategy": {"reduce_bucket_size": GATHER_BUCKET, "gather_cache": cache},
            }
            for cache in ("layer", "next", "auto")
        ),
        # A small sub-group size splits each rank's partition into several ZeRO-3 sub-groups. Counting the update
        # calls and undoing the aliasing fix replace functions for the rest of the process: the last two fits.
        {"name": "sub_groups", "steps": 3, "strategy": {**EXACT, "sub_group_size": 1500}, "count_updates": True},
        {"name": "no_alias_fix", "steps": 1, "strategy": EXACT, "no_alias_fix": True},
    ]
    # The other algorithms: torch.optim.SGD (momentum, Nesterov) and Adafactor converted, this package's Lion with
    # 8-bit momentum and Muon (AdamW for the biases).
    runs[-2:-2] = [
        {"name": name, "steps": 6, "optimizer": name, "strategy": EXACT}
        for name in ("torch_sgd", "lion", "torch_adafactor", "muon")
    ]
    return fit_runs(out, runs, env={"PYTHONWARNINGS": "default"}, devices=2)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Every 1-rank fit of this module in one launch: the refusals (each error written to its output), then the fits
    that replace a function for the rest of the process."""
    out = tmp_path_factory.mktemp("one_rank")
    for name in ("mmap_pure", "no_space"):
        (out / name / "states").mkdir(parents=True)
    runs = [
        {"name": "torch_rmsprop", "steps": 1, "optimizer": "torch_rmsprop", "expect_error": True},
        {"name": "torch_amsgrad", "steps": 1, "optimizer": "torch_amsgrad", "expect_error": True},
        {
            "name": "mmap_pure",
            "steps": 1,
            "optimizer": "pure",
            "strategy": {"state_storage": "mmap", "state_dir": str(out / "mmap_pure" / "states")},
            "expect_error": True,
        },
        {"name": "pure", "steps": 2, "optimizer": "pure"},
        {
            "name": "no_space",
            "steps": 2,
            "strategy": {"state_storage": "mmap", "state_dir": str(out / "no_space" / "states")},
            "fake_free_bytes": 1000,
            "expect_error": True,
        },
        {"name": "gpu_host", "steps": 2, "deepspeed_picked_cuda": True},
    ]
    return fit_runs(out, runs, devices=1)


@pytest.fixture(scope="module")
def default_run(two_ranks):
    return load_ranks(two_ranks / "default")


@pytest.fixture(scope="module")
def kahan_run(two_ranks):
    return load_ranks(two_ranks / "kahan")


@pytest.fixture(scope="module")
def exact_runs(two_ranks):
    return [load_ranks(two_ranks / f"exact{i}") for i in range(2)]


def test_registered_names():
    assert {"deepspeed_pure_bf16", "deepspeed_pure_bf16_kahan"} <= set(StrategyRegistry)
    assert StrategyRegistry["deepspeed_pure_bf16_kahan"]["init_params"] == {"rounding": "kahan"}
    assert StrategyRegistry["deepspeed_pure_bf16_int8"]["init_params"] == {"moments": "int8"}
    assert StrategyRegistry["deepspeed_pure_bf16_int8_kahan"]["init_params"] == {
        "moments": "int8",
        "rounding": "kahan",
        "compensation": "int8",
    }
    DeepSpeedPureBF16Strategy.register_strategies(StrategyRegistry)  # a second import must not fail


def test_the_package_loads_no_lightning_and_registers_its_strategies_when_lightning_loads():
    # The optimizer, the tools and the DeepSpeed, FSDP2 and Hugging Face front ends run without Lightning. A script that
    # imports the package first finds the names once Lightning is loaded, whether it imports Lightning next, one of the
    # package's strategies or its precision module does (the order Lightning first is this module's).
    check = (
        "from lightning.pytorch.strategies import StrategyRegistry as T\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY as F\n"
        "assert T['deepspeed_pure_bf16_int8_mmap_release']['strategy'] is p.DeepSpeedPureBF16Strategy\n"
        "assert T['fsdp2_pure_bf16_kahan']['strategy'] is p.FSDP2PureBF16Strategy\n"
        "assert F['deepspeed_pure_bf16']['strategy'] is p.DeepSpeedPureBF16FabricStrategy\n"
        "import lightning; assert type(lightning.__loader__).__module__.startswith('_frozen_importlib')\n"
    )
    first = "import sys, lightning_pure_bf16 as p\nassert 'lightning' not in sys.modules, 'Lightning loaded'\n"
    first += "assert 'DeepSpeedPureBF16Strategy' in dir(p)\n"
    procs = [
        subprocess.Popen([sys.executable, "-c", first + then + check], stderr=subprocess.PIPE, text=True, env=_env())
        for then in (
            "import lightning\n",
            "from lightning_pure_bf16 import DeepSpeedPureBF16Strategy\n",
            # Lightning's import starting inside the precision plugins' module, which the strategies import.
            "from lightning_pure_bf16.precision import Float32Matmul\n",
        )
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]


def test_unchanged_module_trains_with_torch_adamw_and_scheduler(default_run):
    for r in default_run:
        assert r["optimizer_class"] == "AdamW"
        assert r["rounding"] == ["stochastic", "stochastic"]
        assert r["group_wd"] == [0.1, 0.0]  # param groups kept
        assert r["precision"] == "PureBF16Precision"
        assert r["global_step"] == 8
        # The LambdaLR schedule 1/(1+step) is applied to the swapped optimizer.
        assert r["lrs"] == pytest.approx([1e-2 / (1 + i) for i in range(8)])
    losses = default_run[0]["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_eval_loops_run(default_run):
    r = default_run[0]
    assert "val_loss" in r["validate"][0] and "test_loss" in r["test"][0]
    assert r["predict_shapes"] == [(16, 1)] and r["predict_finite"]


def test_model_state_is_8_bytes_per_param_all_bf16(exact_runs):
    for r in exact_runs[0]:
        report = r["memory_report"]
        assert report["total"] == pytest.approx(8.0)
        assert report["master"] == 0.0 and report["other_state"] == 0.0
        assert r["persistent_numel"] == 0
        buffers = state_buffers(r)
        assert all(dtype == torch.bfloat16 for _, dtype, _ in buffers), buffers
        counted = sum(b for _, _, b in buffers) / report["params_on_rank"]
        assert counted <= 8.0 + 1e-9, buffers


def test_kahan_is_10_bytes_per_param(kahan_run):
    for r in kahan_run:
        report = r["memory_report"]
        assert report["total"] == pytest.approx(10.0) and report["kahan_comp"] == pytest.approx(2.0)
        buffers = state_buffers(r)
        assert all(dtype == torch.bfloat16 for _, dtype, _ in buffers)
        assert sum(b for _, _, b in buffers) / report["params_on_rank"] <= 10.0 + 1e-9


def test_adam_clipping_accumulation_and_frozen_layer(kahan_run):
    n_trainable = 64 * 64 + 64 + 64 + 1  # the first Linear(16, 64) is frozen
    total_on_ranks = sum(r["memory_report"]["params_on_rank"] for r in kahan_run)
    assert n_trainable <= total_on_ranks < n_trainable + 2 * 64  # frozen layer: no partition, no state
    for r in kahan_run:
        assert r["optimizer_class"] == "Adam" and r["rounding"] == ["kahan", "kahan"]
        assert r["gradient_clipping"] == 0.5
        assert r["global_step"] == 4 and len(r["losses"]) == 8  # 2 micro-batches per optimizer step
        assert r["frozen_requires_grad"] == [False, False]


@pytest.mark.parametrize(
    ("name", "optimizer", "state", "state_bytes", "dtypes"),
    [
        ("torch_sgd", "SGD", "momentum_buffer", 2.0, {torch.bfloat16}),
        ("lion", "Lion", "exp_avg", 1 + 2 / 128, {torch.bfloat16, torch.int8}),
    ],
)
def test_sgd_and_lion_train_with_one_state_per_parameter(two_ranks, name, optimizer, state, state_bytes, dtypes):
    """configure_optimizers returning torch.optim.SGD(momentum=0.9, nesterov=True) trains with this package's SGD, and
    its Lion with 8-bit momentum trains as given: 6 and about 5 bytes/param, every buffer bf16 or 8-bit, the loss
    falling."""
    for r in load_ranks(two_ranks / name):
        report = r["memory_report"]
        assert r["optimizer_class"] == optimizer
        # 8-bit: one scale per 128 elements of each partition's tensor, the last block of each partial.
        assert report[state] == pytest.approx(state_bytes, rel=2e-3)
        assert report["total"] == pytest.approx(4.0 + state_bytes, rel=1e-3)
        assert report["exp_avg_sq"] == 0.0 and report["master"] == 0.0 and report["other_state"] == 0.0
        buffers = state_buffers(r)
        assert {dtype for _, dtype, _ in buffers} == dtypes, buffers
        losses = r["losses"]
        assert sum(losses[-2:]) < sum(losses[:2]), losses


@pytest.mark.parametrize(("name", "optimizer"), [("torch_adafactor", "Adafactor"), ("muon", "Muon")])
def test_adafactor_and_muon_see_each_parameter_where_zero3_put_it(two_ranks, name, optimizer):
    """torch.optim.Adafactor converted, and Muon, train under ZeRO-3 on 2 ranks: each flat partition's pieces (what
    the strategy told the optimizer) hold exactly the elements of the whole parameter that ZeRO-3 placed there (the
    gathered parameter's run, on every rank), Adafactor's row and column statistics are the same on both ranks (summed
    over them), model state is 4 bytes/param (Adafactor) or 6 on the matrices and 8 on the biases (Muon), and the loss
    falls."""
    runs = load_ranks(two_ranks / name)
    for r in runs:
        assert r["optimizer_class"] == optimizer
        full = r["full_state"]
        for flat, pieces in zip(r["flat_params"], r["pieces"]):
            for param_name, shape, start, offset, numel in pieces:
                whole = full[param_name.removeprefix("_forward_module.")]
                assert tuple(whole.shape) == tuple(shape)
                assert torch.equal(flat[offset : offset + numel], whole.reshape(-1)[start : start + numel])
            assert sum(numel for *_, numel in pieces) <= flat.numel()
        report = r["memory_report"]
        if name == "torch_adafactor":
            # The float32 statistics: every weight's rows and columns (64 + 64 + 1 rows, 16 + 64 + 64 columns) on
            # each rank, and the rank's run of the biases' (129 elements) second moment; large beside this model's
            # 2,657 parameters per rank, negligible beside a real one's.
            stats_bytes = report["statistics"] * report["params_on_rank"]
            assert 273 * 4 < stats_bytes < (273 + 129) * 4
            assert report["total"] == pytest.approx(4.0 + report["statistics"], rel=1e-3)
        else:
            assert 6.0 < report["total"] < 6.1  # 64*64 + 64 + 1 matrix elements at 6, 64 + 1 bias elements at 8
        assert sum(r["losses"][-2:]) < sum(r["losses"][:2]), r["losses"]
    if name == "torch_adafactor":
        first, second = (r["statistics"] for r in runs)
        assert first[0]["row_var"].numel() == 64 + 64 + 1  # the weights' rows; the biases' group has none
        for a, b in zip(first, second):
            assert all(torch.equal(a[key], b[key]) for key in ("row_var", "col_var"))
    starts = {p[2] for r in runs for pieces in r["pieces"] for p in pieces}
    assert starts != {0}  # rank 1's runs start inside the parameters


def test_same_seed_same_weights(exact_runs):
    first, second = exact_runs
    for a, b in zip(first, second):
        for x, y, real in zip(a["flat_params"], b["flat_params"], a["real_masks"]):
            assert real.sum() > 0
            assert torch.equal(x[real], y[real])
        assert a["seed"] == b["seed"]
    assert first[0]["seed"] != first[1]["seed"]  # each rank has its own noise stream


def test_nonfinite_gradient_on_one_rank_skips_everywhere(two_ranks, exact_runs):
    ranks = exact_runs[0]
    for r in ranks:
        assert r["skipped_steps"] == 1
        assert all(torch.isfinite(t[m].float()).all() for t, m in zip(r["flat_params"], r["real_masks"]))
        assert all(torch.isfinite(torch.tensor(x)) for x in r["losses"][3:])
    # One skipped step: the step counters of the optimizer lag the trainer's by one.
    assert all(int(s["step"]) == ranks[0]["global_step"] - 1 for s in ranks[0]["state"].values())
    metrics = list(csv.DictReader(open(next((two_ranks / "exact0").glob("logs/version_*/metrics.csv")))))
    assert any(row.get("pure_bf16/skipped_steps") == "1.0" for row in metrics)


def test_without_the_aliasing_fix_deepspeed_keeps_a_second_bf16_copy(two_ranks):
    report = load_ranks(two_ranks / "no_alias_fix")[0]["memory_report"]
    assert report["master"] == pytest.approx(2.0) and report["total"] == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        ("torch_rmsprop", "can convert `torch.optim.AdamW`, `Adam`, `SGD`, `Adafactor` and `Muon`, but got"),
        ("torch_amsgrad", "amsgrad=True"),
    ],
)
def test_unconvertible_optimizer_is_a_clear_error(one_rank, optimizer, match):
    assert not (one_rank / optimizer / "rank0.pt").exists()
    assert match in output(one_rank / optimizer)


def test_project_optimizer_passed_directly_is_used(one_rank):
    r = load_ranks(one_rank / "pure", 1)[0]
    assert r["optimizer_class"] == "AdamW" and r["rounding"] == ["kahan", "kahan"]


def test_the_process_group_the_strategy_made_is_destroyed_before_the_interpreter_finalizes(two_ranks):
    # Left to the interpreter's own teardown, gloo's threads can abort a finished fit (benchmarks/exit_stress.py).
    for rank in range(2):
        assert (two_ranks / "default" / f"exit_rank{rank}.txt").read_text() == "False"


def test_the_step_updates_from_the_gradient_partition_itself_not_a_copy(default_run, kahan_run):
    # DeepSpeed flattens each sub-group's gradient into a new tensor (2 bytes/param at the peak of the step); the
    # strategy hands the optimizer a view of the partition. Kahan's run clips and accumulates: the view holds there too.
    for r in default_run + kahan_run:
        seen = r["step_grad_is_partition_view"]  # (the gradient's storage, the gradient partition's), per update
        assert seen and [grad for grad, _ in seen] == [partition for _, partition in seen]


def test_the_peak_of_the_fit_is_measured_and_logged_beside_model_state(two_ranks, default_run):
    for r in default_run:
        peak = r["peak_memory"]
        assert peak["source"] == "resident set (VmHWM)"
        assert peak["peak_gib"] >= peak["at_setup_gib"] > 0
        assert peak["model_state_per_param"] == r["memory_report"]["total"] == 8.0
        assert peak["above_setup_per_param"] >= 0
    log = output(two_ranks / "default")
    assert "memory of rank 0 during the fit:" in log and "GiB at the peak" in log and "no figure per parameter" in log


def test_cpu_loop_is_loaded_before_the_first_step(default_run):
    # Loaded at setup (by the strategy, or by the optimizer's constructor), never inside a step, where every rank
    # would stall on the build.
    assert all(r["cpu_loop_ready_at_first_step"] for r in default_run)


@pytest.mark.parametrize("local_rank", [0, 1])
def test_one_rank_of_a_machine_builds_the_cpu_loop_while_the_others_wait(monkeypatch, local_rank):
    from lightning_pure_bf16 import presets

    events = []
    monkeypatch.setattr(presets, "fused_cpu_available", lambda: events.append("load") or True)
    DeepSpeedPureBF16Strategy().settings.prepare_cpu_loop(local_rank, lambda name: events.append("barrier"))
    assert events == (["load", "barrier", "load"] if local_rank == 0 else ["barrier", "load"])


def test_cpu_fit_on_a_gpu_host_uses_deepspeeds_cpu_accelerator(one_rank):
    # On a GPU host DeepSpeed picks its CUDA accelerator; `accelerator="cpu"` must still train on the CPU with gloo.
    (r,) = load_ranks(one_rank / "gpu_host", 1)
    assert r["global_step"] == 2
    assert r["deepspeed_accelerator"] == "cpu" and r["process_group_backend"] == "gloo"
    assert all(t.device.type == "cpu" for t in r["flat_params"])


def test_known_third_party_warnings_are_silenced_and_a_users_own_still_shows(two_ranks):
    from lightning_pure_bf16._warnings import KNOWN_LOG_RECORDS

    shown = output(two_ranks / "default")
    for known in ("all_gather_into_tensor` is deprecated", "reduce_scatter_tensor` is deprecated", "LeafSpec"):
        assert known not in shown
    assert all(start not in shown for _, start in KNOWN_LOG_RECORDS)
    assert "a user's own warning at step 0" in shown


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "16-true"])
def test_other_precision_flags_are_refused(precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}'\)` is not supported.*precision='bf16-true'"):
        Trainer(accelerator="cpu", devices=1, strategy="deepspeed_pure_bf16", precision=precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_default_and_bf16_true_precision_mean_pure_bf16(precision):
    trainer = Trainer(accelerator="cpu", devices=1, strategy="deepspeed_pure_bf16", precision=precision, logger=False)
    assert isinstance(trainer.strategy.precision_plugin, PureBF16Precision)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 2}, "stage=2"),
        ({"rounding": "up"}, "rounding='up'"),
        ({"backend": "gpu"}, "backend='gpu'"),
        ({"config": {"fp16": {"enabled": True}}}, "fp16.enabled"),
        ({"config": {"bf16": {"bf16_master_weights_and_grads": False}}}, "bf16_master_weights_and_grads"),
        ({"config": {"zero_optimization": {"stage": 2}}}, "ZeRO stage 3"),
        ({"config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}, "offload_optimizer"),
        ({"config": {"optimizer": {"type": "Adam"}}}, "`optimizer`"),
        ({"config": {"data_types": {"grad_accum_dtype": "fp32"}}}, "grad_accum_dtype"),
        ({"offload_optimizer": True}, "offload_optimizer"),
        ({"zero_optimization": False}, "ZeRO stage 3"),
    ],
)
def test_contradicting_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeepSpeedPureBF16Strategy(**kwargs)


def test_user_config_is_merged():
    strategy = DeepSpeedPureBF16Strategy(
        config={"zero_optimization": {"stage3_max_live_parameters": 123}, "wall_clock_breakdown": True}
    )
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_max_live_parameters"] == 123
    assert strategy.config["wall_clock_breakdown"] is True
    assert strategy.config["bf16"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    assert strategy.config["zero_allow_untested_optimizer"] is True


def test_the_gather_cache_setting_and_the_users_own_zero3_settings_are_logged_at_setup(caplog):
    import logging

    def configured(on_cpu=True, **kwargs):
        strategy = DeepSpeedPureBF16Strategy(**kwargs)
        config = strategy.config
        with caplog.at_level(logging.INFO):
            caplog.clear()
            strategy.settings.configure_device(config, None, on_cpu=on_cpu)
        return config["zero_optimization"], caplog.text

    # The same settings on a GPU: a prefetch bucket with a reuse distance of 0 held every layer gathered.
    for on_cpu in (True, False):
        zero, log = configured(on_cpu, gather_cache="layer")
        assert zero["stage3_max_reuse_distance"] == 0 and zero["stage3_prefetch_bucket_size"] == 0
        assert "gather_cache='layer' (the smallest peak" in log and "ZeRO-3's traffic 1.5x" in log
    zero, log = configured(gather_cache="keep")
    assert "stage3_max_reuse_distance" not in zero and "stage3_prefetch_bucket_size" not in zero  # DeepSpeed's own
    assert "gather_cache='keep'" in log
    mine = {"stage3_max_reuse_distance": 123, "stage3_prefetch_bucket_size": 456}
    zero, log = configured(config={"zero_optimization": mine})
    assert {k: zero[k] for k in mine} == mine
    assert "as your config says (stage3_max_reuse_distance=123, stage3_prefetch_bucket_size=456)" in log
    # A prefetch of one's own beside the release after each use holds every layer again: said, and kept.
    with pytest.warns(UserWarning, match="a step holds every layer gathered"):
        zero, _ = configured(config={"zero_optimization": {"stage3_prefetch_bucket_size": 456}})
    assert zero["stage3_prefetch_bucket_size"] == 456 and zero["stage3_max_reuse_distance"] == 0
    zero, log = configured()  # the default
    assert zero["stage3_max_reuse_distance"] == 0 and zero["stage3_prefetch_bucket_size"] == 0
    assert "gather_cache='auto' (the default" in log and "decision is logged after the first step" in log
    with pytest.raises(ValueError, match=r"gather_cache='all'\)` is not one of \('layer', 'next', 'auto', 'keep'\)"):
        DeepSpeedPureBF16Strategy(gather_cache="all")


def test_auto_gathers_the_next_layer_only_where_twice_it_and_the_steps_peak_fit(caplog):
    import logging
    from types import SimpleNamespace

    from lightning_pure_bf16.gather import NextLayerIfItFits

    # Two layers of 1,000 bf16 elements that ZeRO-3 partitions, the larger one 2,000 bytes gathered; and one it
    # keeps whole (persistent), which no all-gather ever adds.
    model = torch.nn.Sequential(torch.nn.Linear(10, 100, bias=False), torch.nn.Linear(100, 10, bias=False))
    model.append(torch.nn.Linear(100, 100, bias=False))
    for i, p in enumerate(model.parameters()):
        p.data = p.data.bfloat16()
        p.ds_numel, p.ds_persist = p.numel(), i == 2
    for m in model.modules():
        m.ds_external_parameters = list  # ZeRO-3's registry of parameters used outside their module: none
    step_count = []
    engine = SimpleNamespace(module=model, optimizer=SimpleNamespace(step=lambda: step_count.append(1)))

    class Meter:
        device = torch.device("cpu")

        def __init__(self, available):
            self.available = available

        def headroom(self):
            return None if self.available is None else (self.available, 1_000)  # the peak: 1,000 bytes above now

    # On the CPU: twice the layer, and gloo's copy of it: 8,000 bytes beside the peak's 1,000.
    for available, fits in ((9_000, True), (8_999, False)):
        auto = NextLayerIfItFits(engine, Meter(available), "deepspeed_pure_bf16")
        assert not auto.on
        with caplog.at_level(logging.INFO):
            caplog.clear()
            engine.optimizer.step()
            auto.after_step()  # as the engine's run calls it after each of ZeRO-3's steps
        assert auto.on is fits and len(step_count) == 1
        assert ("gathered ahead from now on" if fits else "stay gathered one at a time") in caplog.text
        with caplog.at_level(logging.INFO):
            caplog.clear()
            engine.optimizer.step()
            auto.after_step()  # decided once
        assert auto.on is fits and len(step_count) == 2 and "gather_cache='auto'" not in caplog.text
        step_count.clear()
    assert NextLayerIfItFits(engine, Meter(None), "deepspeed_pure_bf16").decide() is False  # no peak measured


def test_package_import_registers_on_reimport():
    import importlib

    importlib.reload(lightning_pure_bf16)
    assert "deepspeed_pure_bf16" in StrategyRegistry


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Three LightningCLI fits in one process (1 rank each): a registered name in a config file, the class with its
    arguments in one, a registered name on the command line."""
    out = tmp_path_factory.mktemp("cli")
    common = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=3", "--trainer.logger=false"]
    common += [
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=1",
    ]
    states = out / "states"
    states.mkdir()
    (out / "kahan.yaml").write_text("trainer:\n  strategy: deepspeed_pure_bf16_kahan\n")
    (out / "mmap.yaml").write_text(
        "trainer:\n  strategy:\n    class_path: lightning_pure_bf16.DeepSpeedPureBF16Strategy\n    init_args:\n"
        f"      rounding: kahan\n      state_storage: mmap\n      state_dir: {states}\n"
    )
    runs = [
        {"name": "yaml", "args": ["fit", "--config", str(out / "kahan.yaml")]},
        {"name": "mmap_yaml", "args": ["fit", "--config", str(out / "mmap.yaml")]},
        {
            "name": "mmap_preset_argument",
            "args": ["fit", "--trainer.strategy", "deepspeed_pure_bf16_mmap"],
            "env": {STATE_DIR_ENV: str(states)},
        },
    ]
    for run in runs:
        run["args"] += [*common, f"--trainer.default_root_dir={out / run['name']}"]
    run_script("cli_mlp.py", out, json.dumps({"runs": runs}))
    return out


@pytest.mark.parametrize(
    ("source", "expected", "expected_total"),
    [("yaml", "kahan", 10.0), ("mmap_yaml", "kahan", 4.0), ("mmap_preset_argument", "stochastic", 4.0)],
)
def test_lightning_cli(cli_runs, source, expected, expected_total):
    r = torch.load(cli_runs / source / "cli_rank0.pt", weights_only=False)
    assert r["strategy"] == "DeepSpeedPureBF16Strategy" and r["rounding"] == expected
    assert r["optimizer"] == "AdamW" and r["global_step"] == 3 and r["world_size"] == 1
    assert r["memory_report"]["total"] == pytest.approx(expected_total)
    if source.startswith("mmap"):
        assert r["memory_report"]["state_files"] == pytest.approx(6.0 if expected == "kahan" else 4.0)


def test_one_update_call_per_sub_group_per_step(two_ranks):
    for r in load_ranks(two_ranks / "sub_groups"):
        assert r["sub_groups"] > 1
        # Each step updates every sub-group's whole flat partition exactly once.
        assert r["update_calls"] == r["sub_group_numels"] * 3


# ------------------------------------------------------------------------------------ states in mmap files
@pytest.fixture(scope="module")
def mmap_run(two_ranks):
    return two_ranks / "mmap_states", load_ranks(two_ranks / "mmap")  # as exact_runs


def test_mmap_states_train_exactly_like_in_memory_states(exact_runs, mmap_run):
    for a, b in zip(exact_runs[0], mmap_run[1]):
        assert a["seed"] == b["seed"] and repr(a["losses"]) == repr(b["losses"])  # exact, the NaN step included
        for x, y, real in zip(a["flat_params"], b["flat_params"], a["real_masks"]):
            assert torch.equal(x[real], y[real])
        for sa, sb, real in zip(a["state"].values(), b["state"].values(), a["real_masks"]):
            assert set(sa) == set(sb) == {"step", "stream", "exp_avg", "exp_avg_sq"}
            assert torch.equal(sa["step"], sb["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[key][real], sb[key][real]), key


def test_8bit_states_in_files_leave_4_bytes_per_param_in_memory_and_2_in_files(two_ranks):
    for r in load_ranks(two_ranks / "int8_mmap"):
        report = r["memory_report"]
        assert report["total"] == pytest.approx(4.0)
        assert 2.0 < report["state_files"] <= 2.05
        assert all(s["exp_avg"].dtype == torch.int8 for s in r["state"].values())


def test_mmap_states_leave_4_bytes_per_param_in_memory(mmap_run):
    state_dir, ranks = mmap_run
    for r in ranks:
        report = r["memory_report"]
        assert report["total"] == pytest.approx(4.0) and report["state_files"] == pytest.approx(4.0)
        assert report["exp_avg"] == report["exp_avg_sq"] == 0.0
        # An independent walk of what the ZeRO optimizer holds in memory: parameters and gradients only (on the CPU
        # the update works in the files' mapping: no streaming slots either).
        slots = [(n, d, b) for n, d, b in state_buffers(r) if "._storage.streamers." in n]
        buffers = [(n, d, b) for n, d, b in state_buffers(r) if "._storage.streamers." not in n]
        assert slots == [], slots
        assert all(dtype == torch.bfloat16 for _, dtype, _ in buffers), buffers
        assert sum(b for _, _, b in buffers) / report["params_on_rank"] <= 4.0 + 1e-9, buffers
        # Every moment is in a file of this rank's own directory under the state directory.
        rank_dir = Path(r["state_dir"])
        assert rank_dir.parent == state_dir and rank_dir.name.startswith(f"pure_bf16_states-rank{r['rank']}-")
        names = [name for files in r["state_files"] for name in files.values()]
        assert names and all(name is not None and Path(name).parent == rank_dir for name in names)
    # The files are gone once the processes exited (the optimizer's finalizer; `close()` removes them earlier).
    assert list(state_dir.iterdir()) == []


def test_mmap_strategy_refuses_an_in_memory_optimizer(one_rank):
    assert not (one_rank / "mmap_pure" / "rank0.pt").exists()
    assert "keeps optimizer states in memory-mapped files" in output(one_rank / "mmap_pure")


def test_mmap_states_that_do_not_fit_on_the_disk_fail_at_setup(one_rank):
    shown = output(one_rank / "no_space")
    assert not (one_rank / "no_space" / "rank0.pt").exists()
    assert "the optimizer states need" in shown and "has 1000 bytes free" in shown
    # Raised while the strategy allocates the states, before the first training step.
    assert "init_zero3_optimizer_state" in shown and "training_step" not in shown
    assert not any((one_rank / "no_space" / "states").rglob("*.bin"))


def test_mmap_preset_takes_the_state_dir_from_the_environment(tmp_path, monkeypatch):
    assert StrategyRegistry["deepspeed_pure_bf16_mmap"]["init_params"] == {"state_storage": "mmap"}
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    trainer = Trainer(accelerator="cpu", devices=1, strategy="deepspeed_pure_bf16_mmap", logger=False)
    assert trainer.strategy.state_storage == "mmap" and trainer.strategy.state_dir == str(tmp_path)


def test_mmap_preset_without_a_state_dir_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=f"needs a state directory.*state_dir=.*{STATE_DIR_ENV}.*pure_bf16"):
        Trainer(accelerator="cpu", devices=1, strategy="deepspeed_pure_bf16_mmap")


def test_mmap_settings_in_the_deepspeed_config(tmp_path, monkeypatch):
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    strategy = DeepSpeedPureBF16Strategy(config={"pure_bf16": {"state_storage": "mmap", "state_dir": str(tmp_path)}})
    assert strategy.state_storage == "mmap" and strategy.state_dir == str(tmp_path)
    assert "pure_bf16" not in strategy.config  # DeepSpeed never sees the section
    with pytest.raises(ValueError, match=r"unknown keys \['state_path'\]"):
        DeepSpeedPureBF16Strategy(config={"pure_bf16": {"state_path": str(tmp_path)}})


def test_mmap_state_dir_errors_come_at_trainer_construction(tmp_path):
    with pytest.raises(StateStorageError, match="does not exist"):
        Trainer(strategy=DeepSpeedPureBF16Strategy(state_storage="mmap", state_dir=tmp_path / "missing"))
    with pytest.raises(StateStorageError, match="cannot create files"):
        DeepSpeedPureBF16Strategy(state_storage="mmap", state_dir="/proc")
    with pytest.raises(ValueError, match="only used with `state_storage='mmap'`"):
        DeepSpeedPureBF16Strategy(state_dir=tmp_path)
    with pytest.raises(ValueError, match="state_storage='nvme'"):
        DeepSpeedPureBF16Strategy(state_storage="nvme", state_dir=tmp_path)


def test_mmap_state_dir_in_memory_is_warned_about(tmp_path, monkeypatch):
    import lightning_pure_bf16.optim.mmap_states as mmap_states

    monkeypatch.setattr(mmap_states, "filesystem_type", lambda _: "tmpfs")
    with pytest.warns(UserWarning, match="is on tmpfs, which is memory"):
        DeepSpeedPureBF16Strategy(state_storage="mmap", state_dir=tmp_path)


def test_a_step_holds_one_layer_gathered_or_two_with_next_and_the_report_counts_frozen_layers(two_ranks):
    # Four 384 x 384 layers (each above ZeRO-3's persistence threshold, so partitioned), sampled at every module's
    # forward and backward: with DeepSpeed's own settings (gather_cache="keep") ZeRO-3 prefetches and holds all four
    # at once (589,824 elements); the default holds the layer it is working on. The first three of the six linear
    # layers are frozen (half the parameters, the seed user's recipe): the report counts them at 2 B/param.
    # Bias-free layers and gradient buckets smaller than a layer: each layer's gradient is reduce-scattered before
    # the next layer's backward starts, so what waits unreduced is at most the bucket (ZeRO-3 alone held a layer's
    # gradient until the next layer's had been computed).
    # gather_cache="next" gathers the next layer while one computes: two layers at once, never more, the same bits;
    # "auto" does the same after its first step where the memory allows it (here it does).
    bucket = GATHER_BUCKET
    layer, ahead, auto = (two_ranks / f"gathered_{cache}" for cache in ("layer", "next", "auto"))
    assert "the next layer is gathered ahead from now on" in output(auto)  # this machine has room for it
    for rank, next_rank, auto_rank in zip(load_ranks(layer), load_ranks(ahead), load_ranks(auto)):
        # The first step as "layer", the rest as "next".
        assert (
            auto_rank["most_gathered_per_step"]
            == rank["most_gathered_per_step"][:1] + next_rank["most_gathered_per_step"][1:]
        )
        assert auto_rank["losses"] == rank["losses"]
        one_layer = rank["largest_partitioned_numel"]
        assert one_layer == 384 * 384
        assert rank["most_gathered_per_step"][1:] == [one_layer, one_layer]  # the first step traces the module order
        # ZeRO-3 records the module order in the first two steps; from then on the next layer is gathered ahead.
        assert max(next_rank["most_gathered_per_step"]) == next_rank["most_gathered_per_step"][-1] == 2 * one_layer
        assert next_rank["losses"] == rank["losses"]
        assert 0 < max(rank["most_unreduced_grads_per_step"]) <= bucket < one_layer
        report = rank["memory_report"]
        trainable, frozen = report["params_on_rank"], report["frozen_params_on_rank"]
        assert report["total"] == pytest.approx(8.0) and report["frozen"] == pytest.approx(2.0)
        assert 0.45 < frozen / (trainable + frozen) < 0.55
        planned = plan(1e9, 2, 80, frozen_fraction=frozen / (trainable + frozen))
        planned_per_param = planned.per_gpu_model_state_gib["pure_bf16_stochastic"] * 1024**3 * 2 / 1e9
        assert report["whole_model"] == pytest.approx(planned_per_param, rel=0.05)
        assert report["whole_model"] == pytest.approx(5.0, rel=0.05)
    said = re.search(r"frozen: 2\.00 B/param over [\d,]+ elements; whole model: (\d\.\d\d) B/param", output(layer))
    assert said and float(said.group(1)) == pytest.approx(5.0, rel=0.05)
