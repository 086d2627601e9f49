"""Pure bf16 for the Hugging Face ``Trainer``: ``PureBF16Trainer`` in place of ``transformers.Trainer``::

    from transformers import TrainingArguments
    from lightning_pure_bf16.integrations.transformers import PureBF16Trainer, deepspeed_config

    args = TrainingArguments("out", bf16=True, deepspeed=deepspeed_config(), learning_rate=3e-4, ...)
    trainer = PureBF16Trainer(model=model, args=args, train_dataset=train)   # 8 bytes/param instead of 16+
    trainer.train()                                   # or trainer.train(resume_from_checkpoint=True)
    trainer.save_model("final")                       # bf16 weights streamed from the partitions: from_pretrained

The Trainer keeps doing what it does with DeepSpeed (the ``TrainingArguments``: learning rate, weight decay on its
own no-decay groups, warm-up and schedulers, gradient accumulation, ``max_grad_norm``; checkpoints every
``save_steps``; ``resume_from_checkpoint``; ``save_model``). What changes is the one call where Accelerate hands the
model and the optimizer to ``deepspeed.initialize``: it goes to :func:`lightning_pure_bf16.deepspeed.initialize`, which
converts the Trainer's torch ``AdamW`` into the pure-bf16 optimizer with its groups, aliases the master partition,
allocates the states, logs the memory report, and gives the engine the durable checkpoint methods (with checks and
re-partitioning to another world size) that the Trainer's save and resume call.

A stock ``transformers.Trainer`` with DeepSpeed discards an optimizer passed in ``optimizers=`` and builds a torch
AdamW with float32 masters; ``PureBF16Trainer`` uses the one given (converted) and its scheduler. A
``lightning_pure_bf16.AdamW`` that a stock Trainer hands to DeepSpeed's bf16 mixed precision refuses to step
float32 masters, naming this class.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from typing import Any

import transformers

from lightning_pure_bf16 import _internals, zero3_engine
from lightning_pure_bf16 import deepspeed as pure_bf16_deepspeed
from lightning_pure_bf16.adoption import rebind_scheduler
from lightning_pure_bf16.pretrained import partition_sources, save_pretrained
from lightning_pure_bf16.release import check_release_config
from lightning_pure_bf16.shards import parse_size

WHO = "PureBF16Trainer"
# The Trainer's optimizer choices (``TrainingArguments.optim``) it builds as torch.optim.AdamW or SGD (``optim_args``
# give SGD's momentum, dampening and nesterov): converted to this package's AdamW and SGD.
ADOPTED_OPTIMS = ("adamw_torch", "adamw_torch_fused", "sgd")
# save_model's largest shard unless the Trainer is given another: the host's own save_pretrained default.
_HOST_MAX_SHARD_SIZE = (
    inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
)

# `save_model` streams the weights from the partitions; the gathering flag stays for the saves it leaves to the Trainer
# (a PEFT model's adapters), which need it.
_DEEPSPEED_CONFIG: dict[str, Any] = {
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


def deepspeed_config(**overrides: Any) -> dict[str, Any]:
    """A DeepSpeed config for ``TrainingArguments(deepspeed=...)``: ZeRO-3, bf16, ``"auto"`` batch sizes, accumulation
    and clipping (the Trainer fills them from its arguments), and the consolidated 16-bit weights gathered by
    ``save_model``. ``overrides`` are merged over it key by key (``zero_optimization={"reduce_bucket_size": 1e7}``).
    Pure bf16's own settings are added by ``PureBF16Trainer`` when it sets DeepSpeed up."""
    config = copy.deepcopy(_DEEPSPEED_CONFIG)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    return config


