"""How often a finished fit fails to exit 0: many short 2-process fits, each a fresh LightningCLI run of the test MLP
(`tests/scripts/cli_mlp.py`, which does not tear anything down itself, as a user's script would not), while other
processes keep every core busy. A run counts as an abort when a rank exits non-zero or prints "terminate called"
after its results were written.

    python benchmarks/exit_stress.py                 # 40 fits beside 2 busy processes
    python benchmarks/exit_stress.py --quick         # 6 fits
    python benchmarks/exit_stress.py --runs 60 --load 4
    python benchmarks/exit_stress.py --script hf --runs 10     # examples/hf_trainer.py (PureBF16Trainer) instead
    python benchmarks/exit_stress.py --script hf --root TREE   # the package and examples of another checkout

Writes benchmarks/results/exit_stress.csv (one row per fit) and exit_stress.md (the counts), as it goes.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "cli_mlp.py"


def _busy() -> None:
    while True:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_hf_run(root: Path) -> tuple[int, bool, float, str]:
    """``examples/hf_trainer.py`` of ``root`` (its package first on the path) for 2 steps on 2 CPU processes."""
    with tempfile.TemporaryDirectory() as out:
        args = ["--max-steps", "2", "--n-layer", "1", "--n-embd", "32", "--batch-size", "2", "--ckpt-dir", out]
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
        start = time.perf_counter()
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        proc = subprocess.run(
            [*launcher, "hf_trainer.py", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=root / "examples",
        )
        seconds = time.perf_counter() - start
    terminate = "terminate called" in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    status = proc.returncode if "validation loss:" in proc.stdout else -999
    return status, terminate, seconds, last


def one_fit(strategy: str) -> tuple[int, bool, float, str]:
    """(exit status, whether "terminate called" was printed, seconds, the last stderr line)."""
    with tempfile.TemporaryDirectory() as out:
        args = ["fit", "--trainer.strategy", strategy, "--trainer.accelerator=cpu", "--trainer.devices=2"]
        args += ["--trainer.max_steps=3", "--trainer.logger=false", f"--trainer.default_root_dir={out}"]
        args += ["--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
        args += ["--trainer.enable_model_summary=false", "--trainer.limit_val_batches=1"]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONWARNINGS": "ignore"}
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), out, *args], capture_output=True, text=True, env=env, timeout=600
        )
        seconds = time.perf_counter() - start
        results_written = all((Path(out) / f"cli_rank{r}.pt").exists() for r in range(2))
    terminate = "terminate called" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    status = proc.returncode if results_written else -999
    return status, terminate, seconds, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the fits (default: 2)")
    parser.add_argument("--strategy", default="deepspeed_pure_bf16")
    parser.add_argument("--quick", action="store_true", help="6 fits")
    parser.add_argument("--script", choices=("cli", "hf"), default="cli", help="hf: examples/hf_trainer.py")
    parser.add_argument("--root", type=Path, default=ROOT, help="--script hf: the checkout to run (default: this)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--label", default="", help="a name for this run in the markdown (say, the commit)")
    args = parser.parse_args()
    runs = 6 if args.quick else args.runs
    args.out.mkdir(parents=True, exist_ok=True)
    busy = [mp.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in busy:
        p.start()
    rows = []
    try:
        with open(args.out / "exit_stress.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["run", "exit_status", "terminate_called", "seconds", "last_stderr_line"])
            for i in range(runs):
                if args.script == "hf":
                    status, terminate, seconds, last = one_hf_run(args.root.resolve())
                else:
                    status, terminate, seconds, last = one_fit(args.strategy)
                rows.append((status, terminate))
                writer.writerow([i, status, terminate, f"{seconds:.1f}", last[-200:]])
                f.flush()
                print(f"fit {i + 1}/{runs}: exit {status}{', terminate called' if terminate else ''} ({seconds:.0f} s)")
    finally:
        for p in busy:
            p.terminate()
    aborts = sum(1 for status, terminate in rows if status != 0 or terminate)
    failed = sum(1 for status, _ in rows if status != 0)
    command = "python benchmarks/exit_stress.py " + " ".join(sys.argv[1:])
    lines = [
        "# Exit stress: short 2-process "
        + ("runs of examples/hf_trainer.py" if args.script == "hf" else "fits")
        + " beside busy processes",
        "",
        f"`{command}` {args.label}",
        "",
        "| fits | busy processes | exited non-zero | printed `terminate called` or exited non-zero |",
        "|---:|---:|---:|---:|",
        f"| {len(rows)} | {args.load} | {failed} | {aborts} |",
        "",
    ]
    (args.out / "exit_stress.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
