"""What the two front ends (the Trainer strategy and the Fabric strategy) do the same way, written once.

Each front end is a thin layer over Lightning's own DeepSpeed strategy of its API; everything about pure bf16 lives
here or below: the options and the DeepSpeed config, device settings (CPU buckets, float32 products on CPUs without
bf16), DeepSpeed initialization with the master aliasing, the state allocation and memory report at setup, the
checkpoint save and load (staged and durable; native or re-partitioned), and skipped-step accounting.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from lightning_pure_bf16 import _internals, collectives, gather
from lightning_pure_bf16._log import rank_zero_info, rank_zero_warn
from lightning_pure_bf16._warnings import silence_known_warnings
from lightning_pure_bf16.checkpoint import (
    TAG,
    CheckpointError,
    is_checkpoint,
    read_latest_tag,
    save_staged,
    state_files,
    tag_directory,
    validate_checkpoint,
    write_latest_tag,
)
from lightning_pure_bf16.config import (
    CONFIG_SECTION,
    GATHER_CACHES,
    pure_bf16_deepspeed_config,
    split_config_section,
)
from lightning_pure_bf16.memory import PeakMeter, format_peak, format_report, peak_report, zero3_model_state_report
from lightning_pure_bf16.optim import PureBF16Optimizer, fused_cpu_available, pieces
from lightning_pure_bf16.optim.options import (
    STATE_DIR_ENV,
    STATE_STORAGES,
    OptimizerOptions,
    check_choice,
    resolve_state_dir,
)
from lightning_pure_bf16.release import GradientRelease, check_release_config
from lightning_pure_bf16.repartition import (
    DEEPSPEED_KEYS,
    RepartitionError,
    ZeroCheckpoint,
    live_layout,
    load_repartitioned,
)
from lightning_pure_bf16.safe_load import check_state_files, load_state_file, verify_state_file

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


@contextlib.contextmanager
def process_group_destroyed_at_exit() -> Iterator[None]:
    """Around a front end's process-group setup: a default process group created inside is destroyed at interpreter
    exit, while Python is still whole; one that existed before (the user's) is left alone.

    Without it the group lives until the interpreter's own teardown, where gloo's worker threads may still hold work
    objects: a finished fit can then end in ``terminate called without an active exception`` (SIGABRT, exit 134),
    rarely and more often under load (benchmarks/exit_stress.py counts it; pytorch/pytorch#190489). Lightning
    registers the same for NCCL groups it creates itself, but the DeepSpeed strategies create theirs through DeepSpeed.
    The group is not destroyed at ``teardown``: a second fit in the same process reuses it (DeepSpeed keeps handles to
    it).
    """
    existed = torch.distributed.is_available() and torch.distributed.is_initialized()
    yield
    if not existed and torch.distributed.is_available() and torch.distributed.is_initialized():
        destroy_process_group_at_exit()


_DESTROY_REGISTERED: list[bool] = []


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit if it is still alive then (ranks leaving together), once
    per process. For the integrations, whose group another library created (the HF ``TrainingArguments``,
    Accelerate's state) and nobody destroys: the abort :func:`process_group_destroyed_at_exit` describes happened to a
    finished HF Trainer run. A group destroyed before exit is not touched."""
    if not _DESTROY_REGISTERED:
        _DESTROY_REGISTERED.append(True)
        atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if not torch.distributed.is_initialized():
        return
    if torch.distributed.get_backend() == "gloo":
        # Leave together, as far as a short wait allows: a rank that tears its connections down while another still
        # uses them can abort that one. A rank that never comes (it crashed) costs this wait, not a hang.
        with contextlib.suppress(RuntimeError):
            torch.distributed.monitored_barrier(timeout=timedelta(seconds=30))
    torch.distributed.destroy_process_group()


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


def device_rank(root_device: torch.device, local_rank: int) -> int:
    """The device rank DeepSpeed wants: the device index, or the local rank for CPU devices (which have none)."""
    return root_device.index if root_device.index is not None else local_rank


@contextlib.contextmanager
def zero3_construction(gradient_release: bool) -> Iterator[None]:
    """Around ``deepspeed.initialize``, for every front end: ZeRO-3's master partitions aliased to the bf16 parameter
    partitions (without the gradient buffers release never uses), and DeepSpeed's collectives in bounded pieces under
    gloo before (ZeRO-3's construction gathers every parameter once, to hook its gradient) and after (where
    ``deepspeed.initialize`` set up DeepSpeed's communication backend itself)."""
    collectives.bounded_gloo_collectives()
    with _internals.alias_bf16_master_partitions(gradient_release=gradient_release):
        yield
    collectives.bounded_gloo_collectives()


def initialize_engine(
    config: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Any,
    lr_scheduler: Any,
    rank: int,
    settings: PureBF16Settings | None = None,
) -> tuple[Any, Any, Any]:
    """``deepspeed.initialize`` with ZeRO-3's master partitions aliased to the bf16 parameter partitions, after the
    final config is checked against the front end's ``settings``."""
    import deepspeed

    if settings is not None:
        settings.check_engine_config(config)

    model_parameters = filter(lambda p: p.requires_grad, model.parameters())
    with zero3_construction(gradient_release=settings is not None and settings.gradient_release):
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            args=argparse.Namespace(device_rank=rank),
            config=config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
    return engine, ds_optimizer, ds_scheduler


def inner_optimizer(engine: Any) -> PureBF16Optimizer:
    """The pure-bf16 optimizer inside DeepSpeed's ZeRO-3 optimizer (holds the moments and counters)."""
    return _internals.zero3_inner_optimizer(engine.optimizer)


def memory_report(engine: Any) -> dict[str, float]:
    """Model-state bytes per parameter on this rank, by category, from the live ZeRO-3 buffers
    (:func:`lightning_pure_bf16.memory.zero3_model_state_report`)."""
    return zero3_model_state_report(engine.optimizer, engine.module)


def init_zero3_optimizer_state(zero_optimizer: Any) -> None:
    """Allocate the pure-bf16 optimizer's state for every ZeRO-3 sub-group now, in sub-group order.

    That is the order of the first step, so nothing changes but the time of allocation: the memory report at setup
    is the steady state, and a shortage of memory shows at setup instead of at the first step.
    """
    optimizer = _internals.zero3_inner_optimizer(zero_optimizer)
    if optimizer.whole_parameter:
        describe_zero3_partitions(zero_optimizer, optimizer)
    optimizer.init_states(
        (flat, optimizer.param_groups[group]) for flat, group in _internals.zero3_sub_groups(zero_optimizer)
    )


def describe_zero3_partitions(zero_optimizer: Any, optimizer: PureBF16Optimizer) -> None:
    """Tell an optimizer whose update needs whole parameters (Adafactor, Muon) which run of which parameter each
    flat partition of this rank holds, and over which process group the other runs are.

    Raises:
        ValueError: a parameter its group's algorithm cannot step (Muon: not a matrix), naming it.
    """
    group = _internals.zero3_data_parallel_group(zero_optimizer)
    rank = torch.distributed.get_rank(group)
    for sub, shapes in zip(_internals.zero3_layout(zero_optimizer), _internals.zero3_param_shapes(zero_optimizer)):
        described = [(name, shape, numel, span) for (name, numel, span), shape in zip(sub.params, shapes)]
        optimizer.set_pieces(sub.flat, pieces.zero3(described, rank, group), optimizer.param_groups[sub.group])


def after_engine_setup(
    engine: Any,
    strategy_name: str,
    device: torch.device,
    *,
    gradient_release: bool = False,
    gather_cache: str = "auto",
) -> EngineRun:
    """Set a new engine up for pure bf16 and return what the package keeps for it (:class:`EngineRun`, also
    ``engine.pure_bf16``): every sub-group's optimizer state allocated now (a shortage shows at setup), the step
    given views of the gradient partition instead of copies, its clip factor applied inside the update (no pass of
    its own) and a gradient norm read in one pass, gradient release if asked (which frees the gradient partition),
    the next layer gathered ahead with ``gather_cache="next"`` (and, with ``"auto"``, where the first step leaves
    room for it), and the memory per parameter logged."""
    optimizer = inner_optimizer(engine)
    if gradient_release and optimizer.whole_parameter:
        raise ValueError(
            f"`{strategy_name}(gradient_release=True)` updates each parameter's partition as its gradient arrives,"
            f" but {type(optimizer).__name__}'s update needs every rank's part of a parameter first (its statistics"
            " or its orthogonalization). Turn gradient release off for this optimizer."
        )
    init_zero3_optimizer_state(engine.optimizer)
    _internals.reduce_full_buckets_at_once(engine.optimizer)
    if gather_cache == "next":
        gather.prefetch_next_module(engine.optimizer)
    release = None
    if gradient_release:
        # ZeRO-3's step then updates nothing: the step's gradient views and norm are not installed (they would keep
        # a reference to the gradient partition that release frees).
        release = GradientRelease(engine.optimizer, strategy_name)
    else:
        _internals.view_sub_group_gradients(engine.optimizer)
        _internals.fold_gradient_scale(
            engine.optimizer, lambda factor: setattr(inner_optimizer(engine), "grad_scale", factor)
        )
        collectives.gradient_norm_in_one_pass(engine.optimizer)
    report = memory_report(engine)
    rank_zero_info(f"{strategy_name}: model state per parameter on each rank: " + format_report(report))
    if optimizer.state_storage == "mmap":
        used = report["state_files"] * report["params_on_rank"] / 1024**3
        free = shutil.disk_usage(optimizer.state_dir).free / 1024**3
        rank_zero_info(
            f"{strategy_name}: optimizer states in memory-mapped files, {used:.2f} GiB in {optimizer.state_dir} on"
            f" rank 0 ({free:.1f} GiB left on that disk); each rank has its own directory there."
        )
    meter = PeakMeter(device)
    gather_policy = gather.NextLayerIfItFits(engine, meter, strategy_name) if gather_cache == "auto" else None
    run = EngineRun(engine, strategy_name, meter, release, gather_policy)
    meter.reset()
    return run


class EngineRun:
    """What this package keeps for one DeepSpeed engine, made by :func:`after_engine_setup` and held the same way by
    every front end (``engine.pure_bf16``): the gradient release, the gather policy, the peak meter, and the one wrap
    of ZeRO-3's step, after which the gather policy decides (once) and a step ZeRO-3 skipped on an inf/NaN gradient is
    counted in the pure-bf16 optimizer and reported.

    Attributes:
        release: the gradient release installed on the engine, or ``None``.
        gather: ``gather_cache="auto"``'s policy, or ``None``.
        meter: the peak memory since setup.
    """

    def __init__(
        self,
        engine: Any,
        strategy_name: str,
        meter: PeakMeter,
        release: GradientRelease | None,
        policy: gather.NextLayerIfItFits | None,
    ) -> None:
        self.engine, self.strategy_name, self.meter = engine, strategy_name, meter
        self.release, self.gather = release, policy
        if policy is not None:
            policy.install()
        zero_optimizer = engine.optimizer
        step = zero_optimizer.step  # gradient release's bookkeeping step, where release replaced it

        def step_and_account(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            self._after_step()
            return out

        zero_optimizer.step = step_and_account
        self.optimizer.overflow = False  # DeepSpeed's ZeRO flag for a skipped step, read by Accelerate
        engine.pure_bf16 = self

    @property
    def optimizer(self) -> PureBF16Optimizer:
        """The pure-bf16 optimizer inside ZeRO-3's."""
        return inner_optimizer(self.engine)

    def _after_step(self) -> None:
        if self.gather is not None:
            self.gather.after_step()
        skipped = _internals.zero3_step_skipped(self.engine.optimizer)
        optimizer = self.optimizer
        optimizer.overflow = skipped
        if skipped:
            optimizer.record_skipped_step()
            rank_zero_warn(
                f"{self.strategy_name}: a gradient was inf/NaN, the step was skipped on every rank"
                f" ({optimizer.skipped_steps} skipped so far)."
            )

    def memory_report(self) -> dict[str, float]:
        """Model-state bytes per parameter on this rank (see :func:`memory_report`)."""
        return memory_report(self.engine)

    def peak_memory(self) -> dict[str, Any] | None:
        """The peak memory of this rank since setup beside its model state
        (:func:`lightning_pure_bf16.memory.peak_report`); ``None`` where no peak can be measured."""
        return peak_report(self.meter, memory_report(self.engine))

    def log_peak_memory(self) -> None:
        """The end-of-fit line: rank 0's measured peak beside its model state."""
        rank_zero_info(f"{self.strategy_name}: memory of rank 0 during the fit: " + format_peak(self.peak_memory()))


def engine_run(engine: Any) -> EngineRun | None:
    """What the package keeps for ``engine`` (:class:`EngineRun`), or ``None`` for an engine it did not set up."""
    run = getattr(engine, "pure_bf16", None)
    return run if isinstance(run, EngineRun) else None


def gradient_release(engine: Any) -> GradientRelease | None:
    """The gradient release installed on this engine, if any."""
    run = engine_run(engine)
    return run.release if run is not None else None


# ------------------------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(
    engine: Any,
    filepath: str | os.PathLike,
    client_state: dict[str, Any],
    *,
    world_size: int,
    is_global_zero: bool,
    barrier: Callable[[str], None],
    exclude_frozen_parameters: bool,
    **info: Any,
) -> None:
    """DeepSpeed's sharded checkpoint, staged, fsynced and moved into place (every rank; ``filepath`` the same)."""

    def write(staged: Path) -> None:
        # The class's method: a front end may route the engine's own ``save_checkpoint`` here.
        type(engine).save_checkpoint(
            engine,
            os.fspath(staged),
            client_state=client_state,
            tag=TAG,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    # The sub-groups' layout, so a resume at the same world size and layout knows it without reading a rank file.
    layout = live_layout(engine.optimizer)
    save_staged(
        filepath, write, world_size=world_size, is_global_zero=is_global_zero, barrier=barrier, layout=layout, **info
    )


def _verify_shared(files: list[Path], rank: int, world_size: int, device: torch.device, trust: bool) -> None:
    """The ranks share out the checks of the checkpoint's files (each file is checked by one rank): its bytes against
    their checksums, and, unless trusted, that it reads without running code. A bad file found by any rank stops every
    rank before anything is loaded."""
    error: CheckpointError | None = None
    try:
        for file in files[rank::world_size]:
            verify_state_file(file)
            check_state_files([file], trust=trust)
    except CheckpointError as err:
        error = err
    if world_size > 1 and torch.distributed.is_initialized():
        found = torch.tensor([float(error is not None)], device=device)
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        if error is None and found.item():
            raise CheckpointError(
                "Another rank found a corrupted file in the checkpoint, or one that needs code to be read (its error"
                " names the file); nothing was loaded."
            )
    if error is not None:
        raise error


def load_checkpoint(
    engine: Any,
    checkpoint_path: str | os.PathLike,
    *,
    world_size: int,
    rank: int,
    load_optimizer_states: bool,
    strict: bool,
    strategy_name: str,
    load_lr_scheduler_states: bool = False,
    trust_checkpoint: bool = False,
) -> tuple[dict[str, Any], ZeroCheckpoint | None]:
    """Check, then load a checkpoint into a live engine; returns the client state and, when the checkpoint had to be
    re-partitioned (another world size or sub-group layout, or DeepSpeed bf16-mixed), its reader.

    ``load_lr_scheduler_states``: also restore the scheduler given to ``deepspeed.initialize`` (``engine.lr_scheduler``)
    from the checkpoint (the Lightning strategies leave schedulers to Lightning). ``trust_checkpoint``: read the files
    without the check that none needs code to be read (:func:`validate_checkpoint`).

    Raises:
        CheckpointError: naming the file and what to do, before anything is loaded.
    """
    directory, manifest = validate_checkpoint(
        checkpoint_path, accept_fp32_masters=True, trust_checkpoint=trust_checkpoint, verify_checksums=False
    )
    _verify_shared(state_files(directory, manifest), rank, world_size, engine.device, trust_checkpoint)
    live = live_layout(engine.optimizer)
    try:
        saved = None
        if manifest is not None and "layout" in manifest:  # written at save since the layout was recorded
            same_layout = manifest["world_size"] == world_size and manifest["layout"] == live
        else:
            saved = ZeroCheckpoint(tag_directory(directory, manifest), trust=trust_checkpoint)
            same_layout = manifest is not None and saved.world_size == world_size and saved.layout() == live
        if not same_layout:
            if saved is None:
                saved = ZeroCheckpoint(tag_directory(directory, manifest), trust=trust_checkpoint)
            loaded = load_repartitioned(saved, engine.optimizer, rank=rank, load_optimizer_states=load_optimizer_states)
    except RepartitionError as err:
        raise CheckpointError(str(err)) from err
    if same_layout:
        # Each file memory-mapped (its pages are page cache, copied into the run's buffers) and read weights-only.
        read = functools.partial(load_state_file, trust=trust_checkpoint)
        with _internals.deepspeed_checkpoint_reads(engine, read):
            _, client_state = type(engine).load_checkpoint(  # the class's method, as in save_checkpoint
                engine,
                os.fspath(directory),
                tag=TAG,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_strict=strict,
            )
        if client_state is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint '{checkpoint_path}'.")
        return {k: v for k, v in client_state.items() if k not in DEEPSPEED_KEYS}, None
    state = saved.model_state
    _internals.set_engine_counters(
        engine,
        global_steps=int(state.get("global_steps", 0)),
        global_samples=int(state.get("global_samples", 0)),
        skipped_steps=int(state.get("skipped_steps", 0)),
    )
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    source = "DeepSpeed bf16-mixed (fp32 masters)" if saved.master_dtype == torch.float32 else "pure bf16"
    rank_zero_info(
        f"{strategy_name}: re-partitioned the {source} checkpoint '{checkpoint_path}' written by {saved.world_size}"
        f" rank(s) in {len(saved.sub_groups)} sub-group(s) to {world_size} rank(s) in"
        f" {len(live_layout(engine.optimizer))}: {loaded}."
    )
    return saved.client_state(), saved


class LightningFrontEnd:
    """What the Trainer's and Fabric's DeepSpeed strategies share, mixed in before Lightning's ``DeepSpeedStrategy`` of
    their API (as Lightning's two DeepSpeed strategies share their helpers): the opening of ``__init__``, the options,
    the registration, the set-up of a new engine, the checkpoint calls and what a user inspects. Each front end keeps
    what its API does its own way; both name the engine ``model`` once it is set up."""

    strategy_name: str
    settings: PureBF16Settings

    def _pure_bf16_init(
        self,
        lightning_init: Callable[..., None],
        *,
        options: dict[str, Any],
        config: dict[str, Any] | str | os.PathLike | None,
        stage: int,
        timeout: timedelta | None,
        buckets: dict[str, int | None],
        deepspeed: dict[str, Any],
    ) -> None:
        """Check the arguments (before anything is set up), run Lightning's ``__init__`` with DeepSpeed's (``config``
        left to the settings), then resolve the settings and build the DeepSpeed config from them.

        Args:
            lightning_init: the ``__init__`` of Lightning's ``DeepSpeedStrategy`` of the front end's API.
            options: the pure-bf16 options (:data:`OPTION_NAMES`), as the user gave them.
            config, stage, timeout: as the user gave them.
            buckets: ``reduce_bucket_size`` and ``allgather_bucket_size`` (``None``: this package's default).
            deepspeed: every other argument of Lightning's ``__init__`` (the user's ``**kwargs`` among them).
        """
        who = type(self).__name__
        check_zero3_arguments(who, stage, deepspeed)
        early = ("rounding", "seed", "backend", "moments", "compensation")  # checked before Lightning's __init__
        OptimizerOptions(**{name: options[name] for name in early}).check(who)
        _internals.use_cpu_deepspeed_accelerator_if_no_cuda()
        silence_known_warnings()
        lightning_init(
            stage=3,
            config=None,
            **{name: size or GPU_BUCKET for name, size in buckets.items()},
            **({"timeout": timeout} if timeout is not None else {}),
            **deepspeed,
        )
        self.settings = PureBF16Settings(
            who=who, strategy_name=self.strategy_name, loaded_config=self._load_config(config), **buckets, **options
        )
        self.config = self.settings.deepspeed_config(self.config)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_presets(strategy_registry, cls)

    @property
    def optimizer_options(self) -> OptimizerOptions:
        """The checked options of the optimizer the strategy builds from a torch one."""
        return self.settings.optimizer_options

    @property
    def state_storage(self) -> str:
        """Where the optimizer's moments live: ``"memory"`` or ``"mmap"``."""
        return self.settings.state_storage

    @property
    def state_dir(self) -> str | None:
        """The directory of the state files (``state_storage="mmap"``)."""
        return self.settings.state_dir

    @property
    def rounding(self) -> str:
        """The rounding of the optimizer the strategy builds from a torch one."""
        return self.optimizer_options.rounding

    @property
    def seed(self) -> int | None:
        """The base seed of the rounding noise (each rank derives its own), or ``None`` for the optimizer's."""
        return self.optimizer_options.seed

    @property
    def backend(self) -> str:
        """The optimizer backend."""
        return self.optimizer_options.backend

    def _pure_bf16_engine_setup(self, engine: Any) -> EngineRun:
        return after_engine_setup(  # held on the engine: engine.pure_bf16
            engine,
            self.strategy_name,
            self.root_device,
            gradient_release=self.settings.gradient_release,
            gather_cache=self.settings.gather_cache,
        )

    def _pure_bf16_save(self, engine: Any, path: Any, client_state: dict[str, Any], **info: Any) -> None:
        save_checkpoint(
            engine,
            self.broadcast(os.fspath(path)),
            client_state,
            world_size=self.world_size,
            is_global_zero=self.is_global_zero,
            barrier=self.barrier,
            exclude_frozen_parameters=self.exclude_frozen_parameters,
            **info,
        )

    def _pure_bf16_load(self, engine: Any, path: Any, **how: Any) -> tuple[dict[str, Any], ZeroCheckpoint | None]:
        return load_checkpoint(
            engine,
            self.broadcast(os.fspath(path)),
            world_size=self.world_size,
            rank=self.global_rank,
            strategy_name=self.strategy_name,
            **how,
        )

    @property
    def pure_bf16_optimizer(self) -> PureBF16Optimizer:
        """The pure-bf16 optimizer inside DeepSpeed's ZeRO-3 optimizer (holds the moments and counters)."""
        return inner_optimizer(self.model)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was inf/NaN on some rank."""
        optimizer = self.pure_bf16_optimizer
        return optimizer.skipped_steps

    def memory_report(self) -> dict[str, float]:
        """Model-state bytes per parameter on this rank, by category, measured from the live ZeRO-3 buffers.

        Returns:
            See :func:`lightning_pure_bf16.memory.zero3_model_state_report`: ``param``, ``grad``, ``master``,
            ``exp_avg``, ``exp_avg_sq``, ``kahan_comp``, ``other_state`` and ``total`` in bytes per trainable
            parameter of this rank's partition, ``params_on_rank``; frozen parameters in ``frozen`` and
            ``frozen_params_on_rank``, and ``whole_model`` over both.
        """
        return memory_report(self.model)

    def peak_memory(self) -> dict[str, Any] | None:
        """This rank's peak memory since setup, measured, beside its model state.

        Returns:
            See :func:`lightning_pure_bf16.memory.peak_report`: ``peak_gib``, ``at_setup_gib``,
            ``above_setup_per_param`` (bytes per parameter of this rank's partition the steps added at their peak),
            ``model_state_per_param`` and ``source`` (CUDA's allocator, or the CPU's resident set); ``None`` before
            setup or where no peak can be measured.
        """
        run = engine_run(self.model)
        return run.peak_memory() if run is not None else None


def check_zero3_arguments(who: str, stage: int, kwargs: Mapping[str, Any]) -> None:
    """Refuse front-end arguments that contradict pure bf16 on ZeRO-3 (a stage, offloading, ZeRO off)."""
    if stage != 3:
        raise ValueError(
            f"`{who}(stage={stage})` is not supported: ZeRO stages 1 and 2 keep a separate master copy of the weights."
            " Use `stage=3`."
        )
    for option in ("offload_optimizer", "offload_parameters"):
        if kwargs.get(option):
            raise ValueError(f"`{who}({option}=True)` is not supported: pure bf16 keeps all state on the device.")
    if kwargs.get("zero_optimization") is False:
        raise ValueError(f"`{who}(zero_optimization=False)` is not supported: it needs ZeRO stage 3.")


__all__ = [
    "ACCEPTED_PRECISION",
    "OPTION_NAMES",
    "PRESETS",
    "check_zero3_arguments",
    "PureBF16Settings",
    "LightningFrontEnd",
    "register_presets",
    "set_up_environment",
    "EngineRun",
    "after_engine_setup",
    "on_cpu",
    "process_group_destroyed_at_exit",
    "translate_precision",
    "destroy_process_group_at_exit",
    "device_rank",
    "gradient_release",
    "init_zero3_optimizer_state",
    "initialize_engine",
    "zero3_construction",
    "is_checkpoint",
    "inner_optimizer",
    "load_checkpoint",
    "memory_report",
    "engine_run",
    "read_latest_tag",
    "save_checkpoint",
    "write_latest_tag",
]
