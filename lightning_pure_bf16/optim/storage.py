"""Where an optimizer keeps its states: :class:`InMemory`, beside the parameters, or :class:`InFiles`, in one
memory-mapped file per tensor streamed through the update. One object per optimizer, made from ``state_storage`` when
it is built (:func:`make`); the optimizer asks both the same things (make a tensor's buffers, update a range of it,
hand its states to a state dict and take them back, wait for writes, close) and never which one it has.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from lightning_pure_bf16.ops import quant
from lightning_pure_bf16.optim import sharded
from lightning_pure_bf16.optim.mmap_states import MmapStateStore, StateStreamer, check_state_dir, read_ahead
from lightning_pure_bf16.optim.state_dicts import (
    check_saved_buffers,
    encode_float_buffers,
    is_scale_key,
    saveable,
    stored_keys,
)

if TYPE_CHECKING:
    from lightning_pure_bf16.optim.base import PureBF16Optimizer

# The update of one tensor or range with the step's scalars bound, called as ``update(param, grad, states,
# index_offset)``, ``states`` keyed as the optimizer's state.
Update = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int], None]
# A state buffer to make: its key, elements and dtype.
Spec = tuple[str, int, torch.dtype]


def _ranges(
    param: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], start: int, *, flat: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``param``, ``grad`` and the state buffers narrowed to elements ``[start, start + grad.numel())`` (the block
    scales to the blocks they cover); a whole tensor keeps its shape unless ``flat``."""
    n = grad.numel()
    if start == 0 and n == param.numel() and not flat:
        return param, grad, states
    end = start + n
    blocks = slice(start // quant.QBLOCK, -(-end // quant.QBLOCK))
    pieces = {k: v[blocks] if is_scale_key(k) else v.view(-1)[start:end] for k, v in states.items()}
    return param.view(-1)[start:end], grad.reshape(-1), pieces


class InMemory:
    """States as tensors beside their parameters; a DTensor parameter's are DTensors sharded like it (its 8-bit block
    scales: this rank's, plain)."""

    directory: str | None = None

    def set_label(self, label: str) -> None:
        """Nothing is named."""

    def check_param(self, who: str, p: torch.Tensor) -> None:
        """Every parameter's states can be held."""

    def check_kept(self, who: str, doing: str) -> None:
        """The states are always there."""

    def allocate(self, who: str, pending: list[tuple[torch.Tensor, dict[str, Any], list[Spec]]]) -> None:
        """Zero buffers for each ``(parameter, its state, the buffers to make)``."""
        for p, state, specs in pending:
            shard = sharded.local(p)
            for key, numel, dtype in specs:
                block_scales = is_scale_key(key)
                buffer = torch.zeros((numel,) if block_scales else shard.shape, dtype=dtype, device=shard.device)
                state[key] = buffer if block_scales else sharded.like_if_sharded(buffer, p)

    def verify(self, states: Iterable[dict[str, Any]]) -> None:
        """Nothing can change under the optimizer."""

    def update(
        self,
        run: Update,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: dict[str, torch.Tensor],
        *,
        start: int,
        index_offset: int,
        defer_writes: bool,
    ) -> None:
        """``run`` on elements ``[start, start + grad.numel())`` of ``param`` and its ``states`` (local tensors, whole,
        the ones this update writes), the first of them drawing the random bits of element ``index_offset``."""
        param, grad, states = _ranges(param, grad, states, start, flat=False)
        run(param, grad, states, index_offset)

    def wait_for_writes(self) -> None:
        """Every write is done when the update returns."""

    def close(self, states: Iterable[dict[str, Any]]) -> None:
        """The states stay readable."""

    def saveable(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def take_saved(self, optimizer: PureBF16Optimizer, state_dict: dict[str, Any]) -> None:
        """torch's loader puts the saved buffers in place: nothing to take."""

    def put_saved(self, optimizer: PureBF16Optimizer, taken: None) -> None:
        """Nothing was taken."""

    def adopt_copy(self, optimizer: PureBF16Optimizer) -> None:
        """A copy's states are its own tensors already."""


class InFiles:
    """States in one memory-mapped file per tensor, in a directory of the optimizer's own under ``state_dir``,
    streamed through the update in chunks of at most ``chunk`` elements (:class:`StateStreamer`): the device holds
    none of them. The files go when :meth:`close` is called, the object is collected, or the interpreter exits."""

    def __init__(self, state_dir: str | os.PathLike, chunk: int, *, name: str, copy: bool = False) -> None:
        self.chunk, self.name = chunk, name
        who = f"{name}(state_storage='mmap', state_dir={os.fspath(state_dir)!r})" + (" (a copy)" if copy else "")
        self.store = MmapStateStore(check_state_dir(state_dir, who=who), who=who)
        self.streamers: dict[tuple[Any, ...], StateStreamer] = {}
        self.closed = False
        self._finalizer = weakref.finalize(self, _close_files, self.store, self.streamers)

    @property
    def directory(self) -> str:
        return os.fspath(self.store.directory or self.store.root)

    def set_label(self, label: str) -> None:
        """Name the files' directory after ``label`` (a rank, say) instead of host and pid; before any file exists."""
        self.store.label = label

    def check_param(self, who: str, p: torch.Tensor) -> None:
        if sharded.is_dtensor(p):
            raise ValueError(
                f"`{who}(state_storage='mmap')` keeps whole tensors' states in files; a DTensor parameter of shape"
                f" {tuple(p.shape)} (FSDP2, tensor parallelism) has only a shard on this rank. Use"
                " `state_storage='memory'` with sharded parameters."
            )

    def check_kept(self, who: str, doing: str) -> None:
        if self.closed:
            raise RuntimeError(
                f"This {who} was closed and its state files removed: there are no moments to {doing}."
                + (" Save before calling `close()`." if doing == "save" else "")
            )

    def allocate(self, who: str, pending: list[tuple[torch.Tensor, dict[str, Any], list[Spec]]]) -> None:
        """The files of every ``(parameter, its state, the buffers to make)`` at once, after one check that the disk
        has room for all of them (all or none)."""
        for _, state, specs in pending:
            if state["stream"] in self.store.files:
                raise RuntimeError(
                    f"{who}(state_storage='mmap'): a parameter needs the state buffers {[k for k, _, _ in specs]}"
                    " added to its existing state file (its group's `rounding` changed to 'kahan' after its first"
                    " step); that is not supported. Set the rounding before the first step."
                )
        created = self.store.allocate([(state["stream"], [(n, d) for _, n, d in specs]) for _, state, specs in pending])
        for p, state, specs in pending:
            for (key, _, _), flat in zip(specs, created[state["stream"]]):
                state[key] = flat if is_scale_key(key) else flat.view(p.shape)

    def verify(self, states: Iterable[dict[str, Any]]) -> None:
        """Every file still has its size and identity (one ``stat`` each), before any buffer changes."""
        for state in states:
            self.store.verify(state["stream"])

    def update(
        self,
        run: Update,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: dict[str, torch.Tensor],
        *,
        start: int,
        index_offset: int,
        defer_writes: bool,
    ) -> None:
        """As :meth:`InMemory.update`, the states streamed from their files; with ``defer_writes`` it returns before
        the last chunks are written back (:meth:`wait_for_writes`)."""
        n = grad.numel()
        if start:
            # The backward reaches a partition's parameters in the reverse of their order, and the kernel's readahead
            # follows a file forward: the states just before this range are asked for now (asynchronously), to be
            # read from the disk while this range is updated.
            read_ahead([v.view(-1)[max(0, start - n) : start] for k, v in states.items() if not is_scale_key(k)])
        whole = param.view(-1) if param.is_contiguous() else param.contiguous().view(-1)
        flat, grad, pieces = _ranges(whole, grad, states, start, flat=True)
        keys = list(pieces)
        specs = tuple((pieces[k].dtype, quant.QBLOCK if is_scale_key(k) else 1) for k in keys)
        # Slots as large as the largest tensor seen (a power of two), at most `chunk`: small models do not pay for
        # 8 MiB slots. 8-bit moments stream whole scale blocks.
        chunk = min(self.chunk, 1 << max(whole.numel() - 1, 1).bit_length())
        if any(is_scale_key(k) for k in keys):
            chunk = max(chunk, quant.QBLOCK)
        streamer = self.streamers.get((param.device, specs))
        if streamer is None or streamer.chunk < chunk:
            if streamer is not None:
                streamer.close()
            streamer = self.streamers[(param.device, specs)] = StateStreamer(param.device, specs, chunk)

        def forward(chunks: list[torch.Tensor]) -> tuple[Any, ...]:
            return (dict(zip(keys, chunks)),)

        def call(param_chunk, grad_chunk, chunk_states, index_offset):  # noqa: ANN001, ANN202
            run(param_chunk, grad_chunk, chunk_states, index_offset)

        streamer.update(call, flat, grad, [pieces[k] for k in keys], forward, index_offset, defer_writes)
        if not param.is_contiguous():
            param.copy_(whole.view(param.shape))

    def wait_for_writes(self) -> None:
        """Return once every chunk an update computed is back in its file."""
        for streamer in self.streamers.values():
            streamer.wait_for_writes()

    def close(self, states: Iterable[dict[str, Any]]) -> None:
        """Remove the files and stop the streaming threads (idempotent); the states lose their buffers."""
        self._finalizer()
        for state in states:
            for key in stored_keys(state):
                del state[key]
        self.closed = True

    def saveable(self, state: dict[str, Any]) -> dict[str, Any]:
        return saveable(state)

    def take_saved(
        self, optimizer: PureBF16Optimizer, state_dict: dict[str, Any]
    ) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """The saved buffers, checked against the parameters (before anything changes) and taken out of
        ``state_dict["state"]``: they go into fresh files (:meth:`put_saved`), not through the device."""
        taken = check_saved_buffers(optimizer, state_dict)
        state_dict["state"] = {
            index: {k: v for k, v in st.items() if k not in stored_keys(st)}
            for index, st in state_dict["state"].items()
        }
        return taken

    def put_saved(self, optimizer: PureBF16Optimizer, taken: dict[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        """Write the buffers :meth:`take_saved` took into fresh files (the old ones belonged to the replaced state);
        floats saved for 8-bit files are encoded first, as in memory."""
        self.store.release_all()
        groups = {p: g for g in optimizer.param_groups for p in g["params"]}
        optimizer.init_states([(p, groups[p]) for p, buffers in taken.items() if buffers])
        for p, buffers in taken.items():
            state = optimizer.state[p]
            for key, value in encode_float_buffers(optimizer, p, state["stream"], buffers).items():
                if key in state:
                    state[key].view(-1).copy_(value.reshape(-1))

    def adopt_copy(self, optimizer: PureBF16Optimizer) -> None:
        """A copy's moments arrive as plain tensors (see :meth:`__getstate__`): they move into files of its own."""
        self.put_saved(optimizer, {p: {k: st.pop(k) for k in stored_keys(st)} for p, st in optimizer.state.items()})

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, ``pickle``) makes files of its own under the same ``state_dir``; the original's
        are never touched."""
        self.check_kept(self.name, "copy")
        return {"root": os.fspath(self.store.root), "chunk": self.chunk, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], state["chunk"], name=state["name"], copy=True)  # type: ignore[misc]


def make(state_storage: str, state_dir: str | os.PathLike | None, chunk: int, *, name: str) -> InMemory | InFiles:
    """The storage ``state_storage`` names (``"memory"`` or ``"mmap"``, checked by the caller); ``name``: the
    optimizer's, for messages."""
    if state_storage == "mmap":
        return InFiles(state_dir, chunk, name=name)  # type: ignore[arg-type]
    return InMemory()


def _close_files(store: MmapStateStore, streamers: dict[Any, StateStreamer]) -> None:
    for streamer in streamers.values():
        streamer.close()
    streamers.clear()
    store.close()


__all__ = ["InFiles", "InMemory", "make"]
