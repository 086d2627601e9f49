"""Hugging Face checkpoints into and out of a module whose parameters ZeRO-3 has partitioned, never gathering the model.

A module built under ZeRO-3's partitioned init (``configure_model`` under the Trainer strategy, ``fabric.init_module()``
under the Fabric one, ``deepspeed.zero.Init``) holds on each rank only its partition of every parameter: the flat
elements ``[rank * n, (rank + 1) * n)`` of the parameter, in ``param.ds_tensor`` (the last rank's padded with zeros).
:func:`load_pretrained` fills those partitions straight from a Hugging Face checkpoint (sharded safetensors with
``model.safetensors.index.json``, one ``model.safetensors``, or any ``.safetensors`` file): safetensors reads a slice
of a tensor from its memory map without reading the rest, so each rank reads only its own elements, and the rise of
its memory is its partition plus one row of the largest tensor. Every name, shape and dtype is checked against the
module before any value is written.

:func:`save_pretrained` is the way back out of a live run: the same layout written from the partitions, one parameter
gathered onto the first rank at a time and streamed into its shard, so no rank ever holds the model.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lightning_pure_bf16 import _internals
from lightning_pure_bf16.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    TensorSource,
    map_keys,
    plan_shards,
    read_config,
    rename,
    save_sharded,
)

INDEX = "model.safetensors.index.json"
_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_OTHERS = {
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

log = logging.getLogger(__name__)


class PretrainedError(ValueError):
    """A checkpoint that does not fit the module (names, shapes, dtypes); raised before anything is written."""


@dataclass
class PretrainedLoad:
    """What :func:`load_pretrained` did: the module's names it found no tensor for, the file's names the module has
    no place for (both empty unless ``strict=False``), and the names converted to the module's dtype (from float32
    or float16, rounded to nearest)."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    converted_keys: list[str] = field(default_factory=list)


