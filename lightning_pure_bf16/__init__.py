"""Pure-bf16 training for PyTorch Lightning: bf16 parameters, gradients and optimizer states, no fp32 master copy."""

from lightning_pure_bf16.optim import Adam, AdamW

__version__ = "0.1.0"

__all__ = ["Adam", "AdamW", "__version__"]
