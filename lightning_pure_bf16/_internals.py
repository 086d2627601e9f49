"""The private surface: every access this package makes to DeepSpeed, Lightning and torch internals, in one module.

Nothing else in the package reads a private attribute of another library or patches one of its methods. Every name is
read directly, without a default that would hide a rename (a renamed attribute raises :class:`UpstreamChanged`
naming it, instead of reporting 0 bytes or never logging a skipped step). ``tests/upstream_names.py`` lists each name
(``PRIVATE_NAMES``: what it is expected to be and why the package needs it) and the upstream code the package copies
or replaces (``COPIED_UPSTREAM``: a fingerprint of each tested version's source); ``tests/test_upstream.py`` checks
both against the installed versions, so an upgrade that changes one fails there, naming it.

DeepSpeed bug worked around here (0.18.3 - 0.19.8 at least): ZeRO-3 master aliasing
    ``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions`` reuses the parameter partition as the master partition
    only when ``partition.device == self.device``. ``self.device`` is a string (``'cpu'``, ``'cuda:0'``) and a
    ``torch.device`` never equals a string, so with ``bf16_master_weights_and_grads`` it always allocates a second
    bf16 copy of every partition (10 instead of 8 bytes/param). :func:`alias_bf16_master_partitions` presents
    ``self.device`` as a ``torch.device`` while the partitions are created. Once aliased, DeepSpeed's copy back into
    the parameter partition after each step is a copy of a tensor onto itself, which torch skips.
    ``tests/test_upstream.py::test_master_aliasing_bug_and_fix`` shows the bug and the fix.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from weakref import ref

import torch


class UpstreamChanged(AttributeError):
    """A private name of DeepSpeed, Lightning or torch the package relies on is missing from the installed version."""


# ZeRO-3's per-parameter views of its flat gradient partition (a name-mangled attribute).
_GRAD_VIEWS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


# ----------------------------------------------------------------------------------------------------------- resolution
def resolve(owner: str) -> Any:
    """The object named ``"module:Qualname"`` (or ``"module"``); a nested function is not resolvable this way."""
    module_name, _, qualname = owner.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _read(obj: Any, name: str, why: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise UpstreamChanged(
            f"`{type(obj).__module__}.{type(obj).__qualname__}` has no attribute `{name}` ({why}). The installed"
            " DeepSpeed/Lightning is not a version lightning_pure_bf16 supports: see the bounds in its pyproject.toml."
        ) from None


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


def _gradient_view(grads: list[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor | None:
    """One view of ``buffer`` covering ``grads`` when they are consecutive views of it, in order; else ``None``."""
    if not grads:
        return None
    storage = buffer.untyped_storage().data_ptr()
    expected = grads[0].storage_offset()
    for g in grads:
        if g.untyped_storage().data_ptr() != storage or g.storage_offset() != expected or not g.is_contiguous():
            return None
        expected += g.numel()
    return buffer.narrow(0, grads[0].storage_offset() - buffer.storage_offset(), expected - grads[0].storage_offset())


def view_sub_group_gradients(zero_optimizer: Any) -> None:
    """Give each sub-group its gradient as a view of ZeRO-3's gradient partition instead of a flattened copy.

    ``_prepare_fp32_grad_for_sub_group`` flattens the sub-group's gradient partitions into a new tensor and casts it
    to the master's dtype. Here the master is the bf16 parameter partition and the gradients are already consecutive
    bf16 views of ``grad_partitions_flat_buffer``, so the copy (2 bytes per parameter of the sub-group, at the peak
    of the step) holds the same values as a view. The view is used where that holds (same dtype, consecutive views,
    every parameter trainable); anything else takes DeepSpeed's own path. Clipping then scales the gradient partition
    in place, which the next backward overwrites (its first micro-step copies into the buffer). Replaced on this
    optimizer instance only.
    """
    original = _read(zero_optimizer, "_prepare_fp32_grad_for_sub_group", "the sub-group gradient preparation")
    buffer = _read(zero_optimizer, "grad_partitions_flat_buffer", "the gradient partition")
    masters = _read(zero_optimizer, "fp32_partitioned_groups_flat", "the master partitions")
    _read(zero_optimizer, "averaged_gradients", "each sub-group's gradient partitions")

    def prepare(sub_group_id: int) -> None:
        grads = zero_optimizer.averaged_gradients[sub_group_id]
        master = masters[sub_group_id]
        view = _gradient_view(grads, buffer) if buffer is not None and grads is not None else None
        if view is None or view.dtype != master.dtype or view.numel() != master.numel():
            original(sub_group_id)
            return
        master.grad = view
        zero_optimizer.averaged_gradients[sub_group_id] = None

    zero_optimizer._prepare_fp32_grad_for_sub_group = prepare


def fold_gradient_scale(zero_optimizer: Any, set_scale: Callable[[float], None]) -> None:
    """Fold ZeRO-3's scaling of the gradient partition into the update that follows it.

    Before each sub-group's update ZeRO-3 multiplies its gradient partition in place by ``1 / (loss scale x clip
    factor)`` (``unscale_and_clip_grads``): a pass over the gradient of its own, 4 bytes per element read and written
    beside the update's 14, made even where the factor is 1 (under bf16 the loss scale is 1, and the clip factor is 1
    without clipping or while the norm is within the clipping norm). Here the factor is computed as ZeRO-3 computes it
    and handed to ``set_scale`` (as a float: the step has already read the norm on the host for its inf/NaN
    decision), and the gradient is left as it is: the update multiplies each element by it in float32, in its own
    pass (:attr:`lightning_pure_bf16.AdamW.grad_scale`), instead of ZeRO-3 rounding the product to bf16 first.
    Wrapped on this optimizer instance only.
    """
    _read(zero_optimizer, "unscale_and_clip_grads", "the gradient scaling before the update")
    _read(zero_optimizer, "clip_grad", "the norm ZeRO-3 clips to")

    def unscale_and_clip(sub_group_id: int, total_norm: Any) -> None:
        combined_scale = zero_optimizer.loss_scale
        if zero_optimizer.clip_grad > 0.0:
            clip = torch.clamp(((total_norm / combined_scale) + 1e-6) / zero_optimizer.clip_grad, min=1.0)
            combined_scale = clip * combined_scale
        set_scale(float(1.0 / combined_scale))

    zero_optimizer.unscale_and_clip_grads = unscale_and_clip


def reduce_full_buckets_at_once(zero_optimizer: Any) -> None:
    """Reduce-scatter a gradient bucket as soon as it is full, not when the next gradient arrives.

    ZeRO-3 adds each parameter's gradient to a bucket and reduce-scatters the bucket only when the next gradient
    does not fit. A layer larger than the bucket (every large linear layer) is a bucket alone, so its full-size
    gradient waits, unreduced, until the next layer's backward has gathered that layer and computed its gradient:
    two layer-sized gradients and a gathered layer at the peak of the backward, where one gradient suffices (FSDP2
    reduce-scatters each layer's gradient after its backward). Here the bucket is reduce-scattered right after the
    gradient that fills it; the same gradients are reduced, each bucket at most ``reduce_bucket_size`` elements, and
    the last partial bucket still waits for ZeRO-3's end of the backward. Wrapped on this optimizer instance only.
    """
    original = _read(zero_optimizer, "reduce_independent_p_g_buckets_and_remove_grads", "the gradient hook")
    reduce = _read(
        zero_optimizer, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", "the bucket reduce-scatter"
    )
    buckets = _read(zero_optimizer, "ipg_buckets", "the gradient buckets")
    size = _read(zero_optimizer, "reduce_bucket_size", "the bucket size")
    comm_dtype = _read(zero_optimizer, "get_param_comm_dtype", "the bucket of a parameter")

    def add_then_reduce_if_full(param: Any) -> None:
        original(param)
        dtype = comm_dtype(param)
        if buckets[dtype].elements >= size:
            reduce(dtype)

    zero_optimizer.reduce_independent_p_g_buckets_and_remove_grads = add_then_reduce_if_full


class Zero3Coordinator:
    """ZeRO-3's parameter coordinator of one engine, as the gather policy (:mod:`lightning_pure_bf16.gather`) reads
    it: the recorded module order and where the step is in it, its all-gather, and its fetch of a module, which
    :meth:`wrap_fetch` replaces on this coordinator only."""

    def __init__(self, zero_optimizer: Any) -> None:
        offload = _read(zero_optimizer, "parameter_offload", "the owner of ZeRO-3's parameter coordinator")
        self._coordinator = offload.get_param_coordinator()
        self.fetch = _read(self._coordinator, "fetch_sub_module", "ZeRO-3's fetch of a module's parameters")
        self.is_complete_trace = _read(self._coordinator, "is_complete_trace", "whether the module order is recorded")
        self.all_gather = _read(
            self._coordinator, "_PartitionedParameterCoordinator__all_gather_params", "ZeRO-3's all-gather"
        )
        for name in ("__submodule_order", "__step_id"):
            _read(self._coordinator, "_PartitionedParameterCoordinator" + name, "the recorded module order")

    def modules_ahead(self) -> list[torch.nn.Module]:
        """The modules of the recorded order from the one the step is at."""
        coordinator = self._coordinator
        return coordinator._PartitionedParameterCoordinator__submodule_order[
            coordinator._PartitionedParameterCoordinator__step_id :
        ]

    def wrap_fetch(self, fetch: Callable[[Any, bool], None]) -> None:
        self._coordinator.fetch_sub_module = fetch


def wrap_deepspeed_collectives(wrap_all_gather: Callable[..., Any], wrap_reduce_scatter: Callable[..., Any]) -> None:
    """Replace the all-gather and reduce-scatter of DeepSpeed's communication backend in this process (what ZeRO-3
    gathers parameters and reduce-scatters gradients with) by ``wrap_X(original)``, once: a function already
    wrapped (marked ``_pure_bf16_wrapped``) is left as it is."""
    from deepspeed.comm import comm

    backend = comm.cdb
    if backend is None:
        return
    gather = _read(backend, "all_gather_function", "the all-gather of ZeRO-3's parameters")
    scatter = _read(backend, "reduce_scatter_function", "the reduce-scatter of ZeRO-3's gradients")
    if gather is not None and not getattr(gather, "_pure_bf16_wrapped", False):
        backend.all_gather_function = wrap_all_gather(gather)
        backend.all_gather_function._pure_bf16_wrapped = True
    if scatter is not None and not getattr(scatter, "_pure_bf16_wrapped", False):
        backend.reduce_scatter_function = wrap_reduce_scatter(scatter)
        backend.reduce_scatter_function._pure_bf16_wrapped = True


def wrap_zero3_grad_norm(zero_optimizer: Any, wrap: Callable[..., Any]) -> None:
    """Replace ZeRO-3's gradient norm (``get_grad_norm_direct(gradients, params, norm_type)``) on this optimizer
    instance by ``wrap(original)``."""
    original = _read(zero_optimizer, "get_grad_norm_direct", "the gradient norm")
    zero_optimizer.get_grad_norm_direct = wrap(original)


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


def release_gradient_partitions(
    zero_optimizer: Any, apply: Callable[[list[Any], list[torch.Tensor], list[bool]], None]
) -> Callable[[], torch.Tensor | None]:
    """Hand each reduce-scattered bucket to ``apply(params, grad_partitions, has_data)`` instead of copying it into
    ZeRO-3's flat gradient partition, and free that partition (gradient release).

    ``partition_grads`` is called by ``__reduce_and_partition_ipg_grads`` inside the stream DeepSpeed reduces on, so
    ``apply`` runs ordered after the reduce-scatter. ``has_data``: whether this rank's partition of the parameter
    holds any of its elements (DeepSpeed's own test). The flat buffer becomes empty, and the per-parameter views of it
    (read by the end-of-backward epilogue) point at that empty tensor. Replaced on this optimizer instance only.
    Returns a weak reference to the freed buffer: dead once nothing else holds it.

    Raises:
        RuntimeError: a second backward before the step (``micro_step_id`` past 0): its gradients would be a second
            update of the same step.
    """
    from deepspeed.accelerator import get_accelerator

    _read(zero_optimizer, "partition_grads", "replaced: each gradient partition is applied, not kept")
    partition_rank = _read(zero_optimizer, "_get_param_partition_rank", "whether a partition holds elements")
    _read(zero_optimizer, "micro_step_id", "a second backward before the step")
    buffer = _read(zero_optimizer, "grad_partitions_flat_buffer", "the gradient partition")
    views = _read(zero_optimizer, _GRAD_VIEWS, "the per-parameter views of the gradient partition")
    synchronized = get_accelerator().is_synchronized_device()

    def partition_grads(params: list[Any], grad_partitions: list[torch.Tensor]) -> list[torch.Tensor]:
        if zero_optimizer.micro_step_id != 0:
            raise RuntimeError(
                "gradient_release=True: a second backward ran before the optimizer step. With gradient release each"
                " backward's gradients are applied as they arrive, so micro-batches cannot accumulate: step after"
                " every backward, or leave gradient release off."
            )
        has_data = [p.partition_numel() * partition_rank(p) < p.ds_numel for p in params]
        apply(params, grad_partitions, has_data)
        for p in params:
            if not synchronized and p.grad is not None:
                p.grad.record_stream(get_accelerator().current_stream())
            p.grad = None
        return []

    zero_optimizer.partition_grads = partition_grads
    # A real device's empty tensor, also where construction left the buffer on the meta device.
    empty = torch.empty(0, dtype=buffer.dtype if buffer is not None else torch.bfloat16, device=zero_optimizer.device)
    freed = ref(buffer) if buffer is not None else (lambda: None)
    zero_optimizer.grad_partitions_flat_buffer = empty
    for key in views:
        views[key] = empty
    del buffer
    return freed


def step_without_update(zero_optimizer: Any, finish: Callable[[], float]) -> None:
    """Make ZeRO-3's ``step`` bookkeeping only, for gradient release: the partitions are already updated, so the step
    partitions the parameters, calls ``finish()`` (the held pieces, the step counters; it returns the gradient norm),
    reports no overflow, clears the gradients and re-gathers persistent parameters (DeepSpeed's ``_pre_step``,
    ``_partition_all_parameters``, ``zero_grad`` and ``_post_step``, as its own step calls them). Replaced on this
    optimizer instance only; the steps of ``step`` this keeps are fingerprinted in the tests'
    ``COPIED_UPSTREAM``."""
    pre = _read(zero_optimizer, "_pre_step", "the step's bookkeeping")
    partition_all = _read(zero_optimizer, "_partition_all_parameters", "parameters partitioned before the step")
    zero_grad = _read(zero_optimizer, "zero_grad", "gradients cleared at the step")
    post = _read(zero_optimizer, "_post_step", "persistent parameters re-gathered after the step")
    _read(zero_optimizer, "overflow", "the skipped-step flag the engine reads")
    _read(zero_optimizer, "_global_grad_norm", "the gradient norm the engine reports")

    def step(closure: Any = None) -> None:
        pre()
        partition_all()
        norm = finish()
        zero_optimizer.overflow = False
        zero_optimizer._global_grad_norm = norm
        zero_grad(set_to_none=True)
        zero_optimizer.averaged_gradients = {}
        post(set())

    zero_optimizer.step = step


def set_engine_counters(engine: Any, *, global_steps: int, global_samples: int, skipped_steps: int) -> None:
    """What DeepSpeed's own load restores on the engine, for a load this package does itself."""
    for name, value in (
        ("global_steps", global_steps),
        ("global_samples", global_samples),
        ("skipped_steps", skipped_steps),
    ):
        _read(engine, name, "restored by a repartitioning load")
        setattr(engine, name, value)


# ------------------------------------------------------------- DeepSpeed as Accelerate and the checkpoint engine use it
_REPLACED_INITIALIZE: list[Any] = []


def deepspeed_initialize() -> Any:
    """DeepSpeed's own ``deepspeed.initialize``, also while :func:`deepspeed_initialize_replaced` runs."""
    import deepspeed

    return _REPLACED_INITIALIZE[0] if _REPLACED_INITIALIZE else deepspeed.initialize


@contextmanager
def deepspeed_checkpoint_reads(engine: Any, read: Callable[[str], Any]) -> Iterator[None]:
    """The engine's checkpoint files are read with ``read(path)`` while the block runs, in place of its checkpoint
    engine's ``torch.load`` (which reads a rank's whole optimizer file into memory: weights and moments, 6 bytes per
    parameter of its partition on the host, where a memory-mapped read holds page cache only)."""
    checkpoint_engine = _read(engine, "checkpoint_engine", "DeepSpeed's checkpoint reader")
    load = _read(checkpoint_engine, "load", "DeepSpeed's checkpoint reader")
    checkpoint_engine.load = lambda path, map_location=None: read(path)  # every caller maps to the CPU
    try:
        yield
    finally:
        checkpoint_engine.load = load


@contextmanager
def deepspeed_initialize_replaced(initialize: Any) -> Iterator[None]:
    """``deepspeed.initialize`` is ``initialize`` while the block runs (Accelerate reads it when it prepares)."""
    import deepspeed

    if _REPLACED_INITIALIZE:  # already routed (a nested prepare): nothing more to replace
        yield
        return
    _REPLACED_INITIALIZE.append(deepspeed.initialize)
    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = _REPLACED_INITIALIZE.pop()


def route_accelerate_deepspeed(accelerator: Any, initialize: Any) -> None:
    """This ``Accelerator`` prepares DeepSpeed models with ``initialize`` instead of ``deepspeed.initialize``."""
    prepare = _read(accelerator, "_prepare_deepspeed", "Accelerate's DeepSpeed preparation")

    def prepare_deepspeed(*args: Any) -> Any:
        with deepspeed_initialize_replaced(initialize):
            return prepare(*args)

    accelerator._prepare_deepspeed = prepare_deepspeed


# ------------------------------------------------------------------------------------------- transformers and zero.Init
def transformers_saved_names(model: torch.nn.Module, shapes: dict[str, torch.Size]) -> list[str] | None:
    """The names ``save_pretrained`` would write for a model whose state has these names and shapes: tied weights
    once, under the name the model expects on load. None where it would also rename or reshape tensors (a model with
    weight conversions), which needs whole tensors."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    kept = remove_tied_weights_from_state_dict(meta, model)
    try:
        reverted = revert_weight_conversion(model, dict(kept))
    except Exception:  # a conversion that needs values cannot run on meta tensors: whole tensors it is
        return None
    if list(reverted) != list(kept) or any(reverted[k].shape != kept[k].shape for k in kept):
        return None
    return list(kept)


def transformers_save_beside_weights(trainer: Any, output_dir: str) -> None:
    """The Trainer's own ``_save`` without weights: ``config.json``, the generation config, the tokenizer or
    processor, ``training_args.bin`` (and an empty weights file, which the weights written next replace)."""
    trainer._save(output_dir, state_dict={})


def _module_subclasses() -> list[type]:
    found, todo = [], [torch.nn.Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _init_calling(init: Callable[..., Any], original: Callable[..., Any]) -> Any:
    """``init``, a function whose closure holds DeepSpeed's wrapper of ``original``, as a new function whose closure
    holds ``original`` instead; None where its closure holds no such wrapper."""
    import types

    cells = init.__closure__ or ()
    wrapped = [getattr(_cell_value(cell), "__wrapped__", None) is original for cell in cells]
    if not any(wrapped):
        return None
    closure = tuple(types.CellType(original) if w else cell for cell, w in zip(cells, wrapped))
    fixed = types.FunctionType(init.__code__, init.__globals__, init.__name__, init.__defaults__, closure)
    fixed.__kwdefaults__, fixed.__qualname__ = init.__kwdefaults__, init.__qualname__
    fixed.__dict__.update(init.__dict__)
    return fixed


@contextmanager
def zero_init_keeping_later_inits(zero_init: Any) -> Iterator[None]:
    """``zero_init`` (a ``deepspeed.zero.Init``) entered, with a DeepSpeed bug worked around at its exit.

    DeepSpeed bug worked around here (0.19.8): ``zero.Init`` wraps the ``__init__`` of every ``nn.Module`` class
    defined while it is open, and on leaving sets ``cls.__init__`` back to the function it wrapped, even where
    something replaced ``cls.__init__`` after it wrapped it. A library that decorates its classes at import does that:
    transformers' model files, through the ``kernels`` package's ``use_kernelized_func``, replace ``__init__`` with one
    that also creates the module's ``_kernel_funcs``. A model family first imported inside the partitioned init
    (``from_pretrained`` resolving its class, ``AutoModelForCausalLM`` inside ``configure_model``) therefore loses
    that replacement when it closes, and every model of the family built afterwards in the process fails in its first
    forward (``AttributeError: 'LlamaAttention' object has no attribute '_kernel_funcs'``). Here, for each class
    defined inside, a replacement of DeepSpeed's wrapper is kept, calling the wrapped function instead of the wrapper
    (the class is then as if defined outside). The bug and the fix: ``tests/test_hf_models.py::``
    ``test_a_class_defined_inside_zero_init_keeps_a_later_init_bug_and_fix``.
    """
    from deepspeed.runtime.zero import partition_parameters

    before = set(_module_subclasses())
    repaired: dict[type, Any] = {}
    with zero_init:
        try:
            yield
        finally:
            depth = _read(partition_parameters, "zero_init_context", "the depth of open zero.Init contexts")
            for cls in _module_subclasses() if depth == 1 else ():  # only the outermost exit restores the classes
                init, original = cls.__dict__.get("__init__"), getattr(cls, "_old_init", None)
                if cls in before or init is None or original is None:
                    continue
                if getattr(init, "__wrapped__", None) is original:  # DeepSpeed's own wrapper: restored correctly
                    continue
                fixed = _init_calling(init, original)
                if fixed is not None:
                    repaired[cls] = fixed
    for cls, init in repaired.items():
        cls.__init__ = init


def zero3_init_active() -> bool:
    """Whether a ``deepspeed.zero.Init`` context is open in this process (modules built now are partitioned)."""
    from deepspeed.runtime.zero import partition_parameters

    return _read(partition_parameters, "zero_init_context", "the depth of open zero.Init contexts") > 0


def transformers_is_auto_class(cls: type) -> bool:
    """Whether ``cls`` is one of transformers' Auto classes (``AutoModelForCausalLM``), which map a config's type to
    the family's class."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return isinstance(cls, type) and issubclass(cls, _BaseAutoModelClass)


def transformers_auto_model_class(auto_cls: type, config: Any) -> type:
    """The class an Auto class builds for ``config`` (``LlamaForCausalLM`` for a Llama config); KeyError if none."""
    return _read(auto_cls, "_model_mapping", "an Auto class's map from config type to model class")[type(config)]


def transformers_set_attn_implementation(config: Any, value: str) -> None:
    """The attention implementation a model built from ``config`` uses, as ``from_pretrained(attn_implementation=)``
    sets it."""
    _read(config, "_attn_implementation", "the attention implementation of a transformers config")
    config._attn_implementation = value


@contextmanager
def transformers_zero3_config(config: dict[str, Any]) -> Iterator[None]:
    """transformers' ``is_deepspeed_zero3_enabled()`` is true while this is open (its ``from_pretrained``,
    ``from_config`` and ``resize_token_embeddings`` then take their ZeRO-3 paths), as ``TrainingArguments`` makes it
    for the Hugging Face Trainer; whatever config was registered before is registered again on exit."""
    from transformers.integrations import deepspeed as hf_deepspeed

    before = _read(hf_deepspeed, "_hf_deepspeed_config_weak_ref", "transformers' registered DeepSpeed config")
    handle = hf_deepspeed.HfDeepSpeedConfig(config)
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = before
        del handle


def initialize_partitioned_weights(model: torch.nn.Module) -> None:
    """transformers' weight initialisation of ``model`` (a ``PreTrainedModel``) run on ZeRO-3's partitions: each
    module's parameters gathered, initialised on the first rank and scattered back, as transformers' own
    ``initialize_weights_zero3`` does; modules already initialised (the flag transformers sets) and modules whose
    parameters were all loaded are skipped before anything is gathered."""
    import deepspeed
    import torch.distributed as dist
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    custom = model.is_custom_code()
    first = not dist.is_initialized() or dist.get_rank() == 0

    def visit(module: torch.nn.Module, init: Callable[..., None]) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        if getattr(module, "_is_hf_initialized", False):
            return
        # transformers' _init_weights of a module may also write its direct children's parameters.
        params = [*module.parameters(recurse=False)]
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params.extend(child.parameters(recurse=False))
        if params and all(getattr(p, "_is_hf_initialized", False) for p in params):
            module._is_hf_initialized = True
            return
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if first:
                init(module, custom)
        # A module's own parameters are partitioned only when its __init__ returns, after its post_init: the first
        # rank's values for every rank, as the gathered ones get on leaving GatheredParameters.
        if dist.is_initialized():
            for param in params:
                if not hasattr(param, "ds_id"):
                    dist.broadcast(param.data, src=dist.get_global_rank(dist.group.WORLD, 0))
        module._is_hf_initialized = True  # on every rank, so that a second pass gathers nothing here

    with torch.no_grad(), guard_torch_init_functions():
        visit(model, model._initialize_weights)


@contextmanager
def transformers_partitioned_init() -> Iterator[None]:
    """Hugging Face models built while ZeRO-3's partitioned init is open are initialised and tied as transformers
    builds them itself under ZeRO-3. Enter it before ``deepspeed.zero.Init``.

    transformers bug worked around here (5.x): a ``PreTrainedModel`` constructed directly (``LlamaForCausalLM(config)``)
    inside ``deepspeed.zero.Init`` runs ``init_weights`` in its ``post_init`` on parameters ZeRO-3 has already
    partitioned into empty tensors: every initialisation is silently a no-op, and a config with a ``pad_token_id``
    crashes on the embedding's padding row (``IndexError: index 2 is out of bounds for dimension 0 with size 0``).
    transformers' own ``from_config`` and ``from_pretrained`` avoid it by skipping the init and running
    ``initialize_weights_zero3`` afterwards. While this is open, ``PreTrainedModel.init_weights`` of a model with
    partitioned parameters runs :func:`initialize_partitioned_weights` and ties the weights, which is what the original
    does on whole tensors. transformers' ``prevent_arange_dtype_change`` keeps the RoPE buffers' explicit dtypes
    (zero.Init otherwise casts every new floating tensor to its dtype).
    ``tests/test_hf_models.py::test_transformers_init_under_zero_init_bug_and_fix`` shows the bug and the fix.
    """
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
    from transformers.modeling_utils import PreTrainedModel

    original = _read(PreTrainedModel, "init_weights", "transformers' initialisation and tying after construction")

    def init_weights(self: Any) -> None:
        if not any(hasattr(p, "ds_id") for p in self.parameters()):
            return original(self)
        initialize_partitioned_weights(self)
        self.tie_weights(recompute_mapping=False)

    PreTrainedModel.init_weights = init_weights
    try:
        with prevent_arange_dtype_change():
            yield
    finally:
        PreTrainedModel.init_weights = original


# ------------------------------------------------------------------------------------------------------------ Lightning
def lightning_remove_module_hooks(model: torch.nn.Module) -> None:
    """Lightning's own clean-up of DeepSpeed's module hooks before an inference engine is built."""
    from lightning.pytorch.strategies.deepspeed import remove_module_hooks

    remove_module_hooks(model)


def lightning_update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """``dataloader`` re-instantiated with ``sampler``, as Lightning does when it injects its distributed sampler."""
    from lightning.fabric.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)


