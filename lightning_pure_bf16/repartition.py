"""Loading a ZeRO-3 checkpoint into a live run of another world size or sub-group layout.

:func:`load_repartitioned` writes a checkpoint (read by :class:`~lightning_pure_bf16.zero_checkpoint.ZeroCheckpoint`)
into a live ZeRO-3 optimizer: each rank takes its own slice of every parameter, the weights go into the parameter
partitions, the per-element states and the remainder through the optimizer's :meth:`load_state_range` (which encodes
them into the run's formats and storage), with the saved step, hyperparameters and skipped-step count. A DeepSpeed
bf16-mixed checkpoint (fp32 masters, fp32 moments) loads the same way: the weights are rounded to nearest bf16, the
moments to the run's format, and under Kahan the remainder starts as the master minus its bf16 rounding, so no part
of the master is lost.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pure_bf16 import _internals
from lightning_pure_bf16.optim import KAHAN_KEY, STATISTICS_KEY, quant, scale_key, statistics_of_pieces
from lightning_pure_bf16.safe_load import CheckpointError
from lightning_pure_bf16.zero_checkpoint import ZeroCheckpoint


def named_sizes(layout: list[_internals.Zero3SubGroup]) -> list[list[list[Any]]]:
    """``[name, numel]`` per parameter of each sub-group of a live ZeRO-3 optimizer's layout
    (``_internals.zero3_layout``), to compare with :meth:`ZeroCheckpoint.layout` and the manifest's."""
    return [[[name, numel] for name, numel, _ in sub.params] for sub in layout]


# Elements of a live partition written at a time (a multiple of ops.quant.QBLOCK): a piece's temporaries, a few bytes
# per element, stay tens of MB at any model size.
PIECE = 1 << 22


@dataclass(frozen=True)
class _SavedSpan:
    """Elements of one parameter contiguous in this rank's live partition and in one saved rank's."""

    live: int  # offset in this rank's flat partition of the live sub-group
    rank: int  # the saved rank that holds them
    sub_group: int  # their saved sub-group
    saved: int  # their offset in that rank's flat partition of it
    count: int


def _saved_spans(checkpoint: ZeroCheckpoint, params: list[tuple[str, int, int]], rank: int) -> list[_SavedSpan]:
    """Where every element of this rank's live partition (``(name, numel, partition numel)`` per parameter) is saved;
    the partition's padding is in no run."""
    runs, live = [], 0
    for name, numel, part in params:
        place = checkpoint.places[name]
        saved_part = math.ceil(numel / checkpoint.world_size)
        element, end = rank * part, min((rank + 1) * part, numel)
        first = element
        while element < end:
            saved_rank = element // saved_part
            stop = min(end, (saved_rank + 1) * saved_part)
            saved = place.offset + element - saved_rank * saved_part
            runs.append(_SavedSpan(live + element - first, saved_rank, place.sub_group, saved, stop - element))
            element = stop
        live += part
    return runs


def _pieces(runs: list[_SavedSpan], size: int) -> Iterator[tuple[int, int, list[_SavedSpan]]]:
    """``(start, count, runs)`` for each piece of :data:`PIECE` elements of a live partition of ``size``: the runs
    clipped to the piece."""
    i = 0
    for start in range(0, size, PIECE):
        end = min(start + PIECE, size)
        clipped = []
        while i < len(runs) and runs[i].live < end:
            run = runs[i]
            lo, hi = max(run.live, start), min(run.live + run.count, end)
            clipped.append(_SavedSpan(lo, run.rank, run.sub_group, run.saved + lo - run.live, hi - lo))
            if run.live + run.count > end:
                break  # the rest of the run is in the next piece
            i += 1
        yield start, end - start, clipped


