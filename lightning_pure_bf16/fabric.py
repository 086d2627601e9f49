"""``Fabric(strategy="deepspeed_pure_bf16")``: pure bf16 over DeepSpeed ZeRO-3 in a Fabric loop.

The Fabric front end of the same core as the Trainer strategy (:mod:`lightning_pure_bf16.core`): the same options,
presets, DeepSpeed config, optimizer adoption, memory report, checkpoints (staged, durable, resumable at any world
size) and skipped-step accounting::

    import lightning_pure_bf16  # registers the strategy with Fabric and the Trainer
    fabric = Fabric(accelerator="cpu", devices=2, strategy="deepspeed_pure_bf16")
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ...)  # the returned optimizer is a torch optimizer
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.utilities.seed import reset_seed
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pure_bf16 import _internals, collectives, core, presets, zero3_engine
from lightning_pure_bf16 import precision as pure_precision  # a module: Lightning's import may begin inside it
from lightning_pure_bf16.adoption import adopt_for_zero3
from lightning_pure_bf16.data import prepare_dataloader
from lightning_pure_bf16.hf_models import partitioned_construction


class _EveryBackwardReduces(_internals.fabric_backward_sync_control()):
    """ZeRO-3 reduce-scatters every backward into each rank's gradient partition, where successive backwards add up:
    there is no synchronization to skip, so ``fabric.no_backward_sync`` accumulates correctly and changes nothing."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class DeepSpeedPureBF16FabricStrategy(core.LightningFrontEnd, DeepSpeedStrategy):
    """DeepSpeed ZeRO-3 in pure bf16 for Fabric: 8 bytes per parameter of model state (10 with Kahan), sharded.

    The arguments are those of :class:`lightning_pure_bf16.DeepSpeedPureBF16Strategy` (``rounding``, ``seed``,
    ``backend``, ``config``, ``sub_group_size``, bucket sizes, ``state_storage``, ``state_dir``, ``moments``,
    ``compensation``, ``gradient_release``, ``gather_cache``), plus Fabric's (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``precision``, ``process_group_backend``, ``timeout``...).

    Differences from Fabric's ``DeepSpeedStrategy``, all following from pure bf16 on ZeRO-3:
        - ``fabric.setup(model, optimizer)`` returns this package's AdamW (a ``torch.optim.Optimizer``) in place of
          the torch AdamW/Adam it was given, so LR schedulers can be built on it; ``optimizer.step()`` steps the
          DeepSpeed engine. A scheduler passed to ``fabric.setup(..., scheduler=...)`` is stepped by the engine.
        - ``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips in the coming step (ZeRO-3 clips inside
          its step, by the norm over all ranks) and returns that norm; clipping by value is not supported.
        - A step with an inf/NaN gradient on any rank is skipped on every rank, counted in
          ``optimizer.skipped_steps`` and warned about (``error_if_nonfinite`` does not raise).
        - ``fabric.no_backward_sync`` is accepted and does nothing: every backward reduce-scatters, and gradients add
          up until ``optimizer.step()`` (with ``gradient_release=True`` a second backward before the step raises).
    """

    strategy_name = "deepspeed_pure_bf16"

    def __init__(
        self,
        accelerator: Any = None,
        *,
        rounding: str = "stochastic",
        seed: int | None = None,
        backend: str = "auto",
        stage: int = 3,
        config: dict[str, Any] | str | os.PathLike | None = None,
        sub_group_size: int = 1_000_000_000,
        reduce_bucket_size: int | None = None,
        allgather_bucket_size: int | None = None,
        state_storage: str = "memory",
        state_dir: str | os.PathLike | None = None,
        moments: str = "bf16",
        compensation: str = "bf16",
        gradient_release: bool = False,
        gather_cache: str = "auto",
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        logging_level: int = logging.WARN,
        **kwargs: Any,
    ) -> None:
        self._pure_bf16_init(
            super().__init__,
            options={
                "rounding": rounding,
                "seed": seed,
                "backend": backend,
                "moments": moments,
                "compensation": compensation,
                "state_storage": state_storage,
                "state_dir": state_dir,
                "gradient_release": gradient_release,
                "gather_cache": gather_cache,
            },
            config=config,
            stage=stage,
            timeout=timeout,
            buckets={"reduce_bucket_size": reduce_bucket_size, "allgather_bucket_size": allgather_bucket_size},
            deepspeed={
                "accelerator": accelerator,
                "sub_group_size": sub_group_size,
                "parallel_devices": parallel_devices,
                "cluster_environment": cluster_environment,
                "precision": precision,
                "process_group_backend": process_group_backend,
                "logging_level": logging_level,
                **kwargs,
            },
        )
        # Fabric clips when `fabric.clip_gradients` asks: without this, DeepSpeed's default (clip to norm 1.0) would
        # apply to every step before the first such call (and not after it).
        self.config.setdefault("gradient_clipping", 0.0)
        self._backward_sync_control = _EveryBackwardReduces()
        self._max_norm: float | None = None

    # -------------------------------------------------------------------------------------------------- precision
    @property
    @override
    def precision(self) -> pure_precision.PureBF16FabricPrecision:
        if not isinstance(self._precision, pure_precision.PureBF16FabricPrecision):
            self._precision = pure_precision.PureBF16FabricPrecision()
        return self._precision

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        self._precision = presets.translate_precision(
            precision,
            pure_cls=pure_precision.PureBF16FabricPrecision,
            flag_classes=(DeepSpeedPrecision, Precision),
            api="Fabric",
            strategy_name=self.strategy_name,
        )

    # ---------------------------------------------------------------------------------------- environment (CPU too)
    @override
    def setup_environment(self) -> None:
        presets.set_up_environment(
            self,
            self.precision,
            DDPStrategy.setup_environment,
            api="Fabric",
            cpu_cls=CPUAccelerator,
            cuda_cls=CUDAAccelerator,
        )

    @override
    def _setup_distributed(self) -> None:
        with zero3_engine.process_group_destroyed_at_exit():
            if isinstance(self.accelerator, CUDAAccelerator):
                super()._setup_distributed()
                return
            # CPU devices carry no index, which Fabric's device-index validation rejects; nothing to validate.
            reset_seed()
            self._set_world_ranks()
            self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        # init_module builds partitioned; a Hugging Face model built there is initialised and tied as transformers
        # does under ZeRO-3 (hf_models.py).
        return partitioned_construction(super().module_sharded_context(), self.config)

    # ----------------------------------------------------------------------------------------------------- setup
    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # A shuffled torchdata loader gets a seeded order (data.py says why); the loop resumes its own position.
        return prepare_dataloader(
            super().process_dataloader(dataloader), who=f"Fabric(strategy='{self.strategy_name}')"
        )

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Any, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(
                f"`Fabric(strategy='{self.strategy_name}')` sets up one optimizer with the model, got"
                f" {len(optimizers)}. Put the parameters of all of them into param groups of one torch.optim.AdamW."
            )
        who = f"Fabric(strategy='{self.strategy_name}')"
        optimizer = adopt_for_zero3(
            optimizers[0],
            scheduler,
            self.optimizer_options,
            who=who,
            source="fabric.setup",
            global_rank=self.global_rank,
        )
        self._deepspeed_engine, _, scheduler = self._initialize_engine(module, optimizer, scheduler)
        self._set_deepspeed_activation_checkpointing()
        self._pure_bf16_engine_setup(self._deepspeed_engine)
        # The pure-bf16 optimizer itself: a torch optimizer (schedulers, param_groups), whose `step` through Fabric's
        # wrapper steps the engine.
        return self._deepspeed_engine, [optimizer], scheduler

    @override
    def _initialize_engine(self, model: Module, optimizer: Optimizer | None = None, scheduler: Any = None) -> Any:
        rank = zero3_engine.device_rank(self.root_device, self.local_rank)
        if optimizer is None:
            # Inference: as Fabric's own, with a device rank DeepSpeed accepts.
            return zero3_engine.initialize_engine(self.config, model, None, None, rank)
        return zero3_engine.initialize_engine(self.config, model, optimizer, scheduler, rank, self.settings)

    # ------------------------------------------------------------------------------------------------ the step
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` steps the DeepSpeed engine, whatever optimizer Fabric passes: ZeRO-3's step (clipped,
        skipped everywhere on an inf/NaN gradient), its counters and the scheduler given to ``fabric.setup``; the
        gradients are cleared after it."""
        if self._max_norm is not None:
            _internals.zero3_set_clip(self._deepspeed_engine.optimizer, self._max_norm)
        try:
            output = self.precision.optimizer_step(self._deepspeed_engine, **kwargs)
        finally:
            if self._max_norm is not None:
                _internals.zero3_set_clip(self._deepspeed_engine.optimizer, self._config_clip())
                self._max_norm = None
        return output

    def _config_clip(self) -> float:
        return float(self.config.get("gradient_clipping", 0.0))

    @override
    def clip_gradients_norm(
        self,
        module: Any,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip in the coming ``optimizer.step()`` to ``max_norm`` (ZeRO-3 clips inside its step, by the 2-norm over
        every rank's gradient partition); returns that norm, computed now from the partitions."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"`fabric.clip_gradients(..., norm_type={norm_type})` is not supported by"
                f" `{self.strategy_name}`: ZeRO-3 clips by the 2-norm. Pass `norm_type=2`."
            )
        if not max_norm > 0:
            raise ValueError(f"`fabric.clip_gradients(..., max_norm={max_norm})`: max_norm must be positive.")
        if self.settings.gradient_release:
            raise ValueError(
                f"`fabric.clip_gradients(...)` is not supported by `{self.strategy_name}` with"
                " `gradient_release=True`: each parameter is updated during the backward, before the norm over all"
                " parameters exists. Remove the call, or leave gradient release off."
            )
        self._max_norm = float(max_norm)
        return collectives.zero3_grad_norm(self._deepspeed_engine.optimizer)

    @override
    def clip_gradients_value(self, module: Any, optimizer: Optimizer, clip_val: float | int) -> None:
        raise NotImplementedError(
            f"`fabric.clip_gradients(..., clip_val=...)` is not supported by `{self.strategy_name}`: ZeRO-3 clips by"
            " the gradient norm inside its step. Use `fabric.clip_gradients(model, optimizer, max_norm=...)`."
        )

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """``fabric.save(path, state)``: DeepSpeed's sharded checkpoint, staged, fsynced and moved into place; the
        state's other entries (step counters, schedulers, anything with a ``state_dict``) go with it."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                f"`fabric.save(..., {'storage_options' if storage_options is not None else 'filter'}=...)` is not"
                f" supported by `{self.strategy_name}`: DeepSpeed writes the checkpoint itself."
            )
        engine = self._engine_in(state, "fabric.save")
        client_state = {k: v for k, v in state.items() if not self._is_engine_or_optimizer(v, engine)}
        client_state = self._convert_stateful_objects_in_state(client_state, filter={})
        self._pure_bf16_save(engine, path, client_state)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load(path, state)``: checked, then loaded (re-partitioned if saved at another world size); the
        state's other entries are restored in place; returns what the checkpoint holds beyond them.
        ``fabric.load(..., weights_only=False)`` trusts the checkpoint (no check that its files need no code to be
        read: only for a checkpoint whose writer you trust)."""
        if isinstance(state, (Module, Optimizer)) or self.load_full_weights:
            return super().load_checkpoint(path=path, state=state, strict=strict, weights_only=weights_only)
        if not state:
            raise ValueError(
                f"`fabric.load(path, state)` with `{self.strategy_name}` needs the state to restore, with the model:"
                " `fabric.load(path, {'model': model, 'optimizer': optimizer, ...})`."
            )
        engine = self._engine_in(state, "fabric.load")
        load_optimizer = any(self._is_engine_or_optimizer(v, engine) and v is not engine for v in state.values())
        client_state, _ = self._pure_bf16_load(
            engine, path, load_optimizer_states=load_optimizer, strict=strict, trust_checkpoint=weights_only is False
        )
        for key in list(client_state):
            if key not in state or key in ("optimizer", "lr_scheduler"):
                continue
            target, value = state[key], client_state.pop(key)
            if hasattr(target, "load_state_dict") and not isinstance(target, (Module, Optimizer)):
                target.load_state_dict(value)
            elif isinstance(target, (Module, Optimizer)):
                continue
            else:
                state[key] = value
        return {k: v for k, v in client_state.items() if k not in ("optimizer", "lr_scheduler")}

    def _engine_in(self, state: dict[str, Any], call: str) -> Any:
        from deepspeed import DeepSpeedEngine

        engines = [v for v in state.values() if isinstance(_internals.fabric_unwrap(v), DeepSpeedEngine)]
        if len(engines) != 1:
            raise ValueError(
                f"`{call}(path, state)` with `{self.strategy_name}` needs exactly one model set up by"
                f" `fabric.setup` in the state, found {len(engines)}: `{call}(path, {{'model': model, ...}})`."
            )
        return _internals.fabric_unwrap(engines[0])

    @staticmethod
    def _is_engine_or_optimizer(value: Any, engine: Any) -> bool:
        inner = _internals.fabric_unwrap(value)
        return inner is engine or inner is engine.optimizer or inner is zero3_engine.inner_optimizer(engine)


# The strategy is named in Lightning's registry as soon as it is defined (the package imports this module when
# Lightning loads).
DeepSpeedPureBF16FabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["DeepSpeedPureBF16FabricStrategy"]
