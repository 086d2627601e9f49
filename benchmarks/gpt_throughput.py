"""GPT training throughput, every arm on the same model, data and batch, side by side in one run.

The arms are those of ``benchmarks/_arms.py``: DeepSpeed ZeRO-3 bf16 mixed precision (the reference of every ratio),
DeepSpeed's own bf16 flags, this strategy (stochastic rounding, Kahan, 8-bit moments, 8-bit Kahan, states in files)
and FSDP2 with bf16 parameters (torch AdamW, torchao's stochastic-rounding AdamW). Each arm runs in fresh processes:
2 ranks over gloo on the CPU (the cores shared between them), one process per GPU on CUDA. Per step, rank 0 times the
forward and backward and the optimizer step (on CUDA after a synchronize); tokens/s counts every rank's tokens over
the steps after the warm-up.

    python benchmarks/gpt_throughput.py                  # CPU: 4 x 640 (20.1M parameters), 12 steps
    python benchmarks/gpt_throughput.py --quick          # CPU: 2 x 128, 5 steps (< 5 min)
    python benchmarks/gpt_throughput.py --device cuda    # GPT-2 124M (12 x 768, 1024 tokens), 30 steps
    python benchmarks/gpt_throughput.py --arms ds_bf16_mixed pure_bf16 pure_bf16_next --rounds 5   # medians, ranges
    python benchmarks/gpt_throughput.py --cpu-matmul float32   # every arm's products in float32 (a CPU without bf16)
Writes DIR/gpt_throughput{,_quick}.{csv,md} (DIR: benchmarks/results, or benchmarks/results/gpu on CUDA; --out).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arms import (  # noqa: E402
    ARMS,
    REFERENCE,
    Spec,
    add_cpu_matmul_option,
    cpu_matmul_sentence,
    cpu_sentence,
    launch,
    missing_peer,
    slowest_rank_phases,
)
from _results import write_results  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def measure(arm: str, spec: Spec) -> dict:
    """One fresh run of ``arm``: tokens/s over the measured steps, the median step phases, the peak."""
    missing = missing_peer(arm)
    if missing:
        print(f"{arm}: {missing}", file=sys.stderr, flush=True)
        return {"arm": arm, "ok": False, "why": missing, "skipped": True}
    r = launch(arm, spec, timeout_s=1200)
    if not r["ok"]:
        print(f"{arm}: {r['why'][-3000:]}", file=sys.stderr, flush=True)
        return {"arm": arm, "ok": False, "why": r["why"].splitlines()[0]}
    ranks = r["ranks"]
    fwd_bwd, opt = slowest_rank_phases(ranks)
    step = [a + b for a, b in zip(fwd_bwd, opt)]
    tokens = spec.world_size * spec.batch_size * spec.block_size
    row = {
        "arm": arm,
        "ok": True,
        "params": r["params"],
        "tokens_per_s": round(tokens * len(step) / sum(step), 1),
        "fwd_bwd_s": round(statistics.median(fwd_bwd), 4),
        "optimizer_s": round(statistics.median(opt), 4),
        "peak_gib": round(r["peak_bytes"] / 1024**3, 3),
    }
    print(
        f"{arm:22s} {row['tokens_per_s']:10,.0f} tokens/s  forward+backward {row['fwd_bwd_s']:.3f} s  optimizer"
        f" {row['optimizer_s']:.3f} s  peak {row['peak_gib']:.2f} GiB",
        file=sys.stderr,
        flush=True,
    )
    return row


def aggregate(arm: str, runs: list[dict], reference: list[dict] | None) -> dict:
    """An arm's rounds as one row: medians, and its ratio to the reference as the median of the per-round ratios
    (each round's runs are next to each other in time)."""
    if not runs[-1]["ok"]:
        return runs[-1]
    row = {
        "arm": arm,
        "ok": True,
        "rounds": len(runs),
        "params": runs[0]["params"],
        **{key: statistics.median(r[key] for r in runs) for key in ("tokens_per_s", "fwd_bwd_s", "optimizer_s")},
        "tokens_per_s_min": min(r["tokens_per_s"] for r in runs),
        "tokens_per_s_max": max(r["tokens_per_s"] for r in runs),
        "peak_gib": max(r["peak_gib"] for r in runs),
    }
    pairs = [(r, ref) for r, ref in zip(runs, reference or []) if ref["ok"]]
    if pairs:
        ratios = [r["tokens_per_s"] / ref["tokens_per_s"] for r, ref in pairs]
        row["vs_reference"] = round(statistics.median(ratios), 3)
        row["vs_reference_min"], row["vs_reference_max"] = round(min(ratios), 3), round(max(ratios), 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 5 steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--world-size", type=int, default=None, help="default: 2 on the CPU, the GPUs on CUDA")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--reference",
        choices=list(ARMS),
        default=REFERENCE,
        help=f"the arm the ratios are to (default {REFERENCE}; on a CPU without native bf16 its bf16 products are"
        " slow, and another arm of this package compares like with like)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run every arm this many times, round-robin; report medians and ranges"
    )
    parser.add_argument(
        "--size",
        choices=("default", "1b"),
        default="default",
        help="1b: a GPT of 1.2B parameters (24 x 2048, 1024 tokens), for one GPU (default: GPT-2 124M on CUDA)",
    )
    add_cpu_matmul_option(parser)
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, run nothing")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    if args.world_size is None:
        import torch

        args.world_size = max(1, torch.cuda.device_count()) if gpu else 2
    if args.quick:
        shape = {"n_layer": 2, "n_embd": 128, "n_head": 2, "block_size": 64, "batch_size": 4, "steps": 5, "warmup": 2}
    elif args.size == "1b":
        shape = {"n_layer": 24, "n_embd": 2048, "n_head": 16, "block_size": 1024, "batch_size": 4, "steps": 20}
        shape["warmup"] = 5
    elif gpu:
        shape = {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 1024, "batch_size": 8, "steps": 30}
        shape["warmup"] = 10
    else:
        shape = {"n_layer": 4, "n_embd": 640, "n_head": 10, "block_size": 128, "batch_size": 8, "steps": 12}
        shape["warmup"] = 4
    spec = Spec(**shape, lr=1e-4, device=args.device, world_size=args.world_size, cpu_matmul=args.cpu_matmul)
    if args.dry_run:
        print(f"dry run: {spec.params():,} parameters on {args.world_size} {args.device} rank(s), arms {args.arms}")
        return 0

    # Round-robin: every arm once per round, so that a slow spell of the machine falls on every arm alike.
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for round_ in range(args.rounds):
        for arm in args.arms:
            if round_ and not runs[arm][-1]["ok"]:
                continue
            runs[arm].append(measure(arm, spec))
    rows = [aggregate(arm, runs[arm], runs.get(args.reference)) for arm in args.arms]

    out = args.out or (RESULTS / "gpu" if gpu else RESULTS)
    stem = "gpt_throughput_quick" if args.quick else "gpt_throughput"
    command = shlex.join(["python", "benchmarks/gpt_throughput.py", *(argv if argv is not None else sys.argv[1:])])
    where = "summed over the ranks (resident high-water marks)" if not gpu else "torch.cuda.max_memory_allocated"
    reference_name = ARMS[args.reference].split(" (")[0]
    lines = [
        f"# GPT training throughput: {spec.params():,} parameters, {args.world_size} {args.device} rank(s)",
        "",
        f"Command: `{command}`. GPT of `examples/gpt.py`, {spec.n_layer} layers x {spec.n_embd}, batch"
        f" {spec.batch_size} x {spec.block_size} tokens per rank, {spec.steps} steps of which {spec.warmup} warm-up;"
        f" the same token batches in every arm. Times are medians over the measured steps of the slowest rank; peak"
        f" memory is {where}."
        + cpu_sentence(args.device)
        + cpu_matmul_sentence(args.device, args.cpu_matmul)
        + (
            f" {args.rounds} rounds, every arm once per round in turn: each figure is the median over the rounds"
            " (tokens/s with its range), the ratio the median of the rounds' ratios (with their range)."
            if args.rounds > 1
            else ""
        ),
        "",
        f"| arm | tokens/s | vs {reference_name} | forward+backward s | optimizer step s | peak GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {ARMS[r['arm']]} | did not run: {r['why']} | | | | |")
            continue
        tokens, ratio = f"{r['tokens_per_s']:,.0f}", ""
        if "vs_reference" in r:
            ratio = f"{r['vs_reference']:.2f}x"
        if args.rounds > 1:
            tokens += f" ({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f})"
            if ratio:
                ratio += f" ({r['vs_reference_min']:.2f}-{r['vs_reference_max']:.2f})"
        lines.append(
            f"| {ARMS[r['arm']]} | {tokens} | {ratio} | {r['fwd_bwd_s']:.3f} | {r['optimizer_s']:.3f} |"
            f" {r['peak_gib']:.2f} |"
        )
    write_results(out, stem, rows, lines, command)
    return 0 if all(r["ok"] or r.get("skipped") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
