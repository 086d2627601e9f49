"""Pure bf16 for plain DeepSpeed: ``lightning_pure_bf16.deepspeed.initialize``, a drop-in for ``deepspeed.initialize``.

The third front end over the same core as the Trainer and Fabric strategies, for a training loop that calls
DeepSpeed itself::

    import lightning_pure_bf16.deepspeed as pure_bf16

    engine, optimizer, _, _ = pure_bf16.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                                   config={"train_micro_batch_size_per_gpu": 8})
    for x, y in loader:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    pure_bf16.save_checkpoint(engine, "ckpt/step100")        # staged, fsynced, validated on load
    pure_bf16.load_checkpoint(engine, "ckpt/step100")        # any world size

It merges the pure-bf16 DeepSpeed config (bf16 everywhere, ZeRO stage 3, bf16 masters aliased to the parameter
partition, bf16 optimizer states) over the user's and refuses settings that contradict it, converts a torch
``AdamW``/``Adam`` (or the config's ``"optimizer"`` section, or builds one from ``model_parameters``) into this
package's optimizer with the same options as the strategies, allocates the states at setup, counts steps ZeRO-3
skips on inf/NaN, logs the measured memory per parameter, and runs on CUDA or on the CPU (gloo).
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

from lightning_pure_bf16 import _internals, checkpoint, engine_checkpoints, presets, zero3_engine
from lightning_pure_bf16._warnings import silence_known_warnings
from lightning_pure_bf16.adoption import adopt_optimizer, prepare_for_zero3, rebind_scheduler
from lightning_pure_bf16.optim import Adam, AdamW, Lion, Muon, PureBF16Optimizer
from lightning_pure_bf16.optim.options import OptimizerOptions

NAME = "lightning_pure_bf16.deepspeed"
WHO = "lightning_pure_bf16.deepspeed.initialize"
# DeepSpeed optimizer types the config's "optimizer" section may name (DeepSpeed's "Adam" is AdamW unless
# "adam_w_mode" is false, which is Adam with L2 regularisation), with the params each takes.
_CONFIG_OPTIMIZERS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction"},
    "adamw": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction"},
    "lion": {"lr", "betas", "weight_decay"},
    # DeepSpeed's Muon: a shared lr (muon_lr and adam_lr override it per half), Muon's momentum, Adam's betas and eps.
    "muon": {"lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "betas", "eps"},
}


def deepspeed_muon_rule(name: str, p: torch.Tensor) -> bool:
    """Whether DeepSpeed's Muon orthogonalizes parameter ``name`` (``deepspeed.set_optimizer_flags``): two or more
    dimensions as a layer (``ds_shape`` under ``zero.Init``) and a name without ``embed`` or ``lm_head``; the rest
    (embeddings, the output layer, biases, norms) is stepped by AdamW."""
    shape = getattr(p, "ds_shape", None) or p.shape
    return len(shape) >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def _muon_groups(hp: dict[str, Any], params: list[Any], model: torch.nn.Module | None) -> list[dict[str, Any]]:
    """The param groups of a config's ``"type": "Muon"``: the parameters split by :func:`deepspeed_muon_rule`, each
    half with its settings (DeepSpeed's ``_muon_param_groups``)."""
    if any(isinstance(p, dict) for p in params) or model is None:
        raise ValueError(
            f'`{WHO}`: a config\'s `"type": "Muon"` splits the model\'s parameters by their names, which'
            " `model_parameters` given as param groups (or no model) do not give. Pass the optimizer as `optimizer`:"
            " `lightning_pure_bf16.Muon` with a group of `use_muon=False` for the rest."
        )
    given = {id(p) for p in params}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in given]
    muon = {k: hp[k] for k in ("lr", "momentum", "weight_decay") if k in hp}
    adam = {k: hp[k] for k in ("lr", "betas", "eps", "weight_decay") if k in hp}
    muon.update({"lr": hp["muon_lr"]} if "muon_lr" in hp else {})
    adam.update({"lr": hp["adam_lr"]} if "adam_lr" in hp else {})
    groups = [
        {"params": [p for n, p in named if deepspeed_muon_rule(n, p)], **muon},
        {"params": [p for n, p in named if not deepspeed_muon_rule(n, p)], "use_muon": False, **adam},
    ]
    return [g for g in groups if g["params"]]


