"""Checkpoints: a durable, atomic save, a check before any load, and the exports (one state dict, Hugging Face's
sharded safetensors, the optimizer state, DeepSpeed's universal layout) from a checkpoint of any world size.

A pure-bf16 checkpoint is DeepSpeed's ZeRO-3 checkpoint directory (one model-state and one optimizer-state file per
rank, Lightning's loop and scheduler state inside rank 0's model-state file) plus ``pure_bf16_checkpoint.json``, a
manifest with the format version, the world size and the size of every file. A save writes into a staging directory;
every file and directory in it is fsynced before the manifest is written (and fsynced), and only then is the staging
directory moved into place, the parent directory fsynced after each rename. A save killed at any instant leaves the
previous checkpoint or the new one, complete, never a mix; once a save has returned, a power loss loses nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_pure_bf16.durable import fsync_path, fsync_tree, replaced_atomically
from lightning_pure_bf16.safe_load import (
    CheckpointError,
    UntrustedCheckpointError,
    check_state_files,
    load_state_file,
    verify_state_file,
)
from lightning_pure_bf16.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    TensorSource,
    check_new_directory,
    map_keys,
    parse_size,
    read_config,
    save_sharded,
    write_safetensors,
)
from lightning_pure_bf16.zero_checkpoint import ZeroCheckpoint

MANIFEST = "pure_bf16_checkpoint.json"
TAG = "checkpoint"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".pure_bf16_tmp"
_OLD_SUFFIX = ".pure_bf16_old"

log = logging.getLogger(__name__)


def staging_path(path: str | os.PathLike) -> Path:
    """Where a save to ``path`` is written before it is moved into place."""
    return Path(f"{os.fspath(path)}{_TMP_SUFFIX}")


def write_manifest(directory: Path, world_size: int, **info: Any) -> None:
    """Record the format, the world size and every file's size; written last, atomically and durably, by one
    process, after every other file of the save is on the disk."""
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"format": FORMAT_VERSION, "world_size": world_size, "tag": TAG, "files": files, **info}
    with replaced_atomically(directory / MANIFEST) as part:
        part.write_text(json.dumps(manifest, indent=1))


def commit_staged(path: str | os.PathLike) -> None:
    """Move a complete staged save into place; the previous checkpoint is deleted only after that (one process).

    Each rename is made durable (the parent directory fsynced) before the next step.
    """
    target, staged, old = Path(path), staging_path(path), Path(f"{os.fspath(path)}{_OLD_SUFFIX}")
    parent = target.absolute().parent
    if old.exists():
        _remove(old)
    if target.exists():
        os.replace(target, old)
        fsync_path(parent)
    os.replace(staged, target)
    fsync_path(parent)
    if old.exists():
        _remove(old)
        fsync_path(parent)


def clear_staging(path: str | os.PathLike) -> None:
    """Remove what an earlier interrupted save to ``path`` left behind (one process, before saving)."""
    staged = staging_path(path)
    if staged.exists():
        _remove(staged)


def save_staged(
    path: str | os.PathLike,
    write: Callable[[Path], None],
    *,
    world_size: int,
    is_global_zero: bool,
    barrier: Callable[[str], None],
    **info: Any,
) -> None:
    """The save protocol, on every rank: ``write(staging_dir)`` writes this rank's files; each rank fsyncs what is
    there; rank 0 writes the manifest and moves the directory into place once every rank has."""
    if is_global_zero:
        clear_staging(path)
    barrier("pure_bf16_save_start")
    staged = staging_path(path)
    with _failed_save_reported(path, staged):
        write(staged)
        fsync_tree(staged)
    barrier("pure_bf16_save_written")
    if is_global_zero:
        with _failed_save_reported(path, staged):
            write_manifest(staged, world_size, **info)
        commit_staged(path)
    barrier("pure_bf16_save_done")


@contextlib.contextmanager
def _failed_save_reported(path: str | os.PathLike, staged: Path) -> Iterator[None]:
    """A write into the staging directory that fails (most often a full file system, which torch's writer reports as
    an opaque ``RuntimeError``) becomes a :class:`CheckpointError` that says where, how much space was free, and that
    the checkpoint already at ``path`` is whole; the partial copy is removed, giving its space back."""
    try:
        yield
    except Exception as err:
        try:
            free = f"{shutil.disk_usage(staged.parent).free:,} bytes"
        except OSError:
            free = "an unknown number of bytes"
        if staged.exists():
            _remove(staged)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(
            f"Saving the checkpoint to '{path}' failed: {type(err).__name__}: {first}. Its file system had {free} free"
            " when it failed: if it ran out of space, free some or save elsewhere. The partial copy was removed;"
            f" nothing at '{path}' was changed, so the checkpoint already there (if any) is whole."
        ) from err


LATEST = "latest"


def write_latest_tag(save_dir: str | os.PathLike, tag: str) -> None:
    """Write DeepSpeed's ``latest`` file (the tag of the newest checkpoint in ``save_dir``): a whole new file moved
    over the old one, fsynced, so a crash leaves one tag or the other."""
    with replaced_atomically(Path(save_dir) / LATEST) as part:
        part.write_text(tag)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one checkpoint written by this package (not a directory of them)."""
    return (_recover_path(Path(path)) / MANIFEST).is_file()


