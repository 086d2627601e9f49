"""Training data that resumes mid-epoch with the same batches, shuffled or not, with any loader Lightning injects a
distributed sampler into.

Two things stand between a mid-epoch checkpoint and the uninterrupted run's batches (both shown by
``tests/test_data.py``):

- A plain ``DataLoader`` holds no position: Lightning restarts its epoch from the first batch on resume while counting
  the batches already trained, so the rest of the epoch replays its first batches. :func:`resume_dataloader` makes
  its next pass start at the first batch not yet trained (the skipped batches are never loaded).
- torchdata's ``StatefulDataLoader(shuffle=True)`` brings its own ``RandomSampler`` class, which Lightning and Fabric
  do not recognise as random: they wrap it in a ``DistributedSamplerWrapper``, whose order comes from that sampler's
  generator (seeded from the global one when the loader is built, advanced by every pass). The wrapper keeps no
  state, so a resumed run starts the generator over and draws other batches, and ranks whose global generators
  differ split the data inconsistently. :func:`distributed_sampler_by_seed` gives it the
  ``DistributedSampler`` Lightning gives torch's own ``RandomSampler``: an order decided by the seed and the epoch.

Both front ends call :func:`distributed_sampler_by_seed` from ``process_dataloader``; the Trainer strategy also calls
:func:`resume_dataloader` there when the fit restarts mid-epoch. A Fabric loop owns its own position: it calls
``sampler.set_epoch`` and skips the trained batches itself (a ``StatefulDataLoader`` in the saved state does both).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler

from lightning_pure_bf16._internals import (
    fabric_dataloader,
    lightning_fit_position,
    lightning_update_dataloader,
    set_fabric_dataloader,
    wrapped_sampler,
)
from lightning_pure_bf16._log import rank_zero_warn


class _ResumeSampler(Sampler[Any]):
    """``sampler`` whose next pass leaves out its first ``skip`` indices (the samples of the trained batches); later
    passes are whole. ``set_epoch`` reaches ``sampler``, so Lightning's per-epoch reshuffle still applies."""

    def __init__(self, sampler: Sampler[Any], skip: int) -> None:
        self.sampler = sampler
        self._skip = skip

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        indices = iter(self.sampler)
        for _ in range(skip):
            next(indices, None)
        return indices

    def __len__(self) -> int:
        # The whole epoch's length: Lightning counts the trained batches itself and ends the epoch at the same step.
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def _samplers(dataloader: object) -> list[Any]:
    # Where Lightning puts the sampler it injects: the loader's own, or (a batch sampler of another class than torch's,
    # such as torchdata's) the batch sampler's.
    found = [getattr(dataloader, "sampler", None), getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)]
    return [s for s in found if s is not None]


def _is_stateful(dataloader: object) -> bool:
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


def _torchdata_random_sampler() -> type | None:
    try:
        from torchdata.stateful_dataloader.sampler import RandomSampler
    except ImportError:
        return None
    return RandomSampler


def distributed_sampler_by_seed(dataloader: DataLoader) -> DataLoader:
    """``dataloader`` with a seeded ``DistributedSampler`` in place of a ``DistributedSamplerWrapper`` around
    torchdata's ``RandomSampler`` (whole dataset, no replacement): the order then depends on the seed and the epoch
    only, exactly what Lightning does with torch's ``RandomSampler`` (whose generator it does not use either). Any
    other loader is returned as it is."""
    sampler, inner = None, None
    for candidate in _samplers(dataloader):
        inner = wrapped_sampler(candidate)
        if inner is not None:
            sampler = candidate
            break
    random_sampler = _torchdata_random_sampler()
    if inner is None or random_sampler is None or type(inner) is not random_sampler:
        return dataloader
    if inner.replacement or inner.num_samples != len(inner.data_source):
        return dataloader
    by_seed = DistributedSampler(
        dataloader.dataset,
        num_replicas=sampler.num_replicas,
        rank=sampler.rank,
        shuffle=True,
        seed=sampler.seed,
        drop_last=sampler.drop_last,
    )
    by_seed.set_epoch(sampler.epoch)
    return lightning_update_dataloader(dataloader, by_seed)


