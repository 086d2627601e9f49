"""Pure-bf16 training for PyTorch Lightning: bf16 parameters, gradients and optimizer states, no fp32 master copy.

Importing the package registers ``"deepspeed_pure_bf16"`` and its presets (``_kahan``, ``_int8``, ``_int8_kahan``,
``_release``, ``_int8_release``, ``_mmap``, ``_mmap_release``, ``_int8_mmap_release``) with Lightning's Trainer and
with Fabric, so ``Trainer(strategy="deepspeed_pure_bf16")`` and ``Fabric(strategy="deepspeed_pure_bf16")`` work in any
script or LightningCLI config that imports it; and ``"fsdp2_pure_bf16"`` (with ``_kahan``, ``_int8``, ``_int8_kahan``,
``_release``, ``_int8_release``) with the Trainer, for models that shard themselves with PyTorch FSDP2.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_pure_bf16.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    consolidate_optimizer_state,
    export_pretrained,
)
from lightning_pure_bf16.data import resume_fabric_dataloader
from lightning_pure_bf16.fabric import DeepSpeedPureBF16FabricStrategy
from lightning_pure_bf16.fsdp2 import FSDP2PureBF16Strategy
from lightning_pure_bf16.hf_models import from_pretrained
from lightning_pure_bf16.integrations import host_watch
from lightning_pure_bf16.optim import Adam, AdamW
from lightning_pure_bf16.optim.mmap_states import StateStorageError
from lightning_pure_bf16.precision import PureBF16FabricPrecision, PureBF16Precision
from lightning_pure_bf16.pretrained import PretrainedError, load_pretrained, save_pretrained
from lightning_pure_bf16.strategy import DeepSpeedPureBF16Strategy

__version__ = "0.1.0"

DeepSpeedPureBF16Strategy.register_strategies(StrategyRegistry)
DeepSpeedPureBF16FabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
FSDP2PureBF16Strategy.register_strategies(StrategyRegistry)
# A stock Hugging Face host that drops this package's optimizer is told about (imports neither transformers nor
# Accelerate).
host_watch.install()

__all__ = [
    "Adam",
    "AdamW",
    "CheckpointError",
    "DeepSpeedPureBF16FabricStrategy",
    "DeepSpeedPureBF16Strategy",
    "FSDP2PureBF16Strategy",
    "PureBF16FabricPrecision",
    "PureBF16Precision",
    "StateStorageError",
    "__version__",
    "consolidate_checkpoint",
    "export_pretrained",
    "from_pretrained",
    "load_pretrained",
    "PretrainedError",
    "consolidate_optimizer_state",
    "resume_fabric_dataloader",
    "save_pretrained",
]
