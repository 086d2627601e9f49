"""Hugging Face's sharded safetensors layout, written one tensor at a time.

Everything downstream of a fine-tune (transformers' ``from_pretrained``, vLLM, TGI, llama.cpp's converters, the Hub)
reads ``model-00001-of-000NN.safetensors`` files of a bounded size, ``model.safetensors.index.json`` naming the file
of every tensor, and the model's ``config.json`` beside them (one shard: ``model.safetensors`` and no index).

safetensors' own writer takes the whole file's tensors in memory and copies them once more to bytes, so a 5 GB shard
costs 10 GB. The format is a little-endian 8-byte header length, a JSON header of every tensor's dtype, shape and byte
range (data offsets relative to the end of the header, contiguous, in file order), and the raw bytes: with the shapes
known in advance, the header is written first and every tensor's bytes follow as they are read, piece by piece, so
the writer holds no tensor at all. The files are read back with safetensors' own reader in the tests. The split into
shards is huggingface_hub's (``split_torch_state_dict_into_shards``, given meta tensors), so the file names, the
shard boundaries and the index are the ones transformers writes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_pure_bf16.durable import fsync_path, fsync_tree

# safetensors' dtype names.
DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DEFAULT_MAX_SHARD_SIZE = "5GB"


@dataclass(frozen=True)
class TensorSource:
    """A tensor to be written, known by its shape and dtype before any of it is read.

    ``read()`` yields its elements in order as 1-D pieces of ``dtype`` (each rank's slice, say); their lengths add up
    to the tensor's number of elements.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], Iterable[torch.Tensor]]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors(
    path: str | os.PathLike, sources: Sequence[TensorSource], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``sources`` as one safetensors file at ``path`` (not atomic: the callers write to a staging name),
    holding at most one piece of one tensor in memory. Returns the bytes of tensor data written."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for source in sources:
        if source.dtype not in DTYPE_NAMES:
            raise ValueError(f"Tensor {source.name!r} has dtype {source.dtype}, which safetensors cannot store.")
        header[source.name] = {
            "dtype": DTYPE_NAMES[source.dtype],
            "shape": list(source.shape),
            "data_offsets": [offset, offset + source.nbytes],
        }
        offset += source.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors' writer pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for source in sources:
            written = 0
            for piece in source.read():
                if piece.dtype != source.dtype:
                    raise ValueError(f"A piece of {source.name!r} is {piece.dtype}, not {source.dtype}.")
                data = piece.detach().reshape(-1).contiguous()
                if data.numel():
                    f.write(memoryview(data.view(torch.uint8).numpy()))
                written += data.numel()
            if written != source.numel:
                raise ValueError(f"{source.name!r} has {source.numel} elements but {written} were read.")
        f.flush()
        os.fsync(f.fileno())
    return offset


def plan_shards(
    sources: Sequence[TensorSource], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, prefix: str = "model"
) -> dict[str, list[TensorSource]]:
    """The files of Hugging Face's layout and the tensors of each, in order (huggingface_hub's split, as
    transformers' ``save_pretrained`` makes it). ``max_shard_size``: bytes, or a size such as ``"5GB"``, ``"500MB"``.
    A tensor larger than the bound has a shard of its own."""
    from huggingface_hub import split_torch_state_dict_into_shards

    by_name = {s.name: s for s in sources}
    meta = {s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in sources}
    split = split_torch_state_dict_into_shards(
        meta, filename_pattern=prefix + "{suffix}.safetensors", max_shard_size=parse_size(max_shard_size)
    )
    return {file: [by_name[name] for name in names] for file, names in split.filename_to_tensors.items()}


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5,000,000,000 bytes (decimal units, as transformers reads ``max_shard_size``), ``"256MiB"`` ->
    268,435,456 (binary units); a bare number is bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", str(size))
        if match is None or match.group(2).upper() not in _UNITS:
            raise ValueError(
                f"Shard size {size!r} is not a size: give bytes or a number with a unit, such as 5GB, 500MB, 256MiB."
            )
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"Shard size {size!r} must be positive.")
    return value


def rename(name: str, key_map: Mapping[str, str] | None) -> str:
    """Rename by prefix: the first ``old`` prefix of ``key_map`` ``name`` starts with becomes ``new`` (``{"model.":
    ""}`` drops a LightningModule's attribute name). A name that starts with none stays as it is."""
    for old, new in (key_map or {}).items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def map_keys(sources: Sequence[TensorSource], key_map: Mapping[str, str] | None) -> list[TensorSource]:
    """Each source renamed (:func:`rename`), refusing a name lost or given twice."""
    if not key_map:
        return list(sources)
    out, seen = [], {}
    for source in sources:
        name = rename(source.name, key_map)
        if not name:
            raise ValueError(f"The key map {dict(key_map)} leaves {source.name!r} without a name.")
        if name in seen:
            raise ValueError(
                f"The key map {dict(key_map)} gives {seen[name]!r} and {source.name!r} the same name {name!r}."
            )
        seen[name] = source.name
        out.append(TensorSource(name, source.shape, source.dtype, source.read))
    return out


