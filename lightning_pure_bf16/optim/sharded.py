"""Parameters that are DTensors (FSDP2's ``fully_shard``, tensor parallelism, HSDP): the update runs on each rank's
local shard, with the same kernels as any plain tensor.

Only public DTensor API is used (``to_local``, ``from_local``, ``device_mesh``, ``placements``). What this module
decides is where a shard's random bits come from:

* a shard that is one contiguous run of the whole tensor's elements (every placement ``Replicate`` or ``Shard(0)``,
  FSDP2's default) draws the bits of its elements' indices in the whole tensor: the bits do not depend on the number
  of ranks, replicas draw the same bits (so they stay equal), and a run on one process draws the same bits as on many;
* any other shard (``Shard(1)``, a strided shard of FSDP2 over tensor parallelism, or, with 8-bit moments, a shard
  that does not start on a scale block) draws from a seed of its own, derived from the optimizer's seed and the
  shard's position on the mesh (replicas share it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pure_bf16.ops.rng import rank_seed


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (or a parameter holding one). A DTensor exists only once its module is imported, so
    the optimizer does not import it (about 1 s) for a model that has none."""
    module = getattr(torch.distributed, "tensor", None)  # set by that module's import
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself, written in place by the update), or ``t``."""
    return t.to_local() if is_dtensor(t) else t


def like(local_tensor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local_tensor`` (shaped like ``p``'s local shard) as a DTensor sharded like the DTensor ``p``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local_tensor, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def like_if_sharded(local_tensor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`like` for a DTensor ``p``; ``local_tensor`` itself for a plain one."""
    return like(local_tensor, p) if is_dtensor(p) else local_tensor


def dtensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The DTensors among ``tensors``."""
    return [t for t in tensors if is_dtensor(t)]


def checked_local(name: str, p: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The tensor the update writes for the parameter ``p`` and what messages call it, after checking that a DTensor
    parameter's placements can be trained (``name``: who asks)."""
    if not is_dtensor(p):
        return p, "a parameter"
    why = unsupported_placement(p)
    if why is not None:
        raise TypeError(f"{name}: a DTensor parameter of shape {tuple(p.shape)} cannot be trained: {why}.")
    return local(p), "the local shard of a DTensor parameter"


def refuse_dtensor(who: str, p: torch.Tensor, why: str) -> None:
    """``TypeError`` from ``who`` for a DTensor ``p``, saying ``why``."""
    if is_dtensor(p):
        raise TypeError(f"{who}: {why}; this is a DTensor.")


def local_pair(name: str, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors the update writes and reads for ``p``: a DTensor parameter's local shard and its gradient's (after
    checking the gradient is sharded like it), or ``p`` and ``p.grad``."""
    if not is_dtensor(p):
        return p, p.grad
    check_grad(name, p, p.grad)
    return local(p), local(p.grad)


def noise(p: torch.Tensor, seed: int, *, block: int) -> tuple[int, int]:
    """The seed and the index of the first element that the update of ``p`` draws its random bits with: ``seed`` and
    0 for a plain tensor; for a DTensor's shard, its elements' indices in the whole tensor, or a seed of the shard's
    own (see the module's description; ``block``: as :func:`layout`'s)."""
    if not is_dtensor(p):
        return seed, 0
    where = layout(p, block=block)
    return (seed if where.shard is None else rank_seed(seed, where.shard)), where.index_offset


def unsupported_placement(p: torch.Tensor) -> str | None:
    """Why the DTensor ``p`` cannot be a parameter of the optimizer, or ``None``: a ``Partial`` placement is a sum not
    yet taken, not a parameter."""
    for placement in p.placements:
        if placement.is_partial():
            return (
                f"its placements {tuple(p.placements)} include a pending reduction ({placement}); a parameter is"
                " sharded or replicated"
            )
    return None


def check_grad(name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
    """A DTensor parameter's gradient must be a DTensor on the same mesh with the same placements."""
    if not is_dtensor(grad) or grad.device_mesh != p.device_mesh or tuple(grad.placements) != tuple(p.placements):
        got = (
            f"a DTensor with placements {tuple(grad.placements)}"
            if is_dtensor(grad)
            else f"a plain {type(grad).__name__}"
        )
        raise RuntimeError(
            f"{name}: a DTensor parameter of shape {tuple(p.shape)} with placements {tuple(p.placements)} has a"
            f" gradient that is {got}. Its gradient must be sharded like it (FSDP2 and tensor parallelism make it so);"
            " do not replace `.grad` with a tensor of another layout."
        )


@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's shard of a DTensor sits: ``index_offset`` is the index of its first element in the whole
    tensor when the shard is a contiguous run of it (else 0), and ``shard`` the shard's number on the mesh when it
    draws from a seed of its own (else ``None``)."""

    index_offset: int
    shard: int | None


def layout(p: torch.Tensor, *, block: int = 1) -> ShardLayout:
    """The :class:`ShardLayout` of this rank's shard of the DTensor ``p``; a contiguous shard whose offset is not a
    multiple of ``block`` (the 8-bit moments' scale block) draws from a seed of its own."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None or p.ndim == 0:  # this rank holds no shard, or the tensor is a replicated scalar
        return ShardLayout(0, None)
    placements = tuple(p.placements)
    rows, start = p.shape[0], 0
    contiguous = local(p).is_contiguous()
    for dim, placement in enumerate(placements):
        if type(placement) is Shard and placement.dim == 0:
            # torch.chunk's rule, which DTensor shards by: ceil-sized pieces, the last ones short or empty.
            size = mesh.size(dim)
            chunk = -(-rows // size)
            first = min(coordinate[dim] * chunk, rows)
            start += first
            rows = min(chunk, rows - first)
        elif not isinstance(placement, Replicate):
            contiguous = False
    if contiguous and rows == local(p).shape[0]:
        offset = start * (p.numel() // p.shape[0] if p.shape[0] else 0)
        if offset % block == 0:
            return ShardLayout(offset, None)
    # Numbered over the sharded mesh dimensions only: replicas of one shard share its seed.
    shard, stride = 0, 1
    for dim in reversed(range(len(placements))):
        if not isinstance(placements[dim], Replicate):
            shard += coordinate[dim] * stride
            stride *= mesh.size(dim)
    return ShardLayout(0, shard)


def agree_any(flag: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``flag`` (a 0-dim float32, 1.0 for "found") maxed over every rank of the default process group, on the device
    the group communicates on (the first DTensor's mesh device); every rank must call it."""
    device_type = next(p.device_mesh.device_type for p in params if is_dtensor(p))
    device = torch.device(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = flag.reshape(1).to(device, torch.float32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.reshape(())


__all__ = [
    "ShardLayout",
    "agree_any",
    "check_grad",
    "checked_local",
    "dtensors",
    "is_dtensor",
    "layout",
    "like",
    "like_if_sharded",
    "local",
    "local_pair",
    "noise",
    "refuse_dtensor",
    "unsupported_placement",
]
