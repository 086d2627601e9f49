"""Where a run's memory peaks: construction (``fabric.setup``, DeepSpeed's engine and ZeRO-3 optimizer) against each
step, per rank, with the code that was running at each phase's peak.

``largest_model.py`` says how large a model fits; this says what sets that limit. One arm of ``_arms.py`` (this
package's Fabric strategy) runs a GPT on 2 CPU ranks; a thread samples the memory each rank holds (RssAnon +
RssShmem every 0.5 ms, as ``largest_model.py`` counts it) and, at every new high, the main thread's Python stack.
Each phase's peak is reported in GiB and as a multiple of the largest layer's bf16 size (one weight of the MLP,
``4 x width x width`` elements), the unit the working set of a layer-by-layer backward is counted in, above the
memory the rank held once the model was built (its partition of the weights and the process).

    python benchmarks/phase_peaks.py                                  # states in files + release, width 4096
    python benchmarks/phase_peaks.py --arm pure_bf16_int8_release --width 2048
    python benchmarks/phase_peaks.py --quick                          # width 512, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _arms import (  # noqa: E402
    HELD,
    OURS,
    ROOT,
    Spec,
    _batches,
    _gpt,
    _status_bytes,
    ours_fabric,
    ranks_environment,
    start_ranks,
)
from _results import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Frames of these libraries say nothing about which step of the set-up or the step is running.
_NOISE = ("site-packages/torch/", "typing_extensions", "nvtx.py", "deepspeed/comm/", "threading.py")


def _where(stack: list[str]) -> str:
    """The innermost frames of a stack outside torch's and the communication layers', as ``file:line function``."""
    frames = [f.strip().splitlines()[0] for f in stack if not any(n in f for n in _NOISE)]
    short = [
        f.replace('File "', "").replace('", line ', ":").replace(", in ", " ").split("site-packages/")[-1]
        for f in frames
    ]
    return " < ".join(reversed([f.replace(f"{ROOT}/", "") for f in short[-3:]]))


def worker(arm: str, spec: Spec, out: Path) -> None:
    """One rank: build, set up and step, marking each phase; write the samples' phase peaks and their stacks."""
    import torch

    torch.set_num_threads(1)
    main, marks, highs = threading.get_ident(), [], []
    stop = threading.Event()

    best = [0]  # the phase's high so far; a mark starts the next phase's

    def sample() -> None:
        while not stop.is_set():
            held = _status_bytes("self", *HELD)
            if held > best[0]:
                best[0] = held
                frame = sys._current_frames().get(main)
                highs.append((time.perf_counter(), held, traceback.format_stack(frame) if frame else []))
            time.sleep(0.0005)

    def mark(name: str) -> None:
        marks.append((time.perf_counter(), name, _status_bytes("self", *HELD)))
        best[0] = 0

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    fabric = ours_fabric(arm, spec, out / f"states{os.environ['RANK']}")
    with fabric.init_module():
        model = _gpt(spec)
    mark("built")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1))
    mark("construction")
    for i, (x, y) in enumerate(_batches(spec, fabric.device)):
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mark(f"step {i + 1}")
    stop.set()
    thread.join()
    phases = []
    for (begin, _, held), (end, name, _) in zip(marks, marks[1:]):  # each phase ends at its own mark
        inside = [h for h in highs if begin <= h[0] <= end]
        peak = max(inside, key=lambda h: h[1]) if inside else (end, held, [])
        phases.append({"phase": name, "peak": peak[1], "where": _where(peak[2])})
    result = {"built": marks[0][2], "phases": phases}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=sorted(OURS), default="pure_bf16_mmap_release")
    parser.add_argument("--width", type=int, default=None, help="n_embd, a multiple of 64 (default 4096)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="width 512: seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    width = args.width or (512 if args.quick else 4096)
    if width <= 0 or width % 64:
        parser.error(f"--width must be a positive multiple of 64 (64-wide heads), got {width}")
    spec = Spec(n_layer=args.n_layer, n_embd=width, n_head=width // 64)
    unit = 4 * width * width * 2
    with tempfile.TemporaryDirectory(prefix="phase_peaks_") as tmp:
        procs: list = []
        cmd = [sys.executable, __file__, "--worker", args.arm, json.dumps(asdict(spec)), tmp]
        start_ranks(cmd, ranks_environment(spec), [Path(tmp) / f"log{r}.txt" for r in range(spec.world_size)], procs)
        for p, log in procs:
            p.wait()
            log.close()
        if any(p.returncode for p, _ in procs):
            print((Path(tmp) / "log0.txt").read_text()[-3000:], file=sys.stderr)
            return 1
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(spec.world_size)]
    rows = [
        {
            "rank": r,
            "phase": ph["phase"],
            "peak_gib": round(ph["peak"] / 2**30, 3),
            "over_built_layers": round((ph["peak"] - rank["built"]) / unit, 2),
            "where": ph["where"],
        }
        for r, rank in enumerate(ranks)
        for ph in rank["phases"]
    ]
    command = "python benchmarks/phase_peaks.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        f"# Where the memory peaks: construction against the steps ({args.arm}, cpu, 2 ranks)",
        "",
        f"Command: `{command.strip()}`. GPT of `examples/gpt.py`, {spec.n_layer} layers, width {width}"
        f" ({spec.params() / 1e6:,.1f}M parameters), batch 2 x 64 tokens. Per rank and phase: the peak of the memory"
        " the process holds (RssAnon + RssShmem, sampled every 0.5 ms), its rise over the memory held once the model"
        f" was built, in units of the largest layer's bf16 size ({unit / 2**20:,.0f} MiB), and the code running at the"
        " peak (innermost frames outside torch and the communication layer).",
        "",
        "| rank | phase | peak GiB | above the built model, layers | running at the peak |",
        "|---:|---|---:|---:|---|",
        *(
            f"| {r['rank']} | {r['phase']} | {r['peak_gib']:.2f} | {r['over_built_layers']:.2f} | `{r['where']}` |"
            for r in rows
        ),
    ]
    stem = f"phase_peaks_{args.arm}_{width}"
    write_results(args.out, stem, rows, md, command.strip())
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Spec(**json.loads(sys.argv[3])), Path(sys.argv[4]))
    else:
        sys.exit(main())
