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

``--study int8`` compares 8-bit states with fp32 and with the peers that run on a CPU, side by side on the same model,
data and schedule, at three learning rates and two seeds: fp32 ``torch.optim.AdamW``; this package's bf16 moments
(stochastic rounding), 8-bit moments (``moments="int8"``) and 8-bit moments with an 8-bit Kahan remainder; torchao's
``_AdamW(bf16_stochastic_round=True)`` and ``AdamW8bit(bf16_stochastic_round=True)``; bitsandbytes' ``AdamW8bit``
(its bf16 weight writes round to nearest). A peer that does not import is left out, with a note.

    python benchmarks/convergence.py --study int8            # 400 steps, lr 1e-4 / 3e-4 / 1e-3, seeds 0 and 1
    python benchmarks/convergence.py --study int8 --quick    # 100 steps
Writes benchmarks/results/convergence_int8{,_quick}.{csv,md,png}.

``--study width`` is the quality check at width: a GPT of 10.9M parameters (6 layers x 384) trained on 2M tokens
(1000 steps of 16 x 128 bytes) at the example's peak lr (1e-3) with its warm-up (50 steps) and cosine decay to 10%,
three ways: DeepSpeed's bf16 mixed precision arithmetic (bf16 weights and gradients, fp32 master weights and fp32
moments updated by torch AdamW, the master rounded to nearest into the weights: the fp32-master reference), and this
package's stochastic rounding and 8-bit moments. ``--gpu`` is the same study for GPT-2 124M (12 x 768, 1024-byte
context) on a CUDA machine.

    python benchmarks/convergence.py --study width             # ~1 hour on 2 CPU cores
    python benchmarks/convergence.py --study width --quick     # 60 steps
    python benchmarks/convergence.py --study width --gpu       # on a CUDA machine
Writes benchmarks/results/convergence_width{,_quick,_gpu}.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import json
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
    "int8": "pure bf16, moments='int8' (6 B/param)",
    "int8_kahan": "pure bf16, moments='int8', 8-bit Kahan (7 B/param)",
    "torchao_bf16_sr": "torchao _AdamW(bf16_stochastic_round=True)",
    "torchao_8bit": "torchao AdamW8bit(bf16_stochastic_round=True)",
    "bnb_8bit": "bitsandbytes AdamW8bit (bf16 weights, nearest)",
    "bf16_mixed": "bf16 weights, fp32 masters and moments (DeepSpeed bf16 mixed, reference)",
}
WIDTH_ARMS = ("bf16_mixed", "stochastic", "int8")
INT8_ARMS = ("fp32", "stochastic", "int8", "int8_kahan", "torchao_bf16_sr", "torchao_8bit", "bnb_8bit")
PEERS = ("torchao_bf16_sr", "torchao_8bit", "bnb_8bit")
INT8_LRS = (1e-4, 3e-4, 1e-3)
INT8_SEEDS = (0, 1)


class FP32MasterAdamW(torch.optim.AdamW):
    """The arithmetic of DeepSpeed's bf16 mixed precision on one process: the model's weights and gradients are bf16;
    each step casts the gradients to float32, updates float32 master weights and moments with torch AdamW, and rounds
    the masters to nearest into the bf16 weights. (Its param groups are the masters', for the scheduler.)"""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float]) -> None:
        self.bf16_groups = [list(g["params"]) for g in groups]
        masters = [{**g, "params": [p.detach().float() for p in g["params"]]} for g in groups]
        super().__init__(masters, lr=lr, betas=betas)

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        pairs = [(m, p) for g, ps in zip(self.param_groups, self.bf16_groups) for m, p in zip(g["params"], ps)]
        for master, p in pairs:
            master.grad = None if p.grad is None else p.grad.float()
        super().step()
        for master, p in pairs:
            p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for ps in self.bf16_groups:
            for p in ps:
                p.grad = None
        super().zero_grad(set_to_none=set_to_none)


