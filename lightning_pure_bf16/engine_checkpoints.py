"""Saving and loading a live engine's checkpoint: staged and durable, validated before anything is read, native at the
saved world size or re-partitioned at another."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_pure_bf16 import _internals
from lightning_pure_bf16._log import rank_zero_info
from lightning_pure_bf16.checkpoint import (
    TAG,
    CheckpointError,
    save_staged,
    state_files,
    tag_directory,
    validate_checkpoint,
)
from lightning_pure_bf16.repartition import load_repartitioned, named_sizes
from lightning_pure_bf16.safe_load import check_state_files, load_state_file, verify_state_file
from lightning_pure_bf16.zero_checkpoint import DEEPSPEED_KEYS, ZeroCheckpoint


# ------------------------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(
    engine: Any,
    filepath: str | os.PathLike,
    client_state: dict[str, Any],
    *,
    world_size: int,
    is_global_zero: bool,
    barrier: Callable[[str], None],
    exclude_frozen_parameters: bool,
    **info: Any,
) -> None:
    """DeepSpeed's sharded checkpoint, staged, fsynced and moved into place (every rank; ``filepath`` the same)."""

    def write(staged: Path) -> None:
        # The class's method: a front end may route the engine's own ``save_checkpoint`` here.
        type(engine).save_checkpoint(
            engine,
            os.fspath(staged),
            client_state=client_state,
            tag=TAG,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    # The sub-groups' layout, so a resume at the same world size and layout knows it without reading a rank file.
    layout = named_sizes(_internals.zero3_layout(engine.optimizer))
    save_staged(
        filepath, write, world_size=world_size, is_global_zero=is_global_zero, barrier=barrier, layout=layout, **info
    )


def _verify_shared(files: list[Path], rank: int, world_size: int, device: torch.device, trust: bool) -> None:
    """The ranks share out the checks of the checkpoint's files (each file is checked by one rank): its bytes against
    their checksums, and, unless trusted, that it reads without running code. A bad file found by any rank stops every
    rank before anything is loaded."""
    error: CheckpointError | None = None
    try:
        for file in files[rank::world_size]:
            verify_state_file(file)
            check_state_files([file], trust=trust)
    except CheckpointError as err:
        error = err
    if world_size > 1 and torch.distributed.is_initialized():
        found = torch.tensor([float(error is not None)], device=device)
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        if error is None and found.item():
            raise CheckpointError(
                "Another rank found a corrupted file in the checkpoint, or one that needs code to be read (its error"
                " names the file); nothing was loaded."
            )
    if error is not None:
        raise error


def load_checkpoint(
    engine: Any,
    checkpoint_path: str | os.PathLike,
    *,
    world_size: int,
    rank: int,
    load_optimizer_states: bool,
    strict: bool,
    strategy_name: str,
    load_lr_scheduler_states: bool = False,
    trust_checkpoint: bool = False,
) -> tuple[dict[str, Any], ZeroCheckpoint | None]:
    """Check, then load a checkpoint into a live engine; returns the client state and, when the checkpoint had to be
    re-partitioned (another world size or sub-group layout, or DeepSpeed bf16-mixed), its reader.

    ``load_lr_scheduler_states``: also restore the scheduler given to ``deepspeed.initialize`` (``engine.lr_scheduler``)
    from the checkpoint (the Lightning strategies leave schedulers to Lightning). ``trust_checkpoint``: read the files
    without the check that none needs code to be read (:func:`validate_checkpoint`).

    Raises:
        CheckpointError: naming the file and what to do, before anything is loaded.
    """
    directory, manifest = validate_checkpoint(
        checkpoint_path, accept_fp32_masters=True, trust_checkpoint=trust_checkpoint, verify_checksums=False
    )
    _verify_shared(state_files(directory, manifest), rank, world_size, engine.device, trust_checkpoint)
    layout = _internals.zero3_layout(engine.optimizer)  # the live one, once per resume
    live = named_sizes(layout)
    saved = None
    if manifest is not None and "layout" in manifest:  # written at save since the layout was recorded
        same_layout = manifest["world_size"] == world_size and manifest["layout"] == live
    else:
        saved = ZeroCheckpoint(tag_directory(directory, manifest), trust=trust_checkpoint)
        same_layout = manifest is not None and saved.world_size == world_size and saved.layout() == live
    if not same_layout:
        if saved is None:
            saved = ZeroCheckpoint(tag_directory(directory, manifest), trust=trust_checkpoint)
        loaded = load_repartitioned(
            saved, engine.optimizer, rank=rank, layout=layout, load_optimizer_states=load_optimizer_states
        )
    if same_layout:
        # Each file memory-mapped (its pages are page cache, copied into the run's buffers) and read weights-only.
        read = functools.partial(load_state_file, trust=trust_checkpoint)
        with _internals.deepspeed_checkpoint_reads(engine, read):
            _, client_state = type(engine).load_checkpoint(  # the class's method, as in save_checkpoint
                engine,
                os.fspath(directory),
                tag=TAG,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_strict=strict,
            )
        if client_state is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint '{checkpoint_path}'.")
        return {k: v for k, v in client_state.items() if k not in DEEPSPEED_KEYS}, None
    state = saved.model_state
    _internals.set_engine_counters(
        engine,
        global_steps=int(state.get("global_steps", 0)),
        global_samples=int(state.get("global_samples", 0)),
        skipped_steps=int(state.get("skipped_steps", 0)),
    )
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    source = "DeepSpeed bf16-mixed (fp32 masters)" if saved.master_dtype == torch.float32 else "pure bf16"
    rank_zero_info(
        f"{strategy_name}: re-partitioned the {source} checkpoint '{checkpoint_path}' written by {saved.world_size}"
        f" rank(s) in {len(saved.sub_groups)} sub-group(s) to {world_size} rank(s) in"
        f" {len(layout)}: {loaded}."
    )
    return saved.client_state(), saved


__all__ = ["load_checkpoint", "save_checkpoint"]
