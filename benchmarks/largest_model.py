"""The largest model each option trains within one memory budget, found by training it.

For each arm of ``benchmarks/_arms.py`` (DeepSpeed ZeRO-3 bf16 mixed precision, DeepSpeed's own bf16 flags, this
strategy's five variants, FSDP2 with torch AdamW and with torchao's stochastic-rounding AdamW) the search trains the
GPT of ``examples/gpt.py`` at a fixed depth and growing width for 3 optimizer steps, each size in fresh processes
(2 ranks, gloo, on the CPU; one process per GPU on CUDA). A size counts only if its 3 steps finished within the
budget: on the CPU the summed memory the ranks hold (anonymous and shared pages; an arm is stopped the moment it
passes the budget, so the machine is never at risk), on CUDA ``torch.cuda.max_memory_allocated`` per GPU under
``torch.cuda.set_per_process_memory_fraction``. The widths climb a fixed grid (doubling the step while they fit)
and then bisect between the last size that fitted and the first that did not; each arm starts at the width that
``python -m lightning_pure_bf16.plan`` predicts for it (with the memory a rank holds before it builds the model,
measured on the smallest size first, as the margin), so that a good prediction costs two sizes. The results are
written after each arm.

    python benchmarks/largest_model.py                  # 12 GiB on the CPU, 4 layers (~30-60 min on 2 cores)
    python benchmarks/largest_model.py --quick          # 2.5 GiB, 2 layers, 4 arms, a coarse grid (< 5 min)
    python benchmarks/largest_model.py --arms fsdp2_bf16 pure_bf16_release --widths 4608 4864 5120 5376 5632
    python benchmarks/largest_model.py --device cuda --budget-gib 40
Writes DIR/largest_model{,_quick}.{csv,md,png} (every size tried: peak memory, whether it fitted, and why not), with
DIR = benchmarks/results (--out).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arms import ARMS, REFERENCE, Spec, add_cpu_matmul_option, cpu_matmul_sentence, launch, missing_peer  # noqa: E402
from _results import write_results  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GIB = 1024**3
# Widths (multiples of 128; 64-wide heads) the search may try.
GRID = [256, 384, 512, 640, 768, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 2816, 3072, 3584, 4096, 4608, 5120]
GRID += [5632, 6144, 7168, 8192, 9216, 10240, 12288]
QUICK_GRID = [256, 512, 1024, 1536, 2048, 3072]
QUICK_ARMS = ["ds_bf16_mixed", "pure_bf16", "pure_bf16_int8", "pure_bf16_mmap"]


def _spec(width: int, args: argparse.Namespace) -> Spec:
    return Spec(
        n_layer=args.n_layer,
        n_embd=width,
        n_head=max(1, width // 64),
        block_size=args.block_size,
        batch_size=args.batch_size,
        steps=3,
        warmup=1,
        device=args.device,
        world_size=args.world_size,
        cpu_matmul=args.cpu_matmul,
    )


def search(
    arm: str, grid: list[int], start: int, args: argparse.Namespace, tries: list[dict], measured: dict | None = None
) -> int | None:
    """Index in ``grid`` of the largest width ``arm`` trains within the budget (``None``: not even the smallest).
    ``measured``: results of :func:`launch` already in hand, by index in ``grid`` (not launched again)."""
    budget = int(args.budget_gib * GIB)
    known: dict[int, bool] = {}
    measured = dict(measured or {})

    def fits(i: int) -> bool:
        if i not in known:
            r = measured.pop(i, None) or launch(arm, _spec(grid[i], args), budget_bytes=budget, timeout_s=args.timeout)
            known[i] = r["ok"]
            why = r["why"].splitlines()[0] if r["why"] else ""
            if why.startswith("failed") or why.startswith("timed out"):
                print(f"{arm} width {grid[i]}: {r['why'][-3000:]}", file=sys.stderr, flush=True)
            tries.append(
                {
                    "arm": arm,
                    "width": grid[i],
                    "params": r["params"],
                    "fits": r["ok"],
                    "peak_gib": round(r["peak_bytes"] / GIB, 3),
                    "why_not": why,
                    "before_model_gib": round(
                        max((x["before_model_bytes"] for x in r["ranks"] if x), default=0) / GIB, 3
                    ),
                }
            )
            print(
                f"{arm:22s} width {grid[i]:5d} {r['params'] / 1e6:8.1f}M params: peak {r['peak_bytes'] / GIB:6.2f} GiB"
                f" {'fits' if r['ok'] else 'does not fit (' + why + ')'}",
                file=sys.stderr,
                flush=True,
            )
        return known[i]

    # Find a bracket: climb while it fits (the step doubling), or descend while it does not.
    i, step = start, 1
    if fits(i):
        lo, hi = i, None
        while hi is None:
            nxt = min(lo + step, len(grid) - 1)
            if nxt == lo:
                return lo  # the top of the grid fits
            if fits(nxt):
                lo, step = nxt, step * 2
            else:
                hi = nxt
    else:
        hi, lo = i, None
        while lo is None:
            nxt = max(hi - step, 0)
            if fits(nxt):
                lo = nxt
            elif nxt == 0:
                return None
            else:
                hi, step = nxt, step * 2
    while hi - lo > 1:  # bisect
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def planner_largest(
    budget_gib: float, world_size: int, margin_gib: float, device: str, layers: int, gather_cache: str = "layer"
) -> dict[str, float]:
    """The largest model ``python -m lightning_pure_bf16.plan`` says fits each of its configurations, for a budget of
    ``budget_gib`` over ``world_size`` devices, a margin of ``margin_gib`` per device, the device's buckets and the
    strategies' ``gather_cache`` (bisection on params)."""
    from lightning_pure_bf16.plan import plan
    from lightning_pure_bf16.presets import CPU_BUCKET, GPU_BUCKET

    bucket = CPU_BUCKET if device == "cpu" else GPU_BUCKET
    out = {}
    per_gpu = budget_gib / world_size
    for config in plan(1e6, world_size, per_gpu, activation_margin_gib=margin_gib).fits:
        lo, hi = 1e5, 1e13
        while hi / lo > 1.001:
            mid = math.sqrt(lo * hi)
            p = plan(
                mid,
                world_size,
                per_gpu,
                activation_margin_gib=margin_gib,
                reduce_bucket=bucket,
                layers=layers,
                gather_cache=gather_cache,
            )
            lo, hi = (mid, hi) if p.fits[config] else (lo, mid)
        out[config] = lo
    return out


