"""``Trainer(strategy="fsdp2_pure_bf16")``: PyTorch FSDP2 (``fully_shard``) with bf16 parameters, gradients and
optimizer states.

Lightning's ``ModelParallelStrategy`` (the LightningModule shards itself in ``configure_model``, with ``fully_shard``
and, if it likes, tensor parallelism) with three changes: the module is bf16 before ``configure_model`` runs (so FSDP2
shards bf16 parameters and reduce-scatters bf16 gradients), the user's ``torch.optim.AdamW``/``Adam`` becomes this
package's optimizer with the same hyperparameters, and its states are allocated, measured and reported at setup.
Checkpoints are FSDP2's own (``torch.distributed.checkpoint``), which reshard to another world size. ZeRO-3
(``"deepspeed_pure_bf16"``) remains the package's engine for everything else (states in files, gradient release,
its checkpoint tools); this strategy is for users whose model code is FSDP2's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from typing_extensions import override

from lightning_pure_bf16 import _internals, presets
from lightning_pure_bf16._log import rank_zero_info
from lightning_pure_bf16.adoption import adopt_optimizer, rebind_scheduler
from lightning_pure_bf16.data import prepare_dataloader
from lightning_pure_bf16.memory import format_report, sharded_model_state_report
from lightning_pure_bf16.optim import PureBF16Optimizer
from lightning_pure_bf16.optim.options import OptimizerOptions
from lightning_pure_bf16.optim.sharded import is_dtensor
from lightning_pure_bf16.safe_load import check_dcp_checkpoint, checkpoint_safe_globals

# The registered names: (description, the strategy arguments they set).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp2_pure_bf16": ("PyTorch FSDP2 in pure bf16 with stochastic rounding (8 bytes/param)", {}),
    "fsdp2_pure_bf16_kahan": (
        "PyTorch FSDP2 in pure bf16 with Kahan compensation (10 bytes/param)",
        {"rounding": "kahan"},
    ),
    "fsdp2_pure_bf16_int8": (
        "PyTorch FSDP2 in pure bf16 with 8-bit moments, stochastic rounding (6 bytes/param)",
        {"moments": "int8"},
    ),
    "fsdp2_pure_bf16_int8_kahan": (
        "PyTorch FSDP2 in pure bf16 with 8-bit moments and an 8-bit Kahan remainder (7 bytes/param)",
        {"moments": "int8", "rounding": "kahan", "compensation": "int8"},
    ),
    "fsdp2_pure_bf16_release": (
        "PyTorch FSDP2 in pure bf16 with stochastic rounding and gradient release (6 bytes/param)",
        {"gradient_release": True},
    ),
    "fsdp2_pure_bf16_int8_release": (
        "PyTorch FSDP2 in pure bf16 with 8-bit moments and gradient release (4 bytes/param)",
        {"moments": "int8", "gradient_release": True},
    ),
}


class FSDP2PureBF16Precision(HalfPrecision):
    """``precision="bf16-true"``: bf16 parameters, inputs cast to bf16; the only precision of the FSDP2 strategy.

    Clipping by norm (``Trainer(gradient_clip_val=...)``) computes the gradients' global norm and the clip factor as
    ``torch.nn.utils.clip_grad_norm_`` does, and hands the factor to this package's optimizer as the step's argument
    (``step(grad_scale=...)``), which applies it in float32 inside its update, instead of a pass that multiplies every
    gradient in place (and rounds it to bf16); the norm being finite, the step skips its own inf/NaN check
    (``step(grads_finite=True)``). A non-finite norm, or another optimizer, takes torch's own clipping (and the step
    its check, which then skips it). For that, this package's optimizer is stepped after the closure (the backward,
    the ``on_before_optimizer_step`` hooks, the clipping), as Lightning's mixed precision steps through its scaler.
    """

    def __init__(self) -> None:
        super().__init__("bf16-true")
        # What clip_grad_by_norm established for the step that follows it: the factor and the finite word.
        self._clipped: dict[int, tuple[float, bool]] = {}

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        if not isinstance(optimizer, PureBF16Optimizer):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        self._clipped.pop(id(optimizer), None)
        loss = _internals.lightning_run_closure(self, model, optimizer, closure)
        grad_scale, grads_finite = self._clipped.pop(id(optimizer), (1.0, False))
        optimizer.step(grad_scale=grad_scale, grads_finite=grads_finite, **kwargs)
        return loss

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if not isinstance(optimizer, PureBF16Optimizer):
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        params = list(self.main_params(optimizer))
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        factor = torch.clamp(float(clip_val) / (total + 1e-6), max=1.0)
        factor = float(factor.full_tensor() if is_dtensor(factor) else factor)
        if not factor > 0.0:  # an inf/NaN norm (factor 0 or NaN): torch's clipping with that norm; the step then skips
            torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)
            return
        # A finite global norm: every gradient on every rank is finite, so the step need not check them again.
        self._clipped[id(optimizer)] = (factor, True)

    def clipped(self, optimizer: Any) -> tuple[float, bool]:
        """The clip factor and the finite word :meth:`clip_grad_by_norm` established for ``optimizer``'s next step
        (``(1.0, False)``: none)."""
        return self._clipped.get(id(optimizer), (1.0, False))


class FSDP2PureBF16Strategy(ModelParallelStrategy):
    """FSDP2 in pure bf16: 8 bytes per parameter of model state (10 with Kahan, 6 with 8-bit moments), sharded.

    The LightningModule applies ``fully_shard`` in ``configure_model`` (to each block, then to itself), on
    ``self.device_mesh["data_parallel"]``, as with Lightning's ``ModelParallelStrategy``; its parameters are bf16 by
    then. ``configure_optimizers`` returns this package's ``AdamW``/``Adam`` or a ``torch.optim.AdamW``/``Adam``,
    which the strategy converts (same hyperparameters, LR schedulers rebound).

    Args:
        rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``; used when the strategy converts a torch optimizer
            (default: ``"stochastic"``).
        seed: seed of the rounding noise of a converted optimizer (default: ``None``: drawn from torch's default
            generator, the same on every rank after ``seed_everything``); each shard's elements draw by their index
            in the whole tensor, so ranks draw different bits from one seed.
        backend: optimizer backend, ``"auto"``, ``"triton"``, ``"cpu"`` or ``"torch"`` (default: ``"auto"``).
        moments: ``"bf16"`` or ``"int8"`` (default: ``"bf16"``).
        compensation: ``"bf16"`` or ``"int8"``, the Kahan buffer's format (default: ``"bf16"``).
        gradient_release: update each parameter as soon as FSDP2 has reduce-scattered its gradient (its
            post-accumulate-grad hooks) and free the gradient then: no gradient shards are kept (6 bytes/param, 4 with
            8-bit moments), the same bits as without. Refuses gradient accumulation and gradient clipping, which need
            every gradient first; an inf/NaN gradient leaves that parameter as it is on every rank (default:
            ``False``).
        data_parallel_size: ranks per data-parallel (FSDP2) group (default: ``"auto"``: the world size divided by
            ``tensor_parallel_size``).
        tensor_parallel_size: ranks per tensor-parallel group (default: ``1``: FSDP2 alone).
        save_distributed_checkpoint: each rank saves its shards (a folder, ``torch.distributed.checkpoint``) or rank 0
            saves the whole model and optimizer in one file (default: ``True``).
        trust_checkpoint: read a checkpoint's files with the full unpickler, which runs whatever code they name
            (default: ``False``: every file PyTorch would unpickle is first read with an allowlist, and one that names
            anything else is refused).
        process_group_backend: ``"nccl"`` or ``"gloo"`` (default: ``None``: chosen by the device).
        timeout: the process group's timeout.
    """

    strategy_name = "fsdp2_pure_bf16"

    def __init__(
        self,
        *,
        rounding: str = "stochastic",
        seed: int | None = None,
        backend: str = "auto",
        moments: str = "bf16",
        compensation: str = "bf16",
        gradient_release: bool = False,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = 1,
        save_distributed_checkpoint: bool = True,
        trust_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        who = type(self).__name__
        self._options = OptimizerOptions(
            rounding=rounding, seed=seed, backend=backend, moments=moments, compensation=compensation
        )
        self._options.check(who)
        self.trust_checkpoint = bool(trust_checkpoint)
        self.gradient_release = bool(gradient_release)
        self._release_hooks: list[Any] = []
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets.register_presets(strategy_registry, cls, PRESETS)

    @property
    def optimizer_options(self) -> OptimizerOptions:
        return self._options

    # -------------------------------------------------------------------------------------------------- precision
    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = FSDP2PureBF16Precision()
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = presets.translate_precision(
            precision_plugin,
            pure_cls=FSDP2PureBF16Precision,
            flag_classes=(HalfPrecision, Precision),
            api="Trainer",
            strategy_name=self.strategy_name,
        )

    # ------------------------------------------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        # "auto": the world divided by the tensor-parallel size (Lightning's "auto" would be the number of nodes).
        _internals.fill_data_parallel_size(self)
        super().setup_environment()

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # configure_model shards what exists by then: bf16 parameters, so that FSDP2 keeps bf16 shards, gathers bf16
        # layers and reduce-scatters bf16 gradients.
        if self.lightning_module is not None:
            self.lightning_module.to(torch.bfloat16)
        with super().model_sharded_context():
            yield

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        who = f"Trainer(strategy='{self.strategy_name}')"
        self._check_parameters(who)
        converted = []
        for optimizer in self.optimizers:
            ours = adopt_optimizer(optimizer, self._options, who=who, source="configure_optimizers")
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is optimizer:
                    rebind_scheduler(config.scheduler, ours)
            # One seed on every rank: replicas of a shard (HSDP) must draw the same bits to stay equal.
            ours.seed = self.broadcast(ours.seed)
            # Allocated now: memory is taken, reported and, if short, fails at setup rather than at the first step.
            ours.init_states([(p, g) for g in ours.param_groups for p in g["params"] if p.requires_grad])
            converted.append(ours)
        self.optimizers = converted
        if self.gradient_release:
            self._release_gradients(trainer, who)
        if converted:
            rank_zero_info(f"{self.strategy_name}: model state on rank 0: {format_report(self.memory_report())}")

    def _release_gradients(self, trainer: Any, who: str) -> None:
        """Update each parameter from FSDP2's post-accumulate-grad hook and free its gradient there."""
        if trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"`{who}` with `gradient_release=True` updates each parameter during the backward, so it cannot"
                f" accumulate gradients over {trainer.accumulate_grad_batches} batches"
                " (`Trainer(accumulate_grad_batches=...)`). Use a larger batch, or leave gradient release off."
            )
        if trainer.gradient_clip_val:
            raise ValueError(
                f"`{who}` with `gradient_release=True` updates each parameter before the gradient norm over all"
                f" parameters exists, so it cannot clip (`Trainer(gradient_clip_val={trainer.gradient_clip_val})`)."
                " Turn clipping off, or leave gradient release off."
            )
        if len(self.optimizers) != 1:
            raise ValueError(f"`{who}` with `gradient_release=True` takes one optimizer, got {len(self.optimizers)}.")
        optimizer = self.optimizers[0]

        def release(p: torch.Tensor) -> None:
            optimizer.step_parameter(p)
            p.grad = None

        for hook in self._release_hooks:
            hook.remove()
        self._release_hooks = [
            p.register_post_accumulate_grad_hook(release)
            for g in optimizer.param_groups
            for p in g["params"]
            if p.requires_grad
        ]

    @override
    def teardown(self) -> None:
        for hook in self._release_hooks:
            hook.remove()
        self._release_hooks = []
        super().teardown()

    def _check_parameters(self, who: str) -> None:
        module = self.lightning_module
        plain = [n for n, p in module.named_parameters() if p.requires_grad and not is_dtensor(p)]
        if plain:
            raise RuntimeError(
                f"`{who}`: {len(plain)} trainable parameter(s) are not sharded (for example {plain[0]!r}): apply"
                " `torch.distributed.fsdp.fully_shard(module, mesh=self.device_mesh['data_parallel'])` to each block"
                " and then to the whole model in the LightningModule's `configure_model`."
            )
        wide = [(n, p.dtype) for n, p in module.named_parameters() if p.requires_grad and p.dtype != torch.bfloat16]
        if wide:
            name, dtype = wide[0]
            raise RuntimeError(
                f"`{who}`: {len(wide)} trainable parameter(s) are not bf16 (for example {name!r}, {dtype}); pure bf16"
                " keeps bf16 parameters. Do not convert the model back to another dtype in `configure_model`."
            )

    # ------------------------------------------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        # As under ZeRO-3: a shuffled torchdata loader gets a seeded order, and a fit resumed mid-epoch goes on with
        # the next batch instead of replaying the epoch's first ones.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        who = f"Trainer(strategy='{self.strategy_name}')"
        return prepare_dataloader(super().process_dataloader(dataloader), who=who, trainer=trainer)

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Check that no file of the checkpoint would run code when read (DCP reads its ``.metadata`` with
        ``pickle.load``; Lightning reads ``meta.pt`` with the full unpickler unless told otherwise), then load it with
        DCP, resharding to this run's world size. ``trust_checkpoint=True`` (or ``weights_only=False``) skips the
        check."""
        trust = self.trust_checkpoint or weights_only is False
        path = Path(self.broadcast(checkpoint_path))
        check_dcp_checkpoint(path, trust=trust)
        with torch.serialization.safe_globals(checkpoint_safe_globals()):
            return super().load_checkpoint(path, weights_only=not trust)

    # ------------------------------------------------------------------------------------------------ inspection
    @property
    def pure_bf16_optimizer(self) -> PureBF16Optimizer:
        """The pure-bf16 optimizer (holds the moments and counters)."""
        return self.optimizers[0]

    def memory_report(self) -> dict[str, float]:
        """Model-state bytes per parameter on this rank, by category, from the live shards.

        Returns:
            See :func:`lightning_pure_bf16.memory.sharded_model_state_report`.
        """
        return sharded_model_state_report(
            self.pure_bf16_optimizer, self.lightning_module, gradients_released=self.gradient_release
        )


# The strategy is named in Lightning's registry as soon as it is defined (the package imports this module when
# Lightning loads).
FSDP2PureBF16Strategy.register_strategies(StrategyRegistry)

__all__ = ["PRESETS", "FSDP2PureBF16Precision", "FSDP2PureBF16Strategy"]
