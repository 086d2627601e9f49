"""The options of pure bf16, defined and checked once.

The optimizer checks its own arguments here, the Trainer strategy (and any other front end) checks the same options
here before it builds anything, and optimizer adoption (:mod:`lightning_pure_bf16.adoption`) carries them from the
front end to the optimizer it builds. Each check raises before any state is touched, naming the argument as the user
wrote it (``who`` is the call the user made, ``"AdamW"`` or ``"DeepSpeedPureBF16Strategy"``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_pure_bf16._log import rank_zero_warn
from lightning_pure_bf16.ops.update_torch import ROUNDING_MODES

BACKENDS = ("auto", "triton", "cpu", "torch")
STATE_STORAGES = ("memory", "mmap")
MOMENT_FORMATS = ("bf16", "int8")
COMPENSATION_FORMATS = ("bf16", "int8")
# torch.optim options the pure-bf16 optimizer does not implement, with the value that means "off".
UNSUPPORTED_TORCH_OPTIONS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
}
# Param group keys of torch.optim.AdamW/Adam that choose torch's implementation, not the optimization problem.
TORCH_ONLY_GROUP_KEYS = ("foreach", "fused", "decoupled_weight_decay", *UNSUPPORTED_TORCH_OPTIONS)
# The environment variable naming the state directory (``strategy="deepspeed_pure_bf16_mmap"``).
STATE_DIR_ENV = "PURE_BF16_STATE_DIR"
# Filesystems held in memory: "mmap" states there save device memory but not host memory.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def check_choice(who: str, name: str, value: Any, choices: Collection[Any]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"`{who}({name}={value!r})` is not one of {tuple(choices)}.")


def check_lr(who: str, lr: Any) -> None:
    """A learning rate is a finite number >= 0, or a one-element tensor of one (torch.optim takes a tensor lr)."""
    if hasattr(lr, "numel"):
        if lr.numel() != 1:
            raise ValueError(f"`{who}(lr=...)` must be a float or a one-element tensor, got shape {tuple(lr.shape)}.")
        lr = float(lr)
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0.0:
        raise ValueError(f"`{who}(lr={lr!r})`: the learning rate must be a finite number >= 0.")


def check_non_negative(who: str, name: str, value: Any, what: str | None = None) -> None:
    """A hyperparameter ``name`` that is a finite number >= 0 (``what``: its words in the message; default ``name``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0.0:
        raise ValueError(f"`{who}({name}={value!r})`: {what or name} must be a finite number >= 0.")


def check_seed(who: str, seed: Any) -> None:
    """A seed is a non-negative int or ``None`` (the optimizer then draws one from torch's generator)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"`{who}(seed={seed!r})`: the seed must be a non-negative int or None.")


def check_torch_arguments(who: str, given: Mapping[str, Any], *, foreach: Any, fused: Any) -> None:
    """The torch.optim keyword arguments ``given`` to ``who`` beyond its own: ``TypeError`` for one torch.optim does
    not have either, ``ValueError`` for one that asks for a feature (or an implementation) pure bf16 lacks."""
    for option in given:
        if option not in UNSUPPORTED_TORCH_OPTIONS:
            raise TypeError(f"{who}() got an unexpected keyword argument {option!r}.")
    for option, value in unsupported_torch_options(given).items():
        raise ValueError(
            f"`{who}({option}={value!r})` is not supported by the pure-bf16 optimizer. Remove `{option}` or"
            " use a torch.optim optimizer with fp32 master weights."
        )
    if foreach or fused:
        flag = "foreach" if foreach else "fused"
        raise ValueError(
            f"`{who}({flag}=True)` selects a torch.optim implementation; the pure-bf16 optimizer picks its own."
            " Use `backend='triton'` or `backend='torch'` instead."
        )


def check_power_of_two(who: str, name: str, value: int, *, minimum: int = 1) -> None:
    """A size in elements that must be a power of two of at least ``minimum``."""
    if value < minimum or value & (value - 1):
        what = "a positive power of two" if minimum == 1 else f"a power of two >= {minimum}"
        raise ValueError(f"`{who}({name}={value})`: `{name}` must be {what}.")


def unsupported_torch_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of ``options`` (kwargs or a param group) that ask for a torch.optim feature pure bf16 lacks."""
    return {k: options[k] for k, off in UNSUPPORTED_TORCH_OPTIONS.items() if k in options and options[k] != off}


@dataclass(frozen=True)
class OptimizerOptions:
    """What a front end asks of the pure-bf16 optimizer it builds from a user's torch optimizer.

    Attributes:
        rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``.
        seed: base seed of the rounding noise, or ``None`` for the optimizer's default.
        backend: ``"auto"``, ``"triton"``, ``"cpu"`` or ``"torch"``.
        state_storage: ``"memory"`` or ``"mmap"``.
        state_dir: the directory of the state files, with ``state_storage="mmap"`` only.
        moments: ``"bf16"`` or ``"int8"``.
        compensation: the Kahan buffer's format, ``"bf16"`` or ``"int8"``.
    """

    rounding: str = "stochastic"
    seed: int | None = None
    backend: str = "auto"
    state_storage: str = "memory"
    state_dir: str | None = None
    moments: str = "bf16"
    compensation: str = "bf16"

    def check(self, who: str) -> OptimizerOptions:
        """Raise ``ValueError`` naming the first bad option; returns ``self``."""
        check_choice(who, "rounding", self.rounding, ROUNDING_MODES)
        check_seed(who, self.seed)
        check_choice(who, "backend", self.backend, BACKENDS)
        check_choice(who, "state_storage", self.state_storage, STATE_STORAGES)
        check_choice(who, "moments", self.moments, MOMENT_FORMATS)
        check_choice(who, "compensation", self.compensation, COMPENSATION_FORMATS)
        if self.compensation != "bf16" and self.rounding != "kahan":
            raise ValueError(
                f"`{who}(compensation={self.compensation!r})` is the format of the Kahan buffer, which only"
                f" `rounding='kahan'` keeps (got rounding={self.rounding!r}): pass `rounding='kahan'`, or leave"
                " `compensation` out."
            )
        if self.state_storage == "memory" and self.state_dir is not None:
            raise ValueError(f"`{who}(state_dir=...)` is only used with `state_storage='mmap'`; pass both or neither.")
        if self.state_storage == "mmap" and self.state_dir is None:
            raise ValueError(
                f"`{who}(state_storage='mmap')` needs `state_dir`: an existing directory for the state files, ideally"
                " on a local NVMe disk."
            )
        return self

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`lightning_pure_bf16.AdamW` for these options."""
        kwargs: dict[str, Any] = {"rounding": self.rounding, "seed": self.seed, "backend": self.backend}
        if self.moments != "bf16":
            kwargs["moments"] = self.moments
        if self.compensation != "bf16":
            kwargs["compensation"] = self.compensation
        if self.state_storage == "mmap":
            kwargs.update(state_storage="mmap", state_dir=self.state_dir)
        return kwargs


def resolve_state_dir(
    state_storage: str,
    state_dir: str | os.PathLike | None,
    config_dir: str | None,
    *,
    who: str,
    strategy_name: str,
    config_section: str,
) -> str | None:
    """The checked state directory of a front end: its argument, else ``$PURE_BF16_STATE_DIR``, else its config's.

    Raises:
        ValueError: a directory given with ``state_storage="memory"``, or none found for ``"mmap"``.
        lightning_pure_bf16.StateStorageError: the directory does not exist or is not writable.
    """
    from lightning_pure_bf16.optim.mmap_states import check_state_dir, filesystem_type

    if state_storage == "memory":
        if state_dir is not None:
            raise ValueError(
                f"`{who}(state_dir=...)` is only used with `state_storage='mmap'` (or"
                f" `strategy='{strategy_name}_mmap'`); pass both or neither."
            )
        return None
    chosen = state_dir if state_dir is not None else os.environ.get(STATE_DIR_ENV) or config_dir
    if not chosen:
        raise ValueError(
            f"`strategy='{strategy_name}'` with optimizer states in memory-mapped files needs a state directory: pass"
            f" `{who}(state_storage='mmap', state_dir='/local/nvme/dir')`, set the environment variable"
            f' {STATE_DIR_ENV}, or add `{{"{config_section}": {{"state_dir": ...}}}}` to the DeepSpeed config.'
        )
    path = check_state_dir(chosen, who=f"{who}(state_storage='mmap', state_dir={os.fspath(chosen)!r})")
    fs_type = filesystem_type(path)
    if fs_type in MEMORY_FILESYSTEMS:
        rank_zero_warn(
            f"{strategy_name}: the state directory '{path}' is on {fs_type}, which is memory: the optimizer states"
            " leave the GPU but still take host memory. Use a directory on a disk."
        )
    return os.fspath(path)


__all__ = [
    "BACKENDS",
    "COMPENSATION_FORMATS",
    "MOMENT_FORMATS",
    "MEMORY_FILESYSTEMS",
    "OptimizerOptions",
    "ROUNDING_MODES",
    "STATE_DIR_ENV",
    "STATE_STORAGES",
    "TORCH_ONLY_GROUP_KEYS",
    "UNSUPPORTED_TORCH_OPTIONS",
    "check_choice",
    "check_lr",
    "check_non_negative",
    "check_power_of_two",
    "check_seed",
    "check_torch_arguments",
    "resolve_state_dir",
    "unsupported_torch_options",
]
