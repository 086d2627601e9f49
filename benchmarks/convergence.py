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
in every arm of ``_quality_arms.STUDY_ARMS`` (fp32 masters, this package's four formats, the peers, two attribution
arms) at two seeds (per seed the same initial weights and data order in every arm). ``--study finetune`` starts
from the width study's fp32-masters model and fine-tunes it on other text (the interpreter's documentation topics,
prose instead of source) for 300 steps at lr 1e-5 and 3e-5, in every arm, two seeds. Each finished run is kept in
``<stem>_runs.json`` and the tables are rewritten from it; a rerun skips the runs already there and resumes an
interrupted one from its last evaluation, so a study completes over several sittings. A peer that is not installed
(torchao, llama-cookbook) is skipped with the line that installs it. ``--gpu`` is the width study for GPT-2 124M
(12 x 768, 1024-byte context) on a CUDA machine.

    python benchmarks/convergence.py --study width             # 20 runs of 15-30 min on 2 CPU cores
    python benchmarks/convergence.py --study finetune          # 40 runs of 4-8 min (pretrains first if needed)
    python benchmarks/convergence.py --study width --quick     # every arm end to end: 2 x 128, 40 steps, seed 0
    python benchmarks/convergence.py --study width --seeds 1 --arms kahan int8_kahan --threads 1
Writes benchmarks/results/convergence_{width,finetune}{,_quick,_gpu}{.md,.png,_summary.csv,_runs.json}.

``--study family`` is the same check for the other algorithms of the package: Lion, SGD (Nesterov momentum), Adafactor
and Muon (AdamW beside it for embeddings and vectors), each trained with float32 master weights and states (its
reference optimizer: torch.optim.SGD, Adafactor and Muon + AdamW (``tests/reference/muon.py``), and lion-pytorch's rule
in ``tests/reference/lion.py``), with this package's optimizer rounding stochastically and with Kahan compensation, and
with the reference optimizer directly on bf16 weights (round to nearest); at a learning rate of training from scratch
and at one of fine-tuning (``FAMILY_LRS``), two seeds, on the small GPT. Resumable as the quality studies.

    python benchmarks/convergence.py --study family            # 64 runs of 300 steps, 2-5 min each
    python benchmarks/convergence.py --study family --quick    # 100 steps, seed 0
Writes benchmarks/results/convergence_family{,_quick}.{csv,md,png} and its _runs.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _quality_arms as quality_arms  # noqa: E402
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
INT8_ARMS = ("fp32", "stochastic", "int8", "int8_kahan", "torchao_bf16_sr", "torchao_8bit", "bnb_8bit")
PEERS = ("torchao_bf16_sr", "torchao_8bit", "bnb_8bit")
INT8_LRS = (1e-4, 3e-4, 1e-3)
INT8_SEEDS = (0, 1)


# This script's older arm names for the arms of _quality_arms (the same optimizers, the same betas).
_STUDY_NAMES = {
    "bf16_mixed": "fp32_masters",
    "stochastic": "stochastic",
    "kahan": "kahan",
    "int8": "int8",
    "int8_kahan": "int8_kahan",
    "torchao_bf16_sr": "torchao_sr",
}


def make_optimizer(arm: str, groups: list[dict], lr: float, seed: int) -> torch.optim.Optimizer:
    """The optimizer of one arm (fp32 weights for "fp32", bf16 weights for every other; ``"lion:kahan"``: an arm of
    the family study)."""
    if ":" in arm:
        algorithm, name = arm.split(":")
        return quality_arms.make_family_optimizer(algorithm, name, groups, lr, seed)
    if arm in _STUDY_NAMES:  # the arms the quality studies share, built in one place
        return quality_arms.make_optimizer(_STUDY_NAMES[arm], groups, lr, seed)
    betas = quality_arms.BETAS
    if arm == "fp32":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    if arm == "nearest":
        return AdamW(groups, lr=lr, betas=betas, rounding="nearest", seed=seed)
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


