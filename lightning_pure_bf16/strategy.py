"""``Trainer(strategy="deepspeed_pure_bf16")``: DeepSpeed ZeRO-3 with bf16 parameters, gradients and optimizer states.

The strategy configures DeepSpeed for bf16 master weights and optimizer states, makes ZeRO-3 use the parameter
partition itself as the master partition (8 bytes/param of model state, 10 with Kahan), swaps the user's
``torch.optim.AdamW``/``Adam`` for the pure-bf16 optimizer with the same hyperparameters, and runs on CUDA (NCCL) or
on the CPU (gloo), where Lightning's own ``DeepSpeedStrategy`` refuses to.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.core.optimizer import LRSchedulerConfig
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning_utilities.core.imports import RequirementCache
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pure_bf16 import _internals, core, presets, zero3_engine
from lightning_pure_bf16 import precision as pure_precision  # a module: Lightning's import may begin inside it
from lightning_pure_bf16._log import rank_zero_info
from lightning_pure_bf16.adoption import adopt_for_zero3
from lightning_pure_bf16.data import prepare_dataloader
from lightning_pure_bf16.hf_models import partitioned_construction
from lightning_pure_bf16.optim.options import STATE_DIR_ENV

_DEEPSPEED_AVAILABLE = RequirementCache("deepspeed>=0.19.8")
# Trainer precision flags that mean pure bf16 under this strategy: the default and the explicit one.


class DeepSpeedPureBF16Strategy(core.LightningFrontEnd, DeepSpeedStrategy):
    """DeepSpeed ZeRO-3 in pure bf16: 8 bytes per parameter of model state (10 with Kahan), sharded.

    Args:
        accelerator: the accelerator (default: chosen by the Trainer; CUDA or CPU).
        rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``; used when the strategy converts a torch optimizer
            (default: ``"stochastic"``).
        seed: base seed of the rounding noise; each rank derives its own (default: ``None``, the optimizer's default,
            drawn from torch's default generator).
        backend: optimizer backend, ``"auto"``, ``"triton"``, ``"cpu"`` or ``"torch"`` (default: ``"auto"``).
        stage: ZeRO stage; only ``3`` is supported (stages 1 and 2 keep a separate master copy) (default: ``3``).
        config: a DeepSpeed config dict or JSON path merged over the strategy's own settings; settings that
            contradict pure bf16 are an error (default: ``None``).
        sub_group_size: elements per ZeRO-3 sub-group; one optimizer kernel launch each (default: ``1e9``).
        reduce_bucket_size: elements per gradient reduce-scatter bucket (default: ``None``: ``2e8`` on CUDA, ``5e6``
            on the CPU, where a 400 MB bucket makes every step slow).
        allgather_bucket_size: elements per all-gather bucket (default: ``None``: as ``reduce_bucket_size``).
        partition_activations: DeepSpeed activation checkpointing option (default: ``False``).
        cpu_checkpointing: DeepSpeed activation checkpointing option (default: ``False``).
        contiguous_memory_optimization: DeepSpeed activation checkpointing option (default: ``False``).
        synchronize_checkpoint_boundary: DeepSpeed activation checkpointing option (default: ``False``).
        state_storage: where the optimizer's moments live: ``"memory"`` (on the device) or ``"mmap"`` (one
            memory-mapped file per rank and flat partition under ``state_dir``, streamed through each step: the
            device keeps 4 bytes/param of model state, the files hold 4, 6 with Kahan). Also settable in the
            DeepSpeed config as ``{"pure_bf16": {"state_storage": "mmap"}}`` (default: ``"memory"``).
        state_dir: an existing, writable directory for the state files, ideally a local NVMe disk; with
            ``state_storage="mmap"`` taken from this argument, else the ``PURE_BF16_STATE_DIR`` environment variable,
            else the config's ``{"pure_bf16": {"state_dir": ...}}`` (default: ``None``).
        moments: the format of both moments, ``"bf16"`` or ``"int8"`` (1 byte each plus a bf16 scale per 128
            elements: 6 bytes/param of model state), used when the strategy converts a torch optimizer
            (default: ``"bf16"``; ``strategy="deepspeed_pure_bf16_int8"``).
        compensation: the Kahan buffer's format, ``"bf16"`` or ``"int8"`` (7 bytes/param with 8-bit moments)
            (default: ``"bf16"``; ``strategy="deepspeed_pure_bf16_int8_kahan"``).
        gradient_release: update each parameter's partition as soon as ZeRO-3 has reduce-scattered its gradient,
            and keep no gradient partition: 2 bytes/param less (6 with bf16 states, 4 with 8-bit moments). Gradient
            accumulation, gradient clipping and states in files are refused with it; an inf/NaN gradient leaves its
            partition as it was instead of skipping the whole step (default: ``False``;
            ``strategy="deepspeed_pure_bf16_release"``, ``"deepspeed_pure_bf16_int8_release"``).
        gather_cache: what ZeRO-3 keeps of the parameters it gathers: ``"auto"`` runs the first step as
            ``"layer"`` and the rest as ``"next"`` if, at that step's peak, every rank has room for twice what the
            next layer adds (the decision is logged): the all-gathers overlapped wherever the memory allows it;
            ``"next"`` releases each layer's gathered parameters after its forward, gathers them again for its
            backward, and starts the next layer's all-gather as a layer computes, as FSDP2 does (one more layer at
            the peak, the all-gathers overlapped); ``"layer"`` does the same without the overlap (the smallest peak,
            for the tightest budgets: each all-gather waited for); ``"keep"`` holds every layer gathered in the
            forward until its backward, DeepSpeed's default (up to 2 bytes/param more at the peak). ZeRO-3 settings
            of the user's config (``stage3_max_reuse_distance``, ``stage3_max_live_parameters``,
            ``stage3_prefetch_bucket_size``) are kept as they are (default: ``"auto"``).
        trust_checkpoint: resume from checkpoints without checking that none of their files needs code to be read
            (each file is otherwise read with torch's weights-only unpickler first, and one that needs more is
            refused). Only for checkpoints whose writer you trust: reading such a file can run any command. The
            Trainer's own ``fit(..., weights_only=False)`` does the same where Lightning passes it on (default:
            ``False``).
        **kwargs: passed to Lightning's ``DeepSpeedStrategy`` (``parallel_devices``, ``cluster_environment``,
            ``process_group_backend``, ``timeout``, ``logging_level``, ``load_full_weights``...).
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
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        contiguous_memory_optimization: bool = False,
        synchronize_checkpoint_boundary: bool = False,
        state_storage: str = "memory",
        state_dir: str | os.PathLike | None = None,
        moments: str = "bf16",
        compensation: str = "bf16",
        gradient_release: bool = False,
        gather_cache: str = "auto",
        trust_checkpoint: bool = False,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        logging_level: int = logging.WARN,
        **kwargs: Any,
    ) -> None:
        if not _DEEPSPEED_AVAILABLE:
            raise ModuleNotFoundError(
                f"`{self.strategy_name}` needs DeepSpeed: {_DEEPSPEED_AVAILABLE.message}."
                " `pip install 'deepspeed>=0.19.8'`"
            )
        self.trust_checkpoint = bool(trust_checkpoint)
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
                "partition_activations": partition_activations,
                "cpu_checkpointing": cpu_checkpointing,
                "contiguous_memory_optimization": contiguous_memory_optimization,
                "synchronize_checkpoint_boundary": synchronize_checkpoint_boundary,
                "parallel_devices": parallel_devices,
                "cluster_environment": cluster_environment,
                "precision_plugin": precision_plugin,
                "process_group_backend": process_group_backend,
                "logging_level": logging_level,
                **kwargs,
            },
        )

    # -------------------------------------------------------------------------------------------------- precision
    @property
    @override
    def precision_plugin(self) -> pure_precision.PureBF16Precision:
        if self._precision_plugin is None:
            self._precision_plugin = pure_precision.PureBF16Precision()
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = presets.translate_precision(
            precision_plugin,
            pure_cls=pure_precision.PureBF16Precision,
            flag_classes=(DeepSpeedPrecision, Precision),
            api="Trainer",
            strategy_name=self.strategy_name,
        )

    # ---------------------------------------------------------------------------------------- environment (CPU too)
    @override
    def setup_environment(self) -> None:
        presets.set_up_environment(
            self,
            self.precision_plugin,
            DDPStrategy.setup_environment,
            api="Trainer",
            cpu_cls=CPUAccelerator,
            cuda_cls=CUDAAccelerator,
        )

    @override
    def setup_distributed(self) -> None:
        assert self.parallel_devices is not None
        with zero3_engine.process_group_destroyed_at_exit():
            if isinstance(self.accelerator, CUDAAccelerator):
                super().setup_distributed()
                return
            # CPU devices carry no index, which Lightning's device-index validation rejects; nothing to validate.
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # configure_model builds partitioned; a Hugging Face model built there is initialised and tied as
        # transformers does under ZeRO-3 (hf_models.py).
        with partitioned_construction(super().model_sharded_context(), self.config):
            yield

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        engine, ds_optimizer, _ = zero3_engine.initialize_engine(
            self.config, model, optimizer, lr_scheduler, self._device_rank(), self.settings
        )
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        import deepspeed

        # As Lightning's own inference setup (bf16 and ZeRO-3 sections only), with a device rank DeepSpeed accepts.
        assert isinstance(self.config, dict)
        inference_config = {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": self.config["bf16"],
            "zero_allow_untested_optimizer": True,
            "zero_optimization": self.config["zero_optimization"],
        }
        _internals.lightning_remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

    def _device_rank(self) -> int:
        # DeepSpeed compares the device rank with 0; CPU devices have no index, so pass the local rank.
        return zero3_engine.device_rank(self.root_device, self.local_rank)

    # ------------------------------------------------------------------------------------------ optimizer adoption
    @override
    def _init_optimizers(self) -> tuple[Optimizer, LRSchedulerConfig | None]:
        optimizer, scheduler_config = super()._init_optimizers()
        who = f"Trainer(strategy='{self.strategy_name}')"
        scheduler = scheduler_config.scheduler if scheduler_config is not None else None
        converted = adopt_for_zero3(
            optimizer,
            scheduler,
            self.optimizer_options,
            who=who,
            source="configure_optimizers",
            global_rank=self.global_rank,
        )
        return converted, scheduler_config

    @override
    def _initialize_deepspeed_train(self, model: Module) -> None:
        super()._initialize_deepspeed_train(model)
        self._pure_bf16_engine_setup(self.deepspeed_engine)

    # ------------------------------------------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Lightning's sampler injection is done: a shuffled torchdata loader gets a seeded order, and a fit resumed
        # mid-epoch goes on with the next batch instead of replaying the epoch's first ones (data.py says why).
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        who = f"Trainer(strategy='{self.strategy_name}')"
        return prepare_dataloader(super().process_dataloader(dataloader), who=who, trainer=trainer)

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        """Save DeepSpeed's sharded checkpoint to a staging directory, fsync it, then move it into place.

        A save interrupted at any instant leaves the previous checkpoint at ``filepath`` or the new one, never a mix.
        """
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by `{type(self).__name__}`:"
                " DeepSpeed writes the checkpoint itself."
            )
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self._pure_bf16_save(self.deepspeed_engine, filepath, client_state, global_step=checkpoint.get("global_step"))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Check the checkpoint (complete, untruncated, a known format, no file that needs code to be read), then
        load it. ``trust_checkpoint=True`` (or ``weights_only=False``, which Lightning 2.6 drops on the way here for
        strategies that restore after setup, as DeepSpeed's do) reads the files without that check.

        Saved by this world size with the same sub-groups: DeepSpeed loads it, bit for bit. Saved by another world size
        or sub-group layout, or by DeepSpeed bf16-mixed (fp32 masters): every value is re-partitioned to this run
        (:mod:`lightning_pure_bf16.repartition`) and a log line says so.
        """
        if self.load_full_weights:
            return super().load_checkpoint(checkpoint_path, weights_only)
        from lightning.pytorch.trainer.states import TrainerFn

        client_state, repartitioned = self._pure_bf16_load(
            self.deepspeed_engine,
            checkpoint_path,
            load_optimizer_states=self.lightning_module.trainer.state.fn == TrainerFn.FITTING,
            strict=self.lightning_module.strict_loading,
            trust_checkpoint=self.trust_checkpoint or weights_only is False,
        )
        if repartitioned is not None and "pytorch-lightning_version" not in client_state:
            import lightning

            # Written by DeepSpeed alone: nothing of Lightning's to restore.
            client_state.update({"pytorch-lightning_version": lightning.__version__, "lr_schedulers": []})
            rank_zero_info(
                f"{self.strategy_name}: '{checkpoint_path}' was written by DeepSpeed without Lightning: the Trainer's"
                " loops and LR schedulers start fresh, the optimizer continues from its saved step."
            )
        return client_state

    # --------------------------------------------------------------------------------------- non-finite steps
    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        opt = self.pure_bf16_optimizer
        before = opt.skipped_steps
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if opt.skipped_steps > before and trainer is not None:  # counted and warned about by the engine's handle
            for logger in trainer.loggers:
                logger.log_metrics({"pure_bf16/skipped_steps": float(opt.skipped_steps)}, step=trainer.global_step)
        return output

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        handle = zero3_engine.engine_handle(self.deepspeed_engine)
        if handle is not None:
            handle.log_peak_memory()


# The strategy is named in Lightning's registry as soon as it is defined (the package imports this module when
# Lightning loads).
DeepSpeedPureBF16Strategy.register_strategies(StrategyRegistry)

__all__ = ["STATE_DIR_ENV", "DeepSpeedPureBF16Strategy"]
