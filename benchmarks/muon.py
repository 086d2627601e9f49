"""Muon under ZeRO-3, this package's beside DeepSpeed's own, on the same GPT: model state per parameter, tokens/s,
the memory the optimizer step allocates above the model state, and the bytes it exchanges.

Arms (``benchmarks/_arms.py``): ``ds_muon``, DeepSpeed ZeRO-3 bf16 mixed with its ``"optimizer": {"type": "Muon"}``
(``MuonWithAuxAdam``: fp32 masters); ``pure_bf16_muon``, this package's Fabric
strategy with its ``Muon`` (bf16 parameters, gradients and momentum, stochastic rounding; AdamW on the rest). Both
orthogonalize the same parameters (DeepSpeed's rule: two or more dimensions, no ``embed``/``lm_head`` in the name),
each arm in fresh processes on the same token batches; ``--arms`` adds the AdamW arms for reference.

The last step's optimizer step is measured on every rank (``_arms.StepProbe``): the peak of the bytes of the tensors
it allocates that are alive at once (above the model state and the gradient partition it starts from), and the bytes
of the tensors it hands to each collective. The bound this package keeps for Muon's step: at most three copies of the
largest matrix it orthogonalizes (bf16) plus 128 MiB above the model state.

    python benchmarks/muon.py            # CPU: 4 x 640 GPT (20.1M parameters), 6 steps, 2 ranks
    python benchmarks/muon.py --quick    # CPU: 2 x 128, 4 steps (about a minute)
    python benchmarks/muon.py --n-layer 2 --n-embd 1536 --name muon_wide   # larger matrices (18 MiB in bf16)
    python benchmarks/muon.py --device cuda
Writes DIR/muon{,_quick}.{csv,md} (DIR: benchmarks/results, or benchmarks/results/gpu on CUDA; --out).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arms import ARMS, Spec, build_gpt, cpu_sentence, launch, slowest_rank_phases  # noqa: E402
from _results import write_results  # noqa: E402

from lightning_pure_bf16.deepspeed import deepspeed_muon_rule  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MUON_ARMS = ["ds_muon", "pure_bf16_muon"]
MIB = 1024**2
BOUND_EXTRA = 128 * MIB  # the bucket-sized allowance of the bound, beside three copies of the largest matrix


def largest_muon_matrix(spec: Spec) -> tuple[str, tuple[int, ...]]:
    """The name and shape of the largest parameter the Muon arms orthogonalize (built on the meta device)."""
    import torch

    with torch.device("meta"):
        model = build_gpt(spec)
    matrices = [(n, p) for n, p in model.named_parameters() if deepspeed_muon_rule(n, p)]
    name, p = max(matrices, key=lambda item: item[1].numel())
    return name, tuple(p.shape)


def measure(arm: str, spec: Spec) -> dict:
    r = launch(arm, spec, timeout_s=3000)
    if not r["ok"]:
        print(f"{arm}: {r['why'][-3000:]}", file=sys.stderr, flush=True)
        return {"arm": arm, "ok": False, "why": r["why"].splitlines()[0]}
    ranks = r["ranks"]
    fwd_bwd, opt = slowest_rank_phases(ranks)
    tokens = spec.world_size * spec.batch_size * spec.block_size
    exchanged = [x["step_exchanged_bytes"] for x in ranks]
    collectives = sorted({name for e in exchanged for name in e})
    return {
        "arm": arm,
        "ok": True,
        "params": r["params"],
        "model_state_B_per_param": round(max(x["model_state_bytes_per_param"]["total"] for x in ranks), 3),
        "model_state_by_category": "; ".join(
            f"{k} {v:.2f}" for k, v in ranks[0]["model_state_bytes_per_param"].items() if k not in ("total",)
        ),
        "tokens_per_s": round(tokens / statistics.median(a + b for a, b in zip(fwd_bwd, opt)), 1),
        "fwd_bwd_s": round(statistics.median(fwd_bwd), 4),
        "step_s": round(statistics.median(opt), 4),
        "step_alloc_peak_mib": round(max(x["step_alloc_peak_bytes"] for x in ranks) / MIB, 2),
        "step_exchanged_mib": round(max(sum(e.values()) for e in exchanged) / MIB, 2),
        "step_collectives": "; ".join(
            f"{name} {max(e.get(name, 0) for e in exchanged) / MIB:.2f}" for name in collectives
        ),
        "peak_rss_gib": round(r["peak_bytes"] / 1024**3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 x 128 GPT, 4 steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=MUON_ARMS)
    parser.add_argument("--n-layer", type=int, default=None, help="blocks (default: 4; --quick 2)")
    parser.add_argument("--n-embd", type=int, default=None, help="width (default: 640; --quick 128)")
    parser.add_argument("--name", default=None, help="stem of the result files (default: muon, muon_quick)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        shape = dict(n_layer=12, n_embd=768, n_head=12, block_size=1024, batch_size=8)
        spec = Spec(**shape, steps=8, warmup=3, device="cuda", world_size=1, probe_step=True)
    elif args.quick:
        spec = Spec(n_layer=2, n_embd=128, n_head=4, steps=4, warmup=2, probe_step=True)
    else:
        spec = Spec(n_layer=4, n_embd=640, n_head=10, steps=6, warmup=2, probe_step=True)
    if args.n_layer or args.n_embd:
        spec.n_layer, spec.n_embd = args.n_layer or spec.n_layer, args.n_embd or spec.n_embd
        spec.n_head = next(h for h in (16, 12, 10, 8, 4, 2, 1) if spec.n_embd % h == 0)
    name, shape = largest_muon_matrix(spec)
    matrix_bytes = 2 * shape[0] * shape[1]
    bound = 3 * matrix_bytes + BOUND_EXTRA
    plan = (
        f"arms {args.arms} on a {spec.n_layer} x {spec.n_embd} GPT ({spec.params():,} parameters), {spec.steps} steps,"
        f" {spec.world_size} rank(s) on {args.device}; largest Muon matrix {name} {shape}"
    )
    if args.dry_run:
        print(f"dry run: {plan}")
        return 0
    print(plan, file=sys.stderr, flush=True)
    rows = []
    for arm in args.arms:
        row = measure(arm, spec)
        if row["ok"] and arm == "pure_bf16_muon":
            row["bound_mib"] = round(bound / MIB, 2)
            row["within_bound"] = row["step_alloc_peak_mib"] * MIB <= bound
        rows.append(row)
        print(row, file=sys.stderr, flush=True)

    out = args.out or (RESULTS / "gpu" if args.device == "cuda" else RESULTS)
    stem = args.name or ("muon_quick" if args.quick else "muon")
    command = "python benchmarks/muon.py" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    reference = next((r for r in rows if r["arm"] == "ds_muon" and r["ok"]), None)
    lines = [
        f"# Muon under ZeRO-3: {spec.n_layer} x {spec.n_embd} GPT, {spec.params():,} parameters,"
        f" {spec.world_size} rank(s)",
        "",
        f"Command: `{command}`.{cpu_sentence(args.device)} Tokens/s over steps {spec.warmup + 1}-{spec.steps} (the"
        " slowest rank's step); model state per parameter of a rank's partition from the live buffers; the step's"
        " allocations and exchange measured in the last step on every rank, the largest rank's figure. The largest"
        f" matrix Muon orthogonalizes is `{name}` {shape}: {matrix_bytes / MIB:.2f} MiB in bf16, so the bound on the"
        f" step's allocations is 3 x {matrix_bytes / MIB:.2f} + 128 = {bound / MIB:.2f} MiB.",
        "",
        "| arm | model state B/param (rank 0, by category) | tokens/s | vs DeepSpeed's Muon | fwd+bwd s | step s"
        " | step allocates at its peak, MiB | step exchanges, MiB per rank (by collective) | peak resident GiB, both"
        " ranks |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {ARMS[r['arm']]} | failed: {r['why']} | | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / reference['tokens_per_s']:.2f}x" if reference else ""
        lines.append(
            f"| {ARMS[r['arm']]} | **{r['model_state_B_per_param']:.2f}** ({r['model_state_by_category']}) |"
            f" {r['tokens_per_s']:,.0f} | {ratio} |"
            f" {r['fwd_bwd_s']:.3f} | {r['step_s']:.3f} | {r['step_alloc_peak_mib']:.2f} |"
            f" {r['step_exchanged_mib']:.2f} ({r['step_collectives']}) | {r['peak_rss_gib']:.3f} |"
        )
    ours = next((r for r in rows if r["arm"] == "pure_bf16_muon" and r["ok"]), None)
    if ours is not None:
        verdict = "within" if ours["within_bound"] else "ABOVE"
        lines += [
            "",
            f"This package's Muon step allocated at most {ours['step_alloc_peak_mib']:.2f} MiB at once on a rank:"
            f" {verdict} the bound of {bound / MIB:.2f} MiB.",
        ]
    write_results(out, stem, rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
