"""Precision plugin for pure bf16: the module and floating inputs in bf16, no autocast, no loss scaling."""

from __future__ import annotations

from typing import Literal

from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from typing_extensions import override


class PureBF16Precision(DeepSpeedPrecision):
    """Casts the LightningModule and floating-point batch tensors to bf16; the DeepSpeed engine runs backward and step.

    The Trainer's default precision (``"32-true"``) and ``"bf16-true"`` both mean pure bf16 under
    ``DeepSpeedPureBF16Strategy``; every other flag is refused by the strategy with a message saying what to pass.
    """

    precision: Literal["bf16-true"] = "bf16-true"

    def __init__(self) -> None:
        super().__init__("bf16-true")

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


__all__ = ["PureBF16Precision"]
