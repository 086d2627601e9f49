"""ZeRO-3 checkpoints at any world size: per-parameter state read from the rank files, written into another layout.

A ZeRO-3 checkpoint holds, per rank, one flat partition per sub-group: rank ``r`` has elements
``[r * ceil(n / W), (r + 1) * ceil(n / W))`` of every parameter of ``n`` elements (zero-padded), concatenated in
the sub-group's order (``param_shapes`` in the model-state files). :class:`ZeroCheckpoint` reads any stored value of
one parameter back into its full tensor: the weight, both moments (8-bit codes decoded with their block scales) and
the Kahan remainder (an 8-bit remainder decoded against its weight). The rank files are memory-mapped, so a reader
touches only the pages it needs.

:func:`load_repartitioned` writes a checkpoint into a live ZeRO-3 optimizer of another world size or sub-group
layout: each rank takes its own slice of every parameter, the weights go into the parameter partitions, the moments
and remainder through :meth:`AdamW.load_state_dict` (which encodes them into the run's formats and storage), with the
saved step, hyperparameters and skipped-step count. A DeepSpeed bf16-mixed checkpoint (fp32 masters, fp32 moments)
loads the same way: the weights are rounded to nearest bf16, the moments to the run's format, and under Kahan the
remainder starts as the master minus its bf16 rounding, so no part of the master is lost.

:func:`export_universal` writes DeepSpeed's universal checkpoint layout (``zero/<param>/fp32.pt``, ``exp_avg.pt``,
``exp_avg_sq.pt`` and, for pure bf16, ``kahan_comp.pt``), which DeepSpeed's engine loads with
``"checkpoint": {"load_universal": true}`` at any world size.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_pure_bf16 import _internals
from lightning_pure_bf16.durable import fsync_tree, replaced_atomically
from lightning_pure_bf16.optim import KAHAN_KEY, STATISTICS_KEY, is_scale_key, quant, scale_key
from lightning_pure_bf16.safe_load import CheckpointError, UntrustedCheckpointError, load_state_file
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


class RepartitionError(RuntimeError):
    """A ZeRO-3 checkpoint cannot be read, or does not fit the model it is loaded into."""


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
    """

    def __init__(self, tag_dir: str | os.PathLike, *, trust: bool = False) -> None:
        self.dir = Path(tag_dir)
        self._trust = trust
        optim = _rank_files(self.dir, _OPTIM_FILE)
        model = _rank_files(self.dir, _MODEL_FILE)
        if not optim or not model:
            raise RepartitionError(
                f"'{self.dir}' holds no ZeRO-3 model and optimizer state files (zero_pp_rank_*_mp_rank_00_*.pt): it"
                " is not a DeepSpeed ZeRO-3 checkpoint tag directory."
            )
        self.world_size = len(optim)
        if len(model) != self.world_size:
            raise RepartitionError(
                f"'{self.dir}' has {len(optim)} optimizer state files and {len(model)} model state files; a ZeRO-3"
                " checkpoint has one of each per rank. The checkpoint is incomplete."
            )
        self._optim_files, self._model_files = optim, model
        self.model_state: dict[str, Any] = _load(model[0], trust)
        shapes = self.model_state.get("param_shapes")
        if not isinstance(shapes, list):
            raise RepartitionError(f"'{model[0]}' has no ZeRO-3 `param_shapes`: not a ZeRO-3 checkpoint.")
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
        self.bytes_read = 0  # tensor data read by `stored`
        zero0 = self._zero_state(0)
        count = zero0.get("partition_count")
        if isinstance(count, int) and count != self.world_size:
            raise RepartitionError(
                f"'{self._optim_files[0]}' was written by {count} ranks but '{self.dir}' holds {self.world_size}"
                " optimizer state files: the checkpoint is incomplete or mixes two saves."
            )
        inner = zero0["optimizer_state_dict"]
        self.param_groups: list[dict[str, Any]] = inner["param_groups"]
        self.sub_group_to_group = {i: g for g, group in enumerate(self.param_groups) for i in group["params"]}
        self.extra: dict[str, Any] | None = inner.get(_EXTRA_KEY)
        self.master_dtype: torch.dtype = zero0["fp32_flat_groups"][0].dtype

    # -------------------------------------------------------------------------------------------------- reading
    def _zero_state(self, rank: int) -> dict[str, Any]:
        if rank not in self._zero:
            self._zero[rank] = _load(self._optim_files[rank], self._trust)["optimizer_state_dict"]
        return self._zero[rank]

    def _inner_state(self, rank: int, sub_group: int) -> dict[str, Any]:
        return self._zero_state(rank)["optimizer_state_dict"]["state"].get(sub_group, {})

    def stored_keys(self, name: str | None = None) -> tuple[str, ...]:
        """The per-element optimizer state the checkpoint holds (``exp_avg``, ``exp_avg_sq``, ``kahan_comp``, ...: every
        state tensor but the step count and the 8-bit block scales): of parameter ``name``, or of any (the param
        groups of one optimizer may keep different states: Muon's matrices a momentum, its AdamW groups two)."""
        sub_groups = [self.places[name].sub_group] if name is not None else range(len(self.sub_groups))
        keys: dict[str, None] = {}
        for sub_group in sub_groups:
            state = self._inner_state(0, sub_group)
            keys.update(
                (k, None)
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.ndim and k != "step" and not is_scale_key(k)
            )
        return tuple(keys)

    def holds_statistics(self) -> bool:
        """Whether the optimizer kept statistics that are not per element (Adafactor's rows and columns)."""
        return any(STATISTICS_KEY in self._inner_state(0, sub) for sub in range(len(self.sub_groups)))

    def step(self) -> int | None:
        """The optimizer step count (the same in every sub-group; checked in the rank files read so far, rank 0's
        always); ``None`` before any step."""
        steps = {
            int(torch.as_tensor(st["step"]).item())
            for rank in sorted({0, *self._zero})
            for sub in range(len(self.sub_groups))
            if "step" in (st := self._inner_state(rank, sub))
        }
        if len(steps) > 1:
            raise RepartitionError(f"'{self.dir}': the sub-groups hold different step counts {sorted(steps)}.")
        return steps.pop() if steps else None

    def stored(self, rank: int, sub_group: int, key: str, start: int, count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of rank ``rank``'s flat partition of ``key`` (``"param"``, a state key,
        or a block-scale key: ``exp_avg_scale`` indexed by block) as stored (8-bit codes not decoded): a view into the
        memory-mapped file, counted in :attr:`bytes_read`."""
        if key == "param":
            flat = self._zero_state(rank)["fp32_flat_groups"][sub_group]
        else:
            flat = self._inner_state(rank, sub_group)[key]
        piece = flat.reshape(-1).narrow(0, start, count)
        self.bytes_read += piece.numel() * piece.element_size()
        return piece

    def _flat(self, rank: int, sub_group: int, key: str) -> torch.Tensor:
        """Rank ``rank``'s flat partition of ``key`` (``"param"`` or a state key), decoded to float when 8-bit."""
        if key == "param":
            return self._zero_state(rank)["fp32_flat_groups"][sub_group].reshape(-1)
        value = self._inner_state(rank, sub_group)[key].reshape(-1)
        if value.is_floating_point():
            return value
        cache_key = (rank, sub_group, key)
        if cache_key not in self._decoded:
            if len(self._decoded) > 8:  # one sub-group at a time, in practice
                self._decoded.clear()
            state = self._inner_state(rank, sub_group)
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
            self._models[rank] = _load(self._model_files[rank], self._trust)
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
        (bf16 as stored; 8-bit codes decoded to float32) and ``NAME.step`` (int64), to be read piece by piece."""
        step = self.step()
        sources = []
        for name in self.iter_params():
            place = self.places[name]
            for key in self.stored_keys(name):
                stored = self._inner_state(0, place.sub_group)[key]
                dtype = stored.dtype if stored.is_floating_point() else torch.float32
                sources.append(
                    TensorSource(f"{name}.{key}", place.shape, dtype, lambda n=name, k=key: self.pieces(n, k))
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
        raise RepartitionError(
            f"'{directory}' holds the files of ranks {sorted(found)}: some ranks' files are missing."
        )
    return [found[r] for r in range(len(found))]


def _load(path: Path, trust: bool) -> dict[str, Any]:
    try:
        return load_state_file(path, trust=trust)
    except UntrustedCheckpointError:
        raise
    except CheckpointError as err:
        raise RepartitionError(str(err)) from err


# ------------------------------------------------------------------------------------------------------ loading
def live_layout(zero_optimizer: Any) -> list[list[list[Any]]]:
    """``[name, numel]`` per parameter of each sub-group of a live ZeRO-3 optimizer (compare with
    :meth:`ZeroCheckpoint.layout`)."""
    return [[[name, numel] for name, numel, _ in sub.params] for sub in _internals.zero3_layout(zero_optimizer)]


# Elements of a live partition written at a time (a multiple of ops.quant.QBLOCK): a piece's temporaries, a few bytes
# per element, stay tens of MB at any model size.
PIECE = 1 << 22


@dataclass(frozen=True)
class _SavedSpan:
    """Elements of one parameter contiguous in this rank's live partition and in one saved rank's."""

    live: int  # offset in this rank's flat partition of the live sub-group
    rank: int  # the saved rank that holds them
    sub_group: int  # their saved sub-group
    saved: int  # their offset in that rank's flat partition of it
    count: int


def _saved_spans(checkpoint: ZeroCheckpoint, params: list[tuple[str, int, int]], rank: int) -> list[_SavedSpan]:
    """Where every element of this rank's live partition (``(name, numel, partition numel)`` per parameter) is saved;
    the partition's padding is in no run."""
    runs, live = [], 0
    for name, numel, part in params:
        place = checkpoint.places[name]
        saved_part = math.ceil(numel / checkpoint.world_size)
        element, end = rank * part, min((rank + 1) * part, numel)
        first = element
        while element < end:
            saved_rank = element // saved_part
            stop = min(end, (saved_rank + 1) * saved_part)
            saved = place.offset + element - saved_rank * saved_part
            runs.append(_SavedSpan(live + element - first, saved_rank, place.sub_group, saved, stop - element))
            element = stop
        live += part
    return runs


