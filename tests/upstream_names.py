"""The registry of the private upstream names the package relies on, and the tools that check it (test data: nothing
in the package reads it).

Every private name of DeepSpeed, Lightning, torch, transformers or Accelerate that ``lightning_pure_bf16/_internals/``
touches is listed in :data:`PRIVATE_NAMES` with what it is expected to be and why the package needs it, and the
upstream code the package copies or replaces in :data:`COPIED_UPSTREAM` (a fingerprint of each tested version's
source). ``tests/test_upstream.py`` checks both against the installed versions, so an upgrade that changes one fails
there, naming it, and walks the package's source for a private name used outside ``_internals.py`` or missing here.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from dataclasses import dataclass, replace
from typing import Any

from lightning_pure_bf16._internals import resolve


@dataclass(frozen=True)
class PrivateName:
    """One private name relied on.

    Attributes:
        owner: ``"module:Qualname"`` of the class or module that holds it.
        name: the attribute, method or marker.
        kind: ``"attribute"`` (assigned as ``self.<name>`` in the class source), ``"method"`` (its leading parameters
            are ``params``), ``"function"`` (a module-level callable whose leading parameters are ``params``) or
            ``"marker"`` (the string appears in the owner's source).
        why: what the package does with it, and where.
        params: the expected leading parameter names (methods and functions).
    """

    owner: str
    name: str
    kind: str
    why: str
    params: tuple[str, ...] = ()


def _private_names(table: str) -> tuple[PrivateName, ...]:
    """The entries of :data:`PRIVATE_NAMES`' table."""
    names: list[PrivateName] = []
    owner = ""
    for line in table.strip("\n").splitlines():
        if not line.startswith(" "):
            owner = line
        elif line.startswith(" " * 8):
            names[-1] = replace(names[-1], why=f"{names[-1].why} {line.strip()}")
        else:
            name, kind, why = (part.strip() for part in line.split(" | "))
            kind, _, params = kind.rstrip(")").partition("(")
            names.append(PrivateName(owner, name, kind, why, tuple(params.split(", ")) if params else ()))
    return tuple(names)


_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_LIGHTNING_DS = "lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy"
# Owners in optional dependencies: checked where they are installed.
OPTIONAL_OWNERS = ("accelerate", "transformers")

# Each private name relied on: the owner (``"module:Qualname"``) on a line of its own, then its names, one per line,
# as ``name | kind | why`` (see :class:`PrivateName`); a kind ``method(self, x)`` names the leading parameters; a
# deeper indent continues a why.
PRIVATE_NAMES: tuple[PrivateName, ...] = _private_names("""
deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3
    _create_fp32_partitions | method(self) | wrapped to alias the master partition
    device | attribute | the string compared in _create_fp32_partitions (aliasing fix)
    offload_optimizer | attribute | aliasing applies only without optimizer offload
    swap_optimizer | attribute | release skips the setup's zero gradient (no swap)
    fp16_partitioned_groups_flat | attribute | the bf16 parameter partitions (memory report)
    fp32_partitioned_groups_flat | attribute | the master partitions the optimizer updates
    sub_group_to_group_id | attribute | maps each flat partition to its param group
    dp_process_group | attribute | the process group the partitions are spread over (Adafactor's and Muon's collectives)
    grad_partitions_flat_buffer | attribute | the gradient partition (memory report)
    optimizer | attribute | the wrapped pure-bf16 optimizer
    def _prepare_fp32_grad_for_sub_group(self, sub_group_id) | marker | replaced per engine: the sub-group's gradient as
        a view, not a flattened copy (its body: COPIED_UPSTREAM)
    averaged_gradients | attribute | each sub-group's gradient partitions (views)
    def get_grad_norm_direct(self, gradients, params, norm_type=2) | marker | wrapped per engine: the gradient norm
        reads the partitions in pieces (no full-size float64 copy)
    fp16_groups | attribute | each sub-group's parameters in partition order (repartition)
    def partition_grads(self, params_to_release | marker | replaced per engine under gradient release: each bucket's
        partitions applied, not kept (its body: COPIED_UPSTREAM)
    self.partition_grads(params_in_bucket, grad_partitions) | marker | the call inside the reduce stream that gradient
        release hooks
    _get_param_partition_rank | method(self) | whether a partition holds elements
    reduce_independent_p_g_buckets_and_remove_grads | method(self, param) | wrapped per engine: a full bucket is
        reduce-scattered at once (reduce_full_buckets_at_once)
    ipg_buckets | attribute | the gradient buckets, by communication dtype
    reduce_bucket_size | attribute | the bucket size a full bucket is measured against
    get_param_comm_dtype | method(self, param) | the bucket of a parameter
    def __reduce_and_partition_ipg_grads(self, communication_data_type | marker | reduce-scatters one bucket and
        partitions its gradients (called for a full bucket)
    parameter_offload | attribute | the owner of ZeRO-3's parameter coordinator
    micro_step_id | attribute | gradient release: a second backward before the step
    __param_id_to_grad_partition | attribute | gradient release points them at an empty tensor
    _pre_step | method(self) | the bookkeeping step of gradient release
    _partition_all_parameters | method(self) | the bookkeeping step of gradient release
    _post_step | method(self, timer_names) | the bookkeeping step of gradient release
    overflow | attribute | whether a step was skipped; gradient release's step reports none
    _global_grad_norm | attribute | the bookkeeping step of gradient release sets it
    param_names | attribute | each parameter's name (repartition)
    clip_grad | attribute | the norm ZeRO-3 clips to in its step (Fabric's clip_gradients)
    unscale_and_clip_grads | method(self, sub_group_id, total_norm) | replaced per engine: its factor handed to the
        update instead of a pass over the gradient (fold_gradient_scale; its factor: COPIED_UPSTREAM)
    _optimizer_step | method(self, sub_group_id) | replaced per engine: the sub-group's update, given the factor as
        the step's argument (fold_gradient_scale; its non-offload path: COPIED_UPSTREAM)
    checkpoint_event_prologue | method(self) | partition every parameter before a load
    checkpoint_event_epilogue | method(self) | re-gather persistent parameters after a load
    _setup_for_real_optimizer | method(self) | wrapped: no gradient buffers under release
    _prepare_fp32_grad_for_sub_group | method(self, sub_group_id) | replaced: the step reads a view of the gradient
        partition
    _DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads | method(self, communication_data_type) | wrapped:
        full buckets reduced at once
    get_grad_norm_direct | method(self, gradients, params, norm_type) | replaced: the norm read in pieces
    partition_grads | method(self, params_to_release, grad_partitions) | wrapped: gradient release updates each
        partition there
    zero_grad | method(self, set_to_none) | gradients cleared at the released step
deepspeed.runtime.zero.partition_parameters
    def partition_numel( | marker | a ZeRO-3 parameter's partition size on each rank (repartition)
    zero_init_context | marker | the depth of open zero.Init contexts (a partitioned construction is open)
    _old_init | marker | where zero.Init keeps a class's own __init__ while it is open
    cls._old_init = cls.__init__ | marker | the __init__ zero.Init wrapped and restores on exit
        (zero_init_keeping_later_inits)
    @functools.wraps(f) | marker | zero.Init's wrapper of a class's __init__ is known by its __wrapped__
        (zero_init_keeping_later_inits)
    zero_init_context = 0 | marker | whether zero.Init is open (from_pretrained refuses to build a model whole)
deepspeed.runtime.engine:DeepSpeedEngine
    skipped_steps | attribute | steps ZeRO-3 skipped on inf/NaN
    global_steps | attribute | restored by a repartitioning load
    global_samples | attribute | restored by a repartitioning load
    checkpoint_engine | attribute | its file reader, given memory-mapped reads for a resume
        (engine_checkpoints.load_checkpoint)
    self.checkpoint_engine.load( | marker | every file a resume reads goes through the checkpoint engine's load
deepspeed.accelerator
    set_accelerator | function(accel_obj) | CPU fits on a GPU host
deepspeed.comm.torch:TorchBackend
    all_gather_function | attribute | ZeRO-3's parameter all-gather, taken in pieces under gloo
        (bounded_gloo_collectives)
    reduce_scatter_function | attribute | ZeRO-3's gradient reduce-scatter, taken in pieces under gloo
        (bounded_gloo_collectives)
deepspeed.comm.comm
    cdb = None | marker | the communication backend DeepSpeed's collectives use
deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator
    fetch_sub_module | method(self, current_submodule, forward) | wrapped per engine: gathers the next module once the
        current one is (gather.prefetch_next_module)
    is_complete_trace | method | the module order is known (gather.prefetch_next_module)
    __submodule_order | attribute | the recorded module order of a step
    __step_id | attribute | the index of the next module in that order
    _PartitionedParameterCoordinator__all_gather_params | method(self, params, forward) | starts an asynchronous
        all-gather and registers it as in flight, which the next fetch waits on
lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy
    _load_config | method(self, config) | reads the user's DeepSpeed config
    _init_deepspeed_distributed | method(self) | the CPU (gloo) process group
    _init_optimizers | method(self) | torch AdamW/Adam adopted there
    _initialize_deepspeed_train | method(self, model) | states allocated after it
    _setup_model_and_optimizer | method(self, model, optimizer) | replaced: DeepSpeed initialized with aliasing and a
        CPU device rank
    _initialize_deepspeed_inference | method(self, model) | replaced: a CPU device rank
    exclude_frozen_parameters | attribute | passed to DeepSpeed's save_checkpoint
lightning.fabric.strategies.deepspeed:DeepSpeedStrategy
    _setup_distributed | method(self) | overridden: the CPU (gloo) process group
    _set_world_ranks | method(self) | called there, as Fabric's own does
    _format_config | method(self) | called there once, as Fabric's own does
    _config_initialized | attribute | whether the config was formatted
    _initialize_engine | method(self, model, optimizer, scheduler) | DeepSpeed initialized (with this package's patches
        around it)
    _deepspeed_engine | attribute | the engine the strategy keeps
    _set_deepspeed_activation_checkpointing | method(self) | as Fabric's setup does
    _convert_stateful_objects_in_state | method(self, state, filter) | fabric.save's client state, as Fabric's own save
        converts it
    _backward_sync_control | attribute | replaced: no_backward_sync under ZeRO-3
lightning.fabric.strategies.strategy:Strategy
    _precision | attribute | the precision the strategy sets
lightning.pytorch.plugins.precision.precision:Precision
    _wrap_closure | method(self, model, optimizer, closure) | the FSDP2 precision runs Lightning's closure (backward,
        hooks, clipping) itself, then steps this package's optimizer with the clip factor as an argument
lightning.pytorch.strategies.strategy:Strategy
    _precision_plugin | attribute | the storage of the precision plugin property the strategy overrides
lightning.pytorch.strategies.model_parallel:ModelParallelStrategy
    _data_parallel_size | attribute | the FSDP2 strategy's data-parallel size, set from the world size before the mesh
        is built
    _tensor_parallel_size | attribute | read with _data_parallel_size
lightning.pytorch.strategies.deepspeed
    remove_module_hooks | function(model) | inference setup, as Lightning's
lightning.pytorch.utilities._pytree
    LeafSpec() | marker | origin of a warning _warnings.py filters
lightning.pytorch.trainer.connectors.data_connector
    _parse_num_batches | function(stage, length, limit_batches) | the batches of a train epoch, as the fit loop counts
        them (data.py)
lightning.fabric.utilities.data
    _update_dataloader | function(dataloader, sampler) | a train loader rebuilt with another sampler (data.py)
lightning.fabric.strategies.strategy
    class _BackwardSyncControl | marker | the base of the Fabric strategy's no_backward_sync control (fabric.py)
lightning.fabric.wrappers
    _unwrap_objects | function(collection) | Fabric's wrappers unwrapped (fabric.py)
lightning.fabric.wrappers:_FabricDataLoader
    _num_iter_calls | attribute | the epoch Fabric gives the sampler at each pass, restored by resume_fabric_dataloader
        (data.py)
    _dataloader | attribute | the loader Fabric wraps, replaced by resume_fabric_dataloader (data.py)
lightning.fabric.utilities.distributed:_DatasetSamplerWrapper
    _sampler | attribute | the sampler a DistributedSamplerWrapper shards (data.py)
lightning.fabric.fabric:Fabric._get_distributed_sampler
    isinstance(dataloader.sampler, (RandomSampler, SequentialSampler)) | marker | Fabric wraps a sampler of another
        class (torchdata's RandomSampler) instead of reshuffling by seed (data.py)
lightning.pytorch.trainer.connectors.data_connector:_get_distributed_sampler
    isinstance(dataloader.sampler, (RandomSampler, SequentialSampler)) | marker | the Trainer wraps torchdata's
        RandomSampler likewise (data.py)
torch.optim.lr_scheduler
    _wrapped_by_lr_sched | marker | set on the adopted optimizer's step (adoption)
    _opt_called | marker | set by that wrapper (adoption), and by gradient release
torch.distributed.distributed_c10d
    `torch.distributed.all_gather_into_tensor` is deprecated | marker | a warning _warnings.py filters
    `torch.distributed.reduce_scatter_tensor` is deprecated | marker | a warning _warnings.py filters
torch.optim:Optimizer.load_state_dict
    self.__setstate__( | marker | AdamW.__setstate__
deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine
    load | method(self, path, map_location) | replaced for a resume by a memory-mapped, weights-only read of the same
        file
accelerate.accelerator:Accelerator
    _prepare_deepspeed | method(self) | run with deepspeed.initialize routed to lightning_pure_bf16.deepspeed.initialize
        (integrations)
accelerate.accelerator:Accelerator._prepare_deepspeed
    ds_initialize = deepspeed.initialize | marker | the function it reads when it runs, replaced for that time
        (integrations)
torch.cpu
    get_capabilities | function | precision.py: does this CPU have bf16 dot products
transformers.modeling_utils
    remove_tied_weights_from_state_dict | function(state_dict, model) | the names save_model writes from the partitions:
        tied weights once, under the name the model expects
transformers.core_model_loading
    revert_weight_conversion | function(model, state_dict) | a model whose saved names or tensors differ from its own is
        saved by the Trainer's gathering path
transformers.modeling_utils:PreTrainedModel
    init_weights | method(self) | replaced while the partitioned init is open: initialisation on gathered partitions
        (COPIED_UPSTREAM)
    _initialize_weights | method(self, module, is_custom_code) | one module's initialisation, run on its gathered
        parameters
    tie_weights | method(self, missing_keys, recompute_mapping) | ties made after a partitioned construction
    _is_hf_initialized | marker | the flag that marks a loaded parameter or an initialised module, which initialisation
        skips
torch.nn.modules.module:Module
    _non_persistent_buffers_set | marker | the buffers a state dict leaves out (pretrained.py's targets)
transformers.integrations.deepspeed
    _hf_deepspeed_config_weak_ref = None | marker | the registered DeepSpeed config, put back after the partitioned
        construction
    prevent_arange_dtype_change | function | RoPE buffers keep their dtypes under zero.Init
transformers.models.auto.auto_factory:_BaseAutoModelClass
    _model_mapping | attribute | from_pretrained(model_class=AutoModel...): the family's class for a config
transformers.configuration_utils:PreTrainedConfig
    _attn_implementation | marker | from_pretrained(attn_implementation=...)
transformers.trainer:Trainer
    _save | method(self, output_dir, state_dict) | the Trainer's config, tokenizer and arguments files, written beside
        the weights save_model streams
""")

# Upstream code this package copies or replaces, with the fingerprint (:func:`source_fingerprint`) of each tested
# version. A fingerprint not listed means upstream changed the code: review the copy named in ``ours``, then add it.
COPIED_UPSTREAM: dict[str, dict[str, Any]] = {
    f"{_LIGHTNING_DS}.setup_environment": {
        "ours": "strategy.py DeepSpeedPureBF16Strategy.setup_environment (skips its CUDA-only check, keeps the rest)",
        "tested": {"lightning 2.6.0, 2.6.6": "eff45e9c561444fb"},
    },
    f"{_LIGHTNING_DS}.setup_distributed": {
        "ours": "strategy.py DeepSpeedPureBF16Strategy.setup_distributed (the same steps without the device check)",
        "tested": {"lightning 2.6.0, 2.6.6": "6bc1df8ae7a74bf2"},
    },
    f"{_LIGHTNING_DS}._setup_model_and_optimizer": {
        "ours": "strategy.py DeepSpeedPureBF16Strategy._setup_model_and_optimizer (with master aliasing)",
        "tested": {"lightning 2.6.0, 2.6.6": "59238c2269096f11"},
    },
    f"{_LIGHTNING_DS}._initialize_deepspeed_inference": {
        "ours": "strategy.py DeepSpeedPureBF16Strategy._initialize_deepspeed_inference (bf16 and ZeRO-3 only)",
        "tested": {"lightning 2.6.0, 2.6.6": "2a71e4bda7726455"},
    },
    f"{_STAGE3}._prepare_fp32_grad_for_sub_group": {
        "ours": "_internals.view_sub_group_gradients (the same result without the flattened copy)",
        "tested": {"deepspeed 0.19.8": "e19095bb1db7f991"},
    },
    f"{_STAGE3}.unscale_and_clip_grads": {
        "ours": "_internals.fold_gradient_scale (its factor, computed the same way, applied inside the update)",
        "tested": {"deepspeed 0.19.8": "3ada6cbf6909016f"},
    },
    f"{_STAGE3}._optimizer_step": {
        "ours": "_internals.fold_gradient_scale (the non-offload path, the step given the clip factor)",
        "tested": {"deepspeed 0.19.8": "9decd7e8d6d9312c"},
    },
    f"{_STAGE3}.step": {
        "ours": "_internals.step_without_update (gradient release: its bookkeeping without the update)",
        "tested": {"deepspeed 0.19.8": "ece97b149cac56f4"},
    },
    f"{_STAGE3}._setup_for_real_optimizer": {
        "ours": "_internals._without_gradient_buffers (release: the flat gradient partition on the meta device)",
        "tested": {"deepspeed 0.19.8": "6e4cbe50d8f3e602"},
    },
    f"{_STAGE3}.initialize_optimizer_states": {
        "ours": "_internals._without_gradient_buffers (skipped without offload, swapping or Adagrad under release)",
        "tested": {"deepspeed 0.19.8": "e8e7178f3b0dffcc"},
    },
    f"{_STAGE3}.partition_grads": {
        "ours": "_internals.release_gradient_partitions (gradient release: what it frees and its test for data)",
        "tested": {"deepspeed 0.19.8": "97f5aff810864920"},
    },
    "torch.optim.lr_scheduler:LRScheduler.__init__.patch_track_step_called": {
        "ours": "_internals.mark_step_for_lr_scheduler",
        "tested": {"torch 2.13": "94239865ea263df3"},
    },
    "transformers.modeling_utils:PreTrainedModel.init_weights": {
        "ours": "_internals.transformers_partitioned_init (its init and tie, on gathered partitions)",
        "tested": {"transformers 5.25.0": "2e0ca47a32e77d78"},
    },
    "transformers.integrations.deepspeed:initialize_weights_zero3": {
        "ours": "_internals.initialize_partitioned_weights (the same dispatch, loaded modules not gathered)",
        "tested": {"transformers 5.25.0": "d2ecd271895f9363"},
    },
}


def source_fingerprint(target: str) -> str:
    """A fingerprint of the code of ``"module:Qualname"`` that ignores formatting, comments, docstrings and type
    annotations (what it does, not how it is written).

    A trailing name below a function (``Class.method.inner``) fingerprints the function defined inside it.
    """
    try:
        obj = resolve(target)
        inner = None
    except AttributeError:
        outer, _, inner = target.rpartition(".")
        obj = resolve(outer)
    obj = undecorated(obj, target.replace(":", ".").rpartition(".")[2])
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    node: ast.AST = tree.body[0]
    if inner is not None:
        node = next(n for n in ast.walk(node) if isinstance(n, ast.FunctionDef) and n.name == inner)
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n.returns = None
        elif isinstance(n, ast.arg):
            n.annotation = None
        body = getattr(n, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            n.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    return hashlib.sha256(ast.dump(node, annotate_fields=False).encode()).hexdigest()[:16]


def undecorated(obj: Any, name: str) -> Any:
    """The function named ``name`` under decorators that keep it only in their closure (DeepSpeed's
    ``instrument_w_nvtx`` has no ``functools.wraps``: the source of the method would be the decorator's)."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    while inspect.isfunction(obj) and obj.__name__ != name and obj.__closure__:
        inner = [c.cell_contents for c in obj.__closure__ if inspect.isfunction(c.cell_contents)]
        if not inner:
            break
        obj = inner[0]
    return obj
