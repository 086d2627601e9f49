"""Model-state memory per parameter, measured: pure bf16 (SR, Kahan, states in memory-mapped files; AdamW, Lion, SGD)
vs DeepSpeed's bf16-master flags and bf16-mixed.

Every configuration runs the same model, world size and ZeRO-3 settings through ``deepspeed.initialize`` and two
training steps (one configuration after the other, in the same processes), then reads bytes per parameter by
category from the live buffers (``lightning_pure_bf16.memory.zero3_model_state_report``). The pure-bf16 rows use
exactly what ``DeepSpeedPureBF16Strategy`` uses (its config builder, master aliasing and state allocation). Peak
memory is ``torch.cuda.max_memory_allocated`` on CUDA; on the CPU it is the sum of every tensor reachable from the
engine (parameters, optimizer, buckets), a tracked-buffer count. State in memory-mapped files (``state_storage="mmap"``)
is reported in its own column and is in neither the total nor the peak.

    python benchmarks/memory.py            # 2 ranks on the CPU (gloo), ~4.2M-parameter MLP
    python benchmarks/memory.py --quick    # ~0.3M parameters
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from _results import write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scripts"))
from _inspect import reachable_tensors  # noqa: E402
from torch import nn

RESULTS = Path(__file__).parent / "results"
CONFIGS = (
    "pure_bf16_stochastic",
    "pure_bf16_kahan",
    "pure_bf16_int8",
    "pure_bf16_int8_kahan",
    "pure_bf16_mmap",
    "pure_bf16_kahan_mmap",
    "pure_bf16_release",
    "pure_bf16_kahan_release",
    "pure_bf16_int8_release",
    "pure_bf16_int8_kahan_release",
    "pure_bf16_mmap_release",
    "pure_bf16_kahan_mmap_release",
    "pure_bf16_int8_mmap_release",
    "pure_bf16_int8_kahan_mmap_release",
    "pure_bf16_lion",
    "pure_bf16_lion_kahan",
    "pure_bf16_lion_int8",
    "pure_bf16_lion_release",
    "pure_bf16_lion_int8_release",
    "pure_bf16_sgd_momentum",
    "pure_bf16_sgd_momentum_int8_release",
    "pure_bf16_sgd",
    "pure_bf16_adafactor",
    "pure_bf16_adafactor_kahan",
    "pure_bf16_muon",
    "deepspeed_bf16_master",
    "deepspeed_bf16_mixed",
)
LABELS = {
    "pure_bf16_stochastic": "this strategy, stochastic rounding",
    "pure_bf16_kahan": "this strategy, Kahan",
    "pure_bf16_int8": "this strategy, 8-bit moments, stochastic rounding",
    "pure_bf16_int8_kahan": "this strategy, 8-bit moments, 8-bit Kahan remainder",
    "pure_bf16_mmap": "this strategy, stochastic rounding, states in mmap files",
    "pure_bf16_kahan_mmap": "this strategy, Kahan, states in mmap files",
    "pure_bf16_release": "this strategy, stochastic rounding, gradient release",
    "pure_bf16_kahan_release": "this strategy, Kahan, gradient release",
    "pure_bf16_int8_release": "this strategy, 8-bit moments, gradient release",
    "pure_bf16_int8_kahan_release": "this strategy, 8-bit moments, 8-bit Kahan remainder, gradient release",
    "pure_bf16_mmap_release": "this strategy, stochastic rounding, states in mmap files, gradient release",
    "pure_bf16_kahan_mmap_release": "this strategy, Kahan, states in mmap files, gradient release",
    "pure_bf16_int8_mmap_release": "this strategy, 8-bit moments in mmap files, gradient release",
    "pure_bf16_int8_kahan_mmap_release": "this strategy, 8-bit moments and 8-bit Kahan in mmap files, gradient release",
    "pure_bf16_lion": "Lion, stochastic rounding",
    "pure_bf16_lion_kahan": "Lion, Kahan",
    "pure_bf16_lion_int8": "Lion, 8-bit momentum",
    "pure_bf16_lion_release": "Lion, gradient release",
    "pure_bf16_lion_int8_release": "Lion, 8-bit momentum, gradient release",
    "pure_bf16_sgd_momentum": "SGD with momentum 0.9",
    "pure_bf16_sgd_momentum_int8_release": "SGD with momentum 0.9, 8-bit momentum, gradient release",
    "pure_bf16_sgd": "SGD without momentum",
    "pure_bf16_adafactor": "Adafactor, stochastic rounding",
    "pure_bf16_adafactor_kahan": "Adafactor, Kahan",
    "pure_bf16_muon": "Muon on the matrices, AdamW on the biases",
    "deepspeed_bf16_master": "DeepSpeed bf16_master_weights_and_grads + bf16_optimizer_states",
    "deepspeed_bf16_mixed": "DeepSpeed bf16 (fp32 masters and moments)",
}
# Every parameter partitioned and small buckets: what is measured is model state, not fixed communication buffers.
ZERO = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "reduce_bucket_size": 100_000,
    "allgather_bucket_size": 100_000,
}


def make_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(64, width)]
    for _ in range(depth):
        layers += [nn.GELU(), nn.Linear(width, width)]
    layers += [nn.GELU(), nn.Linear(width, 1)]
    return nn.Sequential(*layers)


def _worker(rank: int, world: int, port: int, names: list[str], width: int, depth: int, device: str, out: str) -> None:
    """Every configuration in ``names``, one after the other, in one process per rank (one process group)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import gc

    import deepspeed

    if device == "cuda":
        torch.cuda.set_device(rank)  # before the process group, so NCCL binds this rank to its GPU
    deepspeed.init_distributed("gloo" if device == "cpu" else "nccl", dist_init_required=True)
    for name in names:
        report = _measure_config(rank, name, width, depth, device, os.path.join(out, name))
        if rank == 0:
            torch.save(report, os.path.join(out, f"{name}.pt"))
        gc.collect()
    deepspeed.comm.destroy_process_group()


