"""The DeepSpeed config of pure bf16, built and checked in one place (the strategy, tests and benchmarks use it)."""

from __future__ import annotations

import copy
from typing import Any

# What ZeRO-3 keeps of the parameters it gathers (the front ends' ``gather_cache``): "layer" releases each layer after
# its forward and gathers it again for its backward (the smallest peak); "next" does the same and gathers the next
# layer while one computes (FSDP2's pattern: one more layer at the peak, the all-gathers overlapped); "keep" is
# DeepSpeed's default, every layer gathered in the forward held until its backward (2 bytes/param more at the peak,
# one all-gather fewer per step); "auto", the default, runs the first step as "layer" and the rest as "next" when every
# rank has room for it at that step's peak (gather.NextLayerIfItFits).
GATHER_CACHES = ("layer", "next", "auto", "keep")

# What pure bf16 needs from DeepSpeed: bf16 everywhere, bf16 master weights/grads (aliased to the parameter partition
# by the strategy) and bf16 optimizer states; a client optimizer under ZeRO must be explicitly allowed.
_REQUIRED: dict[str, Any] = {
    "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "zero_allow_untested_optimizer": True,
}

_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")
# The section of a user's DeepSpeed config read by this package (and removed before DeepSpeed sees the config).
CONFIG_SECTION = "pure_bf16"
CONFIG_SECTION_KEYS = ("state_storage", "state_dir")


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _is_fp32(value: Any) -> bool:
    return str(value).lower() in _FP32_NAMES


def _contradictions(config: dict[str, Any]) -> list[str]:
    problems = []
    if config.get("fp16", {}).get("enabled") in (True, "auto"):
        problems.append("`fp16.enabled` turns on float16 mixed precision")
    if config.get("amp", {}).get("enabled"):
        problems.append("`amp.enabled` turns on apex mixed precision with fp32 master weights")
    if config.get("torch_autocast", {}).get("enabled"):
        problems.append("`torch_autocast.enabled` keeps fp32 weights and autocasts")
    bf16 = config.get("bf16", {})
    if bf16.get("enabled") is False:
        problems.append("`bf16.enabled: false` turns off bf16")
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if bf16.get(key) is False:
            problems.append(f"`bf16.{key}: false` asks for fp32 master weights, gradients or optimizer states")
    if "optimizer" in config:
        problems.append(
            "`optimizer` makes DeepSpeed build its own optimizer; return torch.optim.AdamW/Adam or"
            " lightning_pure_bf16.AdamW from `configure_optimizers` instead"
        )
    zero = config.get("zero_optimization", {})
    if zero.get("stage", 3) != 3:
        problems.append(f"`zero_optimization.stage: {zero.get('stage')}`: pure bf16 needs ZeRO stage 3")
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            problems.append(
                f"`zero_optimization.{key}.device: {device}` offloads state; pure bf16 keeps it on the device"
            )
    if _is_fp32(config.get("data_types", {}).get("grad_accum_dtype")):
        problems.append("`data_types.grad_accum_dtype: fp32` keeps an fp32 gradient buffer")
    if _is_fp32(config.get("communication_data_type")):
        problems.append("`communication_data_type: fp32` keeps fp32 gradient communication buffers")
    return problems


def split_config_section(
    user_config: dict[str, Any] | None, *, strategy_name: str = "deepspeed_pure_bf16"
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(the "pure_bf16" section, the rest of the config)`` of a user's DeepSpeed config (``None`` stays ``None``).

    Raises:
        ValueError: the section has keys other than :data:`CONFIG_SECTION_KEYS`.
    """
    if user_config is None:
        return {}, None
    section = dict(user_config.get(CONFIG_SECTION) or {})
    unknown = sorted(set(section) - set(CONFIG_SECTION_KEYS))
    if unknown:
        raise ValueError(
            f"`strategy='{strategy_name}'`: the DeepSpeed config's {CONFIG_SECTION!r} section has unknown keys"
            f" {unknown}; it accepts {list(CONFIG_SECTION_KEYS)}."
        )
    return section, {k: v for k, v in user_config.items() if k != CONFIG_SECTION}


def pure_bf16_deepspeed_config(
    base: dict[str, Any], user_config: dict[str, Any] | None = None, *, strategy_name: str = "deepspeed_pure_bf16"
) -> dict[str, Any]:
    """Merge ``user_config`` over ``base``, add what pure bf16 needs, and refuse settings that contradict it.

    Args:
        base: the config the strategy's own arguments describe (ZeRO stage 3, buckets, activation checkpointing...).
        user_config: a DeepSpeed config dict from the user, merged key by key over ``base`` (default: ``None``).
        strategy_name: used in error messages.

    Raises:
        ValueError: naming every setting of ``user_config`` that contradicts pure bf16.
    """
    merged = _merge(base, user_config or {})
    problems = _contradictions(merged)
    if problems:
        raise ValueError(
            f"`Trainer(strategy='{strategy_name}')` got a DeepSpeed config that contradicts pure bf16: "
            + "; ".join(problems)
            + ". Remove these settings; for DeepSpeed's own mixed precision use `strategy='deepspeed_stage_3'`."
        )
    return _merge(merged, _REQUIRED)


__all__ = [
    "CONFIG_SECTION",
    "CONFIG_SECTION_KEYS",
    "GATHER_CACHES",
    "pure_bf16_deepspeed_config",
    "split_config_section",
]
