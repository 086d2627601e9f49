"""DeepSpeed ZeRO-3's internals: its accelerator, the master partitions' aliasing, the patches of its step (gradient
views, the clip factor inside the update, full buckets, gradient release, a step without update), and the accessors of
its partitions, sub-groups and counters."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pure_bf16._internals._access import UpstreamChanged, _read

# ZeRO-3's per-parameter views of its flat gradient partition (a name-mangled attribute).
_GRAD_VIEWS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


# ------------------------------------------------------------------------------------------------------------ DeepSpeed
def use_cpu_deepspeed_accelerator_if_no_cuda() -> None:
    """DeepSpeed picks its accelerator once, at first use; without CUDA it must be told to use the CPU before that."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def set_deepspeed_accelerator(device_type: str) -> None:
    """Point DeepSpeed's accelerator at ``device_type`` (``"cpu"`` or ``"cuda"``), for this process and its children.

    DeepSpeed picks its accelerator from what the machine has (CUDA whenever a GPU exists); a CPU fit on a GPU host
    needs DeepSpeed's CPU accelerator, chosen before any engine exists.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() == device_type:
        return
    if device_type == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as accelerator_cls
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as accelerator_cls
    os.environ["DS_ACCELERATOR"] = device_type
    set_accelerator(accelerator_cls())


@contextmanager
def _without_gradient_buffers(stage3: Any) -> Iterator[None]:
    """ZeRO-3's ``_setup_for_real_optimizer`` without its two gradient buffers, for gradient release.

    Upstream (fingerprinted in ``COPIED_UPSTREAM``), ``initialize_optimizer_states`` allocates a zero gradient
    the size of the largest sub-group, hangs views of it on the master partitions and takes them off again (without
    offload or swapping, and for any optimizer but Adagrad, that is all it does: this package's optimizer allocates
    its states itself); then ``_setup_for_real_optimizer`` allocates the flat gradient partition (2 bytes per
    parameter of the rank), which :func:`release_gradient_partitions` frees again. Both buffers are at their full size
    while the gradient hooks gather each parameter once, the peak of construction. Here the first is skipped in that
    case, and the second is allocated on the meta device (ZeRO-3's ``self.device`` is the meta device between the two
    calls, and its own again after), so neither takes memory. Where offload, swapping or Adagrad is in use, both run
    as upstream does.
    """
    setup, initialize = stage3._setup_for_real_optimizer, stage3.initialize_optimizer_states

    @functools.wraps(initialize)
    def initialize_optimizer_states(self: Any) -> None:
        if self.offload_optimizer or self.swap_optimizer or isinstance(self.optimizer, torch.optim.Adagrad):
            initialize(self)
        else:
            self.device = torch.device("meta")  # for the flat gradient partition, allocated next

    @functools.wraps(setup)
    def setup_for_real_optimizer(self: Any) -> None:
        device = self.device
        try:
            setup(self)
        finally:
            self.device = device

    stage3._setup_for_real_optimizer = setup_for_real_optimizer
    stage3.initialize_optimizer_states = initialize_optimizer_states
    try:
        yield
    finally:
        stage3._setup_for_real_optimizer, stage3.initialize_optimizer_states = setup, initialize


@contextmanager
def alias_bf16_master_partitions(gradient_release: bool = False) -> Iterator[None]:
    """Within this context, ZeRO-3 uses the bf16 parameter partitions themselves as its bf16 master partitions.

    With ``gradient_release``, ZeRO-3's construction also leaves out the two gradient-sized buffers that release
    never uses (:func:`_without_gradient_buffers`): without it, construction holds 2 bytes per parameter of the rank
    more than the steps that follow, and sets the largest model that fits.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    original = DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions

    @functools.wraps(original)
    def create_fp32_partitions(self: DeepSpeedZeroOptimizer_Stage3) -> None:
        device = self.device
        if isinstance(device, str) and not self.offload_optimizer:
            self.device = torch.device(device)
        try:
            original(self)
        finally:
            self.device = device

    DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = create_fp32_partitions
    try:
        if gradient_release:
            with _without_gradient_buffers(DeepSpeedZeroOptimizer_Stage3):
                yield
        else:
            yield
    finally:
        DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = original


def zero3_param_partitions(zero_optimizer: Any) -> list[torch.Tensor]:
    """This rank's flat bf16 parameter partitions, one per ZeRO-3 sub-group."""
    flats = _read(zero_optimizer, "fp16_partitioned_groups_flat", "the bf16 parameter partitions")
    return [t for t in flats if t is not None]


def zero3_master_partitions(zero_optimizer: Any) -> list[torch.Tensor]:
    """This rank's flat master partitions, one per sub-group (the parameter partitions themselves when aliased)."""
    return list(_read(zero_optimizer, "fp32_partitioned_groups_flat", "the master partitions"))


def zero3_grad_partition_buffer(zero_optimizer: Any) -> torch.Tensor | None:
    """ZeRO-3's persistent flat gradient partition buffer (``None`` only while DeepSpeed has released it)."""
    return _read(zero_optimizer, "grad_partitions_flat_buffer", "the gradient partition")


def zero3_sub_groups(zero_optimizer: Any) -> Iterator[tuple[torch.Tensor, int]]:
    """``(flat master partition, param group index)`` for every ZeRO-3 sub-group, in step order."""
    group_ids = _read(zero_optimizer, "sub_group_to_group_id", "the param group of each sub-group")
    for sub_group, flat in enumerate(zero3_master_partitions(zero_optimizer)):
        yield flat, group_ids[sub_group]