def _load_config(config: dict[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"`{WHO}(config={str(config)!r})`: no such file. Pass a dict or the path of a JSON config.")
    return json.loads(path.read_text())


def _optimizer_from_config(
    section: dict[str, Any], params: Any, options: OptimizerOptions, model: torch.nn.Module | None = None
) -> PureBF16Optimizer:
    """This package's optimizer from a DeepSpeed ``"optimizer"`` section (``{"type": "AdamW", "params": {...}}``);
    ``"type": "Muon"`` is this package's ``Muon`` (``torch.optim.Muon``'s arithmetic) over the parameters DeepSpeed's
    Muon would orthogonalize (:func:`deepspeed_muon_rule`), AdamW over the rest."""
    kind = str(section.get("type", "")).lower()
    if kind not in _CONFIG_OPTIMIZERS:
        raise ValueError(
            f"`{WHO}`: the config's optimizer is {section.get('type')!r}; pure bf16 builds Adam, AdamW, Lion and Muon"
            ' from the config. Use `"type": "AdamW"`, or pass the optimizer as `optimizer` (a torch.optim.AdamW, Adam,'
            " SGD, Adafactor or Muon, or this package's AdamW, Adam, Lion, SGD, Adafactor or Muon)."
        )
    hp = dict(section.get("params", {}))
    if "betas" in hp:
        hp["betas"] = tuple(hp["betas"])
    unknown = sorted(set(hp) - _CONFIG_OPTIMIZERS[kind])
    if unknown:
        why = " (its Muon runs torch.optim.Muon's quintic Newton-Schulz)" if kind == "muon" else ""
        raise ValueError(f"`{WHO}`: the config's optimizer params {unknown} are not supported by pure bf16{why}.")
    if hp.pop("bias_correction", True) is not True:
        raise ValueError(f"`{WHO}`: the config's optimizer asks for `bias_correction: false`, which pure bf16 lacks.")
    if kind == "lion":
        return Lion(params, **hp, **options.optimizer_kwargs())
    if kind == "muon":
        return Muon(_muon_groups(hp, list(params), model), **options.optimizer_kwargs())
    hp.pop("torch_adam", None)
    decoupled = hp.pop("adam_w_mode", True)
    cls = AdamW if kind == "adamw" or decoupled else Adam
    return cls(params, **hp, **options.optimizer_kwargs())


OPTION_NAMES = presets.OPTION_NAMES


def take_options(who: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove this front end's options (:data:`OPTION_NAMES`) from ``kwargs`` and return all of them, the ones not
    given at :func:`initialize`'s defaults, after the checks it makes, with the same words naming ``who``: for a front
    end over this one (``PureBF16Trainer``, ``PureBF16Accelerator``) that must refuse a bad value before it sets
    anything up and passes the rest of ``kwargs`` to its own base class.

    Raises:
        ValueError: a bad option.
    """
    defaults = inspect.signature(initialize).parameters
    options = {name: kwargs.pop(name, defaults[name].default) for name in OPTION_NAMES}
    options["trust_checkpoint"] = kwargs.pop("trust_checkpoint", False)
    _check_trust(who, options["trust_checkpoint"])
    presets.PureBF16Settings(who=who, strategy_name=who, loaded_config=None, **{n: options[n] for n in OPTION_NAMES})
    return options


def _check_trust(who: str, trust_checkpoint: Any) -> None:
    if not isinstance(trust_checkpoint, bool):
        raise ValueError(
            f"`{who}(trust_checkpoint={trust_checkpoint!r})` must be True or False: True reads the checkpoints this"
            " run resumes from with the full unpickler, which runs any code a file names (only for files whose writer"
            " you trust)."
        )


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    config: dict[str, Any] | str | os.PathLike | None = None,
    config_params: dict[str, Any] | str | os.PathLike | None = None,
    *,
    rounding: str = "stochastic",
    moments: str = "bf16",
    compensation: str = "bf16",
    state_storage: str = "memory",
    state_dir: str | os.PathLike | None = None,
    seed: int | None = None,
    backend: str = "auto",
    gradient_release: bool = False,
    gather_cache: str = "auto",
    trust_checkpoint: bool = False,
    **kwargs: Any,
) -> tuple[Any, PureBF16Optimizer, Any, Any]:
    """``deepspeed.initialize`` in pure bf16: the same arguments and return value, plus the strategies' options.

    Args:
        args, model, optimizer, model_parameters, training_data, lr_scheduler, config, config_params: as
            ``deepspeed.initialize`` (``config_params`` is its older name for ``config``, which Accelerate passes).
            ``optimizer`` may be a ``torch.optim.AdamW``, ``Adam``, ``SGD``, ``Adafactor`` or ``Muon`` (converted,
            hyperparameters and param groups kept) or one of this package's optimizers; without one, the config's
            ``"optimizer"`` section (type Adam, AdamW, Lion or Muon: this package's ``Muon`` over the parameters
            DeepSpeed's Muon would orthogonalize, :func:`deepspeed_muon_rule`, AdamW over the rest) or else
            ``AdamW(model_parameters)`` with its defaults is built. ``config`` may hold a
            ``"pure_bf16"`` section with ``state_storage`` and ``state_dir``, as the strategies' config does.
        rounding, moments, compensation, state_storage, state_dir, seed, backend, gradient_release, gather_cache: as
            :class:`lightning_pure_bf16.DeepSpeedPureBF16Strategy`.
        trust_checkpoint: the engine's own ``load_checkpoint`` (what the Hugging Face Trainer's and Accelerate's
            resume call) reads files that need code to be read, with the full unpickler; only for checkpoints whose
            writer you trust, since such a file can run any command (default: False, such a file is refused).
        **kwargs: passed on to ``deepspeed.initialize`` (``collate_fn``, ``mpu``, ``dist_init_required``...).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``; ``optimizer`` is the pure-bf16 optimizer (its
        ``param_groups`` are what a scheduler should follow), stepped through ``engine.step()``.

    Raises:
        ValueError: a bad option, a config that contradicts pure bf16 (fp16, ZeRO stage 1/2, offload, fp32
            gradient accumulation...), or a config optimizer other than Adam/AdamW, before anything is set up.
        TypeError: an optimizer that cannot be converted.
    """
    import deepspeed
    import torch.distributed as dist

    silence_known_warnings()
    if model is None:
        raise ValueError(f"`{WHO}` needs `model`.")
    _check_trust(WHO, trust_checkpoint)
    if config is not None and config_params is not None:
        raise ValueError(f"`{WHO}` got both `config` and `config_params` (its older name); pass one of them.")
    config = config if config is not None else config_params
    user = _load_config(config if config is not None else getattr(args, "deepspeed_config", None))
    optimizer_section = user.pop("optimizer", None)
    if optimizer is not None and optimizer_section is not None:
        raise ValueError(
            f'`{WHO}` got both `optimizer` and an `"optimizer"` section in the config; DeepSpeed refuses that too.'
            " Pass one of them."
        )
    settings = presets.PureBF16Settings(
        who=WHO,
        strategy_name=NAME,
        loaded_config=user,
        rounding=rounding,
        seed=seed,
        backend=backend,
        moments=moments,
        compensation=compensation,
        state_storage=state_storage,
        state_dir=state_dir,
        gradient_release=gradient_release,
        gather_cache=gather_cache,
    )
    full = settings.deepspeed_config({"zero_optimization": {"stage": 3}})
    settings.check_engine_config(full)
    on_cpu = not torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR") == "cpu"
    settings.configure_device(full, None, on_cpu=on_cpu)  # no precision plugin: the user's model decides its products
    options = settings.optimizer_options
    params = model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    if optimizer is None and optimizer_section is not None:
        optimizer = _optimizer_from_config(optimizer_section, params, options, model)
    elif optimizer is None:
        optimizer = AdamW(params, **options.optimizer_kwargs())
    else:
        given = optimizer
        optimizer = adopt_optimizer(given, options, who=WHO, source="the `optimizer` argument")
        if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is given and optimizer is not given:
            rebind_scheduler(lr_scheduler, optimizer)  # a scheduler built on the torch optimizer follows the new one

    with zero3_engine.process_group_destroyed_at_exit():
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    if not on_cpu:
        torch.cuda.set_device(local_rank)
    prepare_for_zero3(optimizer, base_seed=options.seed, global_rank=rank)
    if on_cpu:
        settings.prepare_cpu_loop(local_rank, lambda name: dist.barrier())
    kwargs.setdefault("dist_init_required", False)
    with zero3_engine.zero3_construction(gradient_release):
        engine, _, loader, scheduler = _internals.deepspeed_initialize()(
            args=args,
            model=model,
            optimizer=optimizer,
            model_parameters=None,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            config=full,
            **kwargs,
        )
    device = torch.device("cpu") if on_cpu else torch.device("cuda", local_rank)
    # Held on the engine (`engine.pure_bf16`): a step ZeRO-3 skipped on inf/NaN is counted, warned about and flagged
    # as `optimizer.overflow` (DeepSpeed's ZeRO optimizers' flag, read by Accelerate's `step_was_skipped` and so by the
    # Hugging Face Trainer, which then leaves its scheduler where it was).
    zero3_engine.after_engine_setup(engine, NAME, device, gradient_release=gradient_release, gather_cache=gather_cache)
    _route_checkpoint_methods(engine, trust_checkpoint=trust_checkpoint)
    return engine, optimizer, loader, scheduler


def _handle(engine: Any, what: str) -> zero3_engine.EngineHandle:
    handle = zero3_engine.engine_handle(engine)
    if handle is None:
        raise ValueError(
            f"`{NAME}.{what}` needs an engine made by `{WHO}`; this one was not (got {type(engine).__name__})."
        )
    return handle


def save_checkpoint(
    engine: Any,
    path: str | os.PathLike,
    client_state: dict[str, Any] | None = None,
    *,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Save on every rank (same ``path``): DeepSpeed's sharded checkpoint, written to a staging directory, fsynced and
    moved into place, so that a crash leaves the previous checkpoint or the new one, never half of one."""
    import torch.distributed as dist

    _handle(engine, "save_checkpoint")
    engine_checkpoints.save_checkpoint(
        engine,
        path,
        dict(client_state or {}),
        world_size=dist.get_world_size(),
        is_global_zero=dist.get_rank() == 0,
        barrier=lambda name: dist.barrier(),
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_checkpoint(
    engine: Any,
    path: str | os.PathLike,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    strict: bool = True,
    trust_checkpoint: bool = False,
) -> dict[str, Any]:
    """Check, then load a checkpoint saved by :func:`save_checkpoint` (or by the strategies) into ``engine``, from
    any world size (re-partitioned when it differs); returns the ``client_state`` saved with it. The scheduler given
    to :func:`initialize` is restored too (``load_lr_scheduler_states``). No file that needs code to be read is
    loaded unless ``trust_checkpoint=True`` (only for a checkpoint whose writer you trust: it can run any command).

    Raises:
        lightning_pure_bf16.CheckpointError: naming the file and what is wrong, before anything is loaded.
    """
    import torch.distributed as dist

    _handle(engine, "load_checkpoint")
    client_state, _ = engine_checkpoints.load_checkpoint(
        engine,
        path,
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        load_optimizer_states=load_optimizer_states,
        strict=strict,
        strategy_name=NAME,
        load_lr_scheduler_states=load_lr_scheduler_states,
        trust_checkpoint=trust_checkpoint,
    )
    return client_state


def _route_checkpoint_methods(engine: Any, *, trust_checkpoint: bool = False) -> None:
    """The engine's own ``save_checkpoint``/``load_checkpoint`` (what the Hugging Face Trainer and Accelerate call) go
    through :func:`save_checkpoint`/:func:`load_checkpoint`, in DeepSpeed's layout: ``save_dir/<tag>`` (default tag
    ``global_step<N>``) and a ``latest`` file. ``load_dir`` may also be one checkpoint (``save_dir/<tag>``)."""
    import torch.distributed as dist

    def save(
        save_dir: str | os.PathLike,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
        save_checkpoint(engine, Path(save_dir) / tag, client_state, exclude_frozen_parameters=exclude_frozen_parameters)
        if save_latest and dist.get_rank() == 0:
            checkpoint.write_latest_tag(save_dir, tag)
        dist.barrier()
        return True

    def load(
        load_dir: str | os.PathLike,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str, dict[str, Any]]:
        if load_module_only or custom_load_fn is not None:
            raise ValueError(
                f"`engine.load_checkpoint` of an engine made by `{WHO}` loads whole checkpoints; for the weights"
                " alone, consolidate them (`python -m lightning_pure_bf16.consolidate`) and load the state dict."
            )
        if tag is None and checkpoint.is_checkpoint(load_dir):
            path = Path(load_dir)  # one checkpoint rather than a directory of them
        else:
            path = Path(load_dir) / (checkpoint.read_latest_tag(load_dir) if tag is None else str(tag))
        client_state = load_checkpoint(
            engine,
            path,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            strict=load_module_strict,
            trust_checkpoint=trust_checkpoint,
        )
        return os.fspath(path), client_state

    engine.save_checkpoint, engine.load_checkpoint = save, load


__all__ = ["OPTION_NAMES", "take_options", "initialize", "load_checkpoint", "save_checkpoint"]
