"""The patches of DeepSpeed ZeRO-3's step, each on one optimizer instance: the sub-groups' gradients as views, the clip
factor applied inside the update, full buckets reduced at once, the collectives and the gradient norm wrapped, and
gradient release (each bucket applied as it is reduce-scattered, a step that only keeps the books)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import ref

import torch

from lightning_pure_bf16._internals._access import _read
from lightning_pure_bf16._internals.zero3 import _GRAD_VIEWS


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


def fold_gradient_scale(zero_optimizer: Any) -> None:
    """Fold ZeRO-3's scaling of the gradient partition into the update that follows it.

    Before each sub-group's update ZeRO-3 multiplies its gradient partition in place by ``1 / (loss scale x clip
    factor)`` (``unscale_and_clip_grads``): a pass over the gradient of its own, 4 bytes per element read and written
    beside the update's 14, made even where the factor is 1 (under bf16 the loss scale is 1, and the clip factor is 1
    without clipping or while the norm is within the clipping norm). Here the factor is computed as ZeRO-3 computes it
    (as a float: the step has already read the norm on the host for its inf/NaN decision) and the gradient is left as
    it is; the sub-group's update (``_optimizer_step``, without offload: the sub-group's master partition put in its
    param group for one step) passes it to the pure-bf16 optimizer's step as its argument
    (``step(grad_scale=...)``), which multiplies each element by it in float32 in its own pass, instead of ZeRO-3
    rounding the product to bf16 first. Wrapped on this optimizer instance only.
    """
    _read(zero_optimizer, "unscale_and_clip_grads", "the gradient scaling before the update")
    _read(zero_optimizer, "clip_grad", "the norm ZeRO-3 clips to")
    _read(zero_optimizer, "_optimizer_step", "the update of one sub-group")
    group_ids = _read(zero_optimizer, "sub_group_to_group_id", "the param group of each sub-group")
    masters = _read(zero_optimizer, "fp32_partitioned_groups_flat", "the master partitions")
    factors: dict[int, float] = {}  # each sub-group's factor, from its scaling to its update right after

    def unscale_and_clip(sub_group_id: int, total_norm: Any) -> None:
        combined_scale = zero_optimizer.loss_scale
        if zero_optimizer.clip_grad > 0.0:
            clip = torch.clamp(((total_norm / combined_scale) + 1e-6) / zero_optimizer.clip_grad, min=1.0)
            combined_scale = clip * combined_scale
        factors[sub_group_id] = float(1.0 / combined_scale)

    def optimizer_step(sub_group_id: int) -> None:
        optimizer = zero_optimizer.optimizer
        group = optimizer.param_groups[group_ids[sub_group_id]]
        group["params"] = [masters[sub_group_id]]
        optimizer.step(grad_scale=factors.pop(sub_group_id, 1.0))
        group["params"] = []

    zero_optimizer.unscale_and_clip_grads = unscale_and_clip
    zero_optimizer._optimizer_step = optimizer_step


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


__all__ = [
    "Zero3Coordinator",
    "fold_gradient_scale",
    "reduce_full_buckets_at_once",
    "release_gradient_partitions",
    "step_without_update",
    "view_sub_group_gradients",
    "wrap_deepspeed_collectives",
    "wrap_zero3_grad_norm",
]