def read_latest_tag(load_dir: str | os.PathLike) -> str:
    """The tag in ``load_dir/latest``.

    Raises:
        CheckpointError: no ``latest`` file, or one naming a checkpoint that is not there.
    """
    latest = Path(load_dir) / LATEST
    if not latest.is_file():
        raise CheckpointError(
            f"No checkpoint to load in '{load_dir}': it has no '{LATEST}' file naming one. Pass the directory"
            " `save_checkpoint` was given, or the tag of the checkpoint to load."
        )
    tag = latest.read_text().strip()
    if not _recover_path(Path(load_dir) / tag).exists():
        raise CheckpointError(f"'{latest}' names the checkpoint '{tag}', which is not in '{load_dir}'.")
    return tag


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink()


def _recover_path(path: Path) -> Path:
    # A save killed between its two renames leaves the new checkpoint staged (complete, with a manifest) and the
    # previous one under the old name: both are good; prefer the newer.
    if path.exists():
        return path
    for candidate in (staging_path(path), Path(f"{path}{_OLD_SUFFIX}")):
        if (candidate / MANIFEST).is_file():
            return candidate
    return path


def _tag(directory: Path) -> str:
    # Our saves use one fixed tag; a plain DeepSpeed checkpoint names its newest tag in `latest`.
    latest = directory / "latest"
    if not (directory / TAG).is_dir() and latest.is_file():
        return latest.read_text().strip()
    return TAG


def _optim_files(directory: Path) -> list[Path]:
    return sorted((directory / _tag(directory)).glob("*_optim_states.pt"))


def _master_dtype(directory: Path, trust: bool) -> torch.dtype | None:
    files = _optim_files(directory)
    if not files:
        return None
    try:
        sd = load_state_file(files[0], trust=trust)
    except UntrustedCheckpointError:
        raise
    except CheckpointError:  # an unreadable file is reported by the caller as what it is
        return None
    groups = sd.get("optimizer_state_dict", {}).get("fp32_flat_groups")
    return groups[0].dtype if groups else None


