"""Hugging Face models built under ZeRO-3's partitioned init, as transformers builds them itself.

The pure-bf16 strategies build a LightningModule's model in ``configure_model`` (Trainer) or ``fabric.init_module()``
(Fabric) inside ``deepspeed.zero.Init``: each parameter is partitioned as soon as its module is built, so no rank
ever holds the model. transformers builds models under ZeRO-3 in its own ``from_pretrained`` and ``from_config``;
a model built by its constructor inside someone else's ``zero.Init`` would run its weight initialisation on the
empty partitions. :func:`partitioned_construction` is what the front ends enter around the partitioned init, so that
every way of building a Hugging Face model there gives the model transformers would give:

- ``LlamaForCausalLM(config)``: transformers' initialisation gathered a module at a time (the first rank initialises,
  every rank gets its partition), the weights tied as the config says;
- ``AutoModelForCausalLM.from_config(config)`` and ``.from_pretrained(...)``: transformers' own ZeRO-3 paths (its
  ``from_pretrained`` reads the whole checkpoint on the first rank);
- :func:`from_pretrained`: the config read, the model built with the initialisation skipped, ties made, and every
  rank's partitions filled from its own slices of the checkpoint's files (:func:`~lightning_pure_bf16.load_pretrained`),
  so no rank reads or holds the whole model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pure_bf16 import _internals
from lightning_pure_bf16.pretrained import PretrainedError, checkpoint_files, load_pretrained

# The dtypes a model is built and loaded in; anything else is refused before the config is read.
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# What a model repository holds besides its weights (a hub download takes these and the safetensors files only).
_MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


@contextlib.contextmanager
def partitioned_construction(zero_init: Any, config: Mapping[str, Any] | None) -> Iterator[None]:
    """``zero_init`` (the strategy's ``deepspeed.zero.Init``) entered so that Hugging Face models built inside are
    initialised, tied and loaded as transformers does under ZeRO-3 (transformers sees ZeRO-3 as enabled with
    ``config``: its ``is_deepspeed_zero3_enabled()``), and classes first imported inside work after it closes."""
    with contextlib.ExitStack() as stack:
        if transformers_installed():  # both must be entered before zero.Init
            # transformers' ZeRO-3 paths (and its registered config) need Accelerate; the init fix does not.
            if config is not None and importlib.util.find_spec("accelerate") is not None:
                stack.enter_context(_internals.transformers_zero3_config(dict(config)))
            stack.enter_context(_internals.transformers_partitioned_init())
        stack.enter_context(_internals.zero_init_keeping_later_inits(zero_init))
        yield


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name in ("bf16", "fp16", "fp32"):
        name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[name]
    if name not in _DTYPES:
        raise ValueError(
            f"`from_pretrained(dtype={dtype!r})`: a model is built in torch.bfloat16 (pure bf16), torch.float16 or"
            " torch.float32."
        )
    return _DTYPES[name]


def _local_directory(pretrained: str | os.PathLike, revision: str | None) -> Path:
    """A local directory as it is; anything else is a Hugging Face Hub id, downloaded (config, tokenizer and
    safetensors weights) into the hub's cache, or taken from it."""
    path = Path(pretrained)
    if path.is_dir():
        return path
    if path.exists():
        raise PretrainedError(
            f"'{pretrained}' is a file: give the directory that holds the model's config.json and weights, or a"
            " Hugging Face Hub id."
        )
    name = str(pretrained)
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep in name.replace("/", ""):
        raise PretrainedError(f"No directory '{pretrained}': give a model's directory or a Hugging Face Hub id.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=_MODEL_FILES))
    except Exception as err:  # offline, unknown or gated repository: say which, with the hub's own words
        raise PretrainedError(
            f"'{pretrained}' is not a local directory, and downloading it from the Hugging Face Hub failed"
            f" ({type(err).__name__}: {err}). Give a directory holding config.json and the safetensors weights."
        ) from err


def _model_class(config: Any, model_class: type | None, directory: Path) -> type:
    import transformers

    if model_class is not None:
        if not _internals.transformers_is_auto_class(model_class):
            return model_class
        try:
            return _internals.transformers_auto_model_class(model_class, config)
        except KeyError:
            raise PretrainedError(
                f"`{model_class.__name__}` has no model for '{directory}' ({type(config).__name__}); pass the model"
                " class that fits its config."
            ) from None
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    raise PretrainedError(
        f"'{directory / 'config.json'}' names the architectures {architectures}, which transformers"
        f" {transformers.__version__} does not have: upgrade transformers, or pass model_class= (such as"
        " AutoModelForCausalLM)."
    )


def from_pretrained(
    pretrained: str | os.PathLike,
    *,
    model_class: type | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    strict: bool = True,
    revision: str | None = None,
    trust_remote_code: bool = False,
    **config_overrides: Any,
) -> nn.Module:
    """A pretrained Hugging Face model built partitioned, each rank reading only its own slices of the weights.

    What transformers' ``from_pretrained`` does for its own Trainer, for the pure-bf16 Lightning and Fabric
    strategies: the config read, the model built under ZeRO-3's partitioned init with the random initialisation
    skipped (the weights come from the files), tied weights tied as the config says, each rank's partitions filled
    from safetensors slices (:func:`~lightning_pure_bf16.load_pretrained`: no rank reads or holds a whole tensor), any
    weight the files lack (``strict=False``) initialised as transformers initialises it, and the model returned with
    its generation config, in training mode (transformers' returns eval mode; Lightning keeps a module's mode). Call
    it where the strategy partitions what is built: in a LightningModule's ``configure_model``, inside
    ``fabric.init_module()``, or inside ``deepspeed.zero.Init``::

        def configure_model(self):
            if self.model is None:
                self.model = lightning_pure_bf16.from_pretrained("meta-llama/Llama-3.2-1B")

    Args:
        pretrained: a directory holding ``config.json`` and safetensors weights (as transformers' ``save_pretrained``
            writes them), or a Hugging Face Hub id (downloaded into the hub's cache: config, tokenizer and weights).
        model_class: the class to build: a model class (``LlamaForCausalLM``) or an Auto class
            (``AutoModelForSequenceClassification``) (default: ``None``, the config's ``architectures``).
        dtype: the dtype of the weights: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``; files in
            another float dtype are rounded to nearest, with a message (default: ``torch.bfloat16``).
        strict: refuse a checkpoint that lacks any of the model's weights or holds others (default). With False,
            what the files lack is initialised, and what the model has no place for is skipped.
        revision: the hub revision (a branch, tag or commit) of a hub id (default: ``None``, the main branch).
        trust_remote_code: run the model code a hub repository ships (default: ``False``).
        **config_overrides: config attributes replaced before the model is built (``attn_implementation="sdpa"``,
            ``use_cache=False``).

    Returns:
        The ``transformers.PreTrainedModel``, partitioned by ZeRO-3.

    Raises:
        PretrainedError: not a transformers checkpoint (no ``config.json``, no safetensors weights), an architecture
            transformers does not know, a keyword that is not a config attribute, weights that do not fit the model
            (names, shapes), or called outside the partitioned init; all before any weight is read.
        ValueError: a dtype other than bf16, fp16 or fp32.
    """
    torch_dtype = _dtype(dtype)
    if not transformers_installed():
        raise PretrainedError(
            "from_pretrained builds Hugging Face models: pip install 'lightning-pure-bf16[hf]' (transformers)."
        )
    if not _internals.zero3_init_active():
        raise PretrainedError(
            "from_pretrained builds the model partitioned, so call it where the strategy partitions what is built:"
            " in a LightningModule's configure_model under Trainer(strategy='deepspeed_pure_bf16'), inside"
            " `with fabric.init_module():` under Fabric(strategy='deepspeed_pure_bf16'), or inside"
            " deepspeed.zero.Init. Outside them, use transformers' own from_pretrained."
        )
    import transformers
    from transformers.initialization import no_init_weights

    directory = _local_directory(pretrained, revision)
    if not (directory / "config.json").is_file():
        raise PretrainedError(
            f"'{directory}' is not a transformers checkpoint: it has no config.json. Give the directory"
            " transformers' save_pretrained wrote (config.json and model*.safetensors), or a Hugging Face Hub id."
        )
    checkpoint_files(directory)  # refuses a directory without safetensors weights, before anything is built
    try:
        config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PretrainedError(
            f"transformers {transformers.__version__} cannot read '{directory / 'config.json'}': {reason} A"
            " model_type newer than this transformers: upgrade it; a repository that ships its model's code: pass"
            " trust_remote_code=True."
        ) from err
    unknown = sorted(n for n in config_overrides if n != "attn_implementation" and not hasattr(config, n))
    if unknown:
        raise PretrainedError(
            f"{type(config).__name__} has no {', '.join(map(repr, unknown))}: from_pretrained's keyword arguments"
            " replace attributes of the model's config (such as use_cache=False, attn_implementation='sdpa')."
        )
    for name, value in config_overrides.items():
        if name == "attn_implementation":
            _internals.transformers_set_attn_implementation(config, value)
        else:
            setattr(config, name, value)
    config.dtype = torch_dtype
    cls = _model_class(config, model_class, directory)

    # The weights come from the files: transformers' initialisation would be undone (as its own from_pretrained
    # skips it); the ties it makes in the same call are made right after.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with no_init_weights():
            model = cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.tie_weights()
    loaded = load_pretrained(model, directory, strict=strict)
    missing = set(loaded.missing_keys)
    _internals.mark_loaded_parameters(model, missing)
    if missing:
        _internals.initialize_partitioned_weights(model)
        model.tie_weights()
    if model.can_generate() and (directory / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    # In training mode, as any module is built: transformers' from_pretrained returns eval mode, and Lightning keeps
    # the mode a module has, so its dropout would stay off through the fit.
    model.train()
    return model


__all__ = ["from_pretrained", "partitioned_construction", "transformers_installed"]
