"""Optimizer adoption: the user's ``torch.optim.AdamW``/``Adam``/``SGD``/``Adafactor``/``Muon`` becomes the pure-bf16
optimizer of the same algorithm, same hyperparameters.

Front ends (the Trainer strategy, Fabric) call :func:`adopt_optimizer` on what the user built, rebind the user's LR
schedulers with :func:`rebind_scheduler`, and hand the result to ZeRO-3 after :func:`prepare_for_zero3`. Nothing
here needs DeepSpeed or a process group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lightning_pure_bf16._internals import mark_step_for_lr_scheduler
from lightning_pure_bf16._log import rank_zero_info
from lightning_pure_bf16.optim import SGD, Adafactor, Adam, AdamW, Muon, PureBF16Optimizer, rank_seed
from lightning_pure_bf16.optim.options import TORCH_ONLY_GROUP_KEYS, OptimizerOptions, unsupported_torch_options

# The torch.optim optimizers converted, and what each becomes (Adam: see adopt_optimizer).
CONVERSIONS: dict[type, type[PureBF16Optimizer]] = {
    torch.optim.AdamW: AdamW,
    torch.optim.Adam: Adam,
    torch.optim.SGD: SGD,
    torch.optim.Adafactor: Adafactor,
    torch.optim.Muon: Muon,
}
ADOPTABLE = tuple(CONVERSIONS)


def adopt_optimizer(optimizer: Optimizer, options: OptimizerOptions, *, who: str, source: str) -> PureBF16Optimizer:
    """The pure-bf16 optimizer for ``optimizer``: itself if it is one, else a conversion of a fresh torch AdamW, Adam
    or SGD.

    Args:
        optimizer: what the user built.
        options: rounding, seed, backend and state storage for a converted optimizer (a given pure-bf16 optimizer
            keeps its own, but must store its states as ``options`` says).
        who: the user's call, for messages (``"Trainer(strategy='deepspeed_pure_bf16')"``).
        source: where the optimizer came from, for messages (``"configure_optimizers"``).

    Raises:
        TypeError: not a torch AdamW/Adam/SGD/Adafactor/Muon nor a pure-bf16 optimizer.
        ValueError: an option pure bf16 cannot honour (amsgrad, maximize, ...), a torch optimizer that already holds
            state, or a pure-bf16 optimizer with another state storage than ``options``.
    """
    if isinstance(optimizer, PureBF16Optimizer):
        if options.state_storage == "mmap" and optimizer.state_storage != "mmap":
            raise ValueError(
                f"`{who}` keeps optimizer states in memory-mapped files, but got"
                f" `{type(optimizer).__name__}(state_storage={optimizer.state_storage!r})` from `{source}`. Pass"
                " `state_storage='mmap', state_dir=...` to it, or use a `torch.optim.AdamW` and let the strategy"
                " convert it."
            )
        for option in ("moments", "compensation"):
            wanted, given = getattr(options, option), getattr(optimizer, option)
            if wanted != "bf16" and given != wanted:
                raise ValueError(
                    f"`{who}` keeps {option}={wanted!r}, but got"
                    f" `{type(optimizer).__name__}({option}={given!r})` from `{source}`. Pass `{option}={wanted!r}` to"
                    " it, or use a `torch.optim.AdamW` and let the strategy convert it."
                )
        rank_zero_info(f"{who}: using the given {type(optimizer).__name__} as is.")
        return optimizer
    kind = type(optimizer)
    if kind not in ADOPTABLE:
        raise TypeError(
            f"`{who}` can convert `torch.optim.AdamW`, `Adam`, `SGD`, `Adafactor` and `Muon`, but got"
            f" `{kind.__module__}.{kind.__qualname__}` from `{source}`. Use one of those, or this package's"
            " `AdamW`, `Adam`, `Lion`, `SGD`, `Adafactor` or `Muon` directly."
        )
    for group in optimizer.param_groups:
        for option, value in unsupported_torch_options(group).items():
            raise ValueError(
                f"`torch.optim.{kind.__name__}({option}={value!r})` cannot be converted to pure bf16 by `{who}`."
                f" Remove `{option}`."
            )
    if any(len(optimizer.state[p]) for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            f"`{who}` cannot convert a `torch.optim.{kind.__name__}` that already holds state. Create it fresh in"
            f" `{source}`."
        )
    groups = [{k: v for k, v in g.items() if k not in TORCH_ONLY_GROUP_KEYS} for g in optimizer.param_groups]
    kwargs = options.optimizer_kwargs()
    new: PureBF16Optimizer
    if kind is torch.optim.Adam:
        decoupled = bool(optimizer.defaults.get("decoupled_weight_decay", False))
        new = Adam(groups, decoupled_weight_decay=decoupled, **kwargs)
    else:
        new = CONVERSIONS[kind](groups, **kwargs)
    n_params = sum(len(g["params"]) for g in groups)
    rank_zero_info(
        f"{who}: replaced torch.optim.{kind.__name__} with lightning_pure_bf16.{type(new).__name__}"
        f"(rounding={options.rounding!r}, moments={options.moments!r}, state_storage={options.state_storage!r}) on"
        f" {len(groups)} param group(s),"
        f" {n_params} tensors, same hyperparameters."
    )
    return new


def rebind_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point an LR scheduler built on the torch optimizer at the pure-bf16 one (same param group order and keys)."""
    scheduler.optimizer = optimizer
    mark_step_for_lr_scheduler(optimizer)


def prepare_for_zero3(optimizer: PureBF16Optimizer, *, base_seed: int | None, global_rank: int) -> None:
    """Make ``optimizer`` ready to be stepped by ZeRO-3 on rank ``global_rank``.

    Each rank rounds with its own seed (derived from ``base_seed``, else the optimizer's), state files get a
    per-rank label, and the non-finite decision is left to ZeRO-3: it decides for all ranks at once (its all-reduced
    gradient norm) before any partition is updated, while the optimizer sees one sub-group at a time.
    """
    optimizer.seed = rank_seed(base_seed if base_seed is not None else optimizer.seed, global_rank)
    optimizer.set_storage_label(f"rank{global_rank}")
    optimizer.check_nonfinite = False


def adopt_for_zero3(
    optimizer: Optimizer, scheduler: Any, options: OptimizerOptions, *, who: str, source: str, global_rank: int
) -> PureBF16Optimizer:
    """What a Lightning front end does with the optimizer it is given before ZeRO-3 takes it: adopted
    (:func:`adopt_optimizer`), the scheduler built on it (if any) rebound to the adopted one, and prepared for rank
    ``global_rank`` (:func:`prepare_for_zero3`, with the options' seed)."""
    adopted = adopt_optimizer(optimizer, options, who=who, source=source)
    if scheduler is not None and adopted is not optimizer:
        rebind_scheduler(scheduler, adopted)
    prepare_for_zero3(adopted, base_seed=options.seed, global_rank=global_rank)
    return adopted


__all__ = ["ADOPTABLE", "CONVERSIONS", "adopt_for_zero3", "adopt_optimizer", "prepare_for_zero3", "rebind_scheduler"]