class PureBF16TrainerMixin:
    """Pure bf16 for any ``transformers.Trainer`` subclass: put it first among the bases (``class
    MyTrainer(PureBF16TrainerMixin, SFTTrainer)``), or let :func:`pure_bf16_trainer` make the class.

    It changes five methods of the Trainer, and only them: ``__init__`` (takes this package's keyword options, checks
    the ``TrainingArguments`` before anything is set up), ``create_accelerator_and_postprocess`` (routes Accelerate's
    ``deepspeed.initialize`` of the trained model to :func:`lightning_pure_bf16.deepspeed.initialize`),
    ``create_optimizer`` and ``create_scheduler`` (the ones given in ``optimizers=`` are used, not dropped) and
    ``save_model`` (the weights streamed from ZeRO-3's partitions, never gathered on one rank). A
    subclass that prepares another model for DeepSpeed itself (TRL's ``DPOTrainer`` and its reference model) keeps
    doing so: that model is not trained and holds no optimizer.
    """

    pure_bf16_options: dict[str, Any]
    max_shard_size: int | str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        who = type(self).__name__
        self.max_shard_size = kwargs.pop("max_shard_size", _HOST_MAX_SHARD_SIZE)
        parse_size(self.max_shard_size)  # a bad size refused now, not at the first save
        self.pure_bf16_options = pure_bf16_deepspeed.take_options(who, kwargs)
        training_args = _training_args_of(super().__init__, args, kwargs)
        _check_training_args(training_args, who)
        if self.pure_bf16_options["gradient_release"]:
            # The Trainer's own values, checked before anything is set up (its DeepSpeed config takes them as "auto").
            check_release_config(
                who,
                {
                    "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
                    "gradient_clipping": training_args.max_grad_norm,
                },
            )
        super().__init__(*args, **kwargs)
        # The process group TrainingArguments created is destroyed at exit if still alive (else a finished run could
        # abort there, exit 134).
        zero3_engine.destroy_process_group_at_exit()
        # The Trainer's DeepSpeed set-up drops what `optimizers=` gave: kept here, used by create_optimizer/scheduler.
        self._given_optimizer, self._given_scheduler = self.optimizer, self.lr_scheduler

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        if self.is_deepspeed_enabled:
            initialize = functools.partial(pure_bf16_deepspeed.initialize, **self.pure_bf16_options)
            _internals.route_accelerate_deepspeed(self.accelerator, initialize)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained weights in Hugging Face's layout, written from ZeRO-3's partitions: one parameter at a time is
        gathered onto the first rank and streamed into its shard (``max_shard_size``, by default the host's), so no
        rank holds the model; ``config.json``, the tokenizer and the arguments as the Trainer writes them. Called on
        every rank, as the Trainer's own checkpoints call it. A PEFT model (its adapters), or a model whose saved
        names differ from its own, is saved as the Trainer saves it."""
        names = self._names_saved_from_partitions()
        if names is None:
            return super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)

        def beside() -> None:
            if self.args.should_save:
                _internals.transformers_save_beside_weights(self, output_dir)

        save_pretrained(self.model, output_dir, max_shard_size=self.max_shard_size, names=names, on_staged=beside)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _names_saved_from_partitions(self) -> list[str] | None:
        engine = getattr(self, "deepspeed", None)
        if not self.is_deepspeed_enabled or engine is None or engine.zero_optimization_stage() != 3:
            return None
        if not isinstance(self.model, transformers.PreTrainedModel):  # PEFT's adapters, or a plain module
            return None
        shapes = {s.name: s.shape for s in partition_sources(self.model)}
        return _internals.transformers_saved_names(self.model, shapes)

    def create_optimizer(self, model: Any = None) -> Any:
        """The optimizer given in ``optimizers=``, else the Trainer's torch AdamW with its weight-decay groups; either
        becomes the pure-bf16 optimizer when DeepSpeed is set up."""
        if self.optimizer is None and self._given_optimizer is not None:
            self.optimizer = self._given_optimizer
        return super().create_optimizer(model)  # type: ignore[misc]

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The scheduler given in ``optimizers=``, following the pure-bf16 optimizer; else the Trainer's own."""
        if self.lr_scheduler is None and self._given_scheduler is not None:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper around the optimizer
            if getattr(self._given_scheduler, "optimizer", None) is not inner:
                rebind_scheduler(self._given_scheduler, inner)
            self.lr_scheduler = self._given_scheduler
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]