def wrapped_sampler(sampler: Any) -> Any | None:
    """The sampler a Lightning ``DistributedSamplerWrapper`` shards, or ``None`` for any other sampler."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    if not isinstance(sampler, DistributedSamplerWrapper):
        return None
    return _read(sampler.dataset, "_sampler", "the wrapped sampler")


def fabric_unwrap(value: Any) -> Any:
    """What Fabric's wrappers (``_FabricModule``, ``_FabricOptimizer``, ``_FabricDataLoader``) in ``value`` hold."""
    from lightning.fabric.wrappers import _unwrap_objects

    return _unwrap_objects(value)


def fabric_dataloader(loader: Any) -> Any:
    """The ``DataLoader`` inside Fabric's wrapper ``loader`` (what ``fabric.setup_dataloaders`` returned)."""
    from lightning.fabric.wrappers import _FabricDataLoader

    if not isinstance(loader, _FabricDataLoader):
        raise TypeError(f"expected what `fabric.setup_dataloaders` returns, got `{type(loader).__name__}`")
    return _read(loader, "_dataloader", "the wrapped loader")


def set_fabric_dataloader(loader: Any, dataloader: Any, *, passes: int) -> None:
    """Make Fabric's wrapper ``loader`` wrap ``dataloader`` and count ``passes`` passes made: Fabric sets the sampler's
    epoch to that count at the start of each pass."""
    _read(loader, "_num_iter_calls", "the passes Fabric counts")
    loader._dataloader = dataloader
    loader._num_iter_calls = passes


