"""Pure-bf16 training for PyTorch Lightning: bf16 parameters, gradients and optimizer states, no fp32 master copy.

Importing the package registers ``"deepspeed_pure_bf16"`` and its presets (``_kahan``, ``_int8``, ``_int8_kahan``,
``_release``, ``_int8_release``, ``_mmap``, ``_mmap_release``, ``_int8_mmap_release``) with Lightning's Trainer and
with Fabric, so ``Trainer(strategy="deepspeed_pure_bf16")`` and ``Fabric(strategy="deepspeed_pure_bf16")`` work in any
script or LightningCLI config that imports it; and ``"fsdp2_pure_bf16"`` (with ``_kahan``, ``_int8``, ``_int8_kahan``,
``_release``, ``_int8_release``) with the Trainer, for models that shard themselves with PyTorch FSDP2.

The package does not import Lightning itself: the names are registered at once if Lightning is loaded, otherwise as
soon as it is, so the optimizer, the tools and the DeepSpeed, FSDP2 and Hugging Face front ends start without it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from lightning_pure_bf16 import _log  # noqa: F401  (the package logger's console handler, set up once)
from lightning_pure_bf16.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    consolidate_optimizer_state,
    export_pretrained,
)
from lightning_pure_bf16.data import resume_fabric_dataloader
from lightning_pure_bf16.hf_models import from_pretrained
from lightning_pure_bf16.integrations import host_watch
from lightning_pure_bf16.optim import SGD, Adafactor, Adam, AdamW, Lion, Muon, PureBF16Optimizer, muon_param_groups
from lightning_pure_bf16.optim.mmap_states import StateStorageError
from lightning_pure_bf16.pretrained import PretrainedError, load_pretrained, save_pretrained

if TYPE_CHECKING:  # loaded on first use (below); named here for type checkers and the API reference
    from lightning_pure_bf16.fabric import DeepSpeedPureBF16FabricStrategy
    from lightning_pure_bf16.fsdp2 import FSDP2PureBF16Strategy
    from lightning_pure_bf16.precision import PureBF16FabricPrecision, PureBF16Precision
    from lightning_pure_bf16.strategy import DeepSpeedPureBF16Strategy

__version__ = "0.1.0"

# The names that need Lightning, imported when first used (Lightning's imports take seconds).
_LIGHTNING_NAMES = {
    "DeepSpeedPureBF16Strategy": "strategy",
    "DeepSpeedPureBF16FabricStrategy": "fabric",
    "FSDP2PureBF16Strategy": "fsdp2",
    "PureBF16Precision": "precision",
    "PureBF16FabricPrecision": "precision",
}


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_LIGHTNING_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LIGHTNING_NAMES])


def _register_strategies() -> None:
    """Load the three Lightning front ends, each of which names its strategies in Lightning's registries as it loads
    (one already loading, as when Lightning's import started inside it, does so when it finishes)."""
    for module in ("strategy", "fabric", "fsdp2"):
        importlib.import_module(f"{__name__}.{module}")


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers the strategies as soon as the ``lightning`` package has run its ``__init__``, which imports both
    ``lightning.fabric`` and ``lightning.pytorch``: whichever of the two a script imports, and whether before or after
    this package, the registries hold the strategies before any Trainer or Fabric is built."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)  # once; the finders after this one find the package
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            self.loader = spec.loader
            spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _register_strategies()


if "lightning" in sys.modules:
    _register_strategies()
elif not any(isinstance(finder, _RegisterWhenLightningLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
# A stock Hugging Face host that drops this package's optimizer is told about (imports neither transformers nor
# Accelerate).
host_watch.install()

__all__ = [
    "SGD",
    "Adafactor",
    "Adam",
    "AdamW",
    "Lion",
    "Muon",
    "PureBF16Optimizer",
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
    "muon_param_groups",
    "PretrainedError",
    "consolidate_optimizer_state",
    "resume_fabric_dataloader",
    "save_pretrained",
]
