"""Pure-bf16 training for PyTorch Lightning: bf16 parameters, gradients and optimizer states, no fp32 master copy.

Importing the package registers ``"deepspeed_pure_bf16"``, ``"deepspeed_pure_bf16_kahan"`` and
``"deepspeed_pure_bf16_mmap"`` (optimizer states in memory-mapped files) with Lightning, so
``Trainer(strategy="deepspeed_pure_bf16")`` works in any script or LightningCLI config that imports it.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pure_bf16.checkpoint import CheckpointError, consolidate_checkpoint, consolidate_optimizer_state
from lightning_pure_bf16.optim import Adam, AdamW
from lightning_pure_bf16.optim.mmap_states import StateStorageError
from lightning_pure_bf16.precision import PureBF16Precision
from lightning_pure_bf16.strategy import DeepSpeedPureBF16Strategy

__version__ = "0.1.0"

DeepSpeedPureBF16Strategy.register_strategies(StrategyRegistry)

__all__ = [
    "Adam",
    "AdamW",
    "CheckpointError",
    "DeepSpeedPureBF16Strategy",
    "PureBF16Precision",
    "StateStorageError",
    "__version__",
    "consolidate_checkpoint",
    "consolidate_optimizer_state",
]
