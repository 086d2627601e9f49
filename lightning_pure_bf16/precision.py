"""Precision plugin for pure bf16: the module and floating inputs in bf16, no autocast, no loss scaling.

On a CPU without native bf16 dot products (no AVX512-BF16, AMX-BF16 or Arm BF16), PyTorch's bf16 matrix products run
14-30x slower than float32 ones (about 1 GFLOP/s against 30 per thread on one AVX2 CPU), so a CPU fit spends nearly all
its time in them. There the plugin computes matrix products in float32 from the bf16 values: storage, gradients and
optimizer states stay bf16 (the same bytes per parameter), the products are at least as accurate as bf16 ones (whose
accumulation is float32 too), only their results are rounded to bf16 again.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.fabric.plugins.precision.deepspeed import DeepSpeedPrecision as FabricDeepSpeedPrecision
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from torch.overrides import TorchFunctionMode
from typing_extensions import override

CpuMatmul = Literal["auto", "bf16", "float32"]
_CPU_MATMUL = ("auto", "bf16", "float32")
# The matrix-product functions of a transformer's forward; autograd computes their backward in float32 too, because
# the casts are part of the recorded graph.
_MATMUL_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        F.linear,
        F.scaled_dot_product_attention,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
    }
)


# Capabilities (torch.cpu.get_capabilities) that give a CPU native bf16 dot products: x86 AVX512-BF16 and AMX-BF16,
# Arm's BF16 and SVE-BF16 extensions.
_NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions, per ``torch.cpu.get_capabilities()``."""
    capabilities = torch.cpu.get_capabilities()
    return any(bool(capabilities.get(name, False)) for name in _NATIVE_BF16)


class Float32Matmul(TorchFunctionMode):
    """Within this mode, matrix products of bf16 tensors are computed in float32 and their results rounded to bf16.

    What a product saves for its backward is the bf16 tensor a float32 copy was made from, widened again when the
    backward needs it (the same float32 values, so the same gradients): a float32 copy of every weight and input held
    from the forward to the backward would double their memory, the weights' for the whole model.
    """

    @override
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _MATMUL_FUNCTIONS or not any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in (*args, *kwargs.values())
        ):
            return func(*args, **kwargs)
        widened: dict[int, torch.Tensor] = {}  # the float32 copies' storage -> their bf16 sources

        def up(value: Any) -> Any:
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16):
                return value
            wide = value.float()
            if wide.numel():
                widened[wide.untyped_storage().data_ptr()] = value
            return wide

        def pack(t: torch.Tensor) -> Any:
            # A copy or a view of one (a product saves the transposed weight): its bf16 source itself, not a copy (a
            # ZeRO-3 or FSDP2 parameter is gathered again for the backward), and where the view sits in the copy.
            source = widened.get(t.untyped_storage().data_ptr()) if t.dtype == torch.float32 and t.numel() else None
            return t if source is None else (source, t.size(), t.stride(), t.storage_offset())

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            source, size, stride, offset = packed
            return source.float().as_strided(size, stride, offset)

        wide_args, wide_kwargs = [up(a) for a in args], {k: up(v) for k, v in kwargs.items()}
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = func(*wide_args, **wide_kwargs)
        return out.to(torch.bfloat16)


def to_bf16_keeping_metrics(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in bf16, but for the states of the torchmetrics metrics it holds, which keep their dtype: torchmetrics
    guards them against ``.bfloat16()`` but not against ``.to(dtype=...)``, and a mean accumulated in bf16 reports a
    validation loss of 5.6 as 5.625."""
    from torchmetrics import Metric

    kept = {metric: metric.dtype for metric in module.modules() if isinstance(metric, Metric)}
    module = module.to(dtype=torch.bfloat16)
    for metric, dtype in kept.items():
        metric.set_dtype(dtype)
    return module


class _CpuMatmulChoice:
    """What the Trainer and Fabric plugins share: bf16 modules (metrics kept in float32), and how matrix products are
    computed in a CPU fit."""

    precision: Literal["bf16-true"] = "bf16-true"
    cpu_matmul: CpuMatmul
    float32_matmul: bool

    def __init__(self, cpu_matmul: CpuMatmul = "auto") -> None:
        super().__init__("bf16-true")  # Lightning's DeepSpeed precision plugin (Trainer or Fabric)
        if cpu_matmul not in _CPU_MATMUL:
            raise ValueError(f"`{type(self).__name__}(cpu_matmul={cpu_matmul!r})` is not one of {_CPU_MATMUL}.")
        self.cpu_matmul = cpu_matmul
        # Decided by the strategy once the device is known (`use_float32_matmul`).
        self.float32_matmul = False

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return to_bf16_keeping_metrics(module)

    def use_float32_matmul(self, device_type: str) -> str | None:
        """Decide, for a fit on ``device_type``, whether matrix products run in float32; returns why, or ``None``."""
        self.float32_matmul = False
        if device_type != "cpu" or self.cpu_matmul == "bf16":
            return None
        if self.cpu_matmul == "float32":
            self.float32_matmul = True
            return "cpu_matmul='float32'"
        if cpu_has_native_bf16():
            return None
        self.float32_matmul = True
        return "this CPU has no native bf16 dot products (bf16 matrix products would run 14-30x slower)"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cpu_matmul={self.cpu_matmul!r})"


class PureBF16Precision(_CpuMatmulChoice, DeepSpeedPrecision):
    """Casts the LightningModule and floating-point batch tensors to bf16; the DeepSpeed engine runs backward and step.

    The Trainer's default precision (``"32-true"``) and ``"bf16-true"`` both mean pure bf16 under
    ``DeepSpeedPureBF16Strategy``; every other flag is refused by the strategy with a message saying what to pass.

    Args:
        cpu_matmul: how matrix products are computed in a CPU fit (never on GPUs): ``"bf16"``, ``"float32"`` (from the
            bf16 values, results rounded to bf16; see the module docstring), or ``"auto"``: float32 where the CPU has no
            native bf16 dot products (default: ``"auto"``).
    """

    @override
    def forward_context(self) -> AbstractContextManager:
        return Float32Matmul() if self.float32_matmul else nullcontext()


class PureBF16FabricPrecision(_CpuMatmulChoice, FabricDeepSpeedPrecision):
    """The Fabric twin of :class:`PureBF16Precision`: the module and floating inputs in bf16 under
    ``Fabric(strategy="deepspeed_pure_bf16")``, which makes it from Fabric's default precision or ``"bf16-true"``.

    Args:
        cpu_matmul: as for :class:`PureBF16Precision` (default: ``"auto"``).
    """

    @override
    def forward_context(self) -> AbstractContextManager:
        return Float32Matmul() if self.float32_matmul else super().forward_context()


__all__ = ["Float32Matmul", "PureBF16FabricPrecision", "PureBF16Precision", "cpu_has_native_bf16"]