def zero3_state_dtypes(zero_optimizer: Any) -> dict[str, str]:
    """The dtype of every model-state category of a ZeRO-3 optimizer on this rank (``"int8, bfloat16"`` for an 8-bit
    moment and its scales), as ``lightning_pure_bf16.memory.zero3_model_state_report`` counts them."""
    from lightning_pure_bf16._internals import (
        zero3_grad_partition_buffer,
        zero3_inner_optimizer,
        zero3_master_partitions,
        zero3_param_partitions,
    )
    from lightning_pure_bf16.memory import CATEGORIES, state_tensors

    found: dict[str, set[str]] = {"param": set(), "grad": set(), "master": set()}
    params = zero3_param_partitions(zero_optimizer)
    found["param"] = {str(t.dtype).removeprefix("torch.") for t in params}
    grad = zero3_grad_partition_buffer(zero_optimizer)
    if grad is not None and grad.numel():  # empty under gradient release
        found["grad"] = {str(grad.dtype).removeprefix("torch.")}
    ptrs = {t.data_ptr() for t in params}
    found["master"] = {
        str(t.dtype).removeprefix("torch.") for t in zero3_master_partitions(zero_optimizer) if t.data_ptr() not in ptrs
    }
    for state in zero3_inner_optimizer(zero_optimizer).state.values():
        for category, value in state_tensors(state):
            found.setdefault(category if category in CATEGORIES else "other_state", set()).add(
                str(value.dtype).removeprefix("torch.")
            )
    return {k: ", ".join(sorted(v)) for k, v in found.items() if v}


