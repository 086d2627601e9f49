"""Pure-bf16 optimizers."""

from lightning_pure_bf16.optim.adamw import Adam, AdamW

__all__ = ["Adam", "AdamW"]
