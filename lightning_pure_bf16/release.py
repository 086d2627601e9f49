"""Gradient release under ZeRO-3: each parameter's partition is updated as soon as ZeRO-3 has reduce-scattered its
gradient, and no full-size gradient partition is kept (2 bytes/param less: 6 with bf16 states, 4 with 8-bit moments).

The update is elementwise and its random bits belong to the element's index in the flat sub-group partition, so
updating a parameter's slice of the partition during the backward gives the bits the whole-partition update gives at
the step. What needs every gradient before any update cannot be done this way and is refused at setup (gradient
accumulation, global-norm clipping). With states in files (``state_storage="mmap"``) each slice's states stream from
their files as its gradient arrives: the bf16 weights alone stay in memory, 2 bytes/param. A step cannot be skipped
everywhere once parts of it are applied, so the rule for an inf/NaN gradient is per partition: a parameter's partition
whose gradient is not finite is left as it is, weights and states, and the elements so left are counted and warned
about.

8-bit moments share one scale per :data:`QBLOCK` elements, and a block may hold the end of one parameter and the start
of the next: the parameter's whole blocks are updated at once, and its part of a shared block waits (a copy of at most
``QBLOCK - 1`` gradient elements at each end) until the rest of the block has its gradient. Blocks still waiting at
the step (a neighbour that got no gradient) are updated then, the missing elements with a zero gradient.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from lightning_pure_bf16 import _internals, collectives
from lightning_pure_bf16._log import rank_zero_warn
from lightning_pure_bf16.optim import quant


def check_release_config(who: str, config: dict[str, Any]) -> None:
    """Refuse what gradient release cannot do exactly, before anything is set up.

    With ``state_storage="mmap"`` each released partition's states stream from their files as its gradient arrives,
    so only the bf16 weights stay in memory (2 bytes/param).

    Raises:
        ValueError: gradient accumulation over more than one micro-batch, or gradient clipping; each message says why
            and what to use instead.
    """
    accumulation = config.get("gradient_accumulation_steps", 1)
    if accumulation not in (None, "auto") and int(accumulation) > 1:
        raise ValueError(
            f"`{who}(gradient_release=True)` updates each parameter during the backward, so it cannot accumulate"
            f" gradients over {accumulation} micro-batches (`gradient_accumulation_steps` in the DeepSpeed config, set"
            " by `Trainer(accumulate_grad_batches=...)`, `TrainingArguments(gradient_accumulation_steps=...)` or"
            " `DeepSpeedPlugin(gradient_accumulation_steps=...)`)."
            " Use a larger micro-batch, or leave gradient release off."
        )
    clipping = config.get("gradient_clipping", 0.0)
    if clipping not in (None, "auto") and float(clipping) > 0.0:
        raise ValueError(
            f"`{who}(gradient_release=True)` updates each parameter before the gradient norm over all parameters"
            f" exists, so it cannot clip to a global norm (`gradient_clipping={clipping}` in the DeepSpeed config, set"
            " by `Trainer(gradient_clip_val=...)`, `TrainingArguments(max_grad_norm=...)` or"
            " `DeepSpeedPlugin(gradient_clipping=...)`). Turn clipping off (`gradient_clip_val=None`,"
            " `max_grad_norm=0`, `gradient_clipping=0`), or leave gradient release off."
        )


class GradientRelease:
    """Installed on one ZeRO-3 optimizer: applies each bucket's gradient partitions as they arrive, and does at the
    step what is left (waiting 8-bit blocks, the step counters, the norm and the count of non-finite elements).

    Args:
        zero_optimizer: DeepSpeed's ZeRO-3 optimizer, with the bf16 master partitions aliased to the parameters'.
        strategy_name: for messages.
    """

    def __init__(self, zero_optimizer: Any, strategy_name: str) -> None:
        self.zero = zero_optimizer
        self.strategy_name = strategy_name
        self.optimizer = _internals.zero3_inner_optimizer(zero_optimizer)
        self.sub_groups = list(_internals.zero3_sub_groups(zero_optimizer))
        self.positions = _internals.zero3_param_positions(zero_optimizer)
        self.block = quant.QBLOCK if self.optimizer.moments == "int8" else 1
        device = self.sub_groups[0][0].device if self.sub_groups else torch.device("cpu")
        self._sum_sq = torch.zeros((), dtype=torch.float64, device=device)
        self._skipped = 0  # this rank's elements left as they were this step (non-finite gradient)
        self._seen: set[int] = set()
        # (sub-group, block index) -> [gradient of the block, elements filled, poisoned by a non-finite gradient]
        self._pending: dict[tuple[int, int], list[Any]] = {}
        self.skipped_elements = 0  # all ranks, all steps
        freed = _internals.release_gradient_partitions(zero_optimizer, self.apply)
        _internals.step_without_update(zero_optimizer, self.finish_step)
        gc.collect()
        # Whether the gradient partition's memory really went back: a reference left anywhere (a wrapper's closure,
        # say) would keep the 2 bytes/param while the memory report, which reads ZeRO-3's attribute, says 0.
        self.gradient_partition_freed = freed() is None
        if not self.gradient_partition_freed:
            rank_zero_warn(
                f"{strategy_name}(gradient_release=True): ZeRO-3's gradient partition is still referenced after it was"
                f" released ({gc.get_referrers(freed())[:3]}); its memory is not returned."
            )

    # ------------------------------------------------------------------------------------------ during the backward
    @torch.no_grad()
    def apply(self, params: list[Any], grad_partitions: list[torch.Tensor], has_data: list[bool]) -> None:
        """Update the partitions of one reduce-scattered bucket (on the stream DeepSpeed reduced it on)."""
        if any(p.ds_id in self._seen for p in params):  # checked before any of this bucket is applied
            raise RuntimeError(
                f"{self.strategy_name}(gradient_release=True): a parameter's gradient was reduced twice in one step (a"
                " backward through it more than once, as reentrant activation checkpointing of shared weights does);"
                " its first gradient is already applied. Leave gradient release off for this model."
            )
        self._seen.update(p.ds_id for p in params)
        real = [(p, g) for p, g, d in zip(params, grad_partitions, has_data) if d]
        bad = self.optimizer.nonfinite([g for _, g in real])
        nonfinite = {p.ds_id for (p, _), b in zip(real, bad) if b}
        for param, grad, data in zip(params, grad_partitions, has_data):
            sub_group, offset, numel = self.positions[param.ds_id]
            grad = grad.reshape(-1)[:numel] if data else grad.new_zeros(0)
            poisoned = param.ds_id in nonfinite
            if not poisoned:
                self._sum_sq += collectives.gradient_norm(grad).square()
            self._apply_range(sub_group, offset, numel, grad, poisoned)

    def _apply_range(self, sub_group: int, offset: int, numel: int, grad: torch.Tensor, poisoned: bool) -> None:
        """Elements ``[offset, offset + numel)`` of the sub-group's partition, whose first ``grad.numel()`` have
        ``grad`` and the rest (padding past the parameter's end) a zero gradient."""
        flat, _ = self.sub_groups[sub_group]
        length, b = flat.numel(), self.block
        end, known_end = offset + numel, offset + grad.numel()
        # The blocks wholly inside the range (the partition's last block may be short).
        whole_start = -(-offset // b) * b
        whole_end = max(whole_start, length if end == length else (end // b) * b)
        if whole_end > whole_start and poisoned:
            self._skipped += whole_end - whole_start  # left as they are: weights and states
        elif whole_end > whole_start:
            # The known gradient as a view up to its last whole block; the rest (less than a block plus the padding)
            # as a small copy with zeros.
            cut = max(whole_start, min(whole_end, known_end // b * b))
            if cut > whole_start:
                self._update(sub_group, whole_start, grad[whole_start - offset : cut - offset])
            if whole_end > cut:
                rest = grad.new_zeros(whole_end - cut)
                known = grad[cut - offset : known_end - offset]
                rest[: known.numel()] = known
                self._update(sub_group, cut, rest)
        # The pieces in blocks shared with a neighbour wait for it.
        for lo, hi in ((offset, min(whole_start, end)), (max(whole_end, offset), end)):
            if hi > lo:
                self._stash(sub_group, lo, hi, grad, offset, poisoned)

    def _stash(self, sub_group: int, lo: int, hi: int, grad: torch.Tensor, offset: int, poisoned: bool) -> None:
        flat, _ = self.sub_groups[sub_group]
        b = self.block
        k = lo // b
        block_start, block_end = k * b, min((k + 1) * b, flat.numel())
        entry = self._pending.get((sub_group, k))
        if entry is None:
            entry = self._pending[(sub_group, k)] = [grad.new_zeros(block_end - block_start), 0, False]
        known = grad[max(lo - offset, 0) : max(min(hi - offset, grad.numel()), 0)]
        entry[0][lo - block_start : lo - block_start + known.numel()] = known
        entry[1] += hi - lo
        entry[2] = entry[2] or poisoned
        if entry[1] == block_end - block_start:
            del self._pending[(sub_group, k)]
            self._finish_block(sub_group, block_start, entry)

    def _finish_block(self, sub_group: int, block_start: int, entry: list[Any]) -> None:
        grad, _, poisoned = entry
        if poisoned:
            # A shared 8-bit block has one scale: the neighbour's elements in it are left as they are too.
            self._skipped += int(grad.numel())
            return
        self._update(sub_group, block_start, grad)

    def _update(self, sub_group: int, start: int, grad: torch.Tensor) -> None:
        flat, group = self.sub_groups[sub_group]
        self.optimizer.update_slice(flat, self.optimizer.param_groups[group], grad, start)

    # --------------------------------------------------------------------------------------------------- the step
    @torch.no_grad()
    def finish_step(self) -> float:
        """At ZeRO-3's step: update the blocks still waiting, count the step on every sub-group, and return the
        gradient norm over all ranks (of the gradients applied). Warns when elements were left for a non-finite
        gradient."""
        for (sub_group, k), entry in sorted(self._pending.items()):
            self._finish_block(sub_group, k * self.block, entry)
        self._pending.clear()
        self.optimizer.wait_for_state_writes()  # states in files: the step ends with them in the files
        for flat, _ in self.sub_groups:
            self.optimizer.advance_step(flat)
        _internals.mark_optimizer_stepped(self.optimizer)  # the step happened, in slices: a scheduler may follow it
        totals = torch.stack([self._sum_sq, torch.tensor(float(self._skipped), dtype=torch.float64).to(self._sum_sq)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        norm, skipped = totals.tolist()
        self._sum_sq.zero_()
        self._skipped = 0
        self._seen.clear()
        if skipped:
            self.skipped_elements += int(skipped)
            rank_zero_warn(
                f"{self.strategy_name}(gradient_release=True): {int(skipped):,} gradient elements were inf/NaN; the"
                " partitions holding them were left as they were (weights and optimizer states), the rest of the step"
                f" was applied ({self.skipped_elements:,} elements left so far)."
            )
        return norm**0.5


__all__ = ["GradientRelease", "check_release_config"]
