"""Where the time of ZeRO-3's optimizer step goes with this package's AdamW, beside the update alone.

One rank (gloo on the CPU), a stack of square linear layers trained through ``lightning_pure_bf16.deepspeed``; each
part of ``engine.step()`` is timed by wrapping the engine's ZeRO-3 optimizer methods on this instance (host time,
medians over the measured steps): the gradient norm (for clipping and the inf/NaN decision), the update itself, the
re-partitioning of the parameters; beside them the last gradient reduction (which ZeRO-3 runs at the end of the
backward, not in the step) and the same optimizer stepping as many elements outside ZeRO-3.

    python benchmarks/zero3_step.py            # 24 layers of 640 x 640 (9.8M parameters), 10 steps
    python benchmarks/zero3_step.py --quick    # 4 layers of 256 x 256, 4 steps
    python benchmarks/zero3_step.py --layers 4 --width 4096 --out benchmarks/results/zero3_step_wide  # 67M
    python benchmarks/zero3_step.py --clip 1e-6     # with the gradient clipped (ZeRO-3's gradient_clipping)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# The parts of ZeRO-3's step, by the optimizer method that does each (deepspeed/runtime/zero/stage3.py).
PARTS = {
    "_get_norm_groups": "gradient norm",
    "_optimizer_step": "the update (this package's AdamW)",
    "_partition_all_parameters": "re-partitioning the parameters",
    "_post_step": "after the step",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers of 256 x 256, 4 steps")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--steps", type=int, default=10, help="measured steps, after 3 warm-up steps")
    parser.add_argument(
        "--clip", type=float, default=0.0, help="clip the gradient's 2-norm to this (default 0: no clipping)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.steps = 4, 256, 4
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import deepspeed
    import torch
    from _results import write_results

    import lightning_pure_bf16.deepspeed as pure_bf16
    from lightning_pure_bf16 import AdamW

    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    if args.clip < 0:
        parser.error(f"--clip {args.clip}: a norm to clip to is >= 0 (0: no clipping)")
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}, "gradient_clipping": args.clip}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = pure_bf16.initialize(model=model, optimizer=optimizer, config=config)
    times: dict[str, list[float]] = defaultdict(list)
    zero = engine.optimizer

    def timed(name: str) -> None:
        original = getattr(zero, name)

        def run(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                times[name].append(time.perf_counter() - start)

        setattr(zero, name, run)

    epilogue = "independent_gradient_partition_epilogue"
    for name in (*PARTS, "step", epilogue):
        timed(name)
    x = torch.randn(8, args.width, dtype=torch.bfloat16)
    for i in range(3 + args.steps):
        if i == 3:
            times.clear()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    elements = sum(p.ds_numel for p in model.parameters())
    alone = [torch.zeros(elements, dtype=torch.bfloat16, requires_grad=True)]
    alone[0].grad = torch.randn(elements).to(torch.bfloat16)
    standalone = AdamW(alone, lr=1e-3)
    for _ in range(2):
        standalone.step()
    samples = []
    for _ in range(args.steps):
        start = time.perf_counter()
        standalone.step()
        samples.append(time.perf_counter() - start)

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3 if values else 0.0

    step = ms(times["step"])
    rows = [{"part": label, "ms": round(ms(times[name]), 2)} for name, label in PARTS.items()]
    rows.append({"part": "the rest of ZeRO-3's step", "ms": round(step - sum(r["ms"] for r in rows), 2)})
    rows.append({"part": "ZeRO-3's step, in all", "ms": round(step, 2)})
    rows.append({"part": "the last gradient reduction (in the backward)", "ms": round(ms(times[epilogue]), 2)})
    rows.append({"part": "the same AdamW on as many elements, outside ZeRO-3", "ms": round(ms(samples), 2)})
    command = "python benchmarks/zero3_step.py" + (
        " --quick"
        if args.quick
        else "".join(
            f" --{name} {value}"
            for name, value, default in (
                ("layers", args.layers, 24),
                ("width", args.width, 640),
                ("steps", args.steps, 10),
                ("clip", args.clip, 0.0),
            )
            if value != default
        )
    )
    lines = [
        f"# ZeRO-3's optimizer step with this package's AdamW: {elements:,} parameters, 1 CPU rank",
        "",
        f"Command: `{command}`. {args.layers} linear layers of {args.width} x {args.width}, batch 8; medians over"
        f" {args.steps} steps after 3 warm-up steps, host time of each part of `engine.step()`"
        + (f"; the gradient clipped to norm {args.clip:g}." if args.clip else "; no clipping."),
        "",
        "| part | ms per step |",
        "|---|---:|",
        *(f"| {r['part']} | {r['ms']:.2f} |" for r in rows),
    ]
    write_results(args.out, "zero3_step_quick" if args.quick else "zero3_step", rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
