"""transformers' and Accelerate's internals, and DeepSpeed's entry points they go through: ``deepspeed.initialize``
swapped for Accelerate, the engine's checkpoint reads, ``zero.Init`` kept for later inits, transformers' ZeRO-3
initialisation and names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_pure_bf16._internals._access import _read

# ------------------------------------------------------------- DeepSpeed as Accelerate and the checkpoint engine use it
_REPLACED_INITIALIZE: list[Any] = []


def deepspeed_initialize() -> Any:
    """DeepSpeed's own ``deepspeed.initialize``, also while :func:`deepspeed_initialize_replaced` runs."""
    import deepspeed

    return _REPLACED_INITIALIZE[0] if _REPLACED_INITIALIZE else deepspeed.initialize


@contextmanager
def deepspeed_checkpoint_reads(engine: Any, read: Callable[[str], Any]) -> Iterator[None]:
    """The engine's checkpoint files are read with ``read(path)`` while the block runs, in place of its checkpoint
    engine's ``torch.load`` (which reads a rank's whole optimizer file into memory: weights and moments, 6 bytes per
    parameter of its partition on the host, where a memory-mapped read holds page cache only)."""
    checkpoint_engine = _read(engine, "checkpoint_engine", "DeepSpeed's checkpoint reader")
    load = _read(checkpoint_engine, "load", "DeepSpeed's checkpoint reader")
    checkpoint_engine.load = lambda path, map_location=None: read(path)  # every caller maps to the CPU
    try:
        yield
    finally:
        checkpoint_engine.load = load


@contextmanager
def deepspeed_initialize_replaced(initialize: Any) -> Iterator[None]:
    """``deepspeed.initialize`` is ``initialize`` while the block runs (Accelerate reads it when it prepares)."""
    import deepspeed

    if _REPLACED_INITIALIZE:  # already routed (a nested prepare): nothing more to replace
        yield
        return
    _REPLACED_INITIALIZE.append(deepspeed.initialize)
    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = _REPLACED_INITIALIZE.pop()


def route_accelerate_deepspeed(accelerator: Any, initialize: Any) -> None:
    """This ``Accelerator`` prepares DeepSpeed models with ``initialize`` instead of ``deepspeed.initialize``."""
    prepare = _read(accelerator, "_prepare_deepspeed", "Accelerate's DeepSpeed preparation")

    def prepare_deepspeed(*args: Any) -> Any:
        with deepspeed_initialize_replaced(initialize):
            return prepare(*args)

    accelerator._prepare_deepspeed = prepare_deepspeed