def _measure_config(rank: int, name: str, width: int, depth: int, device: str, state_dir: str) -> dict:
    import argparse as ap

    import deepspeed

    from lightning_pure_bf16 import SGD, Adafactor, AdamW, Lion, Muon
    from lightning_pure_bf16._internals import alias_bf16_master_partitions
    from lightning_pure_bf16.config import pure_bf16_deepspeed_config
    from lightning_pure_bf16.memory import is_file_backed, zero3_model_state_report
    from lightning_pure_bf16.zero3_engine import init_zero3_optimizer_state

    before = 0
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # What earlier configurations left allocated is not this one's (seen on an H200: each row's peak was the row
        # before's plus its own state, the previous engines not freed by the time the next began).
        before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = make_model(width, depth).to(torch.bfloat16)
    base = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": dict(ZERO), "zero_allow_untested_optimizer": True}
    if name.startswith("pure_bf16"):
        config = pure_bf16_deepspeed_config(base)
        if name.endswith("_release"):
            config["gradient_clipping"] = 0.0  # release refuses clipping (DeepSpeed's default is 1.0)
        rounding = "kahan" if "kahan" in name else "stochastic"
        os.makedirs(state_dir, exist_ok=True)
        storage = {"state_storage": "mmap", "state_dir": state_dir} if "_mmap" in name else {}
        if "int8" in name:
            storage["moments"] = "int8"
            if "kahan" in name:
                storage["compensation"] = "int8"
        optimizer: torch.optim.Optimizer
        if "_lion" in name:
            optimizer = Lion(model.parameters(), lr=1e-4, rounding=rounding, **storage)
        elif "_adafactor" in name:
            optimizer = Adafactor(model.parameters(), lr=1e-2, rounding=rounding, **storage)
        elif "_muon" in name:
            matrices = [p for p in model.parameters() if p.ndim == 2]
            others = [p for p in model.parameters() if p.ndim != 2]
            groups = [{"params": matrices}, {"params": others, "use_muon": False}]
            optimizer = Muon(groups, lr=2e-2, rounding=rounding, **storage)
        elif "_sgd" in name:
            momentum = 0.9 if "momentum" in name else 0.0
            optimizer = SGD(model.parameters(), lr=1e-2, momentum=momentum, rounding=rounding, **storage)
        else:
            optimizer = AdamW(model.parameters(), lr=1e-3, rounding=rounding, **storage)
        optimizer.check_nonfinite = False
        context = alias_bf16_master_partitions()
    else:
        bf16 = {"enabled": True}
        if name == "deepspeed_bf16_master":
            bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        config = {**base, "bf16": bf16}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        from contextlib import nullcontext

        context = nullcontext()
    with context:
        engine, _, _, _ = deepspeed.initialize(
            args=ap.Namespace(device_rank=rank),
            model=model,
            optimizer=optimizer,
            config=config,
            dist_init_required=False,
        )
    if name.startswith("pure_bf16"):
        init_zero3_optimizer_state(engine.optimizer)
    if name.endswith("_release"):
        from lightning_pure_bf16.release import GradientRelease

        GradientRelease(engine.optimizer, name)
    dev = engine.device
    for _ in range(2):
        x = torch.randn(8, 64, device=dev, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    report = zero3_model_state_report(engine.optimizer)
    report["dtypes"] = "; ".join(f"{k} {v}" for k, v in zero3_state_dtypes(engine.optimizer).items())
    tracked = sum(t.untyped_storage().nbytes() for _, t in reachable_tensors(engine.optimizer) if not is_file_backed(t))
    tracked += sum(p.untyped_storage().nbytes() for p in engine.module.parameters() if p.untyped_storage().nbytes())
    report["peak_per_param"] = (torch.cuda.max_memory_allocated() - before if device == "cuda" else tracked) / report[
        "params_on_rank"
    ]
    engine.destroy()
    return report


def _free_port() -> int:
    """``MASTER_PORT`` where the caller chose one (the tests do), else one the kernel says is free now."""
    if os.environ.get("MASTER_PORT"):
        return int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(names: list[str], world: int, width: int, depth: int, device: str) -> dict[str, dict[str, float]]:
    """Run the configurations ``names`` on ``world`` processes (one after the other, in the same processes) and return
    rank 0's report of each."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world, _free_port(), list(names), width, depth, device, tmp),
            nprocs=world,
            start_method="spawn",
        )
        return {name: torch.load(os.path.join(tmp, f"{name}.pt"), weights_only=False) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~0.3M-parameter model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world-size", type=int, default=None, help="default: 2 on the CPU, all GPUs on CUDA")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, run nothing")
    args = parser.parse_args(argv)
    world = args.world_size or (torch.cuda.device_count() if args.device == "cuda" else 2)
    width, depth = (256, 4) if args.quick else (1024, 4)
    if args.device == "cuda" and not args.quick:
        width, depth = 4096, 8
    out_dir = args.out or (RESULTS / "gpu" if args.device == "cuda" else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_params = sum(p.numel() for p in make_model(width, depth).parameters())
    if args.dry_run:
        print(f"dry run: {list(CONFIGS)} at {n_params:,} parameters on {world} {args.device} rank(s)")
        return 0

    rows = []
    for name, report in measure(CONFIGS, world, width, depth, args.device).items():
        dtypes = report.pop("dtypes")
        rows.append({"config": name, **{k: round(v, 3) for k, v in report.items()}, "dtypes": dtypes})
        print(f"{name:24s} {report['total']:.2f} B/param model state", file=sys.stderr)

    stem = "memory_quick" if args.quick else "memory"
    command = (
        "python benchmarks/memory.py"
        + (" --quick" if args.quick else "")
        + (f" --world-size {args.world_size}" if args.world_size else "")
    )
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
    peak_label = (
        "torch.cuda.max_memory_allocated above what was allocated before the configuration"
        if args.device == "cuda"
        else "tracked buffers (incl. buckets)"
    )
    reference = rows[0]["total"]
    lines = [
        f"# Model-state memory: {n_params:,} parameters, ZeRO-3 on {world} rank(s), {device_name}",
        "",
        f"Command: `{command}`. Bytes per parameter of each rank's partition, measured from the live buffers after two"
        f" steps. Peak: {peak_label}, per parameter of the partition.",
        "",
        "| configuration | param | grad | master | exp_avg | exp_avg_sq | momentum | kahan | total B/param"
        " | vs this strategy | peak B/param | in state files B/param |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {LABELS[r['config']]} | {r['param']:.2f} | {r['grad']:.2f} | {r['master']:.2f} | {r['exp_avg']:.2f} |"
            f" {r['exp_avg_sq']:.2f} | {r['momentum_buffer']:.2f} | {r['kahan_comp']:.2f} | **{r['total']:.2f}** |"
            f" {r['total'] / reference:.2f}x |"
            f" {r['peak_per_param']:.2f} | {r['state_files']:.2f} |"
        )
    lines += ["", "dtypes of each rank's buffers, by category:", ""]
    lines += [f"- {LABELS[r['config']]}: {r['dtypes']}" for r in rows]
    lines += [
        "",
        "8-bit moments: one byte per element and a bf16 scale per 128 elements (0.016 B/param per moment, in the"
        " exp_avg, exp_avg_sq and momentum columns). Lion keeps one moment (exp_avg), SGD its momentum buffer (none"
        " without momentum), Muon its momentum (exp_avg) on the matrices and AdamW's two moments on the biases,"
        " Adafactor float32 row and column statistics (in the total, not a column of its own).",
        "",
        "States in mmap files: the peak adds the two streaming slots, 2 x (2 or 3 buffers) x min(2**22, largest"
        " partition) bf16 elements (pinned host memory, and device memory on CUDA), a fixed cost that does not grow"
        " with the model: large next to this small model's partition, under 50 MiB per rank at any size.",
    ]
    write_results(out_dir, stem, rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
