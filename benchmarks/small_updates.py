"""Small updates: where each rounding keeps its promise, and what a single weight pays for it.

The sweep of tests/test_small_updates.py at larger sizes: update / weight ratios 1e-4 ... 1e-7 (fine-tuning: lr 1e-5 x
weight decay 0.01 is 1e-7 a step), bf16 weights of magnitudes 1e-3 ... 1e2, weight decay alone or a constant gradient
alone, N steps of pure-bf16 AdamW against float64 arithmetic. For each (ratio, magnitude) group it reports the mean
error over the group (bias: must stay within the noise) and the RMS error of one weight (noise: what a single weight
carries), both as a percentage of the drift the updates should have produced.

    python benchmarks/small_updates.py            # 65,536 weights per group, 3,000 steps
    python benchmarks/small_updates.py --quick    # 4,096 weights per group, 1,000 steps
Writes benchmarks/results/small_updates{,_quick}.{csv,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _results import write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.reference.small_updates import MAGNITUDES, RATIOS, drift_sweep  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ROUNDINGS = ("nearest", "stochastic", "kahan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4,096 weights per group, 1,000 steps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    elements, steps = (4096, 1000) if args.quick else (65536, 3000)

    rows = []
    for mode in ("decay", "gradient"):
        for rounding in ROUNDINGS:
            start = time.perf_counter()
            for ratio, magnitude, error, tolerance, rms in drift_sweep(mode, rounding, elements=elements, steps=steps):
                rows.append(
                    {
                        "mode": mode,
                        "rounding": rounding,
                        "ratio": ratio,
                        "magnitude": magnitude,
                        "mean_error_pct": round(100 * error, 3),
                        "tolerance_pct": round(100 * tolerance, 3),
                        "rms_error_pct": round(100 * rms, 2),
                    }
                )
            print(f"{mode:8s} {rounding:10s} {time.perf_counter() - start:.0f} s", file=sys.stderr)

    command = "python benchmarks/small_updates.py" + (" --quick" if args.quick else "")
    lines = [
        f"# Small updates: {elements:,} bf16 weights per group, {steps:,} steps",
        "",
        f"Command: `{command}`. Pure-bf16 AdamW (fused CPU loop; all backends give the same bits) against float64."
        " `mean error`: mean over the group of (final weight - float64 reference), in % of the drift (> 0: moved too"
        " little); must stay within `tolerance` (4 standard deviations of the rounding's own noise; with a gradient,"
        " plus 0.2% for the bf16 moments). For Kahan it is the error of weight + compensation. `RMS error`: one"
        " weight's error (the weight the model uses), in % of the drift.",
        "",
    ]
    for mode, title in (("decay", "Weight decay alone"), ("gradient", "A constant gradient alone")):
        lines += [
            f"## {title}",
            "",
            "| ratio | \\|w\\| | nearest: mean error | SR: mean error | SR: RMS error | Kahan: mean error |"
            " Kahan: RMS error | tolerance (SR) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for ratio in RATIOS:
            for magnitude in MAGNITUDES:
                by = {
                    r["rounding"]: r
                    for r in rows
                    if r["mode"] == mode and r["ratio"] == ratio and r["magnitude"] == magnitude
                }
                lines.append(
                    f"| {ratio:g} | {magnitude:g} | {by['nearest']['mean_error_pct']:+.2f}% |"
                    f" {by['stochastic']['mean_error_pct']:+.3f}% | {by['stochastic']['rms_error_pct']:.1f}% |"
                    f" {by['kahan']['mean_error_pct']:+.3f}% | {by['kahan']['rms_error_pct']:.1f}% |"
                    f" {by['stochastic']['tolerance_pct']:.3f}% |"
                )
        lines.append("")
    write_results(args.out, "small_updates_quick" if args.quick else "small_updates", rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