def validate_checkpoint(
    path: str | os.PathLike,
    *,
    accept_fp32_masters: bool = False,
    trust_checkpoint: bool = False,
    verify_checksums: bool = True,
) -> tuple[Path, dict[str, Any] | None]:
    """Check a checkpoint before anything is loaded from it: complete, untruncated, a known format, every state
    file's bytes as written (torch's CRC-32 of each record) and readable without running code
    (:mod:`lightning_pure_bf16.safe_load`).

    Args:
        path: the checkpoint directory Lightning was given.
        accept_fp32_masters: also accept a DeepSpeed ZeRO-3 checkpoint with fp32 master weights (bf16-mixed), or
            any whole DeepSpeed ZeRO-3 save (its ``latest`` file written: the Hugging Face Trainer's and
            Accelerate's), which have no manifest; it is returned with ``None`` for the manifest (the readers that
            export and convert pass it; a Lightning resume does not).
        trust_checkpoint: skip the check that no state file needs code to be read (default: False). Only for a
            checkpoint whose writer you trust: reading such a file can run any command.
        verify_checksums: read every state file whole to check its checksums, and unpickle it weights-only (default:
            True; the ranks of a resume share both out instead, each file checked by one rank,
            :func:`lightning_pure_bf16.engine_checkpoints.load_checkpoint`).

    Returns:
        The directory to load (``path``, or the complete copy an interrupted save left next to it) and its manifest.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    requested = Path(path)
    directory = _recover_path(requested)
    if not directory.exists():
        raise CheckpointError(f"No checkpoint at '{requested}': the path does not exist.")
    if directory.is_file():
        raise CheckpointError(
            f"'{requested}' is a file, but a pure-bf16 checkpoint is a directory written by"
            " `Trainer(strategy='deepspeed_pure_bf16')`. To start from weights in a file, load them into the"
            " LightningModule before `fit` instead of passing `ckpt_path`."
        )
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file() and (inner := _manifest_below_latest(directory)) is not None:
        directory, manifest_path = inner.parent, inner  # a Hugging Face Trainer's checkpoint-N of this package's save
    if not manifest_path.is_file():
        complete_deepspeed_save = (directory / "latest").is_file() and any(directory.glob("*/*_optim_states.pt"))
        if accept_fp32_masters and complete_deepspeed_save:
            # DeepSpeed's own save (the Hugging Face Trainer's, Accelerate's): `latest` is written after its files.
            _check_files(state_files(directory, None), trust_checkpoint, verify_checksums)
            return directory, None
        if _master_dtype(directory, trust_checkpoint) == torch.float32:
            if accept_fp32_masters:
                _check_files(state_files(directory, None), trust_checkpoint, verify_checksums)
                return directory, None
            raise CheckpointError(
                f"'{requested}' was written with fp32 master weights (DeepSpeed mixed precision). Resume it in pure"
                " bf16 with `trainer.fit(..., ckpt_path=...)` (the masters and moments are converted), or convert"
                f" its weights with `python -m lightning_pure_bf16.consolidate {requested} weights.safetensors`."
            )
        raise CheckpointError(
            f"'{requested}' has no {MANIFEST}: the save that wrote it did not finish (or it was not written by"
            " `deepspeed_pure_bf16`). Use an earlier checkpoint."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"'{manifest_path}' is unreadable ({err}); the checkpoint cannot be trusted.") from err
    version = manifest.get("format") if isinstance(manifest, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(
            f"'{manifest_path}' has checkpoint format {version!r}; this version of lightning_pure_bf16 reads format"
            f" {FORMAT_VERSION}. A newer format was written by a newer lightning_pure_bf16: upgrade it to load this"
            " checkpoint."
        )
    for name, size in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"'{file}' is missing from the checkpoint '{requested}'.")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"'{file}' is truncated or was overwritten: {actual} bytes, the checkpoint recorded {size}."
            )
    _check_files(state_files(directory, manifest), trust_checkpoint, verify_checksums)
    return directory, manifest


def _manifest_below_latest(directory: Path) -> Path | None:
    """The manifest of the save a directory's ``latest`` file names (the Hugging Face Trainer's ``checkpoint-N``
    holds this package's save as ``global_stepN``), or None."""
    try:
        tag = (directory / "latest").read_text().strip()
    except OSError:
        return None
    inner = directory / tag / MANIFEST
    return inner if tag and "/" not in tag and inner.is_file() else None


def _check_files(files: list[Path], trust: bool, verify_checksums: bool) -> None:
    if not verify_checksums:
        return
    for file in files:
        verify_state_file(file)
    check_state_files(files, trust=trust)


def state_files(directory: Path, manifest: dict[str, Any] | None) -> list[Path]:
    """Every file DeepSpeed or the re-partitioning reader would open: the ``.pt`` files of the checkpoint's tag."""
    return sorted(tag_directory(directory, manifest).glob("*.pt"))


def tag_directory(directory: Path, manifest: dict[str, Any] | None) -> Path:
    """The directory of the checkpoint's state files (its tag)."""
    return directory / (manifest["tag"] if manifest else _tag(directory))


def open_checkpoint(path: str | os.PathLike, *, trust_checkpoint: bool = False) -> ZeroCheckpoint:
    """Validate a checkpoint (this package's, or DeepSpeed's ZeRO-3 with fp32 masters) and open its reader: the rank
    files memory-mapped, nothing read until a tensor is asked for. ``trust_checkpoint``: as
    :func:`validate_checkpoint`'s."""
    directory, manifest = validate_checkpoint(path, accept_fp32_masters=True, trust_checkpoint=trust_checkpoint)
    return ZeroCheckpoint(tag_directory(directory, manifest), trust=trust_checkpoint)


def weight_sources(
    path: str | os.PathLike, *, trust_checkpoint: bool = False, tied_aliases: bool = True
) -> list[TensorSource]:
    """The checkpoint's weights to be read tensor by tensor (see :meth:`ZeroCheckpoint.weight_sources`); a
    message where fp32 masters are rounded."""
    reader = open_checkpoint(path, trust_checkpoint=trust_checkpoint)
    sources = reader.weight_sources(tied_aliases=tied_aliases)
    if reader.master_dtype == torch.float32:
        trained = sum(1 for _ in reader.iter_params())
        log.info(
            f"'{path}' holds fp32 master weights (DeepSpeed mixed precision): converted {trained} tensors to bf16,"
            " rounding to nearest."
        )
    return sources


