"""Pure bf16 for an Accelerate loop: ``PureBF16Accelerator`` in place of ``accelerate.Accelerator``::

    from lightning_pure_bf16.integrations.accelerate import PureBF16Accelerator

    accelerator = PureBF16Accelerator()                      # DeepSpeed ZeRO-3, bf16, 8 bytes/param
    model, optimizer, loader, scheduler = accelerator.prepare(model, torch.optim.AdamW(...), loader, scheduler)
    for batch in loader:
        accelerator.backward(model(**batch).loss)            # DeepSpeed's backward and step, as in any Accelerate loop
        scheduler.step()

Accelerate hands the model and optimizer to ``deepspeed.initialize`` inside ``prepare``; this accelerator routes that
one call to :func:`lightning_pure_bf16.deepspeed.initialize`, so the torch ``AdamW``/``Adam`` becomes the pure-bf16
optimizer (param groups and hyperparameters kept), the master partition is the parameter partition, the states are
allocated at setup and the memory report is logged. ``save_state``/``load_state`` write and read DeepSpeed's layout
through the durable save, with the checks and the re-partitioning to another world size.

Without a ``deepspeed_plugin`` (and without ``accelerate launch --use_deepspeed``) it makes one for ZeRO-3; a plugin
or an ``accelerate config`` file of the user is used as is, and refused if it contradicts pure bf16.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import accelerate
import torch
from accelerate import PartialState
from accelerate.utils import DeepSpeedPlugin

from lightning_pure_bf16 import _internals, zero3_engine
from lightning_pure_bf16 import deepspeed as pure_bf16_deepspeed

WHO = "PureBF16Accelerator"


class PureBF16Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose DeepSpeed engines train in pure bf16.

    Args:
        *args, **kwargs: as ``accelerate.Accelerator``. ``mixed_precision`` must be ``"bf16"`` or left out;
            ``deepspeed_plugin`` defaults to ``DeepSpeedPlugin(zero_stage=3)`` (with ``gradient_clipping=0.0`` under
            gradient release); ``cpu=True`` (or no CUDA device)
            runs DeepSpeed on the CPU over gloo.
        rounding, moments, compensation, state_storage, state_dir, seed, backend, gradient_release, gather_cache:
            keyword options, as :func:`lightning_pure_bf16.deepspeed.initialize` (and the strategies) take them.
        trust_checkpoint: a resume reads files that need code to be read, with the full unpickler (default: False,
            such a file is refused); only for checkpoints whose writer you trust.

    Raises:
        ValueError: a bad option, another ``mixed_precision``, or no DeepSpeed, before Accelerate is set up.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = pure_bf16_deepspeed.take_options(WHO, kwargs)
        precision = kwargs.get("mixed_precision")
        if precision not in (None, "bf16"):
            raise ValueError(
                f"`{WHO}(mixed_precision={precision!r})`: pure bf16 keeps parameters, gradients and optimizer states"
                " in bf16. Pass `mixed_precision='bf16'` or leave it out."
            )
        kwargs["mixed_precision"] = "bf16"
        if kwargs.pop("cpu", False) or not torch.cuda.is_available():
            # The process group on gloo first, as the HF Trainer's `use_cpu` does: Accelerate then sets DeepSpeed up
            # over it (`Accelerator(cpu=True)` alone would drop DeepSpeed).
            PartialState(cpu=True)
        launched_with_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if kwargs.get("deepspeed_plugin") is None and kwargs.get("deepspeed_plugins") is None:
            if not launched_with_deepspeed:
                # With gradient release, no clipping in the plugin this class makes (release refuses it; Accelerate's
                # default plugin would clip to 1.0).
                clip = {"gradient_clipping": 0.0} if options["gradient_release"] else {}
                kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=3, **clip)
        super().__init__(*args, **kwargs)
        # The process group Accelerate created is destroyed at exit if still alive (else a finished run could abort
        # there, exit 134).
        zero3_engine.destroy_process_group_at_exit()
        if self.state.deepspeed_plugin is None:
            raise ValueError(f"`{WHO}` trains through DeepSpeed ZeRO-3, but Accelerate was set up without DeepSpeed.")
        self.pure_bf16_options = options
        _internals.route_accelerate_deepspeed(self, functools.partial(pure_bf16_deepspeed.initialize, **options))


__all__ = ["PureBF16Accelerator"]
