"""Reading a ZeRO-3 checkpoint at any world size: each parameter's stored values, from the rank files.

A ZeRO-3 checkpoint holds, per rank, one flat partition per sub-group: rank ``r`` has elements
``[r * ceil(n / W), (r + 1) * ceil(n / W))`` of every parameter of ``n`` elements (zero-padded), concatenated in
the sub-group's order (``param_shapes`` in the model-state files). :class:`ZeroCheckpoint` reads any stored value of
one parameter back into its full tensor: the weight, every per-element optimizer state (8-bit codes decoded with
their block scales) and the Kahan remainder (an 8-bit remainder decoded against its weight). The rank files are
memory-mapped, so a reader touches only the pages it needs. Loading it into a live run of another layout is
:mod:`lightning_pure_bf16.repartition`'s job; validating and exporting it, :mod:`lightning_pure_bf16.checkpoint`'s.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_pure_bf16.optim import (
    KAHAN_KEY,
    STATISTICS_KEY,
    is_scale_key,
    quant,
    scale_key,
    statistics_of_pieces,
    zero3_pieces,
)
from lightning_pure_bf16.safe_load import CheckpointError, load_state_file
from lightning_pure_bf16.shards import TensorSource

_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
# The keys of DeepSpeed's model-state file that are DeepSpeed's own (what its engine strips from the client state).
DEEPSPEED_KEYS = (
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "ds_config",
    "ds_version",
)
_EXTRA_KEY = "pure_bf16"


@dataclass(frozen=True)
class _Place:
    sub_group: int
    offset: int  # within each rank's flat partition of the sub-group
    numel: int
    shape: tuple[int, ...]


class ZeroCheckpoint:
    """Reads one tag directory of a DeepSpeed ZeRO-3 checkpoint (this package's or DeepSpeed's own), any world size.

    Args:
        tag_dir: the directory holding ``*_model_states.pt`` and ``*_optim_states.pt``.
        trust: read the files with the full unpickler, which runs any code they name (default: False: the
            weights-only reader of :mod:`lightning_pure_bf16.safe_load`).

    Attributes:
        world_size: the number of ranks that wrote it.
        optim_files: each rank's optimizer-state file, by rank.
        model_files: each rank's model-state file, by rank.
        model_state: rank 0's model-state file (Lightning's loop state inside).
        places: where each trained parameter lies: its sub-group, its offset in each rank's flat partition, its size.
        sub_groups: the parameter names of each sub-group, in partition order.
        param_groups: the optimizer's param groups as saved.
        master_dtype: the dtype of the saved masters (bf16: pure bf16; float32: DeepSpeed's mixed precision).
        bytes_read: tensor data read so far by :meth:`stored`.

    Raises:
        CheckpointError: files missing, incomplete or mixed from two saves, or not a ZeRO-3 checkpoint.
    """

    def __init__(self, tag_dir: str | os.PathLike, *, trust: bool = False) -> None:
        self.dir = Path(tag_dir)
        self._trust = trust
        optim = _rank_files(self.dir, _OPTIM_FILE)
        model = _rank_files(self.dir, _MODEL_FILE)
        if not optim or not model:
            raise CheckpointError(
                f"'{self.dir}' holds no ZeRO-3 model and optimizer state files (zero_pp_rank_*_mp_rank_00_*.pt): it"
                " is not a DeepSpeed ZeRO-3 checkpoint tag directory."
            )
        self.world_size = len(optim)
        if len(model) != self.world_size:
            raise CheckpointError(
                f"'{self.dir}' has {len(optim)} optimizer state files and {len(model)} model state files; a ZeRO-3"
                " checkpoint has one of each per rank. The checkpoint is incomplete."
            )
        self.optim_files, self.model_files = optim, model
        self.model_state: dict[str, Any] = load_state_file(model[0], trust=trust)
        shapes = self.model_state.get("param_shapes")
        if not isinstance(shapes, list):
            raise CheckpointError(f"'{model[0]}' has no ZeRO-3 `param_shapes`: not a ZeRO-3 checkpoint.")
        self.places: dict[str, _Place] = {}
        self.sub_groups: list[list[str]] = []
        for sub_group, names in enumerate(shapes):
            offset = 0
            self.sub_groups.append(list(names))
            for name, shape in names.items():
                numel = math.prod(shape)
                self.places[name] = _Place(sub_group, offset, numel, tuple(shape))
                offset += math.ceil(numel / self.world_size)
        self._zero: dict[int, dict[str, Any]] = {}
        self._models: dict[int, dict[str, Any]] = {}
        self._decoded: dict[tuple[int, int, str], torch.Tensor] = {}
        self._statistics: dict[tuple[int, int], dict[str, dict[str, torch.Tensor]] | None] = {}
        self.bytes_read = 0  # tensor data read by `stored`
        zero0 = self.zero_state(0)
        count = zero0.get("partition_count")
        if isinstance(count, int) and count != self.world_size:
            raise CheckpointError(
                f"'{self.optim_files[0]}' was written by {count} ranks but '{self.dir}' holds {self.world_size}"
                " optimizer state files: the checkpoint is incomplete or mixes two saves."
            )
        inner = zero0["optimizer_state_dict"]
        self.param_groups: list[dict[str, Any]] = inner["param_groups"]
        self.sub_group_to_group = {i: g for g, group in enumerate(self.param_groups) for i in group["params"]}
        self.extra: dict[str, Any] | None = inner.get(_EXTRA_KEY)
        self.master_dtype: torch.dtype = zero0["fp32_flat_groups"][0].dtype

    # -------------------------------------------------------------------------------------------------- reading
    def zero_state(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s ZeRO-3 optimizer state (its flat masters ``fp32_flat_groups`` and the inner optimizer's
        state dict), read on first use."""
        if rank not in self._zero:
            self._zero[rank] = load_state_file(self.optim_files[rank], trust=self._trust)["optimizer_state_dict"]
        return self._zero[rank]

    def inner_state(self, rank: int, sub_group: int) -> dict[str, Any]:
        """The inner optimizer's state of one sub-group's flat partition on rank ``rank``."""
        return self.zero_state(rank)["optimizer_state_dict"]["state"].get(sub_group, {})

    def stored_keys(self, name: str | None = None) -> tuple[str, ...]:
        """The per-element optimizer state the checkpoint holds (``exp_avg``, ``exp_avg_sq``, ``kahan_comp``, ...: every
        state tensor but the step count and the 8-bit block scales): of parameter ``name``, or of any (the param
        groups of one optimizer may keep different states: Muon's matrices a momentum, its AdamW groups two)."""
        sub_groups = [self.places[name].sub_group] if name is not None else range(len(self.sub_groups))
        keys: dict[str, None] = {}
        for sub_group in sub_groups:
            state = self.inner_state(0, sub_group)
            keys.update(
                (k, None)
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.ndim and k != "step" and not is_scale_key(k)
            )
        return tuple(keys)

    def holds_statistics(self) -> bool:
        """Whether the optimizer kept statistics that are not per element (Adafactor's rows and columns)."""
        return any(STATISTICS_KEY in self.inner_state(0, sub) for sub in range(len(self.sub_groups)))

    def statistics(self, name: str) -> dict[str, torch.Tensor]:
        """Parameter ``name``'s float32 statistics that are not per element (Adafactor's), whole and shaped as
        ``torch.optim.Adafactor`` keeps them: a matrix's ``row_var`` (its shape with the last dimension 1) and
        ``col_var`` (the second last 1; every rank holds both whole: rank 0's), a vector's ``variance`` (the
        parameter's shape; each rank holds its run of it: joined in order); empty when the optimizer kept none."""
        sub_group = self.places[name].sub_group
        parts = []
        for rank in range(self.world_size):
            by_name = self._statistics_by_name(rank, sub_group)
            if by_name is None:
                return {}
            part = by_name[name]
            if "variance" not in part:  # rows and columns: whole on every rank
                shape = self.places[name].shape
                return {
                    "row_var": part["row_var"].view(*shape[:-1], 1),
                    "col_var": part["col_var"].view(*shape[:-2], 1, shape[-1]),
                }
            parts.append(part["variance"])
        return {"variance": torch.cat(parts).view(self.places[name].shape)}

    def _statistics_by_name(self, rank: int, sub_group: int) -> dict[str, dict[str, torch.Tensor]] | None:
        """Each parameter's part of rank ``rank``'s statistics of ``sub_group`` (views), worked out once per rank and
        sub-group; ``None`` when the optimizer kept none."""
        key = (rank, sub_group)
        if key not in self._statistics:
            saved = self.inner_state(rank, sub_group).get(STATISTICS_KEY)
            if saved is None:
                self._statistics[key] = None
            else:
                params = [
                    (n, self.places[n].shape, self.places[n].numel, math.ceil(self.places[n].numel / self.world_size))
                    for n in self.sub_groups[sub_group]
                ]
                pieces = zero3_pieces(params, rank, None)
                self._statistics[key] = {q.name: part for q, part in statistics_of_pieces(pieces, saved)}
        return self._statistics[key]

    def step(self) -> int | None:
        """The optimizer step count (the same in every sub-group; checked in the rank files read so far, rank 0's
        always); ``None`` before any step."""
        steps = {
            int(torch.as_tensor(st["step"]).item())
            for rank in sorted({0, *self._zero})
            for sub in range(len(self.sub_groups))
            if "step" in (st := self.inner_state(rank, sub))
        }
        if len(steps) > 1:
            raise CheckpointError(f"'{self.dir}': the sub-groups hold different step counts {sorted(steps)}.")
        return steps.pop() if steps else None

    def stored(self, rank: int, sub_group: int, key: str, start: int, count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of rank ``rank``'s flat partition of ``key`` (``"param"``, a state key,
        or a block-scale key: ``exp_avg_scale`` indexed by block) as stored (8-bit codes not decoded): a view into the
        memory-mapped file, counted in :attr:`bytes_read`."""
        if key == "param":
            flat = self.zero_state(rank)["fp32_flat_groups"][sub_group]
        else:
            flat = self.inner_state(rank, sub_group)[key]
        piece = flat.reshape(-1).narrow(0, start, count)
        self.bytes_read += piece.numel() * piece.element_size()
        return piece

    def _flat(self, rank: int, sub_group: int, key: str) -> torch.Tensor:
        """Rank ``rank``'s flat partition of ``key`` (``"param"`` or a state key), decoded to float when 8-bit."""
        if key == "param":
            return self.zero_state(rank)["fp32_flat_groups"][sub_group].reshape(-1)
        value = self.inner_state(rank, sub_group)[key].reshape(-1)
        if value.is_floating_point():
            return value
        cache_key = (rank, sub_group, key)
        if cache_key not in self._decoded:
            if len(self._decoded) > 8:  # one sub-group at a time, in practice
                self._decoded.clear()
            state = self.inner_state(rank, sub_group)
            if key == KAHAN_KEY:
                decoded = quant.decode_residual(value, self._flat(rank, sub_group, "param"))
            else:  # int8 codes of a signed state (slot 0), uint8 of a non-negative one (slot 1)
                decoded = quant.decode_states(value, state[scale_key(key)], int(value.dtype == torch.uint8))
            self._decoded[cache_key] = decoded
        return self._decoded[cache_key]

    def pieces(self, name: str, key: str = "param") -> Iterator[torch.Tensor]:
        """Parameter ``name``'s ``key`` as each rank holds it: 1-D views into the memory-mapped files (no copy;
        8-bit codes decoded), in order, the padding left off; together the parameter's elements."""
        place = self.places[name]
        part, left = math.ceil(place.numel / self.world_size), place.numel
        for rank in range(self.world_size):
            if left <= 0:
                return
            count = min(part, left)
            yield self._flat(rank, place.sub_group, key).narrow(0, place.offset, count)
            left -= count

    def _model_state_of(self, rank: int) -> dict[str, Any]:
        if rank == 0:
            return self.model_state
        if rank not in self._models:
            self._models[rank] = load_state_file(self.model_files[rank], trust=self._trust)
        return self._models[rank]

    def weight_sources(self, tied_aliases: bool = True) -> list[TensorSource]:
        """Every tensor of the model's state dict, as DeepSpeed's ``zero_to_fp32`` assembles it (buffers, frozen
        parameters, trained parameters, tied aliases; its keys and order), to be read piece by piece: the trained
        weights in bf16 (fp32 masters rounded to nearest, piece by piece), frozen parameters and buffers in their
        stored dtype. ``tied_aliases=False`` leaves out the second name of a tied parameter (``lm_head.weight`` tied
        to the embedding), as transformers' ``save_pretrained`` writes a tied tensor once, under its first name."""
        state = self.model_state
        sources: list[TensorSource] = []
        module = state.get("module") or {}
        for name in state.get("buffer_names") or []:
            if name in module:
                value = module[name]
                sources.append(TensorSource(name, tuple(value.shape), value.dtype, lambda v=value: [v.reshape(-1)]))
        for name, shape in (state.get("frozen_param_shapes") or {}).items():
            shape = tuple(shape)
            dtype = state["frozen_param_fragments"][name].dtype
            sources.append(TensorSource(name, shape, dtype, lambda n=name, s=shape: self._frozen_pieces(n, s)))
        for name in self.iter_params():
            place = self.places[name]
            sources.append(TensorSource(name, place.shape, torch.bfloat16, lambda n=name: self._bf16_pieces(n)))
        by_name = {s.name: s for s in sources}
        for alias, source in (state.get("shared_params") or {}).items() if tied_aliases else ():
            if source in by_name and alias not in by_name:
                original = by_name[source]
                by_name[alias] = TensorSource(alias, original.shape, original.dtype, original.read)
                sources.append(by_name[alias])
        return sources

    def _bf16_pieces(self, name: str) -> Iterator[torch.Tensor]:
        for piece in self.pieces(name):
            yield piece.to(torch.bfloat16)

    def _frozen_pieces(self, name: str, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
        left = math.prod(shape)
        for rank in range(self.world_size):
            if left <= 0:
                return
            fragment = self._model_state_of(rank)["frozen_param_fragments"][name].reshape(-1)
            count = min(fragment.numel(), left)
            yield fragment.narrow(0, 0, count)
            left -= count

    def optimizer_sources(self) -> list[TensorSource]:
        """Per trained parameter ``NAME``: ``NAME.exp_avg``, ``NAME.exp_avg_sq``, ``NAME.kahan_comp`` where kept
        (bf16 as stored; 8-bit codes decoded to float32), Adafactor's float32 ``NAME.row_var``, ``NAME.col_var`` or
        ``NAME.variance`` (:meth:`statistics`) and ``NAME.step`` (int64), to be read piece by piece."""
        step = self.step()
        sources = []
        for name in self.iter_params():
            place = self.places[name]
            for key in self.stored_keys(name):
                stored = self.inner_state(0, place.sub_group)[key]
                dtype = stored.dtype if stored.is_floating_point() else torch.float32
                sources.append(
                    TensorSource(f"{name}.{key}", place.shape, dtype, lambda n=name, k=key: self.pieces(n, k))
                )
            for key, value in self.statistics(name).items():
                sources.append(
                    TensorSource(f"{name}.{key}", tuple(value.shape), torch.float32, lambda v=value: [v.reshape(-1)])
                )
            if step is not None:
                value = torch.tensor([step], dtype=torch.int64)
                sources.append(TensorSource(f"{name}.step", (), torch.int64, lambda v=value: [v]))
        return sources

    def full(self, name: str, key: str = "param") -> torch.Tensor:
        """The whole of parameter ``name``'s ``key`` (``"param"``, ``"exp_avg"``, ``"exp_avg_sq"``, ``"kahan_comp"``),
        in its stored dtype (float32 for 8-bit codes), shaped as the parameter."""
        place = self.places[name]
        part = math.ceil(place.numel / self.world_size)
        pieces = [self._flat(r, place.sub_group, key).narrow(0, place.offset, part) for r in range(self.world_size)]
        return torch.cat(pieces)[: place.numel].view(place.shape)

    def layout(self) -> list[list[list[Any]]]:
        """``[name, numel]`` per parameter of each sub-group, as saved (the shape of the manifest's ``layout``)."""
        return [[[name, self.places[name].numel] for name in names] for names in self.sub_groups]

    def client_state(self) -> dict[str, Any]:
        """What DeepSpeed's load returns to Lightning: the model-state file without DeepSpeed's own keys."""
        return {k: v for k, v in self.model_state.items() if k not in DEEPSPEED_KEYS}

    def iter_params(self) -> Iterator[str]:
        for names in self.sub_groups:
            yield from names


def _rank_files(directory: Path, pattern: re.Pattern[str]) -> list[Path]:
    found = {}
    for p in directory.glob("*.pt"):
        m = pattern.match(p.name)
        if m:
            found[int(m.group(1))] = p
    if found and sorted(found) != list(range(len(found))):
        raise CheckpointError(f"'{directory}' holds the files of ranks {sorted(found)}: some ranks' files are missing.")
    return [found[r] for r in range(len(found))]


__all__ = ["DEEPSPEED_KEYS", "ZeroCheckpoint"]