def lightning_fit_position(trainer: Any, dataloader: Any) -> tuple[int, int] | None:
    """``(epoch, batches of it already trained)`` when ``trainer`` is restarting a fit in the middle of an epoch of
    the train loader ``dataloader``, else ``None`` (not restarting, or the saved epoch had trained all its batches:
    Lightning then starts the next one).

    Read while the train loader is set up (``Strategy.process_dataloader``): the loops' progress is restored then, and
    the epoch is the value Lightning passes to ``set_epoch``.
    """
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    fit_loop = trainer.fit_loop
    if not fit_loop.restarting:
        return None
    done = int(fit_loop.epoch_loop.batch_progress.current.ready)
    length = len(dataloader) if hasattr(dataloader, "__len__") else float("inf")
    if done >= _parse_num_batches(RunningStage.TRAINING, length, trainer.limit_train_batches):
        return None
    return int(fit_loop.epoch_progress.current.processed), done


def fabric_backward_sync_control() -> type:
    """The base class of a strategy's ``_backward_sync_control`` (what ``fabric.no_backward_sync`` calls)."""
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    return _BackwardSyncControl


# ---------------------------------------------------------------------------------------------------------------- torch
def is_persistent_buffer(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` goes into its state dict (``register_buffer(persistent=True)``)."""
    return name not in _read(module, "_non_persistent_buffers_set", "the buffers a state dict leaves out")


def mark_loaded_parameters(model: torch.nn.Module, missing: set[str]) -> None:
    """Mark every parameter of ``model`` but the ``missing`` ones (names as ``named_parameters(remove_duplicate=False)``
    gives them) as loaded, as transformers' own ``from_pretrained`` does: its initialisation skips them."""
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in missing:
            param._is_hf_initialized = True  # type: ignore[attr-defined]


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """What a call of ``optimizer.step`` tells a torch ``LRScheduler`` built on it (its wrapper's mark), for a step
    applied without that call (gradient release applies it in slices during the backward). Without it the first
    ``scheduler.step()`` warns "lr_scheduler.step() before optimizer.step()"."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def mark_step_for_lr_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` as torch's ``LRScheduler`` does for the optimizer it is built on.

    A scheduler built on a torch optimizer that the strategy then replaced warns "lr_scheduler.step() before
    optimizer.step()" unless the replacement's step carries the same marks.
    """
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    opt_ref = ref(optimizer)

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------ Lightning's ModelParallelStrategy
def fill_data_parallel_size(strategy: Any) -> None:
    """Lightning's ``ModelParallelStrategy`` with ``data_parallel_size="auto"`` takes the number of nodes; an FSDP2 run
    alone on every rank needs the world size divided by the tensor-parallel size (before its mesh is built)."""
    why = "the FSDP2 strategy's data-parallel size"
    tensor_parallel = _read(strategy, "_tensor_parallel_size", why)
    if _read(strategy, "_data_parallel_size", why) == "auto" and isinstance(tensor_parallel, int):
        strategy._data_parallel_size = max(strategy.world_size // tensor_parallel, 1)


# --------------------------------------------------------------------------------------- torch's weights-only unpickler
# The classes DeepSpeed pickles into its checkpoint files besides tensors and builtins (the optimizer-state files:
# ZeRO's loss scaler, a static one under bf16, and its stage enum), in the configurations this package saves and the
# DeepSpeed bf16-mixed checkpoints it converts. Constructing either runs no code beyond their own ``__init__``.
CHECKPOINT_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
)


# What the ``.metadata`` file of a ``torch.distributed.checkpoint`` folder (FSDP2's checkpoints) names: DCP's metadata
# dataclasses and enum, its file reader's storage record, torch.Size, the layout decoder and paths; torch's dtypes,
# layouts and memory formats are allowed besides (see :func:`dcp_metadata_global`). DCP reads the file with
# ``pickle.load``, which would call anything the file names; constructing these runs no code beyond their own.
DCP_METADATA_GLOBALS = (
    "torch.distributed.checkpoint.metadata:Metadata",
    "torch.distributed.checkpoint.metadata:TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata:BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata:ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata:TensorProperties",
    "torch.distributed.checkpoint.metadata:MetadataIndex",
    "torch.distributed.checkpoint.metadata:StorageMeta",
    "torch.distributed.checkpoint.metadata:_MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem:_StorageInfo",
    "torch:Size",
    "torch.serialization:_get_layout",
    "pathlib:PosixPath",
    "pathlib:PurePosixPath",
    "pathlib:WindowsPath",
    "pathlib:PureWindowsPath",
    "collections:OrderedDict",
)


def dcp_metadata_global(module: str, name: str) -> Any:
    """The object a DCP ``.metadata`` file may name as ``module.name``, or ``None`` when it is not allowed: one of
    :data:`DCP_METADATA_GLOBALS`, or a torch dtype, layout or memory format (pickled by name)."""
    if f"{module}:{name}" in DCP_METADATA_GLOBALS:
        return resolve(f"{module}:{name}")
    if module == "torch":
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    return None


def checkpoint_safe_globals() -> list[Any]:
    """The allowlist of :data:`CHECKPOINT_GLOBALS` for torch's weights-only unpickler (``torch.serialization``)."""
    return [resolve(name) for name in CHECKPOINT_GLOBALS]
