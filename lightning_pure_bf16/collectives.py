"""DeepSpeed's collectives under gloo: the all-gather in pieces (bounded temporaries on the CPU, the same elements),
the reduce-scatter as one all-to-all and a local sum (faster than gloo's, with fewer temporaries); and ZeRO-3's
gradient norm in one pass over the gradient (no float64 copy of it). What they replace of DeepSpeed's is reached
through :mod:`lightning_pure_bf16._internals`."""

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
# Elements per float32 accumulator of a reduce-scatter's local sum over more than 2 ranks (4 MiB).
SUM_PIECE = 1 << 20


class _Done:
    """The handle of a collective that has already finished (what an ``async_op=True`` caller waits on)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _on_gloo(group: Any, *tensors: torch.Tensor) -> bool:
    import torch.distributed as dist

    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and dist.get_backend(group) == "gloo"


def _in_pieces(group: Any, *tensors: torch.Tensor) -> bool:
    # Above two pieces only: a piece is staged in a buffer of its own, so a tensor barely larger than one piece would
    # hold more in pieces (its staging and gloo's copy of the piece) than whole (on 16 layers of 37.7M elements, the
    # step's peak grew by 0.12 bytes per parameter).
    return tensors[0].numel() > 2 * COLLECTIVE_PIECE and _on_gloo(group, *tensors)


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


def _sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out = rows[0] + rows[1] + ...``: two rows added as gloo adds them (in float32, rounded once to ``out``'s
    dtype: the same bits); more in a float32 accumulator, in rank order, rounded once."""
    if rows.shape[0] == 2:
        torch.add(rows[0], rows[1], out=out)
        return
    wide = torch.float32 if rows.dtype in (torch.bfloat16, torch.float16) else rows.dtype
    for start in range(0, rows.shape[1], SUM_PIECE):
        columns = rows[:, start : start + SUM_PIECE]
        acc = columns[0].to(wide, copy=True)
        for row in columns[1:]:
            acc.add_(row)
        out[start : start + SUM_PIECE].copy_(acc)