def consolidate_checkpoint(path: str | os.PathLike, *, trust_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """One bf16 state dict with the LightningModule's keys, from a checkpoint written at any world size.

    The values equal the trained parameters bit for bit (frozen parameters and buffers as stored; tied parameters
    are one tensor under both names). A checkpoint written with fp32 master weights (DeepSpeed mixed precision) is
    converted: its masters are rounded to nearest bf16, and a message says so. This holds the whole model in memory;
    :func:`export_pretrained` writes it to files one tensor at a time. ``trust_checkpoint``: as
    :func:`validate_checkpoint`'s.

    Raises:
        CheckpointError: if the checkpoint is missing, incomplete, truncated, or needs code to be read.
    """
    return assemble(weight_sources(path, trust_checkpoint=trust_checkpoint))


def assemble(sources: list[TensorSource]) -> dict[str, torch.Tensor]:
    """The tensors of ``sources``, read whole (a tied alias the same tensor as its original)."""
    state: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    for source in sources:
        key = id(source.read)  # a tied alias shares its original's reader
        if key not in made:
            made[key] = torch.cat([p.reshape(-1) for p in source.read()]).view(source.shape)
        state[source.name] = made[key]
    return state


def export_pretrained(
    path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    config: str | os.PathLike | None = None,
    key_map: dict[str, str] | None = None,
    trust_checkpoint: bool = False,
) -> dict[str, list[TensorSource]]:
    """Write a checkpoint's weights (any world size) in Hugging Face's sharded safetensors layout, into the new
    directory ``output``: ``model-0000K-of-0000N.safetensors`` of at most ``max_shard_size`` each (a tensor larger
    than that alone in its shard) and ``model.safetensors.index.json``, or one ``model.safetensors``; ``config``'s
    ``config.json`` copied beside them (and its directory's ``generation_config.json``); a tied parameter written
    once, as transformers writes it. transformers' ``from_pretrained`` reads the result.

    Streamed: each tensor is read from the rank files' memory maps piece by piece (each rank's slice) and written
    as it is read, bf16 throughout, so the host memory it takes is a piece of one tensor beyond the interpreter, at any
    size of model or shard. The values are the trained parameters bit for bit (fp32 masters rounded to nearest, with
    a message). ``key_map``: prefixes renamed, ``{"model.": ""}`` dropping a LightningModule's attribute name.
    The directory appears complete or not at all.

    Returns:
        The files written and the tensors of each.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete, truncated, or needs code to be read.
        FileExistsError: ``output`` exists and is not empty.
        ValueError: an unreadable shard size, config or key map.
    """
    output = Path(output)
    check_new_directory(output)
    parse_size(max_shard_size)
    beside = read_config(config)
    # A tied parameter once, under its first name, as transformers writes it (and ties it again on load).
    sources = map_keys(weight_sources(path, trust_checkpoint=trust_checkpoint, tied_aliases=False), key_map)
    return save_sharded(sources, output, max_shard_size=max_shard_size, beside=beside)


def export_optimizer_state(
    path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    key_map: dict[str, str] | None = None,
    trust_checkpoint: bool = False,
) -> dict[str, list[TensorSource]]:
    """The optimizer state of a checkpoint, streamed as :func:`export_pretrained` streams the weights: a
    ``.safetensors`` file, or a new directory of ``optimizer-0000K-of-0000N.safetensors`` shards with their index.
    Keys ``NAME.exp_avg``, ``NAME.exp_avg_sq``, ``NAME.kahan_comp`` (where the run kept one; bf16 as stored, 8-bit
    codes decoded to float32) and ``NAME.step`` (int64)."""
    output = Path(output)
    reader = open_checkpoint(path, trust_checkpoint=trust_checkpoint)
    sources = map_keys(reader.optimizer_sources(), key_map)
    if output.suffix.lower() == ".safetensors":
        write_file_atomically(sources, output)
        return {output.name: sources}
    check_new_directory(output)
    return save_sharded(sources, output, max_shard_size=max_shard_size, prefix="optimizer")


def write_file_atomically(sources: list[TensorSource], output: str | os.PathLike) -> Path:
    """One safetensors file, streamed, written aside and moved into place complete (an existing file at ``output``
    stays whole until then)."""
    with replaced_atomically(output) as part:
        write_safetensors(part, sources)
    return Path(output)


def consolidate_optimizer_state(
    path: str | os.PathLike, *, trust_checkpoint: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state of a checkpoint written at any world size, per parameter name of the LightningModule.

    Each entry holds the per-element states the run kept (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
    ``kahan_comp``...) shaped as the parameter, bit for bit what the run held (8-bit states and remainders are decoded
    to float32 with their block scales or weights), Adafactor's float32 ``row_var``/``col_var`` or ``variance`` shaped
    as ``torch.optim.Adafactor`` keeps them, and ``step`` (int64). A DeepSpeed bf16-mixed checkpoint gives its fp32
    moments.
    ``trust_checkpoint``: as :func:`validate_checkpoint`'s.

    Raises:
        CheckpointError: if the checkpoint is missing, incomplete, truncated, or needs code to be read.
    """
    reader = open_checkpoint(path, trust_checkpoint=trust_checkpoint)
    step = reader.step()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in reader.iter_params():
        entry = {key: reader.full(name, key).clone() for key in reader.stored_keys(name)}
        entry.update((key, value.clone()) for key, value in reader.statistics(name).items())
        if step is not None:
            entry["step"] = torch.tensor(step, dtype=torch.int64)
        out[name] = entry
    return out


def export_universal_checkpoint(
    path: str | os.PathLike, output: str | os.PathLike, *, tag: str = "universal", trust_checkpoint: bool = False
) -> Path:
    """Write a checkpoint (any world size) in DeepSpeed's universal layout under ``output/tag``
    (``output/latest_universal`` names the tag), to be loaded by DeepSpeed's engine with ``"checkpoint":
    {"load_universal": true}`` at any world size, or by this package.

    Per parameter: ``fp32.pt`` (the weights, exactly), one file per per-element optimizer state (``exp_avg.pt``,
    ``exp_avg_sq.pt``, ...: float32, 8-bit codes decoded), and ``kahan_comp.pt`` when the run kept a Kahan remainder
    (DeepSpeed's loader ignores it). Written to a staging directory, fsynced, and moved into place complete.
    ``trust_checkpoint``: as :func:`validate_checkpoint`'s.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete, truncated, or needs code to be read.
        FileExistsError: ``output/tag`` exists.
    """
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    reader = open_checkpoint(path, trust_checkpoint=trust_checkpoint)
    output = Path(output)
    final = output / tag
    if final.exists():
        raise FileExistsError(f"'{final}' exists; export into a new directory.")
    staged = output / f".{tag}.part"
    if staged.exists():
        shutil.rmtree(staged)
    (staged / "zero").mkdir(parents=True)
    for name in reader.iter_params():
        folder = staged / "zero" / name
        folder.mkdir()
        torch.save({PARAM: reader.full(name).float().clone()}, folder / "fp32.pt")
        for key in reader.stored_keys(name):
            torch.save({PARAM: reader.full(name, key).float().clone()}, folder / f"{key}.pt")
    zero0 = dict(reader.zero_state(0))
    inner = dict(zero0[OPTIMIZER_STATE_DICT])
    # DeepSpeed's loader reads the step of state 0 and the hyperparameters of group 0 from this file.
    inner["state"] = {0: {"step": torch.tensor(float(reader.step() or 0))}}
    zero0.pop("fp32_flat_groups", None)
    zero0[OPTIMIZER_STATE_DICT] = inner
    zero0[PARAM_GROUPS] = inner["param_groups"]
    torch.save(zero0, staged / "zero" / "optimizer_state.pt")
    for f in reader.model_files:
        shutil.copy2(f, staged / f.name)
    fsync_tree(staged)
    output.mkdir(parents=True, exist_ok=True)
    os.replace(staged, final)
    with replaced_atomically(output / "latest_universal") as part:
        part.write_text(tag)
    return final


def save_state_dict(state: dict[str, torch.Tensor], output: str | os.PathLike) -> Path:
    """Write a state dict as ``.safetensors`` (or ``.pt``/``.pth``/``.bin`` with ``torch.save``), atomically and
    durably (an existing file at ``output`` stays whole until the new one is complete on the disk)."""
    output = Path(output)
    suffix = output.suffix.lower()
    if suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise ValueError(f"Unknown output type '{output.suffix}' for '{output}': use .safetensors or .pt.")
    with replaced_atomically(output) as part:
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            # safetensors refuses tensors that share memory; tied weights are written once each.
            save_file({k: v.contiguous().clone() for k, v in state.items()}, str(part))
        else:
            torch.save(state, part)
    return output


__all__ = [
    "CheckpointError",
    "UntrustedCheckpointError",
    "consolidate_checkpoint",
    "consolidate_optimizer_state",
    "export_optimizer_state",
    "export_pretrained",
    "export_universal_checkpoint",
    "open_checkpoint",
    "weight_sources",
    "save_state_dict",
    "state_files",
    "validate_checkpoint",
]
