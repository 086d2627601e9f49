"""Lightning's and Fabric's internals: module hooks, dataloaders and their wrappers, the fit's position, backward
sync, ``ModelParallelStrategy``'s data-parallel size; and torch's module and optimizer marks they rely on."""

from __future__ import annotations

import functools
from typing import Any
from weakref import ref

import torch

from lightning_pure_bf16._internals._access import _read


# ------------------------------------------------------------------------------------------------------------ Lightning
def lightning_remove_module_hooks(model: torch.nn.Module) -> None:
    """Lightning's own clean-up of DeepSpeed's module hooks before an inference engine is built."""
    from lightning.pytorch.strategies.deepspeed import remove_module_hooks

    remove_module_hooks(model)


def lightning_run_closure(precision: Any, model: Any, optimizer: Any, closure: Any) -> Any:
    """Lightning's closure of one optimizer step as its precision plugins run it before stepping: the closure (the
    backward), the ``on_before_optimizer_step`` hooks, then the gradient clipping. Returns the closure's result."""
    return _read(precision, "_wrap_closure", "the closure of an optimizer step")(model, optimizer, closure)


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


__all__ = [
    "fabric_backward_sync_control",
    "fabric_dataloader",
    "fabric_unwrap",
    "fill_data_parallel_size",
    "is_persistent_buffer",
    "lightning_fit_position",
    "lightning_remove_module_hooks",
    "lightning_run_closure",
    "lightning_update_dataloader",
    "mark_loaded_parameters",
    "mark_optimizer_stepped",
    "mark_step_for_lr_scheduler",
    "set_fabric_dataloader",
    "wrapped_sampler",
]