# ------------------------------------------------------------------------------------------- transformers and zero.Init
def transformers_saved_names(model: torch.nn.Module, shapes: dict[str, torch.Size]) -> list[str] | None:
    """The names ``save_pretrained`` would write for a model whose state has these names and shapes: tied weights
    once, under the name the model expects on load. None where it would also rename or reshape tensors (a model with
    weight conversions), which needs whole tensors."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    kept = remove_tied_weights_from_state_dict(meta, model)
    try:
        reverted = revert_weight_conversion(model, dict(kept))
    except Exception:  # a conversion that needs values cannot run on meta tensors: whole tensors it is
        return None
    if list(reverted) != list(kept) or any(reverted[k].shape != kept[k].shape for k in kept):
        return None
    return list(kept)


def transformers_save_beside_weights(trainer: Any, output_dir: str) -> None:
    """The Trainer's own ``_save`` without weights: ``config.json``, the generation config, the tokenizer or
    processor, ``training_args.bin`` (and an empty weights file, which the weights written next replace)."""
    trainer._save(output_dir, state_dict={})


def _module_subclasses() -> list[type]:
    found, todo = [], [torch.nn.Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _init_calling(init: Callable[..., Any], original: Callable[..., Any]) -> Any:
    """``init``, a function whose closure holds DeepSpeed's wrapper of ``original``, as a new function whose closure
    holds ``original`` instead; None where its closure holds no such wrapper."""
    import types

    cells = init.__closure__ or ()
    wrapped = [getattr(_cell_value(cell), "__wrapped__", None) is original for cell in cells]
    if not any(wrapped):
        return None
    closure = tuple(types.CellType(original) if w else cell for cell, w in zip(cells, wrapped))
    fixed = types.FunctionType(init.__code__, init.__globals__, init.__name__, init.__defaults__, closure)
    fixed.__kwdefaults__, fixed.__qualname__ = init.__kwdefaults__, init.__qualname__
    fixed.__dict__.update(init.__dict__)
    return fixed


@contextmanager
def zero_init_keeping_later_inits(zero_init: Any) -> Iterator[None]:
    """``zero_init`` (a ``deepspeed.zero.Init``) entered, with a DeepSpeed bug worked around at its exit.

    DeepSpeed bug worked around here (0.19.8): ``zero.Init`` wraps the ``__init__`` of every ``nn.Module`` class
    defined while it is open, and on leaving sets ``cls.__init__`` back to the function it wrapped, even where
    something replaced ``cls.__init__`` after it wrapped it. A library that decorates its classes at import does that:
    transformers' model files, through the ``kernels`` package's ``use_kernelized_func``, replace ``__init__`` with one
    that also creates the module's ``_kernel_funcs``. A model family first imported inside the partitioned init
    (``from_pretrained`` resolving its class, ``AutoModelForCausalLM`` inside ``configure_model``) therefore loses
    that replacement when it closes, and every model of the family built afterwards in the process fails in its first
    forward (``AttributeError: 'LlamaAttention' object has no attribute '_kernel_funcs'``). Here, for each class
    defined inside, a replacement of DeepSpeed's wrapper is kept, calling the wrapped function instead of the wrapper
    (the class is then as if defined outside). The bug and the fix: ``tests/test_hf_models.py::``
    ``test_a_class_defined_inside_zero_init_keeps_a_later_init_bug_and_fix``.
    """
    from deepspeed.runtime.zero import partition_parameters

    before = set(_module_subclasses())
    repaired: dict[type, Any] = {}
    with zero_init:
        try:
            yield
        finally:
            depth = _read(partition_parameters, "zero_init_context", "the depth of open zero.Init contexts")
            for cls in _module_subclasses() if depth == 1 else ():  # only the outermost exit restores the classes
                init, original = cls.__dict__.get("__init__"), getattr(cls, "_old_init", None)
                if cls in before or init is None or original is None:
                    continue
                if getattr(init, "__wrapped__", None) is original:  # DeepSpeed's own wrapper: restored correctly
                    continue
                fixed = _init_calling(init, original)
                if fixed is not None:
                    repaired[cls] = fixed
    for cls, init in repaired.items():
        cls.__init__ = init


def zero3_init_active() -> bool:
    """Whether a ``deepspeed.zero.Init`` context is open in this process (modules built now are partitioned)."""
    from deepspeed.runtime.zero import partition_parameters

    return _read(partition_parameters, "zero_init_context", "the depth of open zero.Init contexts") > 0


def transformers_is_auto_class(cls: type) -> bool:
    """Whether ``cls`` is one of transformers' Auto classes (``AutoModelForCausalLM``), which map a config's type to
    the family's class."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return isinstance(cls, type) and issubclass(cls, _BaseAutoModelClass)


def transformers_auto_model_class(auto_cls: type, config: Any) -> type:
    """The class an Auto class builds for ``config`` (``LlamaForCausalLM`` for a Llama config); KeyError if none."""
    return _read(auto_cls, "_model_mapping", "an Auto class's map from config type to model class")[type(config)]


def transformers_set_attn_implementation(config: Any, value: str) -> None:
    """The attention implementation a model built from ``config`` uses, as ``from_pretrained(attn_implementation=)``
    sets it."""
    _read(config, "_attn_implementation", "the attention implementation of a transformers config")
    config._attn_implementation = value


@contextmanager
def transformers_zero3_config(config: dict[str, Any]) -> Iterator[None]:
    """transformers' ``is_deepspeed_zero3_enabled()`` is true while this is open (its ``from_pretrained``,
    ``from_config`` and ``resize_token_embeddings`` then take their ZeRO-3 paths), as ``TrainingArguments`` makes it
    for the Hugging Face Trainer; whatever config was registered before is registered again on exit."""
    from transformers.integrations import deepspeed as hf_deepspeed

    before = _read(hf_deepspeed, "_hf_deepspeed_config_weak_ref", "transformers' registered DeepSpeed config")
    handle = hf_deepspeed.HfDeepSpeedConfig(config)
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = before
        del handle


