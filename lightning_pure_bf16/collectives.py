"""Bounded temporaries on the CPU: DeepSpeed's gloo all-gather and reduce-scatter, and ZeRO-3's gradient norm, in
pieces. The results are the same elements (the norm: the same up to the order of its float64 additions); the
temporaries no longer grow with the layer. What they replace of DeepSpeed's is reached through
:mod:`lightning_pure_bf16._internals`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from lightning_pure_bf16 import _internals

# Elements per piece of a collective under gloo: its temporaries are at most a few times 64 MiB (bf16), whatever the
# size of the layer. At 64 MiB every such temporary is above glibc's largest dynamic mmap threshold (32 MiB), so it is
# mapped and unmapped, never left in the heap: with 8 MiB pieces a GPT of 4 layers x 2048 peaked 0.29 GiB higher on 2
# CPU ranks than with whole collectives (the pieces raised the threshold and the heap kept what they freed).
COLLECTIVE_PIECE = 1 << 25


class _Done:
    """The handle of a collective that has already finished (what an ``async_op=True`` caller waits on)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _in_pieces(group: Any, *tensors: torch.Tensor) -> bool:
    import torch.distributed as dist

    # Above two pieces only: a piece is staged in a buffer of its own, so a tensor barely larger than one piece would
    # hold more in pieces (its staging and gloo's copy of the piece) than whole (on 16 layers of 37.7M elements, the
    # step's peak grew by 0.12 bytes per parameter).
    return (
        tensors[0].numel() > 2 * COLLECTIVE_PIECE
        and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and dist.get_backend(group) == "gloo"
    )


def all_gather_in_pieces(gather: Callable[..., Any]) -> Callable[..., Any]:
    import torch.distributed as dist

    @functools.wraps(gather)
    def all_gather(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        if not _in_pieces(group, output_tensor, input_tensor):
            return gather(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)
        world, size = dist.get_world_size(group), input_tensor.numel()
        if output_tensor.numel() != world * size:
            return gather(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)
        piece = max(1, COLLECTIVE_PIECE // world)
        staging = torch.empty(world * min(piece, size), dtype=output_tensor.dtype)
        flat_in, out = input_tensor.reshape(-1), output_tensor.view(world, size)
        for start in range(0, size, piece):
            n = min(piece, size - start)
            gathered = staging[: world * n]
            gather(output_tensor=gathered, input_tensor=flat_in[start : start + n], group=group)
            out[:, start : start + n].copy_(gathered.view(world, n))
        return _Done() if async_op else None

    return all_gather


def reduce_scatter_in_pieces(scatter: Callable[..., Any]) -> Callable[..., Any]:
    import torch.distributed as dist

    @functools.wraps(scatter)
    def reduce_scatter(
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        op: Any = None,
        group: Any = None,
        async_op: bool = False,
    ):
        op = dist.ReduceOp.SUM if op is None else op
        if not _in_pieces(group, input_tensor, output_tensor):
            return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world, size = dist.get_world_size(group), output_tensor.numel()
        if input_tensor.numel() != world * size:
            return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        piece = max(1, COLLECTIVE_PIECE // world)
        staging = torch.empty(world * min(piece, size), dtype=input_tensor.dtype)
        rows, flat_out = input_tensor.view(world, size), output_tensor.reshape(-1)
        for start in range(0, size, piece):
            n = min(piece, size - start)
            chunk = staging[: world * n]
            chunk.view(world, n).copy_(rows[:, start : start + n])
            scatter(flat_out[start : start + n], chunk, op=op, group=group)
        return _Done() if async_op else None

    return reduce_scatter


def bounded_gloo_collectives() -> None:
    """Let DeepSpeed's all-gather and reduce-scatter run in pieces of :data:`COLLECTIVE_PIECE` elements under gloo.

    gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` stage the whole tensor in temporaries of their
    own (measured: one output's size for the all-gather, one and a half inputs' for the reduce-scatter), so on the
    CPU every layer ZeRO-3 gathers, and every layer gradient it reduce-scatters, costs one to two more layer-sized
    buffers at the peak of the backward. Piece by piece (each piece staged in one bounded buffer), the result is the
    same elements, reduced in the same order of ranks, and the temporaries no longer grow with the layer. Other
    backends (NCCL), devices and tensors of at most two pieces take DeepSpeed's own call. A finished handle is
    returned to an ``async_op`` caller: with ``gather_cache="layer"`` this strategy turns ZeRO-3's prefetch off, and
    ZeRO-3 waits on each gather at once. Installed on DeepSpeed's communication backend of this process, once.
    """
    _internals.wrap_deepspeed_collectives(all_gather_in_pieces, reduce_scatter_in_pieces)


# Elements per piece of the gradient norm: its float64 temporary is at most 32 MiB, whatever the model's size.
NORM_PIECE = 1 << 22


def gradient_norm_in_pieces(zero_optimizer: Any) -> None:
    """Let ZeRO-3's gradient norm read each gradient partition in pieces of at most :data:`NORM_PIECE` elements.

    ``get_grad_norm_direct`` casts each gradient partition to the norm's dtype (float64 where the device has it)
    before taking its norm: a temporary of 8 bytes per element of the largest partition at the peak of the step (the
    token embedding's is a third of GPT-2's parameters). The sum of the squared norms of the pieces is the squared
    norm of the whole, and DeepSpeed's own function sums the pieces as it sums the parameters (each piece is
    attributed to its parameter, so the model-parallel and expert-parallel rules are unchanged): the norm is the
    same up to the order of the float64 additions, and the temporary is bounded by the piece. Wrapped on this
    optimizer instance only.
    """

    def in_pieces(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def norm(gradients: list[torch.Tensor], params: list[Any], norm_type: float = 2) -> torch.Tensor:
            pieces, owners = [], []
            for g, p in zip(gradients, params):
                parts = g.reshape(-1).split(NORM_PIECE) if g.numel() > NORM_PIECE else (g,)
                pieces.extend(parts)
                owners.extend([p] * len(parts))
            return original(pieces, owners, norm_type)

        return norm

    _internals.wrap_zero3_grad_norm(zero_optimizer, in_pieces)


def squared_norm_in_pieces(t: torch.Tensor) -> torch.Tensor:
    """The squared 2-norm of ``t`` (float64, on its device), summed from pieces of :data:`NORM_PIECE` elements: no
    full-size float64 temporary."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for piece in t.reshape(-1).split(NORM_PIECE):
        total += torch.linalg.vector_norm(piece, dtype=torch.float64).square()
    return total


def zero3_grad_norm(zero_optimizer: Any) -> torch.Tensor:
    """The 2-norm of the gradient over every rank's partition (float32), as ZeRO-3 computes it for clipping: summed
    in float64 from pieces of :data:`NORM_PIECE` elements (no full-size temporary)."""
    import torch.distributed as dist

    grads = _internals.zero3_grad_partition_buffer(zero_optimizer)
    total = squared_norm_in_pieces(grads) if grads is not None else torch.zeros((), dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    return total.sqrt().float()


__all__ = [
    "COLLECTIVE_PIECE",
    "NORM_PIECE",
    "all_gather_in_pieces",
    "bounded_gloo_collectives",
    "gradient_norm_in_pieces",
    "reduce_scatter_in_pieces",
    "squared_norm_in_pieces",
    "zero3_grad_norm",
]