def _gathered(
    checkpoint: ZeroCheckpoint, key: str, start: int, count: int, runs: list[_SavedSpan]
) -> dict[str, torch.Tensor]:
    """A piece of ``key`` as stored (floats, or 8-bit codes with ``KEY_scale`` the scale of each element, NaN in the
    padding), from the saved ranks' files."""
    stored = checkpoint.inner_state(0, runs[0].sub_group if runs else 0)[key]  # the format this group kept
    out = {key: torch.zeros(count, dtype=stored.dtype)}
    coded = key != KAHAN_KEY and not stored.is_floating_point()
    if coded:
        out[scale_key(key)] = torch.full((count,), float("nan"))
    for run in runs:
        here = slice(run.live - start, run.live - start + run.count)
        out[key][here] = checkpoint.stored(run.rank, run.sub_group, key, run.saved, run.count)
        if coded:
            first, last = run.saved // quant.QBLOCK, (run.saved + run.count - 1) // quant.QBLOCK
            scales = checkpoint.stored(run.rank, run.sub_group, scale_key(key), first, last - first + 1)
            each = scales.float().repeat_interleave(quant.QBLOCK)
            out[scale_key(key)][here] = each.narrow(0, run.saved - first * quant.QBLOCK, run.count)
    return out


def _load_statistics(checkpoint: ZeroCheckpoint, optimizer: Any, master: torch.Tensor) -> None:
    """The float32 statistics of the live flat partition ``master`` (Adafactor's), from the checkpoint's per
    parameter: a matrix's rows and columns whole, a vector's elements of this partition's run."""
    live = optimizer.state[master].get(STATISTICS_KEY)
    if live is None or not checkpoint.holds_statistics():
        return
    for q, part in statistics_of_pieces(optimizer.pieces_of(master), live):
        saved = checkpoint.statistics(q.name)
        for key, target in part.items():
            flat = saved[key].reshape(-1)
            target.copy_(flat if key != "variance" else flat[q.start : q.start + q.numel])