def train_step(
    model: GPT,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    train: ByteWindows,
    step: int,
    batch_size: int,
    device: torch.device,
) -> None:
    """One optimizer step on the ``step``-th batch of ``train`` (the same data order in every arm)."""
    idx = range(step * batch_size, (step + 1) * batch_size)
    x, y = zip(*(train[i] for i in idx))
    x, y = torch.stack(x).to(device), torch.stack(y).to(device)
    logits = model(x).float()
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()


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
    if arm.startswith("muon:"):  # the hidden matrices in Muon; the embeddings (and the tied head) and vectors in AdamW
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        groups = [
            {"params": [p for p in decay if id(p) not in embeddings], "weight_decay": args.weight_decay},
            {"params": [p for p in decay if id(p) in embeddings], "weight_decay": args.weight_decay, "use_muon": False},
            {"params": no_decay, "weight_decay": 0.0, "use_muon": False},
        ]
    opt = make_optimizer(arm, groups, lr, seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args.warmup, args.steps))
    curve = [(0, evaluate(model, val, dtype, args.batch_size, device))]
    start = time.perf_counter()
    for step in range(args.steps):
        train_step(model, opt, sched, train, step, args.batch_size, device)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, evaluate(model, val, dtype, args.batch_size, device)))
    elapsed = time.perf_counter() - start
    print(f"lr {lr:g} seed {seed} {arm:16s} final val loss {curve[-1][1]:.4f}  ({elapsed:.0f} s)", file=sys.stderr)
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=("rounding", "int8", "width", "finetune", "family"), default="rounding")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="width/finetune: the seeds to run")
    parser.add_argument(
        "--arms", nargs="+", choices=quality_arms.STUDY_ARMS, default=None, help="width/finetune: default all"
    )
    parser.add_argument("--finetune-lrs", type=float, nargs="+", default=[1e-5, 3e-5])
    parser.add_argument(
        "--algorithms",
        nargs="+",
        choices=("lion", "sgd", "adafactor", "muon"),
        default=None,
        help="family: run these only (default all)",
    )
    parser.add_argument("--pretrain-seed", type=int, default=0, help="finetune: the width run it starts from")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.study in ("width", "finetune"):
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
        if args.quick:  # a check that every arm runs end to end: the small model (2 x 128), 40 steps
            defaults = {k: v for k, v in defaults.items() if k in ("batch_size", "lr")}
        for key, (cpu, gpu) in defaults.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, gpu if big else cpu)
        if args.quick:
            args.seeds = [0] if args.seeds == parser.get_default("seeds") else args.seeds
            args.val_windows = 64 if args.val_windows == parser.get_default("val_windows") else args.val_windows
        args.pretrain_steps = 40 if args.quick else (4000 if big else 1000)
        args.pretrain_warmup = min(args.warmup, args.pretrain_steps // 10)
        if args.study == "width":
            args.steps = args.steps or args.pretrain_steps
        else:
            args.steps = args.steps or (20 if args.quick else 300)
        args.warmup = min(args.warmup, args.steps // 10)
    if args.study in ("int8", "family"):
        args.steps = args.steps or (100 if args.quick else 400 if args.study == "int8" else 300)
        args.warmup = min(args.warmup, args.steps // 10)
    args.steps = args.steps or (200 if args.quick else 1200)
    args.eval_every = args.eval_every or max(1, args.steps // 12)
    device = torch.device(args.device)
    if args.study in ("width", "finetune"):
        return quality_study(args, device)

    train_files, val_files = stdlib_files()
    train = ByteWindows(load_bytes(train_files), args.block_size, args.steps * args.batch_size, args.seed)
    val = ByteWindows(load_bytes(val_files), args.block_size, args.val_windows, args.seed + 1)
    if args.study == "int8":
        return int8_study(args, train, val, device)
    if args.study == "family":
        return family_study(args, train, val, device)
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


# --- The family study: Lion, SGD, Adafactor and Muon, each beside its fp32-masters and round-to-nearest versions ------
# Per algorithm, a learning rate of training from scratch and one of fine-tuning, where every update is far below a
# bf16 spacing of the weights (Lion: lr 3e-6 moves a weight of 0.02 by 1.5e-4 of itself, a tenth of half a spacing).
FAMILY_LRS = {"lion": (1e-4, 3e-6), "sgd": (0.3, 3e-3), "adafactor": (1e-2, 1e-4), "muon": (3e-3, 1e-5)}


def family_study(args: argparse.Namespace, train: ByteWindows, val: ByteWindows, device: torch.device) -> int:
    """``--study family``: every arm of ``_quality_arms.FAMILY_ARMS`` for every algorithm at both learning rates of
    :data:`FAMILY_LRS` and every seed; each finished run kept in ``<stem>_runs.json`` (a rerun skips it)."""
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "convergence_family_quick" if args.quick else "convergence_family"
    runs_path = args.out / f"{stem}_runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    seeds = args.seeds[:1] if args.quick else args.seeds
    arms = quality_arms.FAMILY_ARMS
    for algorithm, lrs in FAMILY_LRS.items():
        if args.algorithms and algorithm not in args.algorithms:
            continue
        args.weight_decay = quality_arms.FAMILY[algorithm]["weight_decay"]
        for lr in lrs:
            for seed in seeds:
                for arm in arms:
                    key = f"{algorithm}:{arm}:lr{lr:g}:seed{seed}"
                    if key not in runs:
                        runs[key] = train_arm(f"{algorithm}:{arm}", lr, args, train, val, device, seed)
                        _atomic_write_json(runs, runs_path)

    if args.algorithms and set(args.algorithms) != set(FAMILY_LRS):
        return 0  # a part of the study: its runs are kept; the report waits for the whole

    def curve(algorithm: str, arm: str, lr: float, seed: int) -> list:
        return runs[f"{algorithm}:{arm}:lr{lr:g}:seed{seed}"]

    command = "python benchmarks/convergence.py --study family" + (" --quick" if args.quick else "")
    n_params = sum(
        p.numel() for p in GPT(GPTConfig(args.block_size, 256, args.n_layer, args.n_head, args.n_embd)).parameters()
    )
    lines = [
        f"# Convergence of Lion, SGD, Adafactor and Muon in pure bf16: byte-level GPT, {n_params:,} parameters,"
        f" {args.steps} steps",
        "",
        f"Command: `{command}` (device: {args.device}). Each algorithm trains the same bf16 model four ways: with"
        " float32 master weights and states (its reference optimizer, rounded to nearest into the bf16 weights, the"
        " arithmetic of DeepSpeed's bf16 mixed precision), with this package's optimizer rounding stochastically and"
        " with Kahan compensation, and with the reference optimizer directly on the bf16 weights (every write rounded"
        " to nearest). Lion: lion-pytorch's semantics (`tests/reference/lion.py`), betas (0.9, 0.99), weight decay"
        f" {quality_arms.FAMILY['lion']['weight_decay']} on matrices; SGD: torch.optim.SGD, Nesterov momentum 0.9,"
        f" weight decay {quality_arms.FAMILY['sgd']['weight_decay']} on matrices; Adafactor: torch.optim.Adafactor's"
        " defaults (the learning rate caps its relative step); Muon: torch.optim.Muon (adjust_lr_fn="
        f"'match_rms_adamw', weight decay {quality_arms.FAMILY['muon']['weight_decay']}) on the hidden matrices and"
        " torch.optim.AdamW (betas (0.9, 0.95), eps 1e-10) on the embeddings and vectors (`tests/reference/muon.py`;"
        " this package's Muon steps both). The model state column counts the per-element states (Adafactor's"
        " factored statistics and Muon's AdamW-stepped embeddings left out). Warm-up {args.warmup} steps, cosine"
        f" to 10%, batch {args.batch_size} x {args.block_size} bytes, {args.n_layer} layers x {args.n_embd} wide; per"
        f" seed the same initial weights and data order in every arm; seeds {', '.join(map(str, seeds))}. Final"
        " validation loss: mean over seeds; spread: half the seed-to-seed range; gap: to the fp32-masters arm.",
        "",
        "| algorithm | lr | arm | model state B/param | final validation loss | spread | gap to fp32 masters |"
        " gap per seed |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    rows, verdicts = [], []
    for algorithm, lrs in FAMILY_LRS.items():
        for lr in lrs:
            ref = [curve(algorithm, "fp32_masters", lr, s)[-1][1] for s in seeds]
            ref_mean = sum(ref) / len(ref)
            no_state = algorithm == "adafactor"
            state_bytes = quality_arms.FAMILY_BYTES_NO_STATE if no_state else quality_arms.FAMILY_BYTES
            for arm in arms:
                losses = [curve(algorithm, arm, lr, s)[-1][1] for s in seeds]
                mean = sum(losses) / len(losses)
                gap = 100 * (mean - ref_mean) / ref_mean
                per_seed = ", ".join(f"{100 * (x - r) / r:+.2f}%" for x, r in zip(losses, ref))
                spread = (max(losses) - min(losses)) / 2
                lines.append(
                    f"| {algorithm} | {lr:g} | {quality_arms.FAMILY_LABELS[arm]} | {state_bytes[arm]:.2f}"
                    f" | {mean:.4f} | {spread:.4f} | {gap:+.2f}% | {per_seed} |"
                )
                rows.append({"algorithm": algorithm, "lr": lr, "arm": arm, "loss": f"{mean:.5f}", "gap_pct": gap})
                if arm in ("stochastic", "kahan"):
                    goal = 0.5 if arm == "stochastic" else 0.2
                    verdict = "met" if gap <= goal else "missed"
                    verdicts.append(f"- {algorithm}, lr {lr:g}, {arm}: {gap:+.2f}% (goal <= {goal}%): {verdict}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(algorithm, lr) for algorithm, lrs in FAMILY_LRS.items() for lr in lrs]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6), squeeze=False)
    for ax, (algorithm, lr) in zip(axes[0], panels):
        for arm in arms:
            steps = [s for s, _ in curve(algorithm, arm, lr, seeds[0])[1:]]
            mean = [
                sum(curve(algorithm, arm, lr, s)[i][1] for s in seeds) / len(seeds) for i in range(1, len(steps) + 1)
            ]
            ax.plot(
                steps, mean, label=quality_arms.FAMILY_LABELS[arm], linestyle="--" if arm == "fp32_masters" else "-"
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"validation loss (nats/byte), mean of {len(seeds)} seeds")
        ax.set_title(f"{algorithm}, lr {lr:g}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)
    lines += ["", "Goal: stochastic rounding within 0.5% of the fp32-masters arm, Kahan within 0.2%:", "", *verdicts]
    lines += ["", f"![validation loss]({stem}.png)"]
    write_results(args.out, stem, rows, lines, command, also=("png",))
    return 0


# --- The quality studies: every arm, several seeds, resumable over sittings -------------------------------------


def finetune_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The fine-tuning corpus: the English text of the interpreter's own documentation topics (``pydoc_data``, on
    every machine with Python), split into train and validation by a hash of the topic name. The pretraining corpus
    is Python source; this one is prose."""
    import hashlib
    from pydoc_data.topics import topics

    names = sorted(topics)
    is_val = [int(hashlib.sha1(n.encode()).hexdigest(), 16) % 10 == 0 for n in names]

    def encode(keep: list[str]) -> torch.Tensor:
        text = "\n".join(topics[n] for n in keep).encode()
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()

    return encode([n for n, v in zip(names, is_val) if not v]), encode([n for n, v in zip(names, is_val) if v])


def _atomic_save(obj: object, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_json(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def run_key(arm: str, seed: int, lr: float | None = None) -> str:
    return f"{arm}/seed{seed}" + ("" if lr is None else f"/lr{lr:g}")


def train_study_arm(
    arm: str,
    lr: float,
    seed: int,
    args: argparse.Namespace,
    init: dict[str, torch.Tensor] | None,
    train: ByteWindows,
    val: ByteWindows,
    partial: Path,
    device: torch.device,
) -> tuple[list, float, GPT, torch.optim.Optimizer]:
    """Train one (arm, seed, lr) of a quality study; every ``eval_every`` steps the whole run (model, optimizer,
    scheduler, random state, curve) is saved to ``partial`` so that a run stopped with the sitting resumes there.

    ``init``: the float32 weights to start from (fine-tuning); ``None`` builds the model from ``seed``.
    """
    torch.manual_seed(seed)
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config)
    if init is not None:
        model.load_state_dict(init)
    model = model.to(device=device, dtype=torch.bfloat16)
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = quality_arms.make_optimizer(arm, groups, lr, seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args.warmup, args.steps))
    # Master copies in the optimizer's param groups (fp32_masters) are not in its state_dict: saved beside it.
    masters = [p for g in opt.param_groups for p in g["params"] if not any(p is q for q in params)]
    first, elapsed, curve = 0, 0.0, None
    if partial.exists():
        saved = torch.load(partial, weights_only=False)  # written by this script, just above
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        for m, value in zip(masters, saved["masters"]):
            m.data.copy_(value)
        if hasattr(opt, "generator"):
            opt.generator.set_state(saved["optimizer_generator"])
        torch.set_rng_state(saved["rng"])
        first, elapsed, curve = saved["step"], saved["elapsed"], saved["curve"]
        print(f"{run_key(arm, seed, lr)}: resuming at step {first} of {args.steps}", file=sys.stderr)
    if curve is None:
        curve = [(0, evaluate(model, val, torch.bfloat16, args.batch_size, device))]
    start = time.perf_counter() - elapsed
    for step in range(first, args.steps):
        train_step(model, opt, sched, train, step, args.batch_size, device)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, evaluate(model, val, torch.bfloat16, args.batch_size, device)))
            if step + 1 < args.steps:
                _atomic_save(
                    {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "masters": [m.detach().clone() for m in masters],
                        "optimizer_generator": opt.generator.get_state() if hasattr(opt, "generator") else None,
                        "rng": torch.get_rng_state(),
                        "step": step + 1,
                        "elapsed": time.perf_counter() - start,
                        "curve": curve,
                    },
                    partial,
                )
    return curve, time.perf_counter() - start, model, opt


def quality_study(args: argparse.Namespace, device: torch.device) -> int:
    """``--study width`` / ``--study finetune``: every arm of ``_quality_arms.STUDY_ARMS`` at every seed (and, for
    fine-tuning, every learning rate). Each finished run is added to ``<stem>_runs.json`` at once and the tables and
    plot are rewritten from it, so a study longer than one sitting completes over several: a rerun skips the runs
    already there and resumes an interrupted one from its last evaluation."""
    finetune = args.study == "finetune"
    stem = f"convergence_{args.study}" + ("_gpu" if args.gpu else "") + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    runs_path = args.out / f"{stem}_runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    arms = list(args.arms or quality_arms.STUDY_ARMS)
    skipped = {arm: why for arm in arms if (why := quality_arms.missing_peer(arm))}
    for arm, why in skipped.items():
        print(f"{arm}: {why}", file=sys.stderr)
    lrs = args.finetune_lrs if finetune else [args.lr]
    seeds = args.seeds
    val_bytes: torch.Tensor
    if finetune:
        train_bytes, val_bytes = finetune_corpus()
        init = pretrained_weights(args, device)
    else:
        train_files, val_files = stdlib_files()
        train_bytes, val_bytes = load_bytes(train_files), load_bytes(val_files)
        init = None
    # Validation windows: one fixed set for every arm and seed. Training windows: the data order of each seed.
    val = ByteWindows(val_bytes, args.block_size, args.val_windows, 1)
    todo = [(seed, lr, arm) for seed in seeds for lr in lrs for arm in arms if arm not in skipped]
    for seed, lr, arm in todo:
        key = run_key(arm, seed, lr if finetune else None)
        if key in runs:
            print(f"{key}: already in {runs_path.name}, skipped", file=sys.stderr)
            continue
        train = ByteWindows(train_bytes, args.block_size, args.steps * args.batch_size, seed)
        partial = args.out / ".partial" / f"{stem}_{key.replace('/', '_')}.pt"
        curve, seconds, model, opt = train_study_arm(arm, lr, seed, args, init, train, val, partial, device)
        runs[key] = {
            "arm": arm,
            "seed": seed,
            "lr": lr,
            "curve": curve,
            "seconds": round(seconds, 1),
            "threads": torch.get_num_threads(),
            "state_bytes_per_param": round(quality_arms.state_bytes_per_param(opt, list(model.parameters())), 4),
        }
        print(f"{key}: final val loss {curve[-1][1]:.4f} ({seconds / 60:.1f} min)", file=sys.stderr)
        if not finetune and arm == "fp32_masters" and seed == args.pretrain_seed:
            # The width reference's final float32 masters are the fine-tuning study's pretrained model.
            names = [n for n, _ in model.named_parameters()]
            masters = [p for g in opt.param_groups for p in g["params"]]
            order = {id(p): n for n, p in model.named_parameters()}
            by_name = dict(zip((order[id(p)] for g in opt.bf16_groups for p in g), masters))
            _atomic_save({n: by_name[n].detach().clone() for n in names}, pretrained_path(args))
        _atomic_write_json(runs, runs_path)
        partial.unlink(missing_ok=True)
        write_study_report(args, stem, runs, lrs, skipped, final=False)
    write_study_report(args, stem, runs, lrs, skipped)
    return 0


def pretrained_path(args: argparse.Namespace) -> Path:
    name = f"width_pretrained_seed{args.pretrain_seed}" + ("_gpu" if args.gpu else "")
    name += "_quick.pt" if args.quick else ".pt"
    return args.out / ".partial" / name


def pretrained_weights(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """The fine-tuning study's starting point: the width study's ``fp32_masters`` run's final float32 masters
    (trained here first if that run's weights are not on this machine)."""
    path = pretrained_path(args)
    if not path.exists():
        print(f"pretraining the width model in fp32 masters first ({path.name} not found)", file=sys.stderr)
        width = argparse.Namespace(**{**vars(args), "study": "width", "arms": ["fp32_masters"]})
        width.seeds = [args.pretrain_seed]
        width.steps, width.warmup = args.pretrain_steps, args.pretrain_warmup
        width.lr, width.eval_every = (6e-4 if args.gpu else 1e-3), max(1, args.pretrain_steps // 12)
        stem = "convergence_width" + ("_quick" if args.quick else "")
        runs_path = args.out / f"{stem}_runs.json"
        runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
        runs.pop(run_key("fp32_masters", args.pretrain_seed), None)  # rerun to get the weights
        _atomic_write_json(runs, runs_path)
        quality_study(width, device)
    return torch.load(path, weights_only=True)


def write_study_report(
    args: argparse.Namespace,
    stem: str,
    runs: dict,
    lrs: list[float],
    skipped: dict[str, str],
    final: bool = True,
) -> None:
    """The study's summary CSV, table and plot, from every run in ``runs`` (arms not run yet are listed as such);
    printed when ``final``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finetune = args.study == "finetune"
    arms = list(quality_arms.STUDY_ARMS)
    seeds = sorted({r["seed"] for r in runs.values()} | set(args.seeds))
    labels, state = quality_arms.LABELS, quality_arms.ARM_BYTES
    n_params = sum(
        p.numel() for p in GPT(GPTConfig(args.block_size, 256, args.n_layer, args.n_head, args.n_embd)).parameters()
    )
    tokens = args.steps * args.batch_size * args.block_size
    command = f"python benchmarks/convergence.py --study {args.study}" + (" --gpu" if args.gpu else "")
    command += " --quick" if args.quick else ""

    def done(arm: str, lr: float) -> list[dict]:
        return [r for r in runs.values() if r["arm"] == arm and r["lr"] == lr and r["seed"] in seeds]

    # Summary CSV: one row per run.
    summary = [
        {
            "arm": r["arm"],
            "seed": r["seed"],
            **({"lr": f"{r['lr']:g}"} if finetune else {}),
            "final_val_loss": f"{r['curve'][-1][1]:.5f}",
            "state_bytes_per_param": r["state_bytes_per_param"],
            "wall_min": f"{r['seconds'] / 60:.1f}",
            "threads": r["threads"],
        }
        for r in sorted(runs.values(), key=lambda r: (r["lr"], r["seed"], arms.index(r["arm"])))
    ]
    fields = list(dict.fromkeys(k for row in summary for k in row))
    with open(args.out / f"{stem}_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or ["arm", "seed", "final_val_loss"])
        writer.writeheader()
        writer.writerows(summary)

    fig, axes = plt.subplots(1, len(lrs), figsize=(8 * len(lrs), 5.2), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for arm in arms:
            rs = done(arm, lr)
            if not rs:
                continue
            steps = [s for s, _ in rs[0]["curve"][1:]]
            losses = torch.tensor([[loss for _, loss in r["curve"][1:]] for r in rs])
            (line,) = ax.plot(
                steps,
                losses.mean(0),
                label=f"{labels[arm]} ({len(rs)} seed{'s' * (len(rs) > 1)})",
                linestyle="--" if arm == "fp32_masters" else "-",
            )
            if len(rs) > 1:
                ax.fill_between(steps, losses.min(0).values, losses.max(0).values, color=line.get_color(), alpha=0.2)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation loss (nats/byte): mean, band = seed range")
        ax.set_title(f"{'fine-tuning ' if finetune else ''}lr {lr:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    what = "fine-tuning on the documentation's prose" if finetune else f"{tokens / 1e6:.1f}M tokens of Python source"
    fig.suptitle(f"Byte-level GPT, {n_params / 1e6:.1f}M params, {what}")
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)
    plt.close(fig)

    setup = (
        f"{args.steps} steps of {args.batch_size} x {args.block_size} bytes, AdamW (warm-up {args.warmup} steps, cosine"
        f" to 10%), betas (0.9, 0.95), weight decay {args.weight_decay} on matrices, {args.n_layer} layers x"
        f" {args.n_embd} wide."
    )
    if finetune:
        setup += (
            " Every arm starts from the same weights: the width study's fp32-masters model (seed"
            f" {args.pretrain_seed}), rounded to bf16; it is fine-tuned on the English text of the interpreter's"
            " documentation topics (`pydoc_data`), whose held-out topics are the validation set."
        )
    else:
        setup += " Per seed the same initial weights and data order in every arm."
    lines = [
        f"# Quality {'of fine-tuning' if finetune else 'at width'}: byte-level GPT, {n_params:,} parameters",
        "",
        f"Command: `{command}` (device: {args.device}; each run is kept in `{stem}_runs.json` as it finishes, and a"
        " rerun continues where the last sitting stopped). " + setup + f" Validation: {args.val_windows} fixed windows."
        " Loss: mean over the seeds that ran; spread: half the seed-to-seed range; gap: to the fp32-masters arm's mean"
        " at the same learning rate. Wall time: per run, on the threads shown in the summary CSV.",
        "",
        "| lr | arm | model state B/param | seeds | final validation loss | spread | gap to fp32 masters"
        " | gap per seed | wall time per run |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    gaps: dict[tuple[str, float], float] = {}
    for lr in lrs:
        ref = {r["seed"]: r["curve"][-1][1] for r in done("fp32_masters", lr)}
        for arm in arms:
            rs = done(arm, lr)
            if not rs:
                why = skipped.get(arm, "not run yet")
                lines.append(f"| {lr:g} | {labels[arm]} | {state[arm]:.2f} | 0 | - | - | - | {why} | - |")
                continue
            finals = [r["curve"][-1][1] for r in rs]
            mean = sum(finals) / len(finals)
            spread = (max(finals) - min(finals)) / 2
            paired = [(r["curve"][-1][1], ref[r["seed"]]) for r in rs if r["seed"] in ref]
            per_seed = ", ".join(f"{100 * (x - y) / y:+.2f}%" for x, y in paired) or "-"
            if paired:
                gap = 100 * sum(x - y for x, y in paired) / sum(y for _, y in paired)
                gaps[arm, lr] = gap
                gap_text = f"{gap:+.2f}%"
            else:
                gap_text = "-"
            seconds = sum(r["seconds"] for r in rs) / len(rs)
            wall = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
            lines.append(
                f"| {lr:g} | {labels[arm]} | {state[arm]:.2f} | {len(rs)} | {mean:.4f} | {spread:.4f} | {gap_text} |"
                f" {per_seed} | {wall} |"
            )
    expected = len([1 for _ in seeds for _ in lrs for arm in arms if arm not in skipped])
    finished = sum(1 for r in runs.values() if r["seed"] in seeds and r["arm"] in arms and r["lr"] in lrs)
    lines += ["", f"Runs finished: {finished} of {expected}."]
    lines += [f"- {labels[arm]}: {why}" for arm, why in skipped.items()]
    lines += [f"- {run_key(r['arm'], r['seed'])}: {r['source']}" for r in runs.values() if r.get("source")]
    lines += ["", f"![validation loss]({stem}.png)"]
    if final:
        write_results(args.out, stem, None, lines, command, also=("png",))
    else:
        (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
