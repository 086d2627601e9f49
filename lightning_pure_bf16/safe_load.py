"""Reading a checkpoint's files without running code.

A ``.pt`` file is a pickle, and unpickling can call any function the file names: a checkpoint from a colleague, a hub
or a bucket could run a command on every rank that loads it. Every file this package reads from a checkpoint is read
here, with torch's weights-only unpickler and an allowlist of the few classes DeepSpeed writes into the checkpoints of
the configurations this package runs (:func:`checkpoint_safe_globals`). DeepSpeed's own
loader (``weights_only=False``) only ever sees files that passed this check. A file that needs anything else is
refused, naming the file and the types, unless the caller opts in to trusting the checkpoint.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_pure_bf16 import _internals

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
        return _internals.resolve(f"{module}:{name}")
    if module == "torch":
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    return None


def checkpoint_safe_globals() -> list[Any]:
    """The allowlist of :data:`CHECKPOINT_GLOBALS` for torch's weights-only unpickler (``torch.serialization``)."""
    return [_internals.resolve(name) for name in CHECKPOINT_GLOBALS]


# The ways to opt in, in the words of each front end (one message for all: a checkpoint travels between them).
TRUST_OPT_IN = (
    "`DeepSpeedPureBF16Strategy(trust_checkpoint=True)` or `FSDP2PureBF16Strategy(trust_checkpoint=True)` for the"
    " Trainer, `fabric.load(..., weights_only=False)`,"
    " `lightning_pure_bf16.deepspeed.load_checkpoint(..., trust_checkpoint=True)`, `trust_checkpoint=True` on the"
    " consolidation and export functions, or `--trust-checkpoint` on their commands"
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated, corrupted, unsafe to read, or cannot be loaded into this run."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file needs types outside the allowlist to be read: reading it could run code."""


def load_state_file(path: str | os.PathLike, *, trust: bool = False) -> dict[str, Any]:
    """Read one ``.pt`` file of a checkpoint onto the CPU (memory-mapped where the file allows it).

    Args:
        path: the file.
        trust: read it with the full unpickler, which runs whatever code the file names (default: False).

    Raises:
        UntrustedCheckpointError: the file needs a type outside the allowlist (and ``trust`` is False).
        CheckpointError: the file is not a readable torch file.
    """
    path = Path(path)
    with torch.serialization.safe_globals(checkpoint_safe_globals()):
        try:
            return _load(path, trust)
        except pickle.UnpicklingError as err:
            verify_state_file(path)  # a changed byte is reported as what it is, not as a file that would run code
            if trust:
                raise CheckpointError(f"'{path}' is not a readable torch file: {_first_line(err)}") from err
            names = _unsafe_globals(path)
            what = f"the types {', '.join(names)}" if names else "a construct the weights-only reader refuses"
            raise UntrustedCheckpointError(
                f"'{path}' needs {what} to be read, and reading it could run code on this machine: neither DeepSpeed"
                " nor Lightning writes such a file for this strategy. Nothing was loaded. If you trust whoever wrote"
                f" this checkpoint, opt in with {TRUST_OPT_IN}; loading an untrusted file this way can run any"
                " command as you."
            ) from None
        except (RuntimeError, OSError, EOFError, ValueError) as err:
            verify_state_file(path)
            raise CheckpointError(f"'{path}' is unreadable or corrupted: {_first_line(err)}") from err


def check_state_files(paths: Iterable[Path], *, trust: bool = False) -> None:
    """Read every file of ``paths`` as :func:`load_state_file` does (memory-mapped: the tensors' data are not read),
    so that a file that would run code is refused before any other reader sees it. Does nothing when trusted."""
    if trust:
        return
    for path in paths:
        load_state_file(path)


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Python's unpickler restricted to the classes a DCP ``.metadata`` file is made of (the pickle documentation's
    "restricting globals"): any other name in the file stops the read before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        obj = dcp_metadata_global(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return obj


def check_dcp_checkpoint(path: str | os.PathLike, *, trust: bool = False) -> None:
    """Read what PyTorch's loaders would unpickle in a checkpoint written through ``torch.distributed.checkpoint``
    (a folder: DCP's ``.metadata``, which DCP reads with ``pickle.load``, and Lightning's ``meta.pt``), or a single
    torch file, without running code: a file that names anything else is refused before any loader sees it. Does
    nothing when trusted.

    Raises:
        UntrustedCheckpointError: a file needs a type outside the allowlist.
        CheckpointError: the checkpoint or its metadata is missing or unreadable.
    """
    if trust:
        return
    path = Path(path)
    if not path.is_dir():
        load_state_file(path)
        return
    metadata = path / ".metadata"
    if not metadata.is_file():
        raise CheckpointError(
            f"'{path}' is not a torch.distributed.checkpoint folder: it has no '.metadata' file (an interrupted save,"
            " or another kind of checkpoint). Nothing was loaded."
        )
    try:
        with open(metadata, "rb") as f:
            _DCPMetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise UntrustedCheckpointError(
            f"'{metadata}' names {_first_line(err)}, which torch.distributed.checkpoint's metadata never holds, and"
            " reading it (DCP reads it with `pickle.load`) could run code on this machine. Nothing was loaded. If"
            f" you trust whoever wrote this checkpoint, opt in with {TRUST_OPT_IN}; loading an untrusted file this way"
            " can run any command as you."
        ) from None
    except (OSError, EOFError, ValueError, AttributeError, TypeError) as err:
        raise CheckpointError(f"'{metadata}' is unreadable or corrupted: {_first_line(err)}") from err
    for extra in path.glob("*.pt"):
        load_state_file(extra)


def verify_state_file(path: str | os.PathLike) -> None:
    """Check every record of a torch file against the CRC-32 torch's writer stored beside it in the file (a zip
    archive), reading the file once: a changed byte anywhere in it is found. A file in torch's legacy format (before
    torch 1.6) carries no checksums and is refused: nothing could say whether its bytes changed.

    Raises:
        CheckpointError: naming the file and the record whose bytes changed, or a file in the legacy format.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile:
        if _is_legacy(path):
            raise CheckpointError(
                f"'{path}' is in torch's legacy (pre-1.6, not zip) format, which carries no checksums, so whether its"
                " bytes changed cannot be checked. Nothing was loaded. DeepSpeed and this package write the zip"
                " format; if you trust the file's bytes, rewrite it in that format:"
                f" `torch.save(torch.load('{path}', weights_only=True), '{path}')`."
            ) from None
        bad = "its directory of records"
    except (OSError, EOFError) as err:
        raise CheckpointError(f"'{path}' is unreadable: {_first_line(err)}") from err
    if bad is not None:
        raise CheckpointError(
            f"'{path}' is corrupted: {bad} does not match the checksum written with it (a byte changed on the disk or"
            " in a copy). Nothing was loaded. Copy the file again from where it came from, or resume from an earlier"
            " checkpoint."
        )


def _is_legacy(path: Path) -> bool:
    # torch's pre-1.6 format starts with a pickled magic number, not a zip header.
    with open(path, "rb") as f:
        return f.read(2) == b"\x80\x02"


def _load(path: Path, trust: bool) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=not trust)
    except RuntimeError as err:
        # A file in torch's legacy (not zip) format cannot be memory-mapped; it is read whole instead.
        if "mmap" not in str(err):
            raise
    return torch.load(path, map_location="cpu", weights_only=not trust)


def _unsafe_globals(path: Path) -> list[str]:
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - only for the message; the refusal stands without the names
        return []


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


__all__ = [
    "CHECKPOINT_GLOBALS",
    "DCP_METADATA_GLOBALS",
    "checkpoint_safe_globals",
    "dcp_metadata_global",
    "CheckpointError",
    "TRUST_OPT_IN",
    "UntrustedCheckpointError",
    "check_dcp_checkpoint",
    "check_state_files",
    "load_state_file",
    "verify_state_file",
]