def checkpoint_files(path: str | os.PathLike) -> dict[str, Path]:
    """Each tensor's file in a Hugging Face checkpoint: a directory with ``model.safetensors.index.json`` (the
    sharded layout) or one ``model.safetensors``, or a ``.safetensors`` file, or an index file itself."""
    from safetensors import safe_open

    path = Path(path)
    index = path / INDEX if path.is_dir() else path if path.name.endswith(".index.json") else None
    if index is not None and index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise PretrainedError(f"'{index}' is not a safetensors index (no readable 'weight_map'): {err}.") from err
        files = {name: index.parent / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise PretrainedError(f"'{file}', named by '{index}', is missing.")
        return files
    single = path / "model.safetensors" if path.is_dir() else path
    if not single.is_file() or single.suffix != ".safetensors":
        raise PretrainedError(
            f"No safetensors checkpoint at '{path}': give a directory holding {INDEX} (with its shards) or"
            " model.safetensors, or a .safetensors file. A .bin or .pt file: convert it with safetensors first (its"
            " pickle can run code)."
        )
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _module_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every name of the module's state (tied parameters under each of their names), to the tensor behind it."""
    targets: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        targets[name] = param
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is not None and _internals.is_persistent_buffer(mod, buf_name):
                targets[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
    return targets


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.ds_shape) if hasattr(tensor, "ds_id") else tuple(tensor.shape)


def _flat_range(sl, shape: tuple[int, ...], start: int, stop: int, prefix: tuple = ()) -> Iterator[torch.Tensor]:
    """Elements ``[start, stop)`` of the flattened tensor ``sl[prefix]`` of ``shape``, as 1-D pieces: whole rows where
    the range covers them, the two ends' partial rows read by recursion, so nothing outside the range is read."""
    if start >= stop:
        return
    if len(shape) == 1:
        yield sl[(*prefix, slice(start, stop))].reshape(-1)
        return
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:
        yield from _flat_range(sl, shape[1:], start - first * row, stop - first * row, (*prefix, first))
        return
    if start % row:
        yield from _flat_range(sl, shape[1:], start % row, row, (*prefix, first))
        first += 1
    whole_end = last + 1 if stop % row == 0 else last
    if whole_end > first:
        yield sl[(*prefix, slice(first, whole_end))].reshape(-1)
    if stop % row:
        yield from _flat_range(sl, shape[1:], 0, stop % row, (*prefix, last))


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_pretrained(
    module: nn.Module,
    path: str | os.PathLike,
    *,
    key_map: Mapping[str, str] | None = None,
    strict: bool = True,
) -> PretrainedLoad:
    """Load a Hugging Face checkpoint's weights into ``module``, each rank reading only its own partitions.

    Call it on the module ZeRO-3 partitioned at construction: in a LightningModule's ``configure_model`` under
    ``DeepSpeedPureBF16Strategy``, or after building the model in ``fabric.init_module()`` under the Fabric strategy,
    before ``fabric.setup`` (the engine then builds its flat partitions and optimizer state from these values). A
    tensor ZeRO-3 has not partitioned (a module built outside the partitioned init, a buffer) is loaded whole.

    Args:
        module: the model, or the LightningModule holding it.
        path: a directory with ``model.safetensors.index.json`` and its shards, or with ``model.safetensors``; or a
            ``.safetensors`` file.
        key_map: prefixes of the file's names renamed to the module's, the first that matches; ``{"": "model."}``
            for a LightningModule that keeps the model as ``self.model``, ``{"model.": "model.model."}`` and so on.
        strict: refuse a checkpoint whose names and the module's differ (default). With False, the module's
            parameters the file lacks keep their values and the file's extra names are skipped; both are returned.

    Returns:
        The missing, unexpected and converted names.

    Raises:
        PretrainedError: before any value is written, naming what does not fit: missing or unexpected names (with
            ``strict``), a shape that differs, a dtype that cannot be converted (an integer tensor into a float
            parameter, or the reverse); or a parameter gathered at the time (load outside ``GatheredParameters``).
    """
    from safetensors import safe_open

    files = checkpoint_files(path)
    targets = _module_targets(module)
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    renamed: dict[str, str] = {}
    for name in files:
        new = rename(name, key_map)
        if new in renamed:
            raise PretrainedError(f"The key map {dict(key_map or {})} gives {renamed[new]!r} and {name!r} one name.")
        renamed[new] = name
    unexpected = sorted(old for new, old in renamed.items() if new not in targets)  # as the file names them
    # A tied parameter is found under any of its names (checkpoints keep one, such as GPT-2's wte but not lm_head).
    plan: dict[int, tuple[str, str]] = {}
    for name, tensor in targets.items():
        if id(tensor) not in plan and name in renamed:
            plan[id(tensor)] = (name, renamed[name])
    missing = sorted(n for n, t in targets.items() if id(t) not in plan)
    if strict and (missing or unexpected):
        ours, theirs = _listed(sorted(targets)[:3], 3), _listed(sorted(renamed)[:3], 3)
        hint = (
            f" The file's names start {theirs} and the module's {ours}: give key_map={{OLD_PREFIX: NEW_PREFIX}} to"
            " rename, or strict=False to load what matches."
        )
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the module's names are not in the checkpoint: {_listed(missing)}.")
        if unexpected:
            parts.append(f"{len(unexpected)} of the checkpoint's names are not in the module: {_listed(unexpected)}.")
        raise PretrainedError(f"'{path}' does not fit the module. " + " ".join(parts) + hint)

    # Every shape and dtype checked before anything is written.
    handles: dict[Path, object] = {}
    converted: list[str] = []
    work = []
    try:
        for name, file_name in plan.values():
            file = files[file_name]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt").__enter__()
            sl = handles[file].get_slice(file_name)
            shape, kind = tuple(sl.get_shape()), sl.get_dtype()
            tensor = targets[name]
            if shape != _full_shape(tensor):
                raise PretrainedError(
                    f"'{file_name}' in '{file}' has shape {list(shape)}; the module's {name!r} is"
                    f" {list(_full_shape(tensor))}. Is it the same model's checkpoint?"
                )
            source = _FLOATS.get(kind) or _OTHERS.get(kind)
            if source is None or source.is_floating_point != tensor.dtype.is_floating_point:
                raise PretrainedError(
                    f"'{file_name}' in '{file}' is {kind}; the module's {name!r} is {tensor.dtype}, which it cannot"
                    " be converted to."
                )
            if source != tensor.dtype:
                converted.append(name)
            status = getattr(tensor, "ds_status", None)
            if status is not None and status.name != "NOT_AVAILABLE":
                raise PretrainedError(
                    f"{name!r} is gathered ({status.name}): call load_pretrained on the module as it was built,"
                    " before the engine is set up (fabric.setup, the Trainer's fit) and outside"
                    " deepspeed.zero.GatheredParameters."
                )
            if not hasattr(tensor, "ds_id") and tensor.is_meta:
                raise PretrainedError(
                    f"{name!r} is on the meta device (no storage to load into): build the module in"
                    " fabric.init_module() or configure_model under the pure-bf16 strategy, which partitions it."
                )
            work.append((tensor, sl, shape))
        with torch.no_grad():
            for tensor, sl, shape in work:
                _write(tensor, sl, shape)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    if converted and _is_first_rank():
        log.info(
            f"load_pretrained: {len(converted)} tensors of '{path}' converted to the module's dtype (rounded to"
            f" nearest): {_listed(converted, 4)}."
        )
    return PretrainedLoad(missing, unexpected, converted)


def _write(tensor: torch.Tensor, sl, shape: tuple[int, ...]) -> None:
    if not hasattr(tensor, "ds_id"):  # not partitioned: the whole tensor
        if not shape:
            tensor.copy_(sl[()])
            return
        tensor.copy_(torch.cat([p.to(tensor.dtype) for p in _flat_range(sl, shape, 0, math.prod(shape))]).view(shape))
        return
    import torch.distributed as dist

    part = tensor.ds_tensor
    n = int(tensor.partition_numel())
    rank = dist.get_rank(group=tensor.ds_process_group) if dist.is_initialized() else 0
    start, stop = rank * n, min((rank + 1) * n, int(tensor.ds_numel))
    offset = 0
    if not shape:  # a partitioned scalar: rank 0 holds it
        if start < stop:
            part.narrow(0, 0, 1).copy_(sl[()].reshape(1))
        return
    for piece in _flat_range(sl, shape, start, stop) if start < stop else ():
        part.narrow(0, offset, piece.numel()).copy_(piece.to(part.dtype))
        offset += piece.numel()


def _is_first_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


# A partition gathered on a GPU is copied to the host in pieces of this many bytes, so the host holds one at a time.
_HOST_PIECE_BYTES = 64 * 2**20


def _gathered_pieces(tensor: torch.Tensor, numel: int) -> Iterator[torch.Tensor]:
    """The elements of a partitioned parameter in order, on the first rank of its group: every rank's partition sent
    to it (``dist.gather``, a collective every rank of the group enters for the same tensor in the same order), then
    yielded rank by rank without the padding, in host pieces of at most ``_HOST_PIECE_BYTES``. Other ranks yield
    nothing."""
    import torch.distributed as dist

    part = tensor.ds_tensor.detach().reshape(-1)
    group = tensor.ds_process_group
    if not dist.is_initialized():
        yield part[:numel].cpu()
        return
    first = dist.get_rank(group=group) == 0
    received = [torch.empty_like(part) for _ in range(dist.get_world_size(group=group))] if first else None
    dist.gather(part, received, dst=dist.get_global_rank(group, 0), group=group)
    if not first:
        return
    left = numel
    step = max(1, _HOST_PIECE_BYTES // part.element_size())
    for piece in received:
        take = min(left, piece.numel())
        for start in range(0, take, step):
            yield piece[start : min(take, start + step)].cpu()
        left -= take


def _own_pieces(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A tensor every rank holds whole (a buffer, a parameter outside ZeRO-3): the first rank's copy."""
    if _is_first_rank():
        yield tensor.detach().reshape(-1).cpu()


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside what ``fabric.setup`` or ``deepspeed.initialize`` returned, named as the user built it."""
    from deepspeed import DeepSpeedEngine

    from lightning_pure_bf16._internals import fabric_unwrap

    module = fabric_unwrap(module)
    return module.module if isinstance(module, DeepSpeedEngine) else module


def partition_sources(module: nn.Module, names: Sequence[str] | None = None) -> list[TensorSource]:
    """Every tensor of ``module``'s state as a :class:`TensorSource` known by its full shape: a partitioned parameter
    read by gathering its partitions onto the first rank (a collective: every rank reads the sources in the same
    order), anything else from the first rank's own copy. Tied parameters come once, under their first name;
    ``names`` keeps only those names, in that order."""
    targets = _module_targets(_unwrapped(module))
    if names is None:
        seen: set[int] = set()
        names = [n for n, t in targets.items() if not (id(t) in seen or seen.add(id(t)))]
    else:
        unknown = [n for n in names if n not in targets]
        if unknown:
            raise PretrainedError(f"{len(unknown)} names to save are not in the module: {_listed(unknown)}.")
    sources = []
    for name in names:
        tensor = targets[name]
        if tensor.is_meta and not hasattr(tensor, "ds_id"):
            raise PretrainedError(f"{name!r} is on the meta device: it holds no values to save.")
        shape = _full_shape(tensor)
        if hasattr(tensor, "ds_id"):
            read = functools.partial(_gathered_pieces, tensor, math.prod(shape))
        else:
            read = functools.partial(_own_pieces, tensor)
        sources.append(TensorSource(name, shape, tensor.dtype, read))
    return sources


def _outermost_pretrained_model(module: nn.Module) -> nn.Module | None:
    """The one transformers model in ``module`` that no other contains (the LightningModule's ``self.model``), or
    ``None`` where there is none or several."""
    if "transformers" not in sys.modules:  # no transformers model can have been built
        return None
    from transformers import PreTrainedModel

    found: list[nn.Module] = []
    for candidate in module.modules():
        if isinstance(candidate, PreTrainedModel) and not any(candidate in set(f.modules()) for f in found):
            found.append(candidate)
    return found[0] if len(found) == 1 else None


def _model_files(model: nn.Module, dtype: torch.dtype) -> dict[str, bytes]:
    """``config.json`` and ``generation_config.json`` as transformers' ``save_pretrained`` writes them beside the
    weights of ``model`` (its class as the architecture, the weights' dtype)."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    files = {"config.json": config.to_json_string(use_diff=True).encode()}
    generation = getattr(model, "generation_config", None)
    if model.can_generate() and generation is not None:
        files["generation_config.json"] = generation.to_json_string(use_diff=True).encode()
    return files


def save_pretrained(
    module: nn.Module,
    directory: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    key_map: Mapping[str, str] | None = None,
    names: Sequence[str] | None = None,
    config: str | os.PathLike | bytes | None = None,
    on_staged: Callable[[], None] | None = None,
) -> dict[str, list[str]]:
    """Write ``module``'s weights from ZeRO-3's partitions in Hugging Face's layout (the inverse of
    :func:`load_pretrained`), without gathering the model anywhere: one parameter at a time is gathered onto the first
    rank, which streams it into the shard it belongs to and drops it. Call it on every rank, at the same point.

    The first rank writes ``model-0000K-of-0000N.safetensors`` and ``model.safetensors.index.json`` (one
    ``model.safetensors`` when it fits), staged and moved into place complete. A new directory appears whole; into one
    that holds other files (a tokenizer, a ``config.json``), the weight files replace the previous save's. The rise of
    the first rank's memory is the largest parameter (plus a 64 MB host piece of it on a GPU); the other ranks' is
    nothing.

    Args:
        module: the model (or the LightningModule holding it, or what ``fabric.setup`` or ``deepspeed.initialize``
            returned), partitioned by ZeRO-3 or not.
        directory: where the files go.
        max_shard_size: the largest shard, as transformers reads it (default: 5GB).
        key_map: prefixes of the module's names renamed in the files, the first that matches: ``{"model.": ""}``
            drops a LightningModule's attribute name.
        names: the module's names to write (default: every parameter and persistent buffer, tied ones once).
        config: a ``config.json`` (its path, its directory or its bytes) put beside the weights, with the
            directory's ``generation_config.json`` (default: ``None``: the config and generation config of the
            transformers model inside ``module``, as transformers' ``save_pretrained`` writes them, where the files
            hold its names; nothing for another model, or for adapters around it).
        on_staged: called on the first rank once every weight file is on the disk, before they are moved into place
            (a host writes its own files into ``directory`` then).

    Returns:
        Every file written and the names in it.

    Raises:
        PretrainedError: a name to save that the module does not have, a tensor with no storage; ValueError: a bad
            shard size or key map, a config that is not a JSON object; OSError (FileExistsError, PermissionError):
            ``directory`` is a file, not writable, or its disk has less room than the weights. All before anything
            is gathered or written, on every rank.
    """
    import torch.distributed as dist

    sources = map_keys(partition_sources(module, names), key_map)
    if isinstance(config, bytes):
        beside = {"config.json": config}
    elif config is not None:
        beside = read_config(config)
    else:  # a transformers model's own config, as its save_pretrained writes it, where the files hold its names
        model = _outermost_pretrained_model(_unwrapped(module))
        dtype = next((s.dtype for s in sources if s.dtype.is_floating_point), torch.bfloat16)
        fits = model is not None and {s.name for s in sources} <= set(_module_targets(model))
        beside = _model_files(model, dtype) if fits else {}
    plan = plan_shards(sources, max_shard_size)
    directory = Path(directory)
    problem: tuple[type[OSError], str] | None = None
    if _is_first_rank():
        total = sum(s.nbytes for s in sources)
        probe = next((p for p in (directory, *directory.absolute().parents) if p.exists()), Path("/"))
        if directory.exists() and not directory.is_dir():
            problem = (FileExistsError, f"'{directory}' is a file; save the weights into a directory.")
        elif not os.access(probe, os.W_OK):
            problem = (PermissionError, f"'{probe}' is not writable; save the weights elsewhere.")
        elif shutil.disk_usage(probe).free < total:
            free = shutil.disk_usage(probe).free
            problem = (
                OSError,
                f"'{probe}' has {free:,} bytes free; the weights take {total:,}: free room or save elsewhere.",
            )
    if dist.is_initialized():  # every rank stops together, before anything is gathered or written
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem is not None:
        raise problem[0](problem[1])
    if _is_first_rank():
        save_sharded(
            sources,
            directory,
            max_shard_size=max_shard_size,
            beside=beside,
            replace_weights=True,
            on_staged=on_staged,
        )
    else:
        for members in plan.values():
            for source in members:
                for _ in source.read():  # this rank's partition sent to the first rank
                    pass
    if dist.is_initialized():
        dist.barrier()
    return {file: [s.name for s in members] for file, members in plan.items()}


__all__ = [
    "PretrainedError",
    "PretrainedLoad",
    "checkpoint_files",
    "load_pretrained",
    "partition_sources",
    "save_pretrained",
]
