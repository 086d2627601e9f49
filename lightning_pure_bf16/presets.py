"""The front ends' options in one place: the presets (strategy names and what each sets), the accepted precision flags,
the devices' settings (CPU buckets, the gather cache, float32 products on CPUs without bf16), the DeepSpeed config a
front end builds from its options, and the environment set before DeepSpeed starts."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning_pure_bf16 import _internals
from lightning_pure_bf16._log import rank_zero_info, rank_zero_warn
from lightning_pure_bf16.config import (
    CONFIG_SECTION,
    GATHER_CACHES,
    pure_bf16_deepspeed_config,
    split_config_section,
)
from lightning_pure_bf16.optim import fused_cpu_available
from lightning_pure_bf16.optim.options import (
    STATE_DIR_ENV,
    STATE_STORAGES,
    OptimizerOptions,
    check_choice,
    resolve_state_dir,
)
from lightning_pure_bf16.release import check_release_config

# The precision flags both front ends accept (their defaults, and the explicit one); all mean pure bf16.
ACCEPTED_PRECISION = ("32-true", "bf16-true")
# DeepSpeed's default communication buckets (elements); on the CPU a bucket this large dominates every step.
GPU_BUCKET = 200_000_000
CPU_BUCKET = 5_000_000
# ZeRO-3's settings of gather_cache="layer" (config.GATHER_CACHES), and the keys a user's config may set instead.
# Both on every device: with a prefetch bucket, ZeRO-3 keeps each parameter its prefetcher scanned past while it was
# gathered, so a reuse distance of 0 alone held every layer from the third step on (4 of 4 layers with DeepSpeed's
# 5e7-element bucket, tests/test_strategy.py's module; 1 of 4 without a prefetch).
_LAYER_GATHER = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
_GATHER_KEYS = ("stage3_max_reuse_distance", "stage3_max_live_parameters", "stage3_prefetch_bucket_size")


# The pure-bf16 options every front end takes, by these names (PureBF16Settings's arguments).
OPTION_NAMES = (
    "rounding",
    "seed",
    "backend",
    "moments",
    "compensation",
    "state_storage",
    "state_dir",
    "gradient_release",
    "gather_cache",
)
# The registered names, for the Trainer and for Fabric: (description, the strategy arguments they set).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "deepspeed_pure_bf16": ("DeepSpeed ZeRO-3 in pure bf16 with stochastic rounding", {}),
    "deepspeed_pure_bf16_kahan": ("DeepSpeed ZeRO-3 in pure bf16 with Kahan compensation", {"rounding": "kahan"}),
    "deepspeed_pure_bf16_int8": (
        "DeepSpeed ZeRO-3 in pure bf16 with 8-bit moments, stochastic rounding (6 bytes/param)",
        {"moments": "int8"},
    ),
    "deepspeed_pure_bf16_int8_kahan": (
        "DeepSpeed ZeRO-3 in pure bf16 with 8-bit moments and an 8-bit Kahan remainder (7 bytes/param)",
        {"moments": "int8", "rounding": "kahan", "compensation": "int8"},
    ),
    "deepspeed_pure_bf16_release": (
        "DeepSpeed ZeRO-3 in pure bf16 with stochastic rounding and gradient release (6 bytes/param)",
        {"gradient_release": True},
    ),
    "deepspeed_pure_bf16_int8_release": (
        "DeepSpeed ZeRO-3 in pure bf16 with 8-bit moments and gradient release (4 bytes/param)",
        {"moments": "int8", "gradient_release": True},
    ),
    "deepspeed_pure_bf16_mmap": (
        f"DeepSpeed ZeRO-3 in pure bf16 with optimizer states in memory-mapped files (state_dir or ${STATE_DIR_ENV})",
        {"state_storage": "mmap"},
    ),
    "deepspeed_pure_bf16_mmap_release": (
        "DeepSpeed ZeRO-3 in pure bf16 with optimizer states in memory-mapped files and gradient release (2 bytes/param"
        f" in memory: the bf16 weights; state_dir or ${STATE_DIR_ENV})",
        {"state_storage": "mmap", "gradient_release": True},
    ),
    "deepspeed_pure_bf16_int8_mmap_release": (
        "DeepSpeed ZeRO-3 in pure bf16 with 8-bit moments in memory-mapped files and gradient release (2 bytes/param"
        f" in memory: the bf16 weights; state_dir or ${STATE_DIR_ENV})",
        {"moments": "int8", "state_storage": "mmap", "gradient_release": True},
    ),
}


def translate_precision(
    plugin: Any, *, pure_cls: type, flag_classes: tuple[type, ...], api: str, strategy_name: str
) -> Any:
    """The front end's pure-bf16 precision plugin for the plugin its API made from a precision flag.

    Only the plugins an API makes from ``ACCEPTED_PRECISION`` flags are translated; any other flag or plugin is a
    user's choice that pure bf16 cannot honour.

    Raises:
        ValueError: saying what to pass instead.
    """
    if plugin is None or isinstance(plugin, pure_cls):
        return plugin
    flag = getattr(plugin, "precision", None)
    if flag not in ACCEPTED_PRECISION or type(plugin) not in flag_classes:
        raise ValueError(
            f"`{api}(strategy='{strategy_name}', precision={flag!r})` is not supported: this strategy trains in pure"
            " bf16. Leave `precision` unset or pass `precision='bf16-true'`."
        )
    return pure_cls()


def on_cpu(accelerator: Any, *, cpu_cls: type, cuda_cls: type, api: str, strategy_name: str) -> bool:
    """Whether the front end trains on the CPU (else CUDA).

    Raises:
        RuntimeError: for any other accelerator, saying what to pass.
    """
    if not isinstance(accelerator, (cuda_cls, cpu_cls)):
        raise RuntimeError(
            f"`{api}(strategy='{strategy_name}')` runs on CUDA GPUs or the CPU, but `{type(accelerator).__name__}` is"
            " used. Pass `accelerator='gpu'` or `accelerator='cpu'`."
        )
    return isinstance(accelerator, cpu_cls)


def register_presets(registry: Any, cls: type, presets: dict[str, tuple[str, dict[str, Any]]] = PRESETS) -> None:
    """Register ``cls`` under every preset's name (``presets``: name -> (description, arguments)) in a Lightning
    strategy registry; importing the package twice (or reloading it) registers the same class again, harmlessly."""
    for name, (description, init_params) in presets.items():
        registry.register(name, cls, description=description, override=True, **init_params)


def set_up_environment(
    strategy: Any, precision: Any, ddp_setup: Callable[[Any], None], *, api: str, cpu_cls: type, cuda_cls: type
) -> None:
    """A Lightning front end's environment, the Trainer's and Fabric's alike: CUDA or the CPU (any other accelerator
    refused), the device's settings in the DeepSpeed config, DDP's set-up ``ddp_setup(strategy)`` in place of
    Lightning's DeepSpeed one (which refuses every accelerator but CUDA), and on the CPU the fused optimizer loop made
    ready (compiled by one rank of a machine while the others wait)."""
    cpu = on_cpu(
        strategy.accelerator, cpu_cls=cpu_cls, cuda_cls=cuda_cls, api=api, strategy_name=strategy.strategy_name
    )
    strategy.settings.configure_device(strategy.config, precision, on_cpu=cpu)
    ddp_setup(strategy)
    if cpu:
        strategy.settings.prepare_cpu_loop(strategy.local_rank, strategy.barrier)


class PureBF16Settings:
    """The options of a front end, resolved and checked once, and the DeepSpeed config built from them.

    Args:
        who: the front end's class name, for messages.
        strategy_name: its registered name, for messages.
        loaded_config: the user's DeepSpeed config as loaded by Lightning (``None``: none given).
        state_storage, state_dir, rounding, seed, backend, moments, compensation: the strategy's arguments.
        reduce_bucket_size, allgather_bucket_size: the strategy's arguments (``None``: the device's default).
        gradient_release: update each parameter's partition as soon as its gradient is reduce-scattered
            (:mod:`lightning_pure_bf16.release`).
        gather_cache: what ZeRO-3 keeps of the parameters it gathers (:data:`GATHER_CACHES`).
    """

    def __init__(
        self,
        *,
        who: str,
        strategy_name: str,
        loaded_config: dict[str, Any] | None,
        state_storage: str = "memory",
        state_dir: str | os.PathLike | None = None,
        rounding: str = "stochastic",
        seed: int | None = None,
        backend: str = "auto",
        moments: str = "bf16",
        compensation: str = "bf16",
        reduce_bucket_size: int | None = None,
        allgather_bucket_size: int | None = None,
        gradient_release: bool = False,
        gather_cache: str = "auto",
    ) -> None:
        self.who = who
        self.strategy_name = strategy_name
        if not isinstance(gradient_release, bool):
            raise ValueError(f"`{who}(gradient_release={gradient_release!r})` must be True or False.")
        self.gradient_release = gradient_release
        check_choice(who, "gather_cache", gather_cache, GATHER_CACHES)
        self.gather_cache = gather_cache
        section, self.user_config = split_config_section(loaded_config, strategy_name=strategy_name)
        if state_storage == "memory" and "state_storage" in section:
            state_storage = section["state_storage"]
        check_choice(who, "state_storage", state_storage, STATE_STORAGES)
        self.state_storage = state_storage
        self.state_dir = resolve_state_dir(
            state_storage,
            state_dir,
            section.get("state_dir"),
            who=who,
            strategy_name=strategy_name,
            config_section=CONFIG_SECTION,
        )
        self.optimizer_options = OptimizerOptions(
            rounding, seed, backend, state_storage, self.state_dir, moments, compensation
        ).check(who)
        if gradient_release:
            check_release_config(who, self.user_config or {})
        user_zero = (self.user_config or {}).get("zero_optimization", {})
        # The buckets the user left to the default: set per device once it is known.
        self.default_buckets = [
            key
            for key, arg in (
                ("reduce_bucket_size", reduce_bucket_size),
                ("allgather_bucket_size", allgather_bucket_size),
            )
            if arg is None and key not in user_zero
        ]

    def deepspeed_config(self, base: dict[str, Any]) -> dict[str, Any]:
        """Lightning's config from the strategy's arguments, with the user's merged over it and pure bf16 enforced."""
        return pure_bf16_deepspeed_config(base, self.user_config, strategy_name=self.strategy_name)

    @property
    def user_gather_settings(self) -> dict[str, Any]:
        """The ZeRO-3 gather-cache settings the user's config sets itself (kept as they are)."""
        zero = (self.user_config or {}).get("zero_optimization", {})
        return {key: zero[key] for key in _GATHER_KEYS if key in zero}

    def check_engine_config(self, config: dict[str, Any]) -> None:
        """With gradient release, refuse what the final DeepSpeed config asks that release cannot do (gradient
        accumulation, clipping), before the engine is made. A config that leaves ``gradient_clipping`` out gets 0:
        DeepSpeed's own default (1.0) is not a choice the user made, and release cannot honour it."""
        if not self.gradient_release:
            return
        check_release_config(self.who, config)
        if "gradient_clipping" not in config:
            config["gradient_clipping"] = 0.0
            rank_zero_info(
                f"{self.strategy_name}: gradient release updates each parameter before the global gradient norm"
                " exists, so DeepSpeed's default clipping to norm 1.0 is off (`gradient_clipping: 0`)."
            )

    def configure_device(self, config: dict[str, Any], precision: Any, *, on_cpu: bool) -> None:
        """Point DeepSpeed at the device, set the CPU's buckets, and decide float32 products on CPUs without bf16
        (with a precision plugin; ``None``: the products are left as the model computes them)."""
        _internals.set_deepspeed_accelerator("cpu" if on_cpu else "cuda")
        if on_cpu:
            for key in self.default_buckets:
                config["zero_optimization"][key] = CPU_BUCKET
        self._set_gather_cache(config["zero_optimization"])
        reason = precision.use_float32_matmul("cpu" if on_cpu else "cuda") if precision is not None else None
        if reason is not None:
            # ZeRO-3's memory-efficient linear is a custom autograd function whose backward products would stay bf16;
            # plain F.linear records the float32 casts, so its backward runs in float32 too.
            config["zero_optimization"]["memory_efficient_linear"] = False
            rank_zero_info(
                f"{self.strategy_name}: {reason}: matrix products are computed in float32 from the bf16 values"
                " (storage, gradients and optimizer states stay bf16; `cpu_matmul='bf16'` on the precision plugin"
                " keeps them in bf16)."
            )

    def _set_gather_cache(self, zero: dict[str, Any]) -> None:
        """ZeRO-3's gather cache as ``gather_cache`` says, where the user's config leaves it, logged once."""
        mine = self.user_gather_settings
        if self.gather_cache != "keep":
            zero.update({key: value for key, value in _LAYER_GATHER.items() if key not in mine})
        if mine:
            said = ", ".join(f"{k}={v}" for k, v in mine.items())
            rank_zero_info(
                f"{self.strategy_name}: ZeRO-3 keeps gathered parameters as your config says ({said});"
                f" gather_cache={self.gather_cache!r} sets only what the config leaves out."
            )
            # An absent bucket is DeepSpeed's default, a prefetch.
            if zero.get("stage3_max_reuse_distance") == 0 and zero.get("stage3_prefetch_bucket_size") != 0:
                rank_zero_warn(
                    f"{self.strategy_name}: your config sets a ZeRO-3 prefetch (stage3_prefetch_bucket_size) with"
                    " layers released after each use (stage3_max_reuse_distance=0): ZeRO-3 then keeps every"
                    " parameter its prefetcher scans past, and a step holds every layer gathered, as"
                    " gather_cache='keep' does. Remove the prefetch setting, or use gather_cache='next' (one layer"
                    " gathered ahead) or 'keep'."
                )
        elif self.gather_cache == "layer":
            rank_zero_info(
                f"{self.strategy_name}: gather_cache='layer' (the smallest peak, for the tightest budgets): each"
                " layer's gathered parameters are released after its forward and gathered again for its backward, as"
                " FSDP2 does (ZeRO-3 stage3_max_reuse_distance=0,"
                " and stage3_prefetch_bucket_size=0: ZeRO-3's prefetcher keeps what it scans past, every layer): about"
                " 2 bytes per parameter less at the peak of the step than keeping them, for one more all-gather of the"
                " parameters per step (ZeRO-3's traffic 1.5x) that no prefetch overlaps. `gather_cache='next'`"
                " overlaps each all-gather with the layer before it for one more layer at the peak, and the default"
                " `gather_cache='auto'` does so where the memory allows it; `gather_cache='keep'` keeps them all."
            )
        elif self.gather_cache == "next":
            rank_zero_info(
                f"{self.strategy_name}: gather_cache='next': each layer's gathered parameters are released after its"
                " forward and gathered again for its backward, and the next layer's all-gather starts as a layer"
                " computes, as FSDP2 does: one more layer gathered at the peak of the step than"
                " `gather_cache='layer'`, the all-gathers (ZeRO-3's traffic 1.5x) overlapped with computation."
            )
        elif self.gather_cache == "auto":
            rank_zero_info(
                f"{self.strategy_name}: gather_cache='auto' (the default: the all-gathers overlapped with computation"
                " wherever the memory allows it): each layer's gathered parameters are released after its"
                " forward and gathered again for its backward; the first step gathers one layer at a time (as"
                " gather_cache='layer'), and if at its peak every rank has room for twice what one more layer adds, the"
                " following steps gather the next layer while one computes (as gather_cache='next'). The decision is"
                " logged after the first step; gather_cache='layer' keeps one layer at a time throughout, the"
                " smallest peak."
            )
        else:
            rank_zero_info(
                f"{self.strategy_name}: gather_cache='keep': ZeRO-3 keeps the parameters it gathers for the forward"
                " until their backward (DeepSpeed's defaults): up to 2 bytes per parameter more at the peak of the"
                " step than `gather_cache='layer'`, for one all-gather of the parameters per step fewer."
            )

    def prepare_cpu_loop(self, local_rank: int, barrier: Callable[[str], None]) -> None:
        """Compile (or load) the fused C++ loop now: local rank 0 builds it while the others wait, instead of every
        rank stalling inside the first optimizer step."""
        if self.optimizer_options.backend not in ("auto", "cpu"):
            return
        rank_zero_info(
            f"{self.strategy_name}: preparing the fused CPU optimizer loop (compiled once per machine, then cached;"
            " `python -m lightning_pure_bf16.build` does it ahead of time)."
        )
        if local_rank == 0:
            fused_cpu_available()
        barrier("pure_bf16_cpu_loop")
        fused_cpu_available()


__all__ = [
    "ACCEPTED_PRECISION",
    "CPU_BUCKET",
    "GPU_BUCKET",
    "OPTION_NAMES",
    "PRESETS",
    "PureBF16Settings",
    "on_cpu",
    "register_presets",
    "set_up_environment",
    "translate_precision",
]