class PureBF16Trainer(PureBF16TrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with DeepSpeed ZeRO-3 in pure bf16 (8 bytes/param; 6 with ``moments="int8"``).

    Args:
        *args, **kwargs: as ``transformers.Trainer``. ``args`` must be ``TrainingArguments`` with ``bf16=True`` and
            ``deepspeed`` set (:func:`deepspeed_config`, a dict or a JSON file); ``optim`` an AdamW
            (``"adamw_torch"``, the default, or ``"adamw_torch_fused"``) or ``"sgd"`` (``optim_args`` as the
            Trainer takes them: ``"momentum=0.9,nesterov=true"``). ``optimizers=(optimizer, scheduler)`` may give a
            torch ``AdamW``/``Adam``/``SGD``/``Adafactor``/``Muon`` or this package's ``AdamW``, ``Adam``, ``Lion``,
            ``SGD``, ``Adafactor`` or ``Muon`` and a scheduler on it.
        rounding, moments, compensation, state_storage, state_dir, seed, backend, gradient_release, gather_cache:
            keyword options, as :func:`lightning_pure_bf16.deepspeed.initialize` (and the strategies) take them.
        trust_checkpoint: a resume reads files that need code to be read, with the full unpickler (default: False,
            such a file is refused); only for checkpoints whose writer you trust.
        max_shard_size: the largest safetensors shard ``save_model`` writes (default: ``save_pretrained``'s, 50GB in
            transformers 5); ``"5GB"``, ``"500MB"`` or bytes.

    Raises:
        ValueError: a bad option, ``TrainingArguments`` without DeepSpeed or bf16, or another optimizer choice,
            before the Trainer is set up.
    """


_made: dict[type, type] = {}


def pure_bf16_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass, such as TRL's ``SFTTrainer`` or ``DPOTrainer``) in pure
    bf16: a subclass of it with :class:`PureBF16TrainerMixin` first, named ``PureBF16<Name>``, taking the same
    arguments as ``trainer_cls`` plus this package's keyword options (as :class:`PureBF16Trainer`)::

        from trl import SFTConfig, SFTTrainer
        trainer = pure_bf16_trainer(SFTTrainer)(model=model, args=SFTConfig(..., bf16=True,
                                                deepspeed=deepspeed_config()), train_dataset=data)

    The same class comes back for the same ``trainer_cls``; a class that already is pure bf16 comes back as it is.

    Raises:
        TypeError: ``trainer_cls`` is not a subclass of ``transformers.Trainer``.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(
            f"`pure_bf16_trainer` takes a subclass of `transformers.Trainer` (such as `trl.SFTTrainer`), got"
            f" {trainer_cls!r}."
        )
    if issubclass(trainer_cls, PureBF16TrainerMixin):
        return trainer_cls
    if trainer_cls not in _made:
        name = f"PureBF16{trainer_cls.__name__}"
        doc = f"``{trainer_cls.__module__}.{trainer_cls.__qualname__}`` in pure bf16 (:func:`pure_bf16_trainer`)."
        _made[trainer_cls] = type(name, (PureBF16TrainerMixin, trainer_cls), {"__doc__": doc, "__qualname__": name})
    return _made[trainer_cls]


def _training_args_of(host_init: Any, args: tuple, kwargs: dict) -> Any:
    """The ``args=`` a Trainer's ``__init__`` is called with, by its own signature (``transformers.Trainer`` takes it
    second, TRL's ``DPOTrainer`` third)."""
    try:
        bound = inspect.signature(host_init).bind_partial(*args, **kwargs)
    except TypeError:
        return kwargs.get("args")
    return bound.arguments.get("args")


def _check_training_args(args: Any, who: str = WHO) -> None:
    if not isinstance(args, transformers.TrainingArguments):
        raise ValueError(
            f"`{who}` needs `args=TrainingArguments(..., bf16=True, deepspeed=deepspeed_config())`; got"
            f" {type(args).__name__}."
        )
    if args.deepspeed is None:
        raise ValueError(
            f"`{who}` trains through DeepSpeed ZeRO-3, but `TrainingArguments.deepspeed` is not set. Pass"
            " `deepspeed=lightning_pure_bf16.integrations.transformers.deepspeed_config()` (or your own config)."
        )
    if not args.bf16:
        raise ValueError(f"`{who}` keeps everything in bf16: pass `TrainingArguments(bf16=True)`.")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim == "adafactor":
        # transformers' Adafactor is another rule than torch.optim.Adafactor's (the Trainer turns its relative step
        # and parameter scaling off, so its step is lr itself): converting it would change the algorithm silently.
        raise ValueError(
            f"`{who}`: `TrainingArguments(optim='adafactor')` is transformers' own Adafactor (relative_step and"
            " scale_parameter off, clip_threshold, beta1), which is not torch.optim.Adafactor's rule; this package's"
            " Adafactor has torch's. Pass it as `optimizers=(lightning_pure_bf16.Adafactor(model.parameters(),"
            " lr=...), None)`, or use `optim='adamw_torch'`."
        )
    if optim not in ADOPTED_OPTIMS:
        raise ValueError(
            f"`{who}` trains with this package's AdamW or SGD, but `TrainingArguments(optim={optim!r})` asks for an"
            f" optimizer it cannot convert. Use one of {list(ADOPTED_OPTIMS)} (the default is 'adamw_torch'), or"
            " pass this package's optimizer (`Lion`, `Adafactor` or `Muon`) as `optimizers=(optimizer, None)`."
        )


__all__ = ["ADOPTED_OPTIMS", "PureBF16Trainer", "PureBF16TrainerMixin", "deepspeed_config", "pure_bf16_trainer"]
