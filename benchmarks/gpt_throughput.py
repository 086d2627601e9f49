"""GPT training throughput and peak memory: this strategy against DeepSpeed's bf16 mixed precision (ZeRO-3).

Each arm runs in its own process (fresh CUDA memory statistics): the GPT of ``examples/gpt.py`` for a fixed number
of steps; tokens/s is measured after the warm-up steps, peak memory with ``torch.cuda.max_memory_allocated``.
DeepSpeed's own strategy needs CUDA, so on a CPU-only machine only this strategy's arm runs.

    python benchmarks/gpt_throughput.py            # on a CUDA machine
    python benchmarks/gpt_throughput.py --quick    # tiny model, few steps (checks the script on the CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from _results import write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ARMS = {
    "pure_bf16_stochastic": "this strategy (deepspeed_pure_bf16)",
    "pure_bf16_kahan": "this strategy (deepspeed_pure_bf16_kahan)",
    "deepspeed_bf16_mixed": "Lightning DeepSpeedStrategy(stage=3), precision='bf16-mixed'",
}


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPTModule, StdlibBytes
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_pure_bf16 import DeepSpeedPureBF16Strategy

    class Clock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            if trainer.global_step == args.warmup:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.start, self.start_step = time.perf_counter(), trainer.global_step

        def on_train_end(self, trainer, pl_module):  # noqa: ANN001
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.start
            self.steps = trainer.global_step - self.start_step

    seed_everything(0)
    on_gpu = args.device == "cuda"
    model = GPTModule(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size, max_steps=args.steps
    )
    data = StdlibBytes(
        block_size=args.block_size, batch_size=args.batch_size, train_windows=args.steps * args.batch_size
    )
    if arm == "deepspeed_bf16_mixed":
        strategy, precision = DeepSpeedStrategy(stage=3), "bf16-mixed"
    else:
        strategy, precision = DeepSpeedPureBF16Strategy(rounding=arm.rsplit("_", 1)[1]), "bf16-true"
    clock = Clock()
    trainer = Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, data)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    return {
        "arm": arm,
        "params": n_params,
        "tokens_per_s": clock.steps * args.batch_size * args.block_size / clock.seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 1024**3 if on_gpu else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    big = args.device == "cuda" and not args.quick
    args.n_layer, args.n_head, args.n_embd = (12, 12, 768) if big else (2, 4, 64)
    args.block_size, args.batch_size = (512, 16) if big else (64, 8)
    args.steps, args.warmup = (60, 10) if big else (8, 3)

    if args.arm:  # child process: one arm, result as JSON on the last line
        print(json.dumps(run_arm(args.arm, args)))
        return 0

    out = args.out or (RESULTS / "gpu" if args.device == "cuda" else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for arm in ARMS:
        if arm == "deepspeed_bf16_mixed" and args.device != "cuda":
            print(f"{arm}: skipped, Lightning's DeepSpeedStrategy needs CUDA", file=sys.stderr)
            continue
        cmd = [sys.executable, __file__, "--arm", arm, "--device", args.device] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            print(f"{arm}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if not rows:
        return 1
    stem = "gpt_throughput_quick" if args.quick else "gpt_throughput"
    command = "python benchmarks/gpt_throughput.py" + (" --quick" if args.quick else "")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    ref = next((r for r in rows if r["arm"] == "deepspeed_bf16_mixed"), None)
    lines = [
        f"# GPT training throughput: {rows[0]['params']:,} parameters, 1 {device}",
        "",
        f"Command: `{command}`. {args.steps} steps, tokens/s after {args.warmup} warm-up steps, batch"
        f" {args.batch_size} x {args.block_size} tokens; peak = torch.cuda.max_memory_allocated.",
        "",
        "| arm | tokens/s | vs bf16-mixed | peak GiB | vs bf16-mixed |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        speed = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else ""
        mem = f"{r['peak_gib'] / ref['peak_gib']:.2f}x" if ref else ""
        lines.append(f"| {ARMS[r['arm']]} | {r['tokens_per_s']:,.0f} | {speed} | {r['peak_gib']:.2f} | {mem} |")
    write_results(out, stem, rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