def _pieces(runs: list[_SavedSpan], size: int) -> Iterator[tuple[int, int, list[_SavedSpan]]]:
    """``(start, count, runs)`` for each piece of :data:`PIECE` elements of a live partition of ``size``: the runs
    clipped to the piece."""
    i = 0
    for start in range(0, size, PIECE):
        end = min(start + PIECE, size)
        clipped = []
        while i < len(runs) and runs[i].live < end:
            run = runs[i]
            lo, hi = max(run.live, start), min(run.live + run.count, end)
            clipped.append(_SavedSpan(lo, run.rank, run.sub_group, run.saved + lo - run.live, hi - lo))
            if run.live + run.count > end:
                break  # the rest of the run is in the next piece
            i += 1
        yield start, end - start, clipped


def _gathered(
    checkpoint: ZeroCheckpoint, key: str, start: int, count: int, runs: list[_SavedSpan]
) -> dict[str, torch.Tensor]:
    """A piece of ``key`` as stored (floats, or 8-bit codes with ``KEY_scale`` the scale of each element, NaN in the
    padding), from the saved ranks' files."""
    stored = checkpoint._inner_state(0, runs[0].sub_group if runs else 0)[key]  # the format this group kept
    out = {key: torch.zeros(count, dtype=stored.dtype)}
    coded = key != KAHAN_KEY and not stored.is_floating_point()
    if coded:
        out[scale_key(key)] = torch.full((count,), float("nan"))
    for run in runs:
        here = slice(run.live - start, run.live - start + run.count)
        out[key][here] = checkpoint.stored(run.rank, run.sub_group, key, run.saved, run.count)
        if coded:
            first, last = run.saved // quant.QBLOCK, (run.saved + run.count - 1) // quant.QBLOCK
            scales = checkpoint.stored(run.rank, run.sub_group, scale_key(key), first, last - first + 1)
            each = scales.float().repeat_interleave(quant.QBLOCK)
            out[scale_key(key)][here] = each.narrow(0, run.saved - first * quant.QBLOCK, run.count)
    return out