def make_optimizer(arm: str, groups: list[dict], lr: float, seed: int) -> torch.optim.Optimizer:
    """The optimizer of one arm (fp32 weights for "fp32", bf16 weights for every other)."""
    betas = (0.9, 0.95)
    if arm == "fp32":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    if arm == "bf16_mixed":
        return FP32MasterAdamW(groups, lr=lr, betas=betas)
    if arm in ("nearest", "stochastic", "kahan"):
        return AdamW(groups, lr=lr, betas=betas, rounding=arm, seed=seed)
    if arm == "int8":
        return AdamW(groups, lr=lr, betas=betas, moments="int8", seed=seed)
    if arm == "int8_kahan":
        return AdamW(groups, lr=lr, betas=betas, rounding="kahan", moments="int8", compensation="int8", seed=seed)
    if arm == "torchao_bf16_sr":
        from torchao.optim import _AdamW

        return _AdamW(groups, lr=lr, betas=betas, bf16_stochastic_round=True)
    if arm == "torchao_8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, lr=lr, betas=betas, bf16_stochastic_round=True)
    if arm == "bnb_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas)
    raise ValueError(f"unknown arm {arm!r}")


def available(arm: str) -> str | None:
    """``None`` when the arm can run here, else why not."""
    try:
        p = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
        make_optimizer(arm, [{"params": [p], "weight_decay": 0.0}], 1e-3, 0)
    except Exception as err:  # noqa: BLE001 - a peer that does not import or build is reported, not fatal
        return f"{type(err).__name__}: {err}"
    return None


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
    arm: str,
    lr: float,
    args: argparse.Namespace,
    train: ByteWindows,
    val: ByteWindows,
    device: torch.device,
    seed: int | None = None,
) -> list:
    seed = args.seed if seed is None else seed
    torch.manual_seed(seed)
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(device)
    dtype = torch.float32 if arm == "fp32" else torch.bfloat16
    model = model.to(dtype)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = make_optimizer(arm, groups, lr, seed)
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
    print(f"lr {lr:g} seed {seed} {arm:16s} final val loss {curve[-1][1]:.4f}  ({elapsed:.0f} s)", file=sys.stderr)
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=("rounding", "int8", "width"), default="rounding")
    parser.add_argument("--gpu", action="store_true", help="width study: GPT-2 124M on a CUDA machine")
    parser.add_argument("--quick", action="store_true", help="200 steps (int8 study: 100)")
    parser.add_argument("--steps", type=int, default=None, help="default: 1200, int8 study 600")
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
    if args.study == "width":
        # Sizes of the study unless given: 6 x 384 (10.9M) on the CPU, GPT-2 124M (12 x 768) with --gpu.
        big = args.gpu
        defaults = {
            "n_layer": (6, 12),
            "n_head": (6, 12),
            "n_embd": (384, 768),
            "block_size": (128, 1024),
            "batch_size": (16, 16),
            "lr": (1e-3, 6e-4),  # the example's peak lr; GPT-2's on the GPU
        }
        for key, (cpu, gpu) in defaults.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, gpu if big else cpu)
        args.steps = args.steps or (60 if args.quick else (4000 if big else 1000))
        args.warmup = min(args.warmup, args.steps // 10)
    if args.study == "int8":
        args.steps = args.steps or (100 if args.quick else 400)
        args.warmup = min(args.warmup, args.steps // 10)
    args.steps = args.steps or (200 if args.quick else 1200)
    args.eval_every = args.eval_every or max(1, args.steps // 12)
    device = torch.device(args.device)

    train_files, val_files = stdlib_files()
    train = ByteWindows(load_bytes(train_files), args.block_size, args.steps * args.batch_size, args.seed)
    val = ByteWindows(load_bytes(val_files), args.block_size, args.val_windows, args.seed + 1)
    if args.study == "int8":
        return int8_study(args, train, val, device)
    if args.study == "width":
        return width_study(args, train, val, device)
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


def int8_study(args: argparse.Namespace, train: ByteWindows, val: ByteWindows, device: torch.device) -> int:
    missing = {arm: why for arm in PEERS if (why := available(arm)) is not None}
    arms = [arm for arm in INT8_ARMS if arm not in missing]
    curves = {
        (arm, lr, seed): train_arm(arm, lr, args, train, val, device, seed)
        for lr in INT8_LRS
        for seed in INT8_SEEDS
        for arm in arms
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "convergence_int8_quick" if args.quick else "convergence_int8"
    command = "python benchmarks/convergence.py --study int8" + (" --quick" if args.quick else "")
    rows = [
        {
            "step": step,
            **{
                f"{arm}_lr{lr:g}_seed{seed}": f"{curves[arm, lr, seed][i][1]:.5f}"
                for lr in INT8_LRS
                for seed in INT8_SEEDS
                for arm in arms
            },
        }
        for i, (step, _) in enumerate(curves["fp32", INT8_LRS[0], INT8_SEEDS[0]])
    ]

    def final(arm: str, lr: float) -> list[float]:
        return [curves[arm, lr, seed][-1][1] for seed in INT8_SEEDS]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_params = sum(
        p.numel() for p in GPT(GPTConfig(args.block_size, 256, args.n_layer, args.n_head, args.n_embd)).parameters()
    )
    fig, axes = plt.subplots(1, len(INT8_LRS), figsize=(6.5 * len(INT8_LRS), 4.8), squeeze=False)
    for ax, lr in zip(axes[0], INT8_LRS):
        for arm in arms:
            steps = [s for s, _ in curves[arm, lr, INT8_SEEDS[0]][1:]]
            mean = [
                sum(curves[arm, lr, seed][i][1] for seed in INT8_SEEDS) / len(INT8_SEEDS)
                for i in range(1, len(steps) + 1)
            ]
            ax.plot(steps, mean, label=LABELS[arm], linestyle="--" if arm == "fp32" else "-")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"validation loss (nats/byte), mean of {len(INT8_SEEDS)} seeds")
        ax.set_title(f"lr {lr:g}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Byte-level GPT ({n_params / 1e6:.2f}M params), stdlib source: 8-bit states and peers")
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)

    lines = [
        f"# Convergence of 8-bit optimizer states: byte-level GPT, {n_params:,} parameters, {args.steps} steps",
        "",
        f"Command: `{command}` (device: {args.device}). AdamW (warm-up {args.warmup} steps, cosine to 10%), betas"
        f" (0.9, 0.95), weight decay {args.weight_decay} on matrices, batch {args.batch_size} x {args.block_size}"
        f" bytes, {args.n_layer} layers x {args.n_embd} wide; per seed the same initial weights in every arm, the same"
        f" data order for all; seeds {', '.join(map(str, INT8_SEEDS))}. Final validation loss: mean over seeds, and"
        " half the seed-to-seed range (the spread).",
        "",
        "| learning rate | arm | final validation loss | seed spread | gap to fp32 (mean) | gap per seed |",
        "|---:|---|---:|---:|---:|---|",
    ]
    summary = []
    for lr in INT8_LRS:
        ref = final("fp32", lr)
        for arm in arms:
            losses = final(arm, lr)
            mean = sum(losses) / len(losses)
            gap = 100 * (mean - sum(ref) / len(ref)) / (sum(ref) / len(ref))
            per_seed = ", ".join(f"{100 * (x - r) / r:+.2f}%" for x, r in zip(losses, ref))
            spread = (max(losses) - min(losses)) / 2
            lines.append(f"| {lr:g} | {LABELS[arm]} | {mean:.4f} | {spread:.4f} | {gap:+.2f}% | {per_seed} |")
            summary.append((lr, arm, gap, 100 * spread / (sum(ref) / len(ref))))
    best_peer = {
        lr: min(((gap, sp) for lr_, arm, gap, sp in summary if lr_ == lr and arm in PEERS), default=None)
        for lr in INT8_LRS
    }
    lines += [
        "",
        "Goal: each 8-bit arm of this package within 0.5% of fp32, and no worse than the best peer by more than the"
        " seed spread (the larger of the two arms' spreads, in % of fp32's loss):",
        "",
    ]
    for lr, arm, gap, spread_pct in summary:
        if arm in ("int8", "int8_kahan"):
            peer = best_peer[lr]
            ok = gap <= 0.5 and (peer is None or gap <= peer[0] + max(spread_pct, peer[1]))
            peer_text = f"best peer {peer[0]:+.2f}% +- {peer[1]:.2f}%" if peer is not None else "no peer ran"
            verdict = "met" if ok else "missed"
            lines.append(f"- lr {lr:g}, {LABELS[arm]}: {gap:+.2f}% +- {spread_pct:.2f}% ({peer_text}): {verdict}")
    for arm, why in missing.items():
        lines.append(f"- {LABELS[arm]}: not run here ({why[:200]})")
    lines += ["", f"![validation loss]({stem}.png)"]
    write_results(args.out, stem, rows, lines, command, also=("png",))
    return 0


def width_study(args: argparse.Namespace, train: ByteWindows, val: ByteWindows, device: torch.device) -> int:
    """Quality at width: DeepSpeed's bf16 mixed arithmetic (fp32 masters) against stochastic rounding and 8-bit
    moments, one learning rate, one seed, the same initial weights and data order."""
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "convergence_width" + ("_gpu" if args.gpu else "") + ("_quick" if args.quick else "")
    command = "python benchmarks/convergence.py --study width" + (" --gpu" if args.gpu else "")
    command += " --quick" if args.quick else ""
    command += f" --seed {args.seed}" if args.seed else ""
    curves, seconds = {}, {}
    for arm in WIDTH_ARMS:
        start = time.perf_counter()
        curves[arm] = train_arm(arm, args.lr, args, train, val, device)
        seconds[arm] = time.perf_counter() - start
        # Written as it goes: a long run that stops early keeps the arms it finished.
        rows = [
            {"step": step, **{arm: f"{curves[arm][i][1]:.5f}" for arm in curves}}
            for i, (step, _) in enumerate(curves[WIDTH_ARMS[0]])
        ]
        (args.out / f"{stem}.partial.json").write_text(json.dumps({"rows": rows, "seconds": seconds}))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_params = sum(
        p.numel() for p in GPT(GPTConfig(args.block_size, 256, args.n_layer, args.n_head, args.n_embd)).parameters()
    )
    tokens = args.steps * args.batch_size * args.block_size
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for arm in WIDTH_ARMS:
        steps, losses = zip(*curves[arm][1:])
        ax.plot(steps, losses, label=LABELS[arm], linestyle="--" if arm == "bf16_mixed" else "-")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"Byte-level GPT, {n_params / 1e6:.1f}M params, {tokens / 1e6:.1f}M tokens, lr {args.lr:g}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)

    ref = curves["bf16_mixed"][-1][1]
    lines = [
        f"# Quality at width: byte-level GPT, {n_params:,} parameters, {tokens:,} tokens per arm",
        "",
        f"Command: `{command}` (device: {args.device}). {args.steps} steps of {args.batch_size} x {args.block_size}"
        f" bytes, AdamW lr {args.lr:g} (warm-up {args.warmup} steps, cosine to 10%), betas (0.9, 0.95), weight decay"
        f" {args.weight_decay} on matrices, {args.n_layer} layers x {args.n_embd} wide; the same initial weights and"
        f" data order in every arm; validation on {args.val_windows} fixed windows of held-out files. The reference"
        " is the arithmetic of DeepSpeed's bf16 mixed precision (bf16 weights and gradients, fp32 master weights and"
        " moments, torch AdamW, masters rounded to nearest into the weights), run on one process.",
        "",
        "| arm | model state B/param | final validation loss | gap to fp32 masters | wall time |",
        "|---|---:|---:|---:|---:|",
    ]
    state = {"bf16_mixed": "16", "stochastic": "8", "int8": "6.03"}
    for arm in WIDTH_ARMS:
        loss = curves[arm][-1][1]
        lines.append(
            f"| {LABELS[arm]} | {state[arm]} | {loss:.4f} | {100 * (loss - ref) / ref:+.2f}% | {seconds[arm] / 60:.0f}"
            " min |"
        )
    gaps = {arm: 100 * (curves[arm][-1][1] - ref) / ref for arm in WIDTH_ARMS[1:]}
    verdict = "met" if all(g <= 0.5 for g in gaps.values()) else "missed"
    lines += [
        "",
        f"Goal: stochastic rounding and 8-bit moments within 0.5% of the fp32-master arm's final loss: {verdict}.",
        "",
        f"![validation loss]({stem}.png)",
    ]
    rows = [
        {"step": step, **{arm: f"{curves[arm][i][1]:.5f}" for arm in WIDTH_ARMS}}
        for i, (step, _) in enumerate(curves[WIDTH_ARMS[0]])
    ]
    write_results(args.out, stem, rows, lines, command, also=("png",))
    (args.out / f"{stem}.partial.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