def zero3_inner_optimizer(zero_optimizer: Any) -> Any:
    """The optimizer ZeRO-3 wraps (this package's AdamW under the strategy)."""
    return _read(zero_optimizer, "optimizer", "the wrapped optimizer")


@dataclass
class Zero3SubGroup:
    """One ZeRO-3 sub-group on this rank: its flat bf16 partition, its param group, and what the partition holds.

    ``params`` lists ``(name, numel, partition_numel)`` in partition order: this rank holds elements
    ``[rank * partition_numel, (rank + 1) * partition_numel)`` of each parameter (zero-padded past ``numel``).
    """

    flat: torch.Tensor
    group: int
    params: list[tuple[str, int, int]]


def zero3_layout(zero_optimizer: Any) -> list[Zero3SubGroup]:
    """Every sub-group of this rank, in step order (the order of the optimizer state's indices)."""
    names = _read(zero_optimizer, "param_names", "each parameter's name")
    groups = _read(zero_optimizer, "fp16_groups", "the parameters of each sub-group")
    flats = zero3_param_partitions(zero_optimizer)
    return [
        Zero3SubGroup(flat, group, [(names[p], int(p.ds_numel), int(p.partition_numel())) for p in params])
        for (flat, group), params in zip(zip(flats, (g for _, g in zero3_sub_groups(zero_optimizer))), groups)
    ]


def zero3_param_shapes(zero_optimizer: Any) -> list[list[tuple[int, ...]]]:
    """The whole shape of every parameter of every sub-group, in the order of :func:`zero3_layout`."""
    groups = _read(zero_optimizer, "fp16_groups", "the parameters of each sub-group")
    return [[tuple(p.ds_shape) for p in params] for params in groups]


def zero3_data_parallel_group(zero_optimizer: Any) -> Any:
    """The process group ZeRO-3 partitions over (rank ``r`` of it holds run ``r`` of every parameter)."""
    return _read(zero_optimizer, "dp_process_group", "the process group the partitions are spread over")


@contextmanager
def zero3_partitioned_for_load(zero_optimizer: Any) -> Iterator[None]:
    """Every parameter partitioned while its partition is written; persistent parameters re-gathered after."""
    _read(zero_optimizer, "checkpoint_event_prologue", "partition every parameter before a load")()
    yield
    _read(zero_optimizer, "checkpoint_event_epilogue", "re-gather persistent parameters after a load")()


def zero3_step_skipped(zero_optimizer: Any) -> bool:
    """Whether ZeRO-3's last step skipped its update (an inf/NaN gradient), the flag its engine reads after the step."""
    return bool(_read(zero_optimizer, "overflow", "the skipped-step flag the engine reads"))


def zero3_set_clip(zero_optimizer: Any, max_norm: float) -> None:
    """The gradient norm ZeRO-3 clips to in its next step (``0``: no clipping)."""
    _read(zero_optimizer, "clip_grad", "the norm ZeRO-3 clips to")
    zero_optimizer.clip_grad = max_norm


def zero3_param_positions(zero_optimizer: Any) -> dict[int, tuple[int, int, int]]:
    """``ds_id -> (sub-group, offset in its flat partition, partition numel)`` for every parameter of this rank.

    Raises:
        UpstreamChanged: a parameter's partition is not where the layout says in the master partition (the master
            aliasing is off, or DeepSpeed lays partitions out differently).
    """
    groups = _read(zero_optimizer, "fp16_groups", "the parameters of each sub-group")
    masters = zero3_master_partitions(zero_optimizer)
    positions = {}
    for sub_group, (params, flat) in enumerate(zip(groups, masters)):
        offset = 0
        for p in params:
            numel = int(p.partition_numel())
            if p.ds_tensor.data_ptr() != flat.data_ptr() + offset * flat.element_size():
                raise UpstreamChanged(
                    f"ZeRO-3's partition of parameter {p.ds_id} is not at element {offset} of sub-group {sub_group}'s"
                    " master partition: gradient release needs the parameter partitions to be the master partitions."
                    " The installed DeepSpeed is not a version lightning_pure_bf16 supports."
                )
            positions[p.ds_id] = (sub_group, offset, numel)
            offset += numel
    return positions


def set_engine_counters(engine: Any, *, global_steps: int, global_samples: int, skipped_steps: int) -> None:
    """What DeepSpeed's own load restores on the engine, for a load this package does itself."""
    for name, value in (
        ("global_steps", global_steps),
        ("global_samples", global_samples),
        ("skipped_steps", skipped_steps),
    ):
        _read(engine, name, "restored by a repartitioning load")
        setattr(engine, name, value)


__all__ = [
    "Zero3SubGroup",
    "alias_bf16_master_partitions",
    "set_deepspeed_accelerator",
    "set_engine_counters",
    "use_cpu_deepspeed_accelerator_if_no_cuda",
    "zero3_data_parallel_group",
    "zero3_grad_partition_buffer",
    "zero3_inner_optimizer",
    "zero3_layout",
    "zero3_master_partitions",
    "zero3_param_partitions",
    "zero3_param_positions",
    "zero3_param_shapes",
    "zero3_partitioned_for_load",
    "zero3_set_clip",
    "zero3_step_skipped",
    "zero3_sub_groups",
]