def resume_dataloader(dataloader: DataLoader, *, epoch: int, batches_done: int, who: str) -> DataLoader:
    """``dataloader`` ready to continue epoch ``epoch`` after its first ``batches_done`` batches.

    The sampler is set to ``epoch`` first (a stateful loader fast-forwards through that epoch's order when its saved
    state is loaded). A loader that keeps no position (no ``state_dict``/``load_state_dict``) gets a sampler whose
    next pass starts after the trained batches. Where that cannot be exact (an iterable dataset, a custom batch
    sampler), the loader is returned as it is with a warning that says so and what to use.

    Args:
        dataloader: the train loader, after Lightning's distributed sampler was injected.
        epoch: the epoch being resumed (the value Lightning passes to ``set_epoch``).
        batches_done: batches of that epoch already trained.
        who: the user's call, for the warning.
    """
    for sampler in _samplers(dataloader):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
    if batches_done <= 0 or _is_stateful(dataloader):
        return dataloader
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    plain_batches = type(batch_sampler) is BatchSampler and dataloader.batch_size is not None
    why = None
    if (
        isinstance(dataloader.dataset, IterableDataset)
        or not plain_batches
        or not isinstance(dataloader.sampler, Sized)
    ):
        why = "cannot be fast-forwarded exactly (an iterable dataset or a custom batch sampler)"
    elif isinstance(dataloader.sampler, RandomSampler):
        # No distributed sampler was injected (one process): its order is drawn anew from the global generator.
        why = "shuffles with a `RandomSampler`, whose order a resumed process draws anew"
    if why is not None:
        rank_zero_warn(
            f"`{who}` is resuming {batches_done} batches into epoch {epoch} with a `{type(dataloader).__name__}` that"
            f" keeps no position and {why}: the rest of this epoch will not be the batches the uninterrupted run saw."
            " Use torchdata's `StatefulDataLoader` (it saves its position in the checkpoint), or checkpoint at epoch"
            " ends."
        )
        return dataloader
    return lightning_update_dataloader(
        dataloader, _ResumeSampler(dataloader.sampler, batches_done * dataloader.batch_size)
    )


def prepare_dataloader(dataloader: Any, *, who: str, trainer: Any | None = None) -> Any:
    """What the front ends' ``process_dataloader`` does: :func:`distributed_sampler_by_seed`, then, for the train
    loader of a ``Trainer`` fit restarting from a checkpoint, :func:`resume_dataloader` at the restored position."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    dataloader = distributed_sampler_by_seed(dataloader)
    if trainer is None or not trainer.training:
        return dataloader
    position = lightning_fit_position(trainer, dataloader)
    if position is None:
        return dataloader
    epoch, batches_done = position
    return resume_dataloader(dataloader, epoch=epoch, batches_done=batches_done, who=who)


def resume_fabric_dataloader(loader: Any, *, epoch: int, batches_done: int) -> None:
    """Set a Fabric loader (what ``fabric.setup_dataloaders`` returned) to continue epoch ``epoch`` after its first
    ``batches_done`` batches, after ``fabric.load``.

    Fabric gives the sampler, at each pass over ``loader``, the number of passes this process made before; a resumed
    process starts counting at 0, so without this its shuffled order is epoch 0's. A plain ``DataLoader`` also skips
    the trained batches on its next pass (never loading them); a ``StatefulDataLoader`` saved in the checkpoint state
    fast-forwards by itself.

    Example::

        fabric.load(path, state)
        epoch, done = divmod(state["step"], len(train_loader))
        lightning_pure_bf16.resume_fabric_dataloader(train_loader, epoch=epoch, batches_done=done)
    """
    if epoch < 0 or batches_done < 0:
        raise ValueError(f"`resume_fabric_dataloader(epoch={epoch}, batches_done={batches_done})`: both must be >= 0.")
    inner = resume_dataloader(fabric_dataloader(loader), epoch=epoch, batches_done=batches_done, who="Fabric")
    set_fabric_dataloader(loader, inner, passes=epoch)


__all__ = ["distributed_sampler_by_seed", "prepare_dataloader", "resume_dataloader", "resume_fabric_dataloader"]
