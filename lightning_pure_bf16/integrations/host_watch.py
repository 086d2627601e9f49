"""Told, never silent: a stock Hugging Face host that drops this package's optimizer and trains float32 masters.

A stock ``transformers.Trainer`` with DeepSpeed discards the optimizer given in ``optimizers=`` and trains with a
torch AdamW on float32 master weights (16+ bytes/param), before any code of this package runs again. The optimizer
layer calls :func:`lightning_pure_bf16.optim.register_construction_hook`'s hooks with every optimizer it builds; this
module, installed when the package is imported, notes each one built while a Hugging Face host prepares DeepSpeed
and watches the first optimizer step anywhere: one of this package's optimizers stepping means it is in use (this
package's integrations convert and step it), another one stepping first means the host replaced it, said once on
rank 0. What is noted is the optimizer's class name, not the optimizer: the host drops it, and it is collected before
the first step (``optimizers=(AdamW(model.parameters()), None)`` written inline leaves nothing else referring to it).

Nothing here imports transformers or Accelerate: it reads whether they are set up for DeepSpeed, if they are loaded.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_pure_bf16._log import global_rank
from lightning_pure_bf16.optim import PureBF16Optimizer, register_construction_hook

# Class names of this package's optimizers built while a Hugging Face host prepares DeepSpeed, since the last step.
_built: list[str] = []
_step_hook: Any = None
_construction_hook: Any = None


def host_prepares_deepspeed() -> bool:
    """Whether a Hugging Face host is set up for DeepSpeed: ``TrainingArguments(deepspeed=...)`` holds a live DeepSpeed
    config in transformers (its own test, ``is_deepspeed_zero3_enabled``, reads it), and ``accelerate launch`` with
    DeepSpeed sets ACCELERATE_USE_DEEPSPEED. Both are in place before a user builds the optimizer."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return True
    hf = sys.modules.get("transformers.integrations.deepspeed")  # loaded only if the user's script imported it
    ref = getattr(hf, "_hf_deepspeed_config_weak_ref", None)
    return ref is not None and ref() is not None


def install() -> None:
    """Start watching (once per process: importing the package twice installs one hook)."""
    global _construction_hook
    if _construction_hook is None:
        _construction_hook = register_construction_hook(_on_new_optimizer)


def _on_new_optimizer(optimizer: PureBF16Optimizer) -> None:
    global _step_hook
    if not host_prepares_deepspeed():
        return
    _built.append(type(optimizer).__name__)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_first_step_anywhere)


def _first_step_anywhere(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    global _step_hook
    replaced = [] if isinstance(optimizer, PureBF16Optimizer) else list(_built)
    _built.clear()
    if _step_hook is not None:
        _step_hook.remove()
        _step_hook = None
    if replaced and global_rank() == 0:
        warnings.warn(
            f"`lightning_pure_bf16.{replaced[0]}` was built for a Hugging Face DeepSpeed run, but"
            f" `{type(optimizer).__module__}.{type(optimizer).__name__}` is stepping and it never has: the host"
            " replaced it. A stock `transformers.Trainer` with DeepSpeed discards the optimizer given in `optimizers=`"
            " and trains with torch AdamW on float32 master weights (16+ bytes/param, not pure bf16). Use"
            " `lightning_pure_bf16.integrations.transformers.PureBF16Trainer` (same arguments; it trains with the"
            " optimizer you give it), `pure_bf16_trainer(SFTTrainer)` for a subclass such as TRL's, or"
            " `PureBF16Accelerator` for an Accelerate loop.",
            UserWarning,
            stacklevel=2,
        )


__all__ = ["host_prepares_deepspeed", "install"]
