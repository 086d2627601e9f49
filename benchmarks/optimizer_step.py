"""Optimizer step time and effective bandwidth: pure-bf16 AdamW against torch.optim.AdamW on the same bf16 buffers;
pure-bf16 Lion and SGD with momentum (one state: 10 bytes/param) against torch.optim.SGD.

Effective bandwidth counts the bytes a step must move: read p, g, m, v and write p, m, v at 2 bytes each (14 B/param),
plus a read and a write of the Kahan buffer (18 B/param). A copy of as many bytes gives the bandwidth ceiling (device to
device on CUDA, memory to memory with all threads on the CPU).

    python benchmarks/optimizer_step.py            # full run
    python benchmarks/optimizer_step.py --quick    # smaller buffers, fewer repeats
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/optimizer_step.py --no-torch-path --out benchmarks/results/avx2
                                                   # as on a CPU without AVX-512 (torch and this loop alike)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _results import write_results

from lightning_pure_bf16 import SGD, AdamW, Lion

RESULTS = Path(__file__).parent / "results"
# One transformer block at d_model=2048 (attention qkv + out, 4x MLP, two norms): typical per-tensor shapes.
LAYER_SHAPES = [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192), (2048,), (2048,)]
# Bytes moved per parameter and step: read and write p, m, v (and the Kahan buffer), read g; 8-bit states move one
# byte per moment (and remainder) each way, plus their scales (1/64 of a byte).
BYTES_PER_PARAM = {
    "stochastic": 14,
    "nearest": 14,
    "kahan": 18,
    "torch": 14,
    "int8": 10,
    "int8_kahan": 12,
    "one_state": 10,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return 1e3 * times[len(times) // 2]


def _make_params(shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.Tensor]:
    params = []
    for s in shapes:
        p = (torch.randn(s, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
        p.grad = (torch.randn(s, device=device) * 1e-3).to(torch.bfloat16)
        params.append(p)
    return params


def _unchecked(opt: AdamW) -> AdamW:
    opt.check_nonfinite = False
    return opt


def _scaled(opt: AdamW) -> AdamW:
    # Every timed step given a clip factor, as ZeRO-3's clipping hands it over (the step's argument).
    opt.timed_step = functools.partial(opt.step, grad_scale=0.5)
    return opt


def _candidates(
    device: torch.device, torch_path: bool = True
) -> list[tuple[str, str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]]:
    cands: list[tuple[str, str, Callable]] = []
    backends = ["triton" if device.type == "cuda" else "cpu", *(["torch"] if torch_path else [])]
    for backend in backends:
        for rounding in ("stochastic", "kahan", "nearest"):
            cands.append(
                (
                    f"pure_bf16 {rounding} ({backend})",
                    rounding,
                    lambda ps, r=rounding, b=backend: AdamW(ps, lr=1e-4, rounding=r, backend=b, seed=0),
                )
            )
        if backend != "torch":
            # The step as the ZeRO-3 strategies run it: ZeRO-3 decides about inf/NaN gradients from its all-reduced
            # gradient norm, so the optimizer does not read the gradients once more to check them.
            for rounding in ("stochastic", "kahan"):
                cands.append(
                    (
                        f"pure_bf16 {rounding}, no inf/NaN check ({backend})",
                        rounding,
                        lambda ps, r=rounding, b=backend: _unchecked(AdamW(ps, lr=1e-4, rounding=r, backend=b, seed=0)),
                    )
                )
            # ZeRO-3's clip factor folded into the update (step(grad_scale=...)): one more product per element.
            cands.append(
                (
                    f"pure_bf16 stochastic, no inf/NaN check, a clip factor ({backend})",
                    "stochastic",
                    lambda ps, b=backend: _scaled(_unchecked(AdamW(ps, lr=1e-4, backend=b, seed=0))),
                )
            )
        cands.append(
            (
                f"pure_bf16 int8 moments ({backend})",
                "int8",
                lambda ps, b=backend: AdamW(ps, lr=1e-4, moments="int8", backend=b, seed=0),
            )
        )
        cands.append(
            (
                f"pure_bf16 int8 moments + int8 Kahan ({backend})",
                "int8_kahan",
                lambda ps, b=backend: AdamW(
                    ps, lr=1e-4, rounding="kahan", moments="int8", compensation="int8", backend=b, seed=0
                ),
            )
        )
        if backend != "torch":
            # The algorithms with one state per element, as the ZeRO-3 strategies run them.
            cands.append(
                (
                    f"pure_bf16 Lion stochastic, no inf/NaN check ({backend})",
                    "one_state",
                    lambda ps, b=backend: _unchecked(Lion(ps, lr=1e-5, weight_decay=0.1, backend=b, seed=0)),
                )
            )
            cands.append(
                (
                    f"pure_bf16 SGD momentum stochastic, no inf/NaN check ({backend})",
                    "one_state",
                    lambda ps, b=backend: _unchecked(SGD(ps, lr=1e-4, momentum=0.9, nesterov=True, backend=b, seed=0)),
                )
            )
    cands.append(
        (
            "torch.optim.SGD momentum foreach",
            "one_state",
            lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, foreach=True),
        )
    )
    cands.append(("torch.optim.AdamW foreach", "torch", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)))
    cands.append(("torch.optim.AdamW fused", "torch", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)))
    return cands


def _copy_gbps(n_elements: int, device: torch.device, warmup: int, repeats: int) -> float:
    src = torch.empty(n_elements * 7, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2**20-element buffer, one layer at 1/4 size, 3 repeats")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: benchmarks/results[/gpu])")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="times each fast optimizer is measured, the best round kept (default: 3, 1 with --quick); torch's fused"
        " AdamW varies by up to 1.5x between minutes on a shared machine",
    )
    parser.add_argument("--no-torch-path", action="store_true", help="leave out the slow chunked PyTorch path")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, run nothing")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = args.out or (RESULTS / "gpu" if device.type == "cuda" else RESULTS)
    out.mkdir(parents=True, exist_ok=True)

    if args.quick:
        cases = {
            "flat 2^20": [(1 << 20,)],
            "layer d=512": [(s[0] // 4, s[1] // 4) if len(s) == 2 else (s[0] // 4,) for s in LAYER_SHAPES],
        }
        warmup, repeats = 1, 3
    else:
        cases = {"flat 2^24": [(1 << 24,)], "layer d=2048": LAYER_SHAPES}
        if device.type == "cuda":
            cases["flat 2^27"] = [(1 << 27,)]  # 1.9 GB moved per step: well past the L2 cache
        warmup, repeats = 2, 7 if device.type == "cpu" else 50
    if args.dry_run:
        print(f"dry run: {list(cases)} on {device}, {warmup} warm-up and {repeats} timed steps")
        return 0

    rounds = args.rounds or (1 if args.quick else 3)
    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})"
    )
    rows = []
    for case, shapes in cases.items():
        n = sum(torch.Size(s).numel() for s in shapes)
        # The bandwidth ceiling: one copy of the step's 7 bf16 buffers' worth of bytes (on the CPU, torch's own
        # multi-threaded copy, memory to memory).
        copy_gbps = _copy_gbps(n, device, warmup, repeats)
        if copy_gbps is not None:
            rows.append(
                {
                    "case": case,
                    "optimizer": "device-to-device copy" if device.type == "cuda" else "memory copy (all threads)",
                    "ms": "",
                    "gbps": f"{copy_gbps:.1f}",
                    "vs_copy": "1.00",
                    "vs_torch_foreach": "",
                    "vs_torch_fused": "",
                }
            )
        best: dict[str, float] = {}
        kinds: dict[str, str] = {}
        candidates = _candidates(device, torch_path=not args.no_torch_path)
        for round_ in range(rounds):
            for name, kind, make in candidates:
                if round_ and "(torch)" in name:
                    continue  # the chunked PyTorch path is measured once: it is 10-50x slower
                params = _make_params(shapes, device)
                try:
                    opt = make(params)
                    ms = _time_ms(getattr(opt, "timed_step", opt.step), device, warmup, repeats)
                except (RuntimeError, ValueError) as err:  # fused AdamW is not built for every device/dtype
                    print(f"{case}: {name}: skipped ({str(err).splitlines()[0]})", file=sys.stderr)
                    continue
                best[name] = min(ms, best.get(name, ms))
                kinds[name] = kind
                del opt, params
        foreach_ms = best["torch.optim.AdamW foreach"]
        fused_ms = best.get("torch.optim.AdamW fused")
        for name, ms in best.items():
            gbps = BYTES_PER_PARAM[kinds[name]] * n / (ms * 1e-3) / 1e9
            rows.append(
                {
                    "case": case,
                    "optimizer": name,
                    "ms": f"{ms:.2f}",
                    "gbps": f"{gbps:.1f}",
                    "vs_copy": f"{gbps / copy_gbps:.2f}" if copy_gbps else "",
                    "vs_torch_foreach": f"{foreach_ms / ms:.2f}",
                    "vs_torch_fused": f"{fused_ms / ms:.2f}" if fused_ms else "",
                }
            )

    stem = "optimizer_step_quick" if args.quick else "optimizer_step"
    command = " ".join(["python benchmarks/optimizer_step.py", *(argv if argv is not None else sys.argv[1:])])
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and device.type == "cpu":
        command = f"ATEN_CPU_CAPABILITY={capability} {command}"
    lines = [
        f"# Optimizer step: {device_name}, torch {torch.__version__}",
        "",
        f"Command: `{command}`. Median of {repeats} steps after {warmup} warm-up, the best of {rounds} round(s) for"
        " all but the chunked PyTorch path. GB/s counts 14 bytes/param moved (18 with Kahan, 10 with 8-bit moments,"
        " 12 with 8-bit moments and remainder). `speed vs ...` is that optimizer's time divided by this time (>1 is"
        " faster; for Lion and SGD, against torch's AdamW too: compare them with `torch.optim.SGD momentum foreach`,"
        " which moves the same 10 bytes/param). Our steps read the gradients once more before the update to check"
        " them for inf/NaN (a skipped step changes nothing), except the rows `no inf/NaN check`: the step as the"
        " ZeRO-3 strategies run it, where ZeRO-3 decides from its gradient norm. torch's fused AdamW has no such"
        " check.",
        "",
        "| case | optimizer | ms/step | GB/s | fraction of copy | speed vs foreach | speed vs fused |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['optimizer']} | {r['ms']} | {r['gbps']} | {r['vs_copy']} | {r['vs_torch_foreach']}"
            f" | {r['vs_torch_fused']} |"
        )
    write_results(out, stem, rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