def _planner_verdict(predicted: float, fitted: float, failed: float | None) -> str:
    """The planner's largest size against the measured bracket [largest that fitted, first that did not]."""
    text = f"{predicted / 1e6:,.0f}M"
    if predicted < fitted:
        return f"{text} (under by {100 * (fitted - predicted) / fitted:.0f}%+)"
    if failed is None or predicted < failed:
        return f"{text} (in the bracket)"
    return f"{text} (over by {100 * (predicted - failed) / failed:.0f}%+)"


# This benchmark's arms and the planner's configurations they correspond to.
PLANNER_CONFIG = {
    "ds_bf16_mixed": "deepspeed_bf16_mixed",
    "ds_bf16_flags": "deepspeed_bf16_master",
    "pure_bf16": "pure_bf16_stochastic",
    "pure_bf16_kahan": "pure_bf16_kahan",
    "pure_bf16_int8": "pure_bf16_int8",
    "pure_bf16_int8_kahan": "pure_bf16_int8_kahan",
    "pure_bf16_mmap": "pure_bf16_mmap",
    "pure_bf16_release": "pure_bf16_release",
    "pure_bf16_int8_release": "pure_bf16_int8_release",
    "pure_bf16_mmap_release": "pure_bf16_mmap_release",
    "pure_bf16_int8_mmap_release": "pure_bf16_int8_mmap_release",
    "pure_bf16_next": "pure_bf16_stochastic",
    "pure_bf16_keep": "pure_bf16_stochastic",
    "pure_bf16_layer": "pure_bf16_stochastic",
}
# The gather_cache of the arms that do not run the default's, as the planner takes it.
PLANNER_GATHER = {"pure_bf16_next": "next", "pure_bf16_keep": "keep", "pure_bf16_layer": "layer"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2.5 GiB, 2 layers, a coarse grid")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--budget-gib", type=float, default=None, help="CPU: summed over ranks (default 12)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=None, help="default: all (--quick: four)")
    parser.add_argument("--n-layer", type=int, default=None, help="depth (default 4; --quick 2)")
    parser.add_argument(
        "--widths", nargs="+", type=int, default=None, help="the grid to search, multiples of 64 (default: built in)"
    )
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=None, help="default: 2 on the CPU, the GPUs on CUDA")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per size tried")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the table and plot from DIR's CSV (no training)"
    )
    add_cpu_matmul_option(parser)
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, run nothing")
    args = parser.parse_args(argv)
    if args.budget_gib is None:
        args.budget_gib = 2.5 if args.quick else (40.0 if args.device == "cuda" else 12.0)
    if not args.budget_gib > 0:
        parser.error(f"--budget-gib must be positive, got {args.budget_gib}")
    if args.widths and any(w <= 0 or w % 64 for w in args.widths):
        parser.error(f"--widths must be positive multiples of 64 (64-wide heads), got {args.widths}")
    if args.device == "cpu":
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        if args.budget_gib > 0.75 * total:
            parser.error(
                f"--budget-gib {args.budget_gib:g} is more than 3/4 of this machine's {total:.0f} GiB: the search must"
                " not take the machine down. Choose a smaller budget."
            )
    args.n_layer = args.n_layer or (2 if args.quick else 4)
    args.arms = list(args.arms or (QUICK_ARMS if args.quick else ARMS))
    for arm in [a for a in args.arms if missing_peer(a)]:
        print(f"{arm}: {missing_peer(arm)}", file=sys.stderr, flush=True)
        args.arms.remove(arm)
    if args.world_size is None:
        import torch

        args.world_size = 2 if args.device == "cpu" else max(1, torch.cuda.device_count())
    grid = sorted(args.widths) if args.widths else (QUICK_GRID if args.quick else GRID)
    if args.dry_run:
        print(
            f"dry run: arms {args.arms} in {args.budget_gib:g} GiB on {args.world_size} {args.device} rank(s),"
            f" widths {grid}"
        )
        return 0

    if args.report_only:
        import csv

        stem = "largest_model_quick" if args.quick else "largest_model"
        with open(args.out / f"{stem}.csv") as f:
            tries = [
                {
                    **row,
                    "width": int(row["width"]),
                    "params": int(row["params"]),
                    "fits": row["fits"] == "True",
                    "peak_gib": float(row["peak_gib"]),
                    "before_model_gib": float(row["before_model_gib"]),
                }
                for row in csv.DictReader(f)
            ]
        write_report(args, [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"], tries)
        return 0

    # Each arm's search starts at the width the planner predicts (FSDP2 arms: as this strategy's 8 bytes/param), with
    # a margin of what a rank holds before it builds the model, measured on the first arm's first size.
    tries: list[dict] = []
    largest: dict[str, int | None] = {}
    for arm in args.arms:
        measured = {}
        if not tries:  # the smallest size of the first arm measures the margin, and counts as a try of the search
            search_probe = launch(
                arm, _spec(grid[0], args), budget_bytes=int(args.budget_gib * GIB), timeout_s=args.timeout
            )
            probe = max((x["before_model_bytes"] for x in search_probe["ranks"] if x), default=0) / GIB
            measured = {0: search_probe}
        else:
            probe = 0.0
        margin = max([t["before_model_gib"] for t in tries] + [probe])
        gather = PLANNER_GATHER.get(arm, "auto")
        predicted = planner_largest(args.budget_gib, args.world_size, margin, args.device, args.n_layer, gather)
        predicted_params = predicted[PLANNER_CONFIG.get(arm, "pure_bf16_stochastic")]
        start = max([i for i, w in enumerate(grid) if _spec(w, args).params() <= predicted_params], default=0)
        largest[arm] = search(arm, grid, start, args, tries, measured)
        write_report(args, argv, tries)  # as it goes: a long search that stops keeps the arms it finished
    return 0


def write_report(args: argparse.Namespace, argv: list[str] | None, tries: list[dict]) -> None:
    """The table, the CSV of every size tried, and the plot, for the arms searched so far."""

    def best(arm: str) -> dict | None:
        return max((t for t in tries if t["arm"] == arm and t["fits"]), key=lambda t: t["params"], default=None)

    def first_failing(arm: str) -> float | None:
        b = best(arm)
        above = [
            t["params"] for t in tries if t["arm"] == arm and not t["fits"] and (b is None or t["params"] > b["params"])
        ]
        return min(above, default=None)

    ref = best(REFERENCE)
    where = "summed over the ranks" if args.device == "cpu" else "per GPU"
    measured = (
        "the anonymous and shared pages the ranks hold, sampled every millisecond"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated"
    )
    command = shlex.join(["python", "benchmarks/largest_model.py", *(argv if argv is not None else sys.argv[1:])])
    # What a rank holds before it builds the model (interpreter, libraries, process group): the planner's margin.
    margin = max((t["before_model_gib"] for t in tries), default=0.0)
    planned = {
        gather: planner_largest(args.budget_gib, args.world_size, margin, args.device, args.n_layer, gather)
        for gather in {PLANNER_GATHER.get(arm, "auto") for arm in dict.fromkeys(t["arm"] for t in tries)}
    }
    lines = [
        f"# The largest GPT each option trains in {args.budget_gib:g} GiB ({args.device}, {args.world_size} ranks)",
        "",
        f"Command: `{command}`. GPT of `examples/gpt.py`, {args.n_layer} layers, width on a grid of multiples of 128"
        f" (64-wide heads), batch {args.batch_size} x {args.block_size} tokens, 3 optimizer steps per size in fresh"
        f" processes. Memory: {measured} ({where}); a size fits when its 3 steps finished within the budget. Every"
        " size tried is in the CSV." + cpu_matmul_sentence(args.device, args.cpu_matmul),
        "",
        "| arm | largest width | parameters | peak GiB | vs DeepSpeed bf16 mixed | planner's largest |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm in dict.fromkeys(t["arm"] for t in tries):
        b = best(arm)
        if b is None:
            lines.append(f"| {ARMS[arm]} | none fits | | | | |")
            continue
        ratio = f"{b['params'] / ref['params']:.2f}x" if ref else ""
        plan_text = ""
        if arm in PLANNER_CONFIG:
            predicted = planned[PLANNER_GATHER.get(arm, "auto")][PLANNER_CONFIG[arm]]
            plan_text = _planner_verdict(predicted, b["params"], first_failing(arm))
        lines.append(
            f"| {ARMS[arm]} | {b['width']} | {b['params'] / 1e6:,.1f}M | {b['peak_gib']:.2f} | {ratio} | {plan_text} |"
        )
    lines += [
        "",
        (
            f"The widths searched: {', '.join(map(str, sorted(args.widths)))}, so a ratio can be off by one grid"
            " step either way;"
            if args.widths
            else "The width grid is coarse at the top (steps of 256-1024), so a ratio can be off by one grid step"
            " either way;"
        )
        + " the CSV has the first size that did not fit for each arm. The planner's column is"
        f" `plan(params, gpus={args.world_size}, gpu_memory_gib={args.budget_gib / args.world_size:g},"
        f" activation_margin_gib={margin:.2f}, reduce_bucket=<the device's>, layers={args.n_layer},"
        " gather_cache=<the arm's>)` (the margin is the memory a rank holds before it builds the model, measured"
        " here) against the measured bracket: the"
        " true largest size lies between the largest that fitted and the first that did not, so a prediction inside"
        " it is as right as the grid can tell, and one outside is off by at least the distance to the bracket's"
        " nearer end. On the CPU the state files of the mmap arm are in the page cache, which the budget does not"
        " count (the kernel can drop those pages under pressure), as on a GPU they are off the device.",
        "",
        "![peak memory against parameters](" + ("largest_model_quick" if args.quick else "largest_model") + ".png)",
    ]
    _plot(tries, args, ("largest_model_quick" if args.quick else "largest_model"))
    stem = "largest_model_quick" if args.quick else "largest_model"
    write_results(args.out, stem, tries, lines, command, also=("png",))


def _plot(tries: list[dict], args: argparse.Namespace, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    for arm in dict.fromkeys(t["arm"] for t in tries):
        mine = sorted((t for t in tries if t["arm"] == arm), key=lambda t: t["params"])
        fit = [t for t in mine if t["fits"]]
        line = ax.plot([t["params"] / 1e6 for t in fit], [t["peak_gib"] for t in fit], marker="o", label=ARMS[arm])
        over = [t for t in mine if not t["fits"]]
        ax.scatter(
            [t["params"] / 1e6 for t in over], [t["peak_gib"] for t in over], marker="x", color=line[0].get_color()
        )
    ax.axhline(args.budget_gib, color="black", linestyle="--", label=f"budget {args.budget_gib:g} GiB")
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("peak memory (GiB)" + (", summed over ranks" if args.device == "cpu" else ", per GPU"))
    ax.set_title(f"Peak memory of 3 training steps, GPT with {args.n_layer} layers (x: did not fit)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
