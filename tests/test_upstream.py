"""Every private DeepSpeed, Lightning and torch name this package relies on, checked against the installed versions.

An upgrade that renames or removes one of them fails here, naming it, instead of silently turning a feature off
(a memory report of 0 bytes, a skipped step never logged, a warning filter that no longer matches).
"""

import inspect

import pytest


def _source(obj) -> str:
    return inspect.getsource(obj)


def _assert_assigned(cls, attribute: str, why: str) -> None:
    assert f"self.{attribute} =" in _source(cls), f"{cls.__qualname__} no longer sets `{attribute}`: {why}"


def _assert_parameters(function, names: list[str], why: str) -> None:
    params = list(inspect.signature(function).parameters)
    assert params[: len(names)] == names, f"{function.__qualname__}{inspect.signature(function)} changed: {why}"


# ------------------------------------------------------------------------------------------------------ DeepSpeed
def test_zero3_optimizer_internals():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    _assert_parameters(
        Stage3._create_fp32_partitions, ["self"], "_deepspeed_fixes.py wraps it to alias the master partition"
    )
    for attribute, why in [
        ("fp16_partitioned_groups_flat", "memory.py counts the bf16 parameter partitions"),
        ("fp32_partitioned_groups_flat", "the master partitions the optimizer updates (memory.py, strategy.py)"),
        ("sub_group_to_group_id", "strategy.py maps each flat partition to its param group"),
        ("grad_partitions_flat_buffer", "memory.py counts the gradient partition"),
        ("optimizer", "the wrapped optimizer: the strategy reaches the pure-bf16 AdamW through it"),
    ]:
        _assert_assigned(Stage3, attribute, why)


def test_engine_counts_skipped_steps():
    from deepspeed.runtime.engine import DeepSpeedEngine

    _assert_assigned(DeepSpeedEngine, "skipped_steps", "strategy.py logs the steps ZeRO-3 skipped on inf/NaN")


def test_deepspeed_accelerator_can_be_set():
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    assert callable(set_accelerator) and callable(get_accelerator)
    assert CPU_Accelerator().device_name() == "cpu" and CUDA_Accelerator().device_name() == "cuda"


# ------------------------------------------------------------------------------------------------------ Lightning
@pytest.mark.parametrize(
    ("method", "names", "why"),
    [
        ("_load_config", ["self", "config"], "the strategy merges the user's DeepSpeed config"),
        ("_init_deepspeed_distributed", ["self"], "the CPU (gloo) process group setup"),
        ("_init_optimizers", ["self"], "the strategy adopts torch's AdamW/Adam there"),
        ("_initialize_deepspeed_train", ["self", "model"], "optimizer states are allocated after it"),
        ("_setup_model_and_optimizer", ["self", "model", "optimizer"], "the strategy initializes DeepSpeed itself"),
    ],
)
def test_lightning_deepspeed_strategy_methods(method, names, why):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert hasattr(DeepSpeedStrategy, method), f"DeepSpeedStrategy.{method} is gone: {why}"
    _assert_parameters(getattr(DeepSpeedStrategy, method), names, why)


def test_lightning_pytree_origin_of_the_filtered_warning():
    import lightning.pytorch.utilities._pytree as pytree

    assert "LeafSpec()" in _source(pytree), "Lightning's _pytree no longer builds LeafSpec: drop its warning filter"


# ------------------------------------------------------------------------------------------------------ torch
def test_torch_deprecations_the_filters_match():
    import torch.distributed.c10d_logger  # the module the warnings are attributed to
    import torch.distributed.distributed_c10d as c10d

    from lightning_pure_bf16._warnings import KNOWN_WARNINGS

    source = _source(c10d)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert f"`torch.distributed.{name}` is deprecated" in source, f"torch changed the {name} deprecation"
    assert torch.distributed.c10d_logger.__name__ == "torch.distributed.c10d_logger"
    assert any("c10d_logger" in module for _, _, module in KNOWN_WARNINGS)


def test_lr_scheduler_step_markers():
    import torch.optim.lr_scheduler as lr_scheduler

    source = _source(lr_scheduler)
    for marker in ("_wrapped_by_lr_sched", "_opt_called"):
        assert marker in source, f"torch's LRScheduler no longer uses `{marker}`: strategy._rebind_scheduler sets it"


def test_cpp_extension_build_directory():
    from torch.utils.cpp_extension import _get_build_directory

    _assert_parameters(_get_build_directory, ["name", "verbose"], "build.py reports where the CPU loop is cached")


def test_optimizer_state_hooks_and_pickling():
    from torch.optim import Optimizer

    _assert_parameters(Optimizer.register_load_state_dict_pre_hook, ["self", "hook", "prepend"], "load_state_dict")
    _assert_parameters(Optimizer.register_load_state_dict_post_hook, ["self", "hook", "prepend"], "load_state_dict")
    # torch's load_state_dict sets state and groups through __setstate__; AdamW.__setstate__ tells it from a copy.
    assert "self.__setstate__(" in _source(Optimizer.load_state_dict)
