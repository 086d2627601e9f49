"""``python -m lightning_pure_bf16.plan --params 70e9 --gpus 8 --gpu-memory-gib 80``: will the model fit?

Per-GPU memory for ZeRO-3 training under four configurations: this strategy with stochastic rounding and with Kahan
compensation, DeepSpeed's bf16-master flags, and DeepSpeed's bf16 mixed precision. Model state is the measured bytes
per parameter (``lightning_pure_bf16.memory.MODEL_STATE_BYTES``), sharded over the GPUs; on top come ZeRO-3's
gathered-parameter working set and communication buckets (DeepSpeed's defaults), and a stated margin for
activations, the CUDA context and allocator fragmentation, which this planner does not estimate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

from lightning_pure_bf16.memory import FROZEN_BYTES, MODEL_STATE_BYTES, bytes_per_param

GIB = 1024**3
# DeepSpeed ZeRO-3 defaults (elements): parameters gathered at once, prefetch bucket, gradient reduce bucket.
MAX_LIVE_PARAMETERS = 1_000_000_000
PREFETCH_BUCKET = 50_000_000
REDUCE_BUCKET = 200_000_000
DEFAULT_MARGIN_FRACTION = 0.15
LABELS = {
    "pure_bf16_stochastic": "this strategy (stochastic rounding)",
    "pure_bf16_kahan": "this strategy (Kahan)",
    "deepspeed_bf16_master": "DeepSpeed bf16 masters (bf16_master_weights_and_grads)",
    "deepspeed_bf16_mixed": "DeepSpeed bf16 mixed (fp32 masters and moments)",
}


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


def plan(
    params: float,
    gpus: int,
    gpu_memory_gib: float,
    *,
    frozen_fraction: float = 0.0,
    activation_margin_gib: float | None = None,
) -> Plan:
    """Per-GPU memory of each configuration and whether it fits.

    Args:
        params: total parameters of the model.
        gpus: GPUs the model state is sharded over (data-parallel world size).
        gpu_memory_gib: memory of one GPU in GiB.
        frozen_fraction: fraction of parameters that are not trained (no gradient or optimizer state).
        activation_margin_gib: memory kept for activations, CUDA context and fragmentation (default: ``None``, 15% of
            ``gpu_memory_gib``).

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
    trainable, frozen = params * (1 - frozen_fraction), params * frozen_fraction
    # Gathered bf16 parameters (at most DeepSpeed's live-parameter limit) plus the prefetch and reduce buckets.
    buffers = 2 * (min(params, MAX_LIVE_PARAMETERS) + PREFETCH_BUCKET + REDUCE_BUCKET) / GIB
    bpp, state, total, fits = {}, {}, {}, {}
    for config in MODEL_STATE_BYTES:
        state_bytes = (trainable * bytes_per_param(config) + frozen * FROZEN_BYTES) / gpus
        bpp[config] = float(bytes_per_param(config))
        state[config] = state_bytes / GIB
        total[config] = state[config] + buffers + margin
        fits[config] = total[config] <= gpu_memory_gib
    return Plan(params, gpus, gpu_memory_gib, frozen_fraction, buffers, margin, bpp, state, total, fits)


def _format(p: Plan) -> str:
    lines = [
        f"{p.params:.3g} parameters ({p.frozen_fraction:.0%} frozen) on {p.gpus} GPU(s) of {p.gpu_memory_gib:g} GiB,"
        " ZeRO-3:",
        "",
        f"{'configuration':56s} {'B/param':>7s} {'model state/GPU':>16s} {'total/GPU':>10s}  fits",
    ]
    for config, label in LABELS.items():
        lines.append(
            f"{label:56s} {p.bytes_per_param[config]:7.0f} {p.per_gpu_model_state_gib[config]:13.1f} GiB"
            f" {p.per_gpu_total_gib[config]:6.1f} GiB  {'yes' if p.fits[config] else 'NO'}"
        )
    lines += [
        "",
        f"total = model state + {p.working_buffers_gib:.1f} GiB ZeRO-3 gathered parameters and buckets (DeepSpeed"
        f" defaults) + {p.activation_margin_gib:.1f} GiB margin for activations, CUDA context and fragmentation"
        " (not estimated; set --activation-margin-gib).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pure_bf16.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, required=True, help="total parameters, e.g. 70e9")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs the model state is sharded over")
    parser.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU, e.g. 80")
    parser.add_argument("--frozen-fraction", type=float, default=0.0, help="fraction of parameters not trained")
    parser.add_argument("--activation-margin-gib", type=float, default=None, help="default: 15%% of GPU memory")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        result = plan(
            args.params,
            args.gpus,
            args.gpu_memory_gib,
            frozen_fraction=args.frozen_fraction,
            activation_margin_gib=args.activation_margin_gib,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result), indent=1) if args.json else _format(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