def initialize_partitioned_weights(model: torch.nn.Module) -> None:
    """transformers' weight initialisation of ``model`` (a ``PreTrainedModel``) run on ZeRO-3's partitions: each
    module's parameters gathered, initialised on the first rank and scattered back, as transformers' own
    ``initialize_weights_zero3`` does; modules already initialised (the flag transformers sets) and modules whose
    parameters were all loaded are skipped before anything is gathered."""
    import deepspeed
    import torch.distributed as dist
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    custom = model.is_custom_code()
    first = not dist.is_initialized() or dist.get_rank() == 0

    def visit(module: torch.nn.Module, init: Callable[..., None]) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        if getattr(module, "_is_hf_initialized", False):
            return
        # transformers' _init_weights of a module may also write its direct children's parameters.
        params = [*module.parameters(recurse=False)]
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params.extend(child.parameters(recurse=False))
        if params and all(getattr(p, "_is_hf_initialized", False) for p in params):
            module._is_hf_initialized = True
            return
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if first:
                init(module, custom)
        # A module's own parameters are partitioned only when its __init__ returns, after its post_init: the first
        # rank's values for every rank, as the gathered ones get on leaving GatheredParameters.
        if dist.is_initialized():
            for param in params:
                if not hasattr(param, "ds_id"):
                    dist.broadcast(param.data, src=dist.get_global_rank(dist.group.WORLD, 0))
        module._is_hf_initialized = True  # on every rank, so that a second pass gathers nothing here

    with torch.no_grad(), guard_torch_init_functions():
        visit(model, model._initialize_weights)


@contextmanager
def transformers_partitioned_init() -> Iterator[None]:
    """Hugging Face models built while ZeRO-3's partitioned init is open are initialised and tied as transformers
    builds them itself under ZeRO-3. Enter it before ``deepspeed.zero.Init``.

    transformers bug worked around here (5.x): a ``PreTrainedModel`` constructed directly (``LlamaForCausalLM(config)``)
    inside ``deepspeed.zero.Init`` runs ``init_weights`` in its ``post_init`` on parameters ZeRO-3 has already
    partitioned into empty tensors: every initialisation is silently a no-op, and a config with a ``pad_token_id``
    crashes on the embedding's padding row (``IndexError: index 2 is out of bounds for dimension 0 with size 0``).
    transformers' own ``from_config`` and ``from_pretrained`` avoid it by skipping the init and running
    ``initialize_weights_zero3`` afterwards. While this is open, ``PreTrainedModel.init_weights`` of a model with
    partitioned parameters runs :func:`initialize_partitioned_weights` and ties the weights, which is what the original
    does on whole tensors. transformers' ``prevent_arange_dtype_change`` keeps the RoPE buffers' explicit dtypes
    (zero.Init otherwise casts every new floating tensor to its dtype).
    ``tests/test_hf_models.py::test_transformers_init_under_zero_init_bug_and_fix`` shows the bug and the fix.
    """
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
    from transformers.modeling_utils import PreTrainedModel

    original = _read(PreTrainedModel, "init_weights", "transformers' initialisation and tying after construction")

    def init_weights(self: Any) -> None:
        if not any(hasattr(p, "ds_id") for p in self.parameters()):
            return original(self)
        initialize_partitioned_weights(self)
        self.tie_weights(recompute_mapping=False)

    PreTrainedModel.init_weights = init_weights
    try:
        with prevent_arange_dtype_change():
            yield
    finally:
        PreTrainedModel.init_weights = original


__all__ = [
    "deepspeed_checkpoint_reads",
    "deepspeed_initialize",
    "deepspeed_initialize_replaced",
    "initialize_partitioned_weights",
    "route_accelerate_deepspeed",
    "transformers_auto_model_class",
    "transformers_is_auto_class",
    "transformers_partitioned_init",
    "transformers_save_beside_weights",
    "transformers_saved_names",
    "transformers_set_attn_implementation",
    "transformers_zero3_config",
    "zero3_init_active",
    "zero_init_keeping_later_inits",
]