@torch.no_grad()
def load_repartitioned(
    checkpoint: ZeroCheckpoint, zero_optimizer: Any, *, rank: int, load_optimizer_states: bool = True
) -> str:
    """Write ``checkpoint`` into this rank's partitions of a live ZeRO-3 optimizer; returns what was loaded, in words.

    Each rank reads only the saved elements of its own partitions (memory-mapped, a piece of :data:`PIECE` elements at
    a time) and writes them straight into the weights and the optimizer's state buffers
    (:meth:`~lightning_pure_bf16.AdamW.load_state_range`, which keeps the run's formats: 8-bit moments re-blocked, bit
    for bit where a block's codes share one scale). Everything is checked before anything is written: every live
    parameter must be in the checkpoint with its size, and the param groups must match.
    """
    from lightning_pure_bf16.optim import PureBF16Optimizer

    layout = _internals.zero3_layout(zero_optimizer)
    optimizer = _internals.zero3_inner_optimizer(zero_optimizer)
    missing = [n for sub in layout for n, _, _ in sub.params if n not in checkpoint.places]
    if missing:
        raise RepartitionError(
            f"The checkpoint '{checkpoint.dir}' has no parameter {missing[0]!r} ({len(missing)} missing in all): it"
            " was saved from another model."
        )
    for sub in layout:
        for name, numel, _ in sub.params:
            if checkpoint.places[name].numel != numel:
                raise RepartitionError(
                    f"Parameter {name!r} has {numel} elements here and {checkpoint.places[name].numel} in the"
                    f" checkpoint '{checkpoint.dir}': it was saved from another model."
                )
    if load_optimizer_states and len(checkpoint.param_groups) != len(optimizer.param_groups):
        raise RepartitionError(
            f"The checkpoint '{checkpoint.dir}' has {len(checkpoint.param_groups)} parameter groups, this run's"
            f" optimizer {len(optimizer.param_groups)}: configure_optimizers must build the same groups."
        )
    if not isinstance(optimizer, PureBF16Optimizer):
        raise _internals.UpstreamChanged(
            f"ZeRO-3 wraps a {type(optimizer).__name__}, not an optimizer of this package."
        )
    if load_optimizer_states and checkpoint.holds_statistics():
        raise RepartitionError(
            f"The checkpoint '{checkpoint.dir}' was saved by {checkpoint.world_size} rank(s) with an optimizer that"
            " keeps row and column statistics (Adafactor), which cannot be re-partitioned to another world size"
            " yet. Resume on the saved number of ranks, or load the weights only."
        )
    masters = _internals.zero3_master_partitions(zero_optimizer)
    if [m.data_ptr() for m in masters] != [sub.flat.data_ptr() for sub in layout]:
        raise _internals.UpstreamChanged("ZeRO-3's master partitions are not its bf16 parameter partitions.")
    saved_keys = checkpoint.stored_keys()
    step = checkpoint.step()
    fp32_masters = checkpoint.master_dtype == torch.float32
    with_states = load_optimizer_states and step is not None
    optimizer.wait_for_state_writes()
    with _internals.zero3_partitioned_for_load(zero_optimizer):
        for sub, master in zip(layout, masters):
            runs = _saved_spans(checkpoint, sub.params, rank)
            kahan = optimizer.param_groups[sub.group]["rounding"] == "kahan"
            live_keys = optimizer.state_keys(optimizer.param_groups[sub.group])
            for start, count, piece in _pieces(runs, sub.flat.numel()):
                weights = sub.flat.narrow(0, start, count)
                weights.zero_()  # the padding
                for run in piece:
                    saved = checkpoint.stored(run.rank, run.sub_group, "param", run.saved, run.count)
                    weights.narrow(0, run.live - start, run.count).copy_(saved)
                if not with_states:
                    continue
                values: dict[str, torch.Tensor] = {}
                for key in (k for k in saved_keys if k != KAHAN_KEY and k in live_keys):
                    values.update(_gathered(checkpoint, key, start, count, piece))
                if kahan and KAHAN_KEY in saved_keys:
                    values.update(_gathered(checkpoint, KAHAN_KEY, start, count, piece))
                elif kahan:  # none saved: what the bf16 weight does not hold of an fp32 master, else nothing
                    comp = values[KAHAN_KEY] = torch.zeros(count)
                    for run in piece if fp32_masters else ():
                        saved = checkpoint.stored(run.rank, run.sub_group, "param", run.saved, run.count)
                        here = comp.narrow(0, run.live - start, run.count)
                        here.copy_(saved).sub_(saved.to(torch.bfloat16).float())
                if values:
                    optimizer.load_state_range(master, start, values)
            if with_states:
                optimizer.state[master]["step"] = torch.tensor(step, dtype=torch.int64)
    if not load_optimizer_states:
        return "weights"
    for ours, saved in zip(optimizer.param_groups, checkpoint.param_groups):
        # The algorithm's hyperparameters as saved (an LR scheduler's initial_lr too); the rounding stays this run's.
        ours.update({k: saved[k] for k in (*optimizer.defaults, "initial_lr") if k in saved and k != "rounding"})
    skipped = int(checkpoint.extra["skipped_steps"]) if checkpoint.extra else 0
    optimizer.skipped_steps = skipped
    loaded = ["weights"]
    if with_states:
        kept = any(g["rounding"] == "kahan" for g in optimizer.param_groups)
        loaded += [k for k in saved_keys if k != KAHAN_KEY] + ([KAHAN_KEY] if kept else [])
    if fp32_masters and KAHAN_KEY in loaded and KAHAN_KEY not in saved_keys:
        loaded[-1] = "kahan_comp (from the fp32 masters)"
    total = sum(f.stat().st_size for f in checkpoint._optim_files)
    return (
        ", ".join(loaded) + f", step {step or 0}, {skipped} skipped steps; rank {rank} read"
        f" {checkpoint.bytes_read:,} bytes of the {total:,} in the optimizer state files"
    )


