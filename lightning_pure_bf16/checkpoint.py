"""Checkpoints: an atomic save, a check before any load, and a consolidated bf16 state dict from any world size.

A pure-bf16 checkpoint is DeepSpeed's ZeRO-3 checkpoint directory (one model-state and one optimizer-state file per
rank, Lightning's loop and scheduler state inside rank 0's model-state file) plus ``pure_bf16_checkpoint.json``, a
manifest with the world size and the size of every file. The manifest is written last, and the directory is moved
into place only once it is complete, so an interrupted save leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

MANIFEST = "pure_bf16_checkpoint.json"
TAG = "checkpoint"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".pure_bf16_tmp"
_OLD_SUFFIX = ".pure_bf16_old"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated, or cannot be loaded into this run."""


def staging_path(path: str | os.PathLike) -> Path:
    """Where a save to ``path`` is written before it is moved into place."""
    return Path(f"{os.fspath(path)}{_TMP_SUFFIX}")


def write_manifest(directory: Path, world_size: int, **info: Any) -> None:
    """Record the world size and every file's size; written last, atomically, by one process."""
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"format": FORMAT_VERSION, "world_size": world_size, "tag": TAG, "files": files, **info}
    part = directory / f"{MANIFEST}.part"
    with open(part, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, directory / MANIFEST)


def commit_staged(path: str | os.PathLike) -> None:
    """Move a complete staged save into place; the previous checkpoint is deleted only after that (one process)."""
    target, staged, old = Path(path), staging_path(path), Path(f"{os.fspath(path)}{_OLD_SUFFIX}")
    if old.exists():
        _remove(old)
    if target.exists():
        os.replace(target, old)
    os.replace(staged, target)
    if old.exists():
        _remove(old)


def clear_staging(path: str | os.PathLike) -> None:
    """Remove what an earlier interrupted save to ``path`` left behind (one process, before saving)."""
    staged = staging_path(path)
    if staged.exists():
        _remove(staged)


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


def _master_dtype(directory: Path) -> torch.dtype | None:
    files = _optim_files(directory)
    if not files:
        return None
    try:
        sd = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # noqa: BLE001 - any unreadable file is reported by the caller as what it is
        return None
    groups = sd.get("optimizer_state_dict", {}).get("fp32_flat_groups")
    return groups[0].dtype if groups else None


def validate_checkpoint(path: str | os.PathLike, *, world_size: int | None = None) -> tuple[Path, dict[str, Any]]:
    """Check a checkpoint before anything is loaded from it.

    Args:
        path: the checkpoint directory Lightning was given.
        world_size: the world size of the run that wants to resume it (``None``: any).

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
    if not manifest_path.is_file():
        if _master_dtype(directory) == torch.float32:
            raise CheckpointError(
                f"'{requested}' was written with fp32 master weights (DeepSpeed mixed precision), so its optimizer"
                " state cannot be resumed in pure bf16. Convert its weights with `python -m lightning_pure_bf16."
                f"consolidate {requested} weights.safetensors` and start a new run from them."
            )
        raise CheckpointError(
            f"'{requested}' has no {MANIFEST}: the save that wrote it did not finish (or it was not written by"
            " `deepspeed_pure_bf16`). Use an earlier checkpoint."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"'{manifest_path}' is unreadable ({err}); the checkpoint cannot be trusted.") from err
    for name, size in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"'{file}' is missing from the checkpoint '{requested}'.")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"'{file}' is truncated or was overwritten: {actual} bytes, the checkpoint recorded {size}."
            )
    saved_world = int(manifest["world_size"])
    if world_size is not None and saved_world != world_size:
        raise CheckpointError(
            f"'{requested}' was written by {saved_world} ranks and this run has {world_size}: ZeRO-3 optimizer state"
            " cannot be re-partitioned for pure bf16. Consolidate the weights with `python -m"
            f" lightning_pure_bf16.consolidate {requested} weights.safetensors` and start a new run from them."
        )
    return directory, manifest


def consolidate_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """One bf16 state dict with the LightningModule's keys, from a checkpoint written at any world size.

    The values equal the trained parameters bit for bit. A checkpoint written with fp32 master weights (DeepSpeed
    mixed precision) is converted: its masters are rounded to nearest bf16, and a message says so.

    Raises:
        CheckpointError: if the checkpoint is missing, incomplete or truncated.
    """
    requested = Path(path)
    directory = _recover_path(requested)
    if (directory / MANIFEST).is_file():
        directory, _ = validate_checkpoint(requested)
    elif _master_dtype(directory) != torch.float32:
        validate_checkpoint(requested)  # raises with the reason
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # DeepSpeed's reader prints progress and progress bars; the caller reports what matters.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=_tag(directory))
        except (OSError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"Could not read the checkpoint '{requested}': {err}") from err
    converted = [k for k, v in state.items() if v.dtype == torch.float32]
    trainable_fp32 = _master_dtype(directory) == torch.float32
    if trainable_fp32:
        print(
            f"'{requested}' holds fp32 master weights (DeepSpeed mixed precision): converted {len(converted)} tensors"
            " to bf16, rounding to nearest."
        )
    # DeepSpeed's reader returns floating buffers as fp32; in a pure-bf16 module they are bf16, so this is exact.
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}


def save_state_dict(state: dict[str, torch.Tensor], output: str | os.PathLike) -> Path:
    """Write a state dict as ``.safetensors`` (or ``.pt``/``.pth``/``.bin`` with ``torch.save``), atomically."""
    output = Path(output)
    suffix = output.suffix.lower()
    if suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise ValueError(f"Unknown output type '{output.suffix}' for '{output}': use .safetensors or .pt.")
    part = output.with_name(output.name + ".part")
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        # safetensors refuses tensors that share memory; tied weights are written once each.
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(part))
    else:
        torch.save(state, part)
    os.replace(part, output)
    return output


__all__ = ["CheckpointError", "consolidate_checkpoint", "save_state_dict", "validate_checkpoint"]
