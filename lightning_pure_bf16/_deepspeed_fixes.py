"""Workarounds for DeepSpeed bugs on the pure-bf16 path. Each is applied only around the call that needs it.

ZeRO-3 master aliasing (DeepSpeed 0.18.3 - 0.19.8 at least)
    ``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions`` reuses the parameter partition as the master partition
    only when ``partition.device == self.device``. ``self.device`` is a string (``'cpu'``, ``'cuda:0'``) and a
    ``torch.device`` never equals a string, so with ``bf16_master_weights_and_grads`` it always allocates a second
    bf16 copy of every partition (10 instead of 8 bytes/param). While the partitions are created, ``self.device`` is
    presented as a ``torch.device`` so the comparison means what it says. Once aliased, DeepSpeed's copy back into
    the parameter partition after each step is a copy of a tensor onto itself, which torch skips.
    ``tests/test_deepspeed_fixes.py`` shows the bug and the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def alias_bf16_master_partitions() -> Iterator[None]:
    """Within this context, ZeRO-3 uses the bf16 parameter partitions themselves as its bf16 master partitions."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    original = DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions

    @functools.wraps(original)
    def create_fp32_partitions(self: DeepSpeedZeroOptimizer_Stage3) -> None:
        device = self.device
        if isinstance(device, str) and not self.offload_optimizer:
            self.device = torch.device(device)
        try:
            original(self)
        finally:
            self.device = device

    DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = create_fp32_partitions
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = original


__all__ = ["alias_bf16_master_partitions"]
