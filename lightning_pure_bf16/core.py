"""What the Trainer's and Fabric's DeepSpeed strategies do the same way, written once: the opening of ``__init__``, the
options a user reads back, the registration of the presets, the set-up of a new engine, the checkpoint calls and the
checks of the ZeRO-3 arguments. The jobs beneath live in their own modules: :mod:`~lightning_pure_bf16.presets`
(presets, options, the DeepSpeed config), :mod:`~lightning_pure_bf16.zero3_engine` (an engine's construction, set-up and
step) and :mod:`~lightning_pure_bf16.engine_checkpoints` (save and load)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from lightning_pure_bf16 import _internals
from lightning_pure_bf16._warnings import silence_known_warnings
from lightning_pure_bf16.engine_checkpoints import load_checkpoint, save_checkpoint
from lightning_pure_bf16.optim import PureBF16Optimizer
from lightning_pure_bf16.optim.options import (
    OptimizerOptions,
)
from lightning_pure_bf16.presets import GPU_BUCKET, PureBF16Settings, register_presets
from lightning_pure_bf16.zero3_engine import (
    EngineHandle,
    after_engine_setup,
    engine_handle,
    inner_optimizer,
    memory_report,
)
from lightning_pure_bf16.zero_checkpoint import ZeroCheckpoint


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

    def _pure_bf16_engine_setup(self, engine: Any) -> EngineHandle:
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
        handle = engine_handle(self.model)
        return handle.peak_memory() if handle is not None else None


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


__all__ = ["LightningFrontEnd", "check_zero3_arguments"]