def read_config(config: str | os.PathLike | None) -> dict[str, bytes]:
    """The model's files to put beside the weights: a ``config.json`` (the file, or a directory holding one, checked to
    be a JSON object) and, from a directory that has one, its ``generation_config.json``; by file name."""
    if config is None:
        return {}
    path = Path(config)
    directory = path if path.is_dir() else None
    if directory is not None:
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"No model config at '{path}': give a config.json file or the directory holding it.")
    files = {"config.json": _json_object(path)}
    if directory is not None and (directory / "generation_config.json").is_file():
        files["generation_config.json"] = _json_object(directory / "generation_config.json")
    return files


def _json_object(path: Path) -> bytes:
    data = path.read_bytes()
    try:
        parsed = json.loads(data)
    except ValueError as err:
        raise ValueError(f"'{path}' is not JSON ({err}); give the model's {path.name}.") from err
    if not isinstance(parsed, dict):
        raise ValueError(f"'{path}' holds a JSON {type(parsed).__name__}, not a model config (a JSON object).")
    return data


def check_new_directory(output: Path) -> None:
    """The export goes into a new (or empty) directory: nothing the user saved is overwritten."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"'{output}' exists and is not an empty directory; export into a new directory.")


def save_sharded(
    sources: Sequence[TensorSource],
    output: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    beside: Mapping[str, bytes] | None = None,
    prefix: str = "model",
    replace_weights: bool = False,
    on_staged: Callable[[], None] | None = None,
) -> dict[str, list[TensorSource]]:
    """Write ``sources`` in Hugging Face's layout into the new directory ``output``: staged beside it, fsynced, and
    moved into place complete. With ``replace_weights``, ``output`` may also be a directory holding other files
    (a ``config.json``, a tokenizer): the weight files are staged inside it and replace the previous save's. Returns
    the files and their tensors. ``beside`` are files written with the weights (``config.json``,
    ``generation_config.json``), by name. ``on_staged`` is called once every file is on the disk, before any is
    moved into place (a host writes its own files into ``output`` then)."""
    output = Path(output)
    into_existing = replace_weights and output.is_dir()
    if not into_existing:
        check_new_directory(output)
    shards = plan_shards(sources, parse_size(max_shard_size), prefix)
    # A new directory is staged beside it and appears whole; into a directory that holds other files (a Hugging Face
    # Trainer's output), the files are staged inside it and each moved into place after all are on the disk.
    staged = output / f".{prefix}.part" if into_existing else output.with_name(f".{output.name}.part")
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    index_name = f"{prefix}.safetensors.index.json"
    try:
        total = 0
        for file, members in shards.items():
            total += write_safetensors(staged / file, members)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {s.name: file for file, members in shards.items() for s in members},
            }
            (staged / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for name, data in (beside or {}).items():
            (staged / name).write_bytes(data)
        fsync_tree(staged)
        if on_staged is not None:
            on_staged()
        if into_existing:
            _move_weights_into(staged, output, prefix, sharded=len(shards) > 1)
        else:
            if output.exists():
                output.rmdir()  # empty, checked above
            os.replace(staged, output)
            fsync_path(output.absolute().parent)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return shards


def _move_weights_into(staged: Path, output: Path, prefix: str, *, sharded: bool) -> None:
    """Move the staged files into ``output``: the shards, then the index (the file readers open first), then the
    previous save's weight files that the new one does not have are removed, as ``save_pretrained`` removes them."""
    index_name = f"{prefix}.safetensors.index.json"
    written = {p.name for p in staged.iterdir()}
    for name in sorted(written - {index_name}):
        os.replace(staged / name, output / name)
    if sharded:
        os.replace(staged / index_name, output / index_name)
    stale = re.compile(rf"^{re.escape(prefix)}(-\d{{5}}-of-\d{{5}})?\.safetensors$")
    for old in output.iterdir():
        if old.name not in written and (stale.match(old.name) or (old.name == index_name and not sharded)):
            old.unlink()
    staged.rmdir()
    fsync_path(output)


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "TensorSource",
    "check_new_directory",
    "map_keys",
    "parse_size",
    "plan_shards",
    "read_config",
    "rename",
    "save_sharded",
    "write_safetensors",
]
