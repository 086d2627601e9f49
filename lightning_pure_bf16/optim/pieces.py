"""What a tensor the optimizer steps holds of the model's parameters, for the algorithms whose update needs a whole
matrix (Adafactor's row and column statistics, Muon's orthogonalization).

A plain parameter is one piece: all of itself. A ZeRO-3 flat partition holds a run of elements of each parameter of
its sub-group, one after the other; an FSDP2 DTensor's local shard holds a run of rows. :class:`Pieces` says which
runs, of which shapes, and over which process group the other runs live, so an algorithm can sum its statistics over
the ranks or gather a matrix. The ZeRO-3 strategies describe their partitions with
:meth:`~lightning_pure_bf16.optim.base.PureBF16Optimizer.set_pieces`; plain tensors and DTensors describe
themselves (:func:`of_tensor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pure_bf16.optim import sharded


@dataclass(frozen=True)
class Piece:
    """A run of one parameter's elements held by a tensor.

    ``shape`` is the whole parameter's; the tensor holds elements ``[start, start + numel)`` of its flattened form at
    ``[offset, offset + numel)`` of its own, and reserves ``span`` elements there (ZeRO-3 pads every rank's run of a
    parameter to the same length; ``span >= numel``, equal on every rank)."""

    name: str
    shape: tuple[int, ...]
    start: int
    offset: int
    numel: int
    span: int

    @property
    def total(self) -> int:
        """The whole parameter's number of elements."""
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Rows of the factored statistics: every index but the last (``shape[:-1]`` flattened)."""
        return self.total // self.shape[-1] if self.shape and self.shape[-1] else 0

    @property
    def cols(self) -> int:
        """Columns of the factored statistics: the last index within each matrix of the leading dimensions."""
        return self.total // self.shape[-2] if len(self.shape) >= 2 and self.shape[-2] else 0

    def indices(self, begin: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The row and column (as :attr:`rows` and :attr:`cols` count them) of the piece's elements
        ``[begin, end)``, as int64 tensors."""
        c, r = self.shape[-1], self.shape[-2]
        i = torch.arange(self.start + begin, self.start + end, dtype=torch.int64, device=device)
        return i // c, (i // (r * c)) * c + i % c


@dataclass(frozen=True)
class Pieces:
    """Everything a tensor holds, and the process group whose ranks hold the rest of each parameter (``None``: this
    process holds all of every piece). Every rank of the group has the same list of pieces, in the same order."""

    pieces: tuple[Piece, ...]
    group: Any = None

    def world_size(self) -> int:
        if self.group is None or not torch.distributed.is_initialized():
            return 1
        return torch.distributed.get_world_size(self.group)

    def rank(self) -> int:
        return 0 if self.world_size() == 1 else torch.distributed.get_rank(self.group)


def of_tensor(p: torch.Tensor, name: str = "") -> Pieces:
    """A parameter's own description: all of a plain tensor; for a DTensor, its local shard's run of rows (a
    ``Shard(0)`` placement on a one-dimensional mesh, as FSDP2 makes) or all of it (replicated).

    Raises:
        ValueError: a DTensor sharded any other way (the whole-matrix algorithms cannot find its rows).
    """
    shape = tuple(p.shape)
    if not sharded.is_dtensor(p):
        # A parameter ZeRO-3 partitioned at construction (``deepspeed.zero.Init``, Fabric's ``init_module``) is an
        # empty placeholder whose shape as a layer is ``ds_shape``; what the engine steps in its place is described
        # by ``set_pieces`` once the engine is set up.
        shape = tuple(getattr(p, "ds_shape", None) or shape)
        numel = math.prod(shape)
        return Pieces((Piece(name, shape, 0, 0, numel, numel),))
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(p.placements)
    if all(isinstance(q, Replicate) for q in placements):
        return Pieces((Piece(name, shape, 0, 0, p.numel(), p.numel()),))
    if len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
        raise ValueError(
            f"a DTensor of shape {shape} with placements {placements}: Adafactor and Muon need a parameter sharded"
            " by rows on one mesh dimension (`Shard(0)`, as FSDP2 makes), or replicated."
        )
    mesh = p.device_mesh
    local = sharded.local(p)
    per_row = p.numel() // p.shape[0] if p.shape[0] else 0
    chunk = -(-p.shape[0] // mesh.size()) * per_row  # torch.chunk's ceil-sized pieces, the last short or empty
    start = min(mesh.get_local_rank() * chunk, p.numel())
    return Pieces((Piece(name, shape, start, 0, local.numel(), chunk),), mesh.get_group())


def zero3(params: list[tuple[str, tuple[int, ...], int, int]], rank: int, group: Any) -> Pieces:
    """A ZeRO-3 flat partition on ``rank``: ``(name, shape, numel, partition_numel)`` of each parameter of the
    sub-group in partition order; the rank holds elements ``[rank * partition_numel, (rank + 1) * partition_numel)``
    of each, zero-padded past its end."""
    pieces, offset = [], 0
    for name, shape, numel, span in params:
        start = min(rank * span, numel)
        pieces.append(Piece(name, tuple(shape), start, offset, min(span, numel - start), span))
        offset += span
    return Pieces(tuple(pieces), group)


__all__ = ["Piece", "Pieces", "of_tensor", "zero3"]
