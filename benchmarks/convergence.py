"""Convergence: the same GPT, data order and initialisation trained four ways, validation loss curves side by side.

Arms: fp32 weights with ``torch.optim.AdamW`` (the reference), and pure bf16 (bf16 weights, gradients and moments)
with ``lightning_pure_bf16.AdamW`` rounding ``nearest``, ``stochastic`` and ``kahan``. Everything else is identical:
AdamW(betas=(0.9, 0.95), weight_decay=0.1 on matrices), linear warm-up then cosine decay to 10%, batch, data windows
and initial weights. The model and data are ``examples/gpt.py`` (byte-level, the standard library's source).

The four arms run twice: at the usual learning rate (3e-4) and at a fine-tuning one (1e-5, so weight decay alone is
1e-6 of the weight a step), where every update is far below a bf16 spacing.

    python benchmarks/convergence.py            # 1200 steps at lr 3e-4 and at lr 1e-5
    python benchmarks/convergence.py --quick    # 200 steps
Writes benchmarks/results/convergence{,_quick}.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _results import write_results  # noqa: E402
from gpt import GPT, ByteWindows, GPTConfig, load_bytes, lr_factor, stdlib_files  # noqa: E402

from lightning_pure_bf16 import AdamW  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ARMS = ("fp32", "nearest", "stochastic", "kahan")
LABELS = {
    "fp32": "fp32 weights, torch.optim.AdamW (reference)",
    "nearest": "pure bf16, rounding='nearest'",
    "stochastic": "pure bf16, rounding='stochastic'",
    "kahan": "pure bf16, rounding='kahan'",
}


def evaluate(model: GPT, val: ByteWindows, dtype: torch.dtype, batch: int, device: torch.device) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(val), batch):
            x, y = zip(*(val[j] for j in range(i, min(i + batch, len(val)))))
            x, y = torch.stack(x).to(device), torch.stack(y).to(device)
            logits = model(x).float()
            total += F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count


def train_arm(
    arm: str, lr: float, args: argparse.Namespace, train: ByteWindows, val: ByteWindows, device: torch.device
) -> list:
    torch.manual_seed(args.seed)
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(device)
    dtype = torch.float32 if arm == "fp32" else torch.bfloat16
    model = model.to(dtype)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if arm == "fp32":
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    else:
        opt = AdamW(groups, lr=lr, betas=(0.9, 0.95), rounding=arm, seed=args.seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args.warmup, args.steps))
    curve = [(0, evaluate(model, val, dtype, args.batch_size, device))]
    start = time.perf_counter()
    for step in range(args.steps):
        idx = range(step * args.batch_size, (step + 1) * args.batch_size)
        x, y = zip(*(train[i] for i in idx))
        x, y = torch.stack(x).to(device), torch.stack(y).to(device)
        logits = model(x).float()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, evaluate(model, val, dtype, args.batch_size, device)))
    elapsed = time.perf_counter() - start
    print(f"lr {lr:g} {arm:10s} final val loss {curve[-1][1]:.4f}  ({elapsed:.0f} s)", file=sys.stderr)
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 steps")
    parser.add_argument("--steps", type=int, default=None, help="default: 1200 (200 with --quick)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--small-lr", type=float, default=1e-5, help="the second set of arms; 0: none")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=None, help="default: steps/12")
    parser.add_argument("--val-windows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (200 if args.quick else 1200)
    args.eval_every = args.eval_every or max(1, args.steps // 12)
    device = torch.device(args.device)

    train_files, val_files = stdlib_files()
    train = ByteWindows(load_bytes(train_files), args.block_size, args.steps * args.batch_size, args.seed)
    val = ByteWindows(load_bytes(val_files), args.block_size, args.val_windows, args.seed + 1)
    lrs = [args.lr] + ([args.small_lr] if args.small_lr else [])
    curves = {(arm, lr): train_arm(arm, lr, args, train, val, device) for lr in lrs for arm in ARMS}

    args.out.mkdir(parents=True, exist_ok=True)
    stem = "convergence_quick" if args.quick else "convergence"
    command = "python benchmarks/convergence.py" + (" --quick" if args.quick else "")
    rows = [
        {"step": step, **{f"{arm}_lr{lr:g}": f"{curves[arm, lr][i][1]:.5f}" for lr in lrs for arm in ARMS}}
        for i, (step, _) in enumerate(curves["fp32", args.lr])
    ]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_params = sum(
        p.numel() for p in GPT(GPTConfig(args.block_size, 256, args.n_layer, args.n_head, args.n_embd)).parameters()
    )
    fig, axes = plt.subplots(1, len(lrs), figsize=(7 * len(lrs), 4.5), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for arm in ARMS:
            steps, losses = zip(*curves[arm, lr][1:])
            ax.plot(steps, losses, label=LABELS[arm], linestyle="--" if arm == "fp32" else "-")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"Byte-level GPT ({n_params / 1e6:.2f}M params), stdlib source, lr {lr:g}")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)

    lines = [
        f"# Convergence: byte-level GPT, {n_params:,} parameters, {args.steps} steps",
        "",
        f"Command: `{command}` (device: {args.device}). AdamW (warm-up {args.warmup} steps, cosine to"
        f" 10%), betas (0.9, 0.95), weight decay {args.weight_decay} on matrices, batch {args.batch_size} x"
        f" {args.block_size} bytes, {args.n_layer} layers x {args.n_embd} wide; same initial weights and data order in"
        f" every arm; validation on {args.val_windows} fixed windows of held-out files.",
        "",
        "| learning rate | arm | final validation loss | gap to fp32 |",
        "|---:|---|---:|---:|",
    ]
    for lr in lrs:
        ref = curves["fp32", lr][-1][1]
        for arm in ARMS:
            loss = curves[arm, lr][-1][1]
            lines.append(f"| {lr:g} | {LABELS[arm]} | {loss:.4f} | {100 * (loss - ref) / ref:+.2f}% |")
    lines += ["", f"![validation loss]({stem}.png)"]
    write_results(args.out, stem, rows, lines, command, also=("png",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