@torch.no_grad()
def load_repartitioned(
    checkpoint: ZeroCheckpoint,
    zero_optimizer: Any,
    *,
    rank: int,
    layout: list[_internals.Zero3SubGroup],
    load_optimizer_states: bool = True,
) -> str:
    """Write ``checkpoint`` into this rank's partitions of a live ZeRO-3 optimizer; returns what was loaded, in words.

    Each rank reads only the saved elements of its own partitions (memory-mapped, a piece of :data:`PIECE` elements at
    a time) and writes them straight into the weights and the optimizer's state buffers
    (:meth:`~lightning_pure_bf16.AdamW.load_state_range`, which keeps the run's formats: 8-bit moments re-blocked, bit
    for bit where a block's codes share one scale). Everything is checked before anything is written: every live
    parameter must be in the checkpoint with its size, and the param groups must match. ``layout``: the live
    optimizer's (``_internals.zero3_layout``), computed once by the caller.

    Raises:
        CheckpointError: the checkpoint does not fit this model or optimizer; nothing was written.
    """
    from lightning_pure_bf16.optim import PureBF16Optimizer

    optimizer = _internals.zero3_inner_optimizer(zero_optimizer)
    missing = [n for sub in layout for n, _, _ in sub.params if n not in checkpoint.places]
    if missing:
        raise CheckpointError(
            f"The checkpoint '{checkpoint.dir}' has no parameter {missing[0]!r} ({len(missing)} missing in all): it"
            " was saved from another model."
        )
    for sub in layout:
        for name, numel, _ in sub.params:
            if checkpoint.places[name].numel != numel:
                raise CheckpointError(
                    f"Parameter {name!r} has {numel} elements here and {checkpoint.places[name].numel} in the"
                    f" checkpoint '{checkpoint.dir}': it was saved from another model."
                )
    if load_optimizer_states and len(checkpoint.param_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"The checkpoint '{checkpoint.dir}' has {len(checkpoint.param_groups)} parameter groups, this run's"
            f" optimizer {len(optimizer.param_groups)}: configure_optimizers must build the same groups."
        )
    if not isinstance(optimizer, PureBF16Optimizer):
        raise _internals.UpstreamChanged(
            f"ZeRO-3 wraps a {type(optimizer).__name__}, not an optimizer of this package."
        )
    masters = _internals.zero3_master_partitions(zero_optimizer)
    if load_optimizer_states and checkpoint.holds_statistics():  # rows and columns need the same shapes, not sizes
        for master in (m for m in masters if STATISTICS_KEY in optimizer.state.get(m, {})):
            for q in optimizer.pieces_of(master).pieces:
                if checkpoint.places[q.name].shape != q.shape:
                    raise CheckpointError(
                        f"Parameter {q.name!r} has shape {q.shape} here and {checkpoint.places[q.name].shape} in the"
                        f" checkpoint '{checkpoint.dir}', whose optimizer kept row and column statistics: it was saved"
                        " from another model."
                    )
    if [m.data_ptr() for m in masters] != [sub.flat.data_ptr() for sub in layout]:
        raise _internals.UpstreamChanged("ZeRO-3's master partitions are not its bf16 parameter partitions.")
    saved_keys = checkpoint.stored_keys()
    step = checkpoint.step()
    fp32_masters = checkpoint.master_dtype == torch.float32
    with_states = load_optimizer_states and step is not None
    optimizer.wait_for_state_writes()
    with _internals.zero3_partitioned_for_load(zero_optimizer):
        for sub, master in zip(layout, masters):
            runs = _saved_spans(checkpoint, sub.params, rank)
            kahan = optimizer.param_groups[sub.group]["rounding"] == "kahan"
            live_keys = optimizer.state_keys(optimizer.param_groups[sub.group])
            for start, count, piece in _pieces(runs, sub.flat.numel()):
                weights = sub.flat.narrow(0, start, count)
                weights.zero_()  # the padding
                for run in piece:
                    saved = checkpoint.stored(run.rank, run.sub_group, "param", run.saved, run.count)
                    weights.narrow(0, run.live - start, run.count).copy_(saved)
                if not with_states:
                    continue
                values: dict[str, torch.Tensor] = {}
                for key in (k for k in saved_keys if k != KAHAN_KEY and k in live_keys):
                    values.update(_gathered(checkpoint, key, start, count, piece))
                if kahan and KAHAN_KEY in saved_keys:
                    values.update(_gathered(checkpoint, KAHAN_KEY, start, count, piece))
                elif kahan:  # none saved: what the bf16 weight does not hold of an fp32 master, else nothing
                    comp = values[KAHAN_KEY] = torch.zeros(count)
                    for run in piece if fp32_masters else ():
                        saved = checkpoint.stored(run.rank, run.sub_group, "param", run.saved, run.count)
                        here = comp.narrow(0, run.live - start, run.count)
                        here.copy_(saved).sub_(saved.to(torch.bfloat16).float())
                if values:
                    optimizer.load_state_range(master, start, values)
            if with_states:
                optimizer.set_step(master, step)
                _load_statistics(checkpoint, optimizer, master)
    if not load_optimizer_states:
        return "weights"
    for ours, saved in zip(optimizer.param_groups, checkpoint.param_groups):
        # The algorithm's hyperparameters as saved (an LR scheduler's initial_lr too); the rounding stays this run's.
        ours.update({k: saved[k] for k in (*optimizer.defaults, "initial_lr") if k in saved and k != "rounding"})
    skipped = int(checkpoint.extra["skipped_steps"]) if checkpoint.extra else 0
    optimizer.skipped_steps = skipped  # a public counter, saved in its state dict
    loaded = ["weights"]
    if with_states:
        kept = any(g["rounding"] == "kahan" for g in optimizer.param_groups)
        loaded += [k for k in saved_keys if k != KAHAN_KEY] + ([KAHAN_KEY] if kept else [])
    if fp32_masters and KAHAN_KEY in loaded and KAHAN_KEY not in saved_keys:
        loaded[-1] = "kahan_comp (from the fp32 masters)"
    total = sum(f.stat().st_size for f in checkpoint.optim_files)
    return (
        ", ".join(loaded) + f", step {step or 0}, {skipped} skipped steps; rank {rank} read"
        f" {checkpoint.bytes_read:,} bytes of the {total:,} in the optimizer state files"
    )


__all__ = ["PIECE", "load_repartitioned", "named_sizes"]
