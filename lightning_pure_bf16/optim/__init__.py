"""Pure-bf16 optimizers, and what the layers above use of the optimizer: per-rank seeds, whether the fused CPU loop
is available, the 8-bit state format's decoders (checkpoints decode saved 8-bit states), the names of a tensor's
state entries (the Kahan remainder, the block scales of an 8-bit state), what a ZeRO-3 partition holds of each
parameter and its part of Adafactor's statistics (checkpoints read them per parameter), and a hook called with each
optimizer built (the layers above watch what a host does with it)."""

from lightning_pure_bf16.ops import quant
from lightning_pure_bf16.ops.rng import rank_seed
from lightning_pure_bf16.ops.update_cpu import fused_cpu_available
from lightning_pure_bf16.optim.adafactor import Adafactor, statistics_of_pieces
from lightning_pure_bf16.optim.adamw import Adam, AdamW
from lightning_pure_bf16.optim.base import PureBF16Optimizer, register_construction_hook
from lightning_pure_bf16.optim.lion import Lion
from lightning_pure_bf16.optim.muon import Muon, muon_param_groups
from lightning_pure_bf16.optim.pieces import zero3 as zero3_pieces
from lightning_pure_bf16.optim.sgd import SGD
from lightning_pure_bf16.optim.state_dicts import KAHAN_KEY, STATISTICS_KEY, is_scale_key, scale_key

__all__ = [
    "KAHAN_KEY",
    "STATISTICS_KEY",
    "SGD",
    "Adafactor",
    "Adam",
    "AdamW",
    "Lion",
    "Muon",
    "PureBF16Optimizer",
    "fused_cpu_available",
    "muon_param_groups",
    "is_scale_key",
    "quant",
    "rank_seed",
    "register_construction_hook",
    "scale_key",
    "statistics_of_pieces",
    "zero3_pieces",
]
