"""``python -m lightning_pure_bf16.plan --params 70e9 --gpus 8 --gpu-memory-gib 80``: will the model fit?

Per-GPU memory for ZeRO-3 training under six configurations: this strategy with stochastic rounding and with Kahan
compensation, each with optimizer states in device memory or in memory-mapped files (``state_storage="mmap"``),
DeepSpeed's bf16-master flags, and DeepSpeed's bf16 mixed precision. Model state is the measured bytes per parameter
(``lightning_pure_bf16.memory.MODEL_STATE_BYTES``; ``STATE_FILE_BYTES`` for the files), sharded over the GPUs; on
top come the optimizer step's transients, ZeRO-3's gathered parameters (this strategy's ``gather_cache``: one layer
by default, the whole model up to ZeRO-3's live-parameter limit with ``--gather-cache keep`` and for DeepSpeed's own
configurations), its communication buckets, one layer's working set in the backward (``--layers``), and a stated
margin for activations, the CUDA context and allocator fragmentation, which this planner does not estimate. For the
"mmap" configurations it also gives the disk space per node and, with ``--disk-gbps``, the time each optimizer step
spends streaming the states (read once, written once), a lower bound that the disk sets.

The phases around the step need host memory of their own, per process: construction, loading the pretrained
weights, a checkpoint save, a save in Hugging Face's layout, a resume and the export. :func:`host_phases` gives each
beside what the common stock path holds (``benchmarks/lifecycle_memory.py`` measures the same phases on the CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field

from lightning_pure_bf16.config import GATHER_CACHES
from lightning_pure_bf16.memory import FROZEN_BYTES, MODEL_STATE_BYTES, STATE_FILE_BYTES, bytes_per_param
from lightning_pure_bf16.optim.mmap_states import DEFAULT_STATE_CHUNK

GIB = 1024**3
# DeepSpeed ZeRO-3 defaults (elements): parameters gathered at once, prefetch bucket, gradient reduce bucket.
MAX_LIVE_PARAMETERS = 1_000_000_000
PREFETCH_BUCKET = 50_000_000
REDUCE_BUCKET = 200_000_000
DEFAULT_MARGIN_FRACTION = 0.15
# ZeRO-3's sub-group (DeepSpeed's ``sub_group_size``): the step's transients below are per element of one sub-group.
SUB_GROUP_SIZE = 1_000_000_000
# What the optimizer step allocates on top of model state, in bytes per element of the sub-group it updates. This
# package: nothing that grows with the model (its update is chunked, its gradient norm read in pieces of at most
# 32 MiB). DeepSpeed's own bf16 flags: 1.88 (its step flattens the sub-group's bf16 gradient into a copy;
# `benchmarks/peak_memory.py --upstream-step`). DeepSpeed bf16 mixed: 6 (that bf16 copy, then its float32 conversion,
# in `_prepare_fp32_grad_for_sub_group`).
STEP_TRANSIENT_BYTES = {
    **{config: 0.0 for config in MODEL_STATE_BYTES if config.startswith("pure_bf16")},
    "deepspeed_bf16_master": 1.88,
    "deepspeed_bf16_mixed": 6.0,
}
# The backward's working set beyond ZeRO-3's gathered copy, in bytes per parameter of one layer, on each GPU: a layer's
# bf16 gradients before their reduce-scatter (`benchmarks/largest_model.py`: about 1 B/param of a 4-layer GPT on each
# rank, 2 B per parameter of its layer).
LAYER_WORKING_BYTES = 2.0
DEFAULT_LAYERS = 32
# The streaming slots of state_storage="mmap" on the device, at most: 2 slots x 3 buffers x a chunk of bf16 elements.
MMAP_STAGING_BYTES = 2 * 3 * DEFAULT_STATE_CHUNK * 2
LABELS = {
    "pure_bf16_stochastic": "this strategy (stochastic rounding)",
    "pure_bf16_kahan": "this strategy (Kahan)",
    "pure_bf16_int8": "this strategy, 8-bit moments (stochastic)",
    "pure_bf16_int8_kahan": "this strategy, 8-bit moments + 8-bit Kahan",
    "pure_bf16_mmap": "this strategy (stochastic), states in mmap files",
    "pure_bf16_kahan_mmap": "this strategy (Kahan), states in mmap files",
    "pure_bf16_release": "this strategy (stochastic), gradient release",
    "pure_bf16_kahan_release": "this strategy (Kahan), gradient release",
    "pure_bf16_int8_release": "this strategy, 8-bit moments, gradient release",
    "pure_bf16_int8_kahan_release": "this strategy, 8-bit moments + 8-bit Kahan, release",
    "pure_bf16_mmap_release": "this strategy (stochastic), states in mmap files, release",
    "pure_bf16_kahan_mmap_release": "this strategy (Kahan), states in mmap files, release",
    "pure_bf16_int8_mmap_release": "this strategy, 8-bit moments in mmap files, release",
    "pure_bf16_int8_kahan_mmap_release": "this strategy, 8-bit moments + Kahan in files, release",
    "pure_bf16_lion": "Lion (stochastic rounding)",
    "pure_bf16_lion_kahan": "Lion (Kahan)",
    "pure_bf16_lion_int8": "Lion, 8-bit momentum",
    "pure_bf16_lion_release": "Lion, gradient release",
    "pure_bf16_lion_int8_release": "Lion, 8-bit momentum, gradient release",
    "pure_bf16_sgd_momentum": "SGD with momentum",
    "pure_bf16_sgd_momentum_int8_release": "SGD, 8-bit momentum, gradient release",
    "pure_bf16_sgd": "SGD without momentum",
    "pure_bf16_adafactor": "Adafactor (stochastic rounding)",
    "pure_bf16_adafactor_kahan": "Adafactor (Kahan)",
    "pure_bf16_muon": "Muon (AdamW beside it for non-matrices)",
    "deepspeed_bf16_master": "DeepSpeed bf16 masters (bf16_master_weights_and_grads)",
    "deepspeed_bf16_mixed": "DeepSpeed bf16 mixed (fp32 masters and moments)",
}


# --------------------------------------------------------------------------------- host memory around the step
# Llama 3's vocabulary: with the width the parameter count and layers imply, the embedding is the largest tensor.
DEFAULT_VOCAB = 128_256
# The export command's interpreter, torch and Lightning (`benchmarks/lifecycle_memory.py`: 318 MB exporting 1B params).
EXPORT_BASE_BYTES = 300 * 10**6
# A gathered parameter reaches the host in pieces of this size when the weights are saved from a GPU run
# (lightning_pure_bf16.pretrained).
HOST_PIECE_BYTES = 64 * 2**20
# DeepSpeed's zero_to_fp32.py, per parameter, with its default 5GB shards: every float32 master of a shard in memory
# (4 B/param up to 5 GB), the shard's tensors built whole.
ZERO_TO_FP32_SHARD_BYTES = 5 * 10**9
# Its interpreter, torch and what it holds beside the shard (`benchmarks/lifecycle_memory.py`: 4,614 MB exporting 1.0B
# parameters, of which 4,032 MB the float32 shard).
ZERO_TO_FP32_BASE_BYTES = 580 * 10**6
# What a rank's DeepSpeed bf16-mixed optimizer file holds, per parameter of its partition: the float32 master and two
# float32 moments, read whole by DeepSpeed's load_checkpoint (torch.load without a memory map).
DEEPSPEED_MIXED_FILE_BYTES = 12


@dataclass
class HostPhase:
    """One phase's host memory per process, in bytes above the interpreter and the libraries (the export's row counts
    them: it is a process of its own), for this package and for the stock path a user would otherwise take."""

    phase: str
    ours_bytes: float
    ours_how: str
    stock_bytes: float | None
    stock_how: str


def host_phases(
    params: float, gpus: int, *, layers: int = DEFAULT_LAYERS, largest_tensor: float | None = None
) -> list[HostPhase]:
    """Host memory of each phase around the step of a GPU run (the step itself holds everything on the devices).

    Args:
        params: total parameters.
        gpus: ranks the model is partitioned over.
        layers: the model's layers (with ``params``, the width of the default ``largest_tensor``).
        largest_tensor: elements of the largest tensor (default: ``None``, a Llama-shaped embedding: 128,256 x the
            width that ``params`` and ``layers`` imply).

    Raises:
        ValueError: for non-positive sizes.
    """
    if not (params > 0 and math.isfinite(params)) or gpus < 1 or layers < 1:
        raise ValueError("params, gpus and layers must be positive.")
    if largest_tensor is None:
        largest_tensor = DEFAULT_VOCAB * math.sqrt(params / (12 * layers))
    if not largest_tensor > 0:
        raise ValueError(f"--largest-tensor must be a positive number of elements, got {largest_tensor!r}.")
    weights, largest = 2 * params, 2 * largest_tensor
    # torch.save copies each device storage it writes to the host, one at a time: a flat bf16 partition of one
    # ZeRO-3 sub-group is the largest (float32 for DeepSpeed's masters and moments).
    flat = min(params / gpus, SUB_GROUP_SIZE)
    return [
        HostPhase(
            "construction",
            0,
            "partitioned as it is built (configure_model, fabric.init_module, zero.Init)",
            4 * params,
            "a module built outside configure_model: whole, float32, on every rank",
        ),
        HostPhase(
            "load pretrained",
            largest / gpus,
            "each rank reads its own slices from the files' memory maps (load_pretrained)",
            largest,
            "transformers' from_pretrained under zero.Init: each tensor whole on every rank",
        ),
        HostPhase("steps", 0, "everything on the devices (mmap states: page cache)", 0, "everything on the devices"),
        HostPhase(
            "checkpoint save",
            2 * flat,
            "one flat bf16 partition of a sub-group copied to the host while written",
            4 * flat,
            "DeepSpeed bf16 mixed: a float32 flat partition copied to the host",
        ),
        HostPhase(
            "save in HF layout",
            HOST_PIECE_BYTES,
            "rank 0: one parameter gathered at a time, streamed in 64 MiB pieces (save_pretrained, save_model)",
            weights,
            "transformers' save_model under ZeRO-3: every weight gathered on rank 0",
        ),
        HostPhase(
            "resume",
            0,
            "every file memory-mapped: page cache, copied to the devices",
            DEEPSPEED_MIXED_FILE_BYTES * params / gpus,
            "DeepSpeed's load_checkpoint, bf16 mixed: the rank's optimizer file read whole",
        ),
        HostPhase(
            "export",
            EXPORT_BASE_BYTES + largest / gpus,
            "one process writing each rank's slice of each tensor from the files' memory maps (a DeepSpeed bf16-mixed"
            " checkpoint's float32 slice rounded first)",
            ZERO_TO_FP32_BASE_BYTES + min(4 * params, ZERO_TO_FP32_SHARD_BYTES),
            "DeepSpeed's zero_to_fp32.py, default 5GB shards: a float32 shard whole",
        ),
    ]


@dataclass
class Plan:
    params: float
    gpus: int
    gpu_memory_gib: float
    frozen_fraction: float
    working_buffers_gib: float
    activation_margin_gib: float
    bytes_per_param: dict[str, float]
    per_gpu_model_state_gib: dict[str, float]
    per_gpu_total_gib: dict[str, float]
    fits: dict[str, bool]
    gpus_per_node: int
    state_files_per_node_gib: dict[str, float]
    disk_gbps: float | None
    disk_seconds_per_step: dict[str, float | None]
    layers: int = DEFAULT_LAYERS
    gather_cache: str = "auto"
    deepspeed_working_buffers_gib: float = 0.0
    host_phases: list[HostPhase] = field(default_factory=list)


def plan(
    params: float,
    gpus: int,
    gpu_memory_gib: float,
    *,
    frozen_fraction: float = 0.0,
    activation_margin_gib: float | None = None,
    gpus_per_node: int | None = None,
    disk_gbps: float | None = None,
    reduce_bucket: int = REDUCE_BUCKET,
    layers: int = DEFAULT_LAYERS,
    gather_cache: str = "auto",
    largest_tensor: float | None = None,
) -> Plan:
    """Per-GPU memory of each configuration and whether it fits.

    Args:
        params: total parameters of the model.
        gpus: GPUs the model state is sharded over (data-parallel world size).
        gpu_memory_gib: memory of one GPU in GiB.
        frozen_fraction: fraction of parameters that are not trained (no gradient or optimizer state).
        activation_margin_gib: memory kept for activations, CUDA context and fragmentation (default: ``None``, 15% of
            ``gpu_memory_gib``).
        gpus_per_node: GPUs per node, whose ranks share one disk for their state files (default: ``None``,
            ``min(gpus, 8)``).
        disk_gbps: read and write bandwidth, in GB/s, of the disk holding one node's state files; gives the time
            each step streams the states (default: ``None``, not estimated).
        reduce_bucket: ZeRO-3's gradient reduce bucket in elements (default: DeepSpeed's, 2e8; the strategies use
            5e6 on the CPU).
        layers: the model's layers, of equal size: the backward holds one layer's working set (default: 32).
        gather_cache: this strategy's ``gather_cache``: ``"layer"`` keeps one layer gathered at a time, ``"next"``
            two (the next one gathered ahead), ``"auto"`` one (it gathers the next one ahead only where the
            memory left at the first step's peak holds it), ``"keep"``
            every gathered layer up to ZeRO-3's live-parameter limit, as DeepSpeed's own configurations always do
            (default: ``"auto"``, the strategies' default).
        largest_tensor: elements of the model's largest tensor, for the host memory of the phases around the step
            (:func:`host_phases`; default: ``None``, a Llama-shaped embedding).

    Raises:
        ValueError: for non-positive sizes or a fraction outside [0, 1).
    """
    if not (params > 0 and math.isfinite(params)):
        raise ValueError(f"--params must be a positive number of parameters, got {params!r}.")
    if gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {gpus}.")
    if not gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib must be positive, got {gpu_memory_gib!r}.")
    if not 0.0 <= frozen_fraction < 1.0:
        raise ValueError(f"--frozen-fraction must be in [0, 1), got {frozen_fraction!r}.")
    margin = DEFAULT_MARGIN_FRACTION * gpu_memory_gib if activation_margin_gib is None else activation_margin_gib
    if margin < 0:
        raise ValueError(f"--activation-margin-gib must be >= 0, got {margin!r}.")
    per_node = min(gpus, 8) if gpus_per_node is None else gpus_per_node
    if not 1 <= per_node <= gpus:
        raise ValueError(f"--gpus-per-node must be between 1 and --gpus ({gpus}), got {per_node}.")
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}.")
    if gather_cache not in GATHER_CACHES:
        raise ValueError(f"--gather-cache must be one of {GATHER_CACHES}, got {gather_cache!r}.")
    if disk_gbps is not None and not (disk_gbps > 0 and math.isfinite(disk_gbps)):
        raise ValueError(f"--disk-gbps must be a positive number of GB/s, got {disk_gbps!r}.")
    trainable, frozen = params * (1 - frozen_fraction), params * frozen_fraction

    # Gathered bf16 parameters plus the prefetch and reduce buckets, and the backward's working set of one layer.
    # ZeRO-3 frees gathered layers only once a module's use leaves more than its live-parameter limit alive, so up to
    # the limit plus one layer stay gathered (`benchmarks/largest_model.py`: with the layer counted, the predictions
    # above 1e9 parameters fall inside the measured brackets; without it, they were 4% over).
    # With gather_cache="layer" each layer is released after its use: one layer gathered; "auto" (the default) plans
    # the same, the layer ahead being gathered only where the first step's peak left room for it.
    def working(cache: str) -> float:
        if cache == "keep":
            gathered = min(params, MAX_LIVE_PARAMETERS + params / layers)
        else:  # "next" holds the following layer too, gathered while one computes; "auto" only where that fits
            gathered = (2 if cache == "next" else 1) * params / layers
        return (2 * (gathered + PREFETCH_BUCKET + reduce_bucket) + LAYER_WORKING_BYTES * params / layers) / GIB

    buffers, deepspeed_buffers = working(gather_cache), working("keep")
    sub_group = min(trainable / gpus, SUB_GROUP_SIZE)
    bpp, state, total, fits, files, seconds = {}, {}, {}, {}, {}, {}
    for config in MODEL_STATE_BYTES:
        state_bytes = (trainable * bytes_per_param(config) + frozen * FROZEN_BYTES) / gpus
        bpp[config] = float(bytes_per_param(config))
        state[config] = state_bytes / GIB
        staging = MMAP_STAGING_BYTES / GIB if config in STATE_FILE_BYTES else 0.0
        step = STEP_TRANSIENT_BYTES[config] * sub_group / GIB
        ours = not config.startswith("deepspeed_")
        total[config] = state[config] + step + (buffers if ours else deepspeed_buffers) + staging + margin
        fits[config] = total[config] <= gpu_memory_gib
        file_bytes = trainable * STATE_FILE_BYTES.get(config, 0) / gpus * per_node
        files[config] = file_bytes / GIB
        # Every step reads each state file once and writes it once.
        seconds[config] = 2 * file_bytes / (disk_gbps * 1e9) if disk_gbps and file_bytes else None
    return Plan(
        params,
        gpus,
        gpu_memory_gib,
        frozen_fraction,
        buffers,
        margin,
        bpp,
        state,
        total,
        fits,
        per_node,
        files,
        disk_gbps,
        seconds,
        layers,
        gather_cache,
        deepspeed_buffers,
        host_phases(params, gpus, layers=layers, largest_tensor=largest_tensor),
    )


def _format(p: Plan) -> str:
    lines = [
        f"{p.params:.3g} parameters ({p.frozen_fraction:.0%} frozen) on {p.gpus} GPU(s) of {p.gpu_memory_gib:g} GiB,"
        " ZeRO-3:",
        "",
        f"{'configuration':56s} {'B/param':>7s} {'model state/GPU':>16s} {'total/GPU':>10s}  fits",
    ]
    for config, label in LABELS.items():
        lines.append(
            f"{label:56s} {p.bytes_per_param[config]:7.2f} {p.per_gpu_model_state_gib[config]:13.1f} GiB"
            f" {p.per_gpu_total_gib[config]:6.1f} GiB  {'yes' if p.fits[config] else 'NO'}"
        )
    lines += [
        "",
        "total = model state + the optimizer step's transients (per configuration) +"
        f" {p.working_buffers_gib:.1f} GiB ZeRO-3 gathered parameters (gather_cache={p.gather_cache!r}; DeepSpeed's"
        f" rows keep every gathered layer: {p.deepspeed_working_buffers_gib:.1f} GiB), buckets and one layer's"
        f" backward working set (of {p.layers}; set --layers) + {p.activation_margin_gib:.1f} GiB margin for"
        " activations, CUDA context and fragmentation (not estimated; set --activation-margin-gib); mmap rows add"
        f" {MMAP_STAGING_BYTES / 1024**2:.0f} MiB of streaming slots.",
        "",
        f"State files (mmap rows), on the disk of each node of {p.gpus_per_node} GPU(s):",
    ]
    for config in STATE_FILE_BYTES:
        seconds = p.disk_seconds_per_step[config]
        stream = (
            f"{seconds:.1f} s/step streaming them at {p.disk_gbps:g} GB/s (read + write, a lower bound)"
            if seconds is not None
            else "each step reads and writes them once (set --disk-gbps for the time)"
        )
        lines.append(f"  {LABELS[config]}: {p.state_files_per_node_gib[config]:.1f} GiB per node; {stream}")
    lines += [
        "",
        "Host memory of the phases around the step, GiB per process above its interpreter and libraries (the export"
        " is a process of its own and counts them):",
        f"  {'phase':18s} {'this package':>12s} {'stock':>8s}  the stock path",
    ]
    for h in p.host_phases:
        stock = "" if h.stock_bytes is None else f"{h.stock_bytes / GIB:8.1f}"
        lines.append(f"  {h.phase:18s} {h.ours_bytes / GIB:12.1f} {stock:>8s}  {h.stock_how}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pure_bf16.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, required=True, help="total parameters, e.g. 70e9")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs the model state is sharded over")
    parser.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU, e.g. 80")
    parser.add_argument("--frozen-fraction", type=float, default=0.0, help="fraction of parameters not trained")
    parser.add_argument("--activation-margin-gib", type=float, default=None, help="default: 15%% of GPU memory")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs sharing one disk (default: up to 8)")
    parser.add_argument("--disk-gbps", type=float, default=None, help="disk bandwidth per node for the mmap rows")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="layers of the model (default 32)")
    parser.add_argument(
        "--gather-cache", choices=GATHER_CACHES, default="auto", help="the strategy's gather_cache (default auto)"
    )
    parser.add_argument(
        "--largest-tensor",
        type=float,
        default=None,
        help="elements of the largest tensor, for the host memory of loading and exporting (default: a Llama-shaped"
        " embedding, 128256 x the width --params and --layers imply)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        result = plan(
            args.params,
            args.gpus,
            args.gpu_memory_gib,
            frozen_fraction=args.frozen_fraction,
            activation_margin_gib=args.activation_margin_gib,
            gpus_per_node=args.gpus_per_node,
            disk_gbps=args.disk_gbps,
            layers=args.layers,
            gather_cache=args.gather_cache,
            largest_tensor=args.largest_tensor,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result), indent=1) if args.json else _format(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