def reduce_scatter_by_exchange(scatter: Callable[..., Any]) -> Callable[..., Any]:
    """A reduce-scatter (sum) under gloo as one all-to-all and a local sum, in pieces of at most
    :data:`COLLECTIVE_PIECE` elements over the ranks.

    gloo's own ``reduce_scatter_tensor`` stages the whole input in temporaries (one and a half inputs, measured),
    and is slower: on 2 CPU ranks a bucket of 5M bf16 elements took 17.3 ms there and 7.6 ms here (``python
    benchmarks/collectives.py``, ``benchmarks/results/collectives.md``). Each rank sends every other rank its row of
    the input, receives theirs, and sums the rows in place of its output: on 2 ranks the same bits as gloo's (one
    float32 addition rounded once), on more a float32 sum in rank order rounded once, which may differ from gloo's
    in the last bit (gloo's own order of partial sums). Temporaries: the received rows (the input's size up to two
    pieces, then one piece per rank) and the rows to send of a piece. One rank, other operations, backends, devices,
    non-contiguous tensors and mismatched sizes take DeepSpeed's own call.
    """
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
        if not _on_gloo(group, input_tensor, output_tensor) or op != dist.ReduceOp.SUM:
            return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world, size = dist.get_world_size(group), output_tensor.numel()
        if world == 1 or input_tensor.numel() != world * size or input_tensor.dtype != output_tensor.dtype:
            return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        rows, flat_out = input_tensor.view(world, size), output_tensor.reshape(-1)
        whole = size <= 2 * max(1, COLLECTIVE_PIECE // world)
        piece = max(1, size) if whole else max(1, COLLECTIVE_PIECE // world)
        received = torch.empty(world * min(piece, size), dtype=input_tensor.dtype)
        sending = None if whole else torch.empty_like(received)
        for start in range(0, size, piece):
            n = min(piece, size - start)
            send = rows.reshape(-1) if whole else sending[: world * n]
            if not whole:
                send.view(world, n).copy_(rows[:, start : start + n])
            recv = received[: world * n]
            dist.all_to_all_single(recv, send, group=group)
            _sum_rows(recv.view(world, n), flat_out[start : start + n])
        return _Done() if async_op else None

    return reduce_scatter


def bounded_gloo_collectives() -> None:
    """Let DeepSpeed's all-gather run in pieces of :data:`COLLECTIVE_PIECE` elements under gloo, and its
    reduce-scatter by exchange (:func:`reduce_scatter_by_exchange`).

    gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` stage the whole tensor in temporaries of their
    own (measured: one output's size for the all-gather, one and a half inputs' for the reduce-scatter), so on the
    CPU every layer ZeRO-3 gathers, and every layer gradient it reduce-scatters, costs one to two more layer-sized
    buffers at the peak of the backward. Piece by piece (each piece staged in one bounded buffer), the gathered
    elements are the same and the temporaries no longer grow with the layer; the reduce-scatter by exchange holds at
    most its input's size below two pieces, and one piece per rank above. Other backends (NCCL), devices, and
    all-gathers of at most two pieces take DeepSpeed's own call. A finished handle is returned to an ``async_op``
    caller: with ``gather_cache="layer"`` this strategy turns ZeRO-3's prefetch off, and ZeRO-3 waits on each gather
    at once. Installed on DeepSpeed's communication backend of this process, once.
    """
    _internals.wrap_deepspeed_collectives(all_gather_in_pieces, reduce_scatter_by_exchange)


# A gradient norm reads the gradient in pieces of NORM_PIECE elements, each converted to float32 by torch before it is
# reduced (a temporary of 4 MiB, which stays in the cache, whatever the model's size), each reduced in rows of
# NORM_ROW elements whose squares are summed in float32 (within a few float32 roundings for a row this short), the
# rows' norms combined in float64.
NORM_PIECE = 1 << 20
NORM_ROW = 1024


def gradient_norm(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of ``t`` (float64, on its device), reading each element once, with a bounded temporary
    (:data:`NORM_PIECE`, :data:`NORM_ROW`).

    An inf or NaN anywhere makes the result inf or NaN, as does a row whose squares pass float32's range (elements
    beyond about 1e17): that gradient counts as non-finite, as under torch's and FSDP2's ``clip_grad_norm_``.
    """
    norms = []
    for piece in t.reshape(-1).split(NORM_PIECE):  # an empty tensor is one empty piece
        whole = piece.numel() // NORM_ROW * NORM_ROW
        norms.append(torch.linalg.vector_norm(piece[:whole].view(-1, NORM_ROW), dim=1, dtype=torch.float32))
        if whole < piece.numel():
            norms.append(torch.linalg.vector_norm(piece[whole:], dtype=torch.float32).reshape(1))
    return torch.linalg.vector_norm(torch.cat(norms), dtype=torch.float64)


def gradient_norm_in_one_pass(zero_optimizer: Any) -> None:
    """Let ZeRO-3's 2-norm of the gradient read each gradient partition once, with a bounded temporary.

    ``get_grad_norm_direct`` casts each gradient partition to float64 before taking its norm: a copy of 8 bytes per
    element, so the norm moves 18 bytes per element (bf16 read, float64 written and read again), more than the
    optimizer's update of the same elements (14). Here each gradient is read once, through float32 pieces of 4 MiB
    small enough to stay in the cache (:func:`gradient_norm`), and handed to DeepSpeed's function as a one-element
    float64 tensor holding its norm, attributed to its own parameter: DeepSpeed's function still sums them under its
    model-parallel and expert-parallel rules, and reduces over the ranks. Other norms (``inf``) take DeepSpeed's path.
    Wrapped on this optimizer instance only.
    """

    def in_one_pass(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def norm(gradients: list[torch.Tensor], params: list[Any], norm_type: float = 2) -> torch.Tensor:
            if float(norm_type) != 2.0:
                return original(gradients, params, norm_type)
            return original([gradient_norm(g).reshape(1) for g in gradients], params, norm_type)

        return norm

    _internals.wrap_zero3_grad_norm(zero_optimizer, in_one_pass)


def zero3_grad_norm(zero_optimizer: Any) -> torch.Tensor:
    """The 2-norm of the gradient over every rank's partition (float32), as ZeRO-3 computes it for clipping
    (:func:`gradient_norm`)."""
    import torch.distributed as dist

    grads = _internals.zero3_grad_partition_buffer(zero_optimizer)
    total = gradient_norm(grads).square() if grads is not None else torch.zeros((), dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    return total.sqrt().float()


__all__ = [
    "COLLECTIVE_PIECE",
    "NORM_PIECE",
    "NORM_ROW",
    "SUM_PIECE",
    "all_gather_in_pieces",
    "bounded_gloo_collectives",
    "gradient_norm_in_one_pass",
    "reduce_scatter_by_exchange",
    "gradient_norm",
    "zero3_grad_norm",
]