# ------------------------------------------------------------------------------------------------ consolidation
def consolidate_optimizer_state(
    tag_dir: str | os.PathLike, *, trust: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name, the optimizer state the run held: ``exp_avg``, ``exp_avg_sq``, ``kahan_comp`` when
    present (bf16 as stored; 8-bit codes decoded to float32 with their block scales) and ``step`` (int64).
    ``trust``: as :class:`ZeroCheckpoint`'s."""
    ckpt = ZeroCheckpoint(tag_dir, trust=trust)
    step = ckpt.step()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in ckpt.iter_params():
        entry = {key: ckpt.full(name, key).clone() for key in ckpt.stored_keys(name)}
        if step is not None:
            entry["step"] = torch.tensor(step, dtype=torch.int64)
        out[name] = entry
    return out


# ---------------------------------------------------------------------------------------------- universal layout
def export_universal(
    tag_dir: str | os.PathLike, output: str | os.PathLike, *, tag: str = "universal", trust: bool = False
) -> Path:
    """Write a ZeRO-3 checkpoint in DeepSpeed's universal layout under ``output/tag`` (``output/latest_universal``
    names the tag), to be loaded by DeepSpeed's engine with ``"checkpoint": {"load_universal": true}`` at any world
    size, or by this package.

    Per parameter: ``fp32.pt`` (the weights, exactly), ``exp_avg.pt`` and ``exp_avg_sq.pt`` (float32, 8-bit moments
    decoded), and ``kahan_comp.pt`` when the run kept a Kahan remainder (DeepSpeed's loader ignores it). Written to a
    staging directory, fsynced, and moved into place complete. ``trust``: as :class:`ZeroCheckpoint`'s.
    """
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    ckpt = ZeroCheckpoint(tag_dir, trust=trust)
    output = Path(output)
    final = output / tag
    if final.exists():
        raise FileExistsError(f"'{final}' exists; export into a new directory.")
    staged = output / f".{tag}.part"
    if staged.exists():
        shutil.rmtree(staged)
    (staged / "zero").mkdir(parents=True)
    for name in ckpt.iter_params():
        folder = staged / "zero" / name
        folder.mkdir()
        torch.save({PARAM: ckpt.full(name).float().clone()}, folder / "fp32.pt")
        for key in ckpt.stored_keys(name):
            torch.save({PARAM: ckpt.full(name, key).float().clone()}, folder / f"{key}.pt")
    zero0 = dict(ckpt._zero_state(0))
    inner = dict(zero0[OPTIMIZER_STATE_DICT])
    step = ckpt.step() or 0
    # DeepSpeed's loader reads the step of state 0 and the hyperparameters of group 0 from this file.
    inner["state"] = {0: {"step": torch.tensor(float(step))}}
    zero0.pop("fp32_flat_groups", None)
    zero0[OPTIMIZER_STATE_DICT] = inner
    zero0[PARAM_GROUPS] = inner["param_groups"]
    torch.save(zero0, staged / "zero" / "optimizer_state.pt")
    for f in ckpt._model_files:
        shutil.copy2(f, staged / f.name)
    fsync_tree(staged)
    output.mkdir(parents=True, exist_ok=True)
    os.replace(staged, final)
    with replaced_atomically(output / "latest_universal") as part:
        part.write_text(tag)
    return final


__all__ = [
    "RepartitionError",
    "ZeroCheckpoint",
    "consolidate_optimizer_state",
    "export_universal",
    "live_layout",
    "load_repartitioned",
]
