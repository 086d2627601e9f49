"""Memory by phase of a fit with ``Trainer(strategy="deepspeed_pure_bf16...")``: before setup, after setup (states
allocated), between steps, and the peak inside a step, at two or more model sizes, and the peak's growth per
parameter (the slope between sizes, so that fixed costs such as buckets and the CPU loop's build drop out).

Each arm and size is a fresh 2-process fit (gloo, CPU) of a plain module of 8 bias-free d x d linear layers, batch 4,
4 steps. Every rank samples its anonymous resident memory (``RssAnon``: file-backed pages, such as optimizer states
in memory-mapped files, are not counted) from a thread every 0.2 ms; ``MALLOC_MMAP_THRESHOLD_`` is fixed so that
freed large buffers go back to the system and resident memory follows live memory. A step's peak is the largest
sample from the start of its batch to its end (steps 2-4; the first step builds what later steps reuse); the
optimizer step's is from the moment ZeRO-3's step has released the parameters the backward gathered (its first act)
to the batch's end: the gradient norm and the update. Figures are the sum
over both ranks.

    python benchmarks/peak_memory.py              # d = 1024, 2048, 4096 (8.4M, 34M, 134M parameters)
    python benchmarks/peak_memory.py --quick      # d = 512, 1024
    python benchmarks/peak_memory.py --arms stochastic int8 --sizes 1024 2048
    python benchmarks/peak_memory.py --arms stochastic release int8 int8_release --sizes 1024 4096 \
        --name peak_memory_release
    python benchmarks/peak_memory.py --config '{"zero_optimization": {"stage3_max_reuse_distance": 0}}'

``--config`` is merged into every arm's DeepSpeed config (ZeRO-3's caches of gathered parameters, for example).
``--upstream-step`` measures DeepSpeed's own optimizer step instead of this package's (which updates from views of
the gradient partition and takes the gradient norm in pieces), for the comparison.

Writes benchmarks/results/peak_memory{,_quick}.{csv,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ARMS = {
    "stochastic": {},
    "kahan": {"rounding": "kahan"},
    "int8": {"moments": "int8"},
    "mmap": {"state_storage": "mmap"},
    # Gradient release: no gradient partition; each partition updated as its gradient is reduce-scattered.
    "release": {"gradient_release": True},
    "int8_release": {"moments": "int8", "gradient_release": True},
    # Both: the states in files, streamed as each gradient arrives; the bf16 weights alone in memory.
    "mmap_release": {"state_storage": "mmap", "gradient_release": True},
    "int8_mmap_release": {"moments": "int8", "state_storage": "mmap", "gradient_release": True},
    "int8_kahan": {"moments": "int8", "rounding": "kahan", "compensation": "int8"},
    # The default before the gather cache was bounded: DeepSpeed's own cache of gathered layers.
    "stochastic_keep": {"gather_cache": "keep"},
    # The next layer gathered while one computes (FSDP2's pattern).
    "stochastic_next": {"gather_cache": "next"},
    # PyTorch FSDP2 through Lightning's ModelParallelStrategy: fully_shard per layer, bf16 parameters, torch AdamW.
    "fsdp2": None,
    # The same module and sharding under Trainer(strategy="fsdp2_pure_bf16..."): this package's AdamW over FSDP2.
    "fsdp2_pure_bf16": None,
    "fsdp2_pure_bf16_int8": None,
    "fsdp2_pure_bf16_release": None,
    "fsdp2_pure_bf16_int8_release": None,
}
LAYERS, BATCH, STEPS = 8, 4, 4


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class _Sampler(threading.Thread):
    """The largest RssAnon seen since the last :meth:`reset`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self._peak = 0
        self._lock = threading.Lock()  # a reset between the sampler's read and its write is not lost
        self._stop = threading.Event()

    @property
    def peak(self) -> int:
        with self._lock:
            return self._peak

    def reset(self) -> int:
        with self._lock:
            self._peak = _rss_anon()
            return self._peak

    def run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._peak = max(self._peak, _rss_anon())
            time.sleep(0.0002)

    def stop(self) -> None:
        self._stop.set()


def worker(arm: str, d: int, out: Path, config: dict, upstream_step: bool, layers: int) -> None:
    """One fit; every rank writes its phases to ``out/rank{R}.json``."""
    if upstream_step:  # DeepSpeed's own step: the flattened gradient copy and the full-size float64 norm
        from lightning_pure_bf16 import _internals, collectives

        _internals.view_sub_group_gradients = lambda zero_optimizer: None
        collectives.gradient_norm_in_one_pass = lambda zero_optimizer: None
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pure_bf16 import DeepSpeedPureBF16Strategy

    fsdp2 = ARMS[arm] is None
    sampler = _Sampler()
    sampler.start()
    # The optimizer step's window opens when ZeRO-3's step has released the parameters the backward gathered (its
    # first act), so that it measures what the step itself allocates: the norm and the update.
    window = {"armed": False, "step_peak_so_far": 0}
    partition_all = DeepSpeedZeroOptimizer_Stage3._partition_all_parameters

    def partitioned(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = partition_all(self, *args, **kwargs)
        if window["armed"]:
            window["armed"] = False
            window["step_peak_so_far"] = sampler.peak
            sampler.reset()
        return out

    DeepSpeedZeroOptimizer_Stage3._partition_all_parameters = partitioned
    phases: dict[str, float] = {"before_setup": sampler.reset()}
    step_peaks: list[int] = []
    opt_peaks: list[int] = []
    between: list[int] = []

    class Phases(Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            phases["after_setup"] = sampler.reset()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            between.append(sampler.reset())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
            if fsdp2:  # FSDP2 has released the backward's layers already: the window opens here
                window["step_peak_so_far"] = sampler.peak
                sampler.reset()
            else:
                window["armed"] = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            opt_peaks.append(sampler.peak)
            step_peaks.append(max(sampler.peak, window["step_peak_so_far"]))

    class Plain(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)])

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            return self.net(batch[0].to(torch.bfloat16) if fsdp2 else batch[0]).float().pow(2).mean()

        def configure_model(self) -> None:
            if fsdp2:  # bf16 parameters, each layer its own FSDP2 unit, then the root (as torchtitan does)
                from torch.distributed.fsdp import fully_shard

                self.net.to(torch.bfloat16)
                for layer in self.net:
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    seed_everything(0)
    if arm == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif fsdp2:
        strategy = arm  # a registered name of this package's FSDP2 strategy
    else:
        options = dict(ARMS[arm])
        if config:
            options["config"] = config
        if options.get("state_storage") == "mmap":
            options["state_dir"] = str(out / "states")
            (out / "states").mkdir(exist_ok=True)
        strategy = DeepSpeedPureBF16Strategy(**options)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Phases()],
    )
    model = Plain()
    phases["before_setup"] = sampler.reset()  # the fp32 module built, nothing partitioned yet
    data = DataLoader(TensorDataset(torch.randn(BATCH * STEPS * 2, d)), batch_size=BATCH)
    trainer.fit(model, data)
    sampler.stop()
    if fsdp2:
        params = sum(p.numel() for p in model.parameters())
        local = [p.to_local() for p in model.parameters()]
        held = sum(t.numel() * t.element_size() for t in local)  # weights
        held += sum(t.numel() * t.element_size() for t in local)  # their gradients (same format; freed between steps)
        for state in trainer.optimizers[0].state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    v = v.to_local() if hasattr(v, "to_local") else v
                    held += v.numel() * v.element_size()
        model_state = held * trainer.world_size / params
    else:
        params = sum(p.ds_numel for p in model.parameters())
        model_state = trainer.strategy.memory_report()["total"]
    phases.update(
        between_steps=max(between[1:]),
        step_peak=max(step_peaks[1:]),
        optimizer_step_peak=max(opt_peaks[1:]),
        params=params,
        model_state_b_per_param=model_state,
    )
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(phases))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(arm: str, d: int, config: str, upstream_step: bool = False, layers: int = LAYERS) -> dict[str, float]:
    """Both ranks' phases of one fit, summed."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "PYTHONWARNINGS": "ignore",
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", arm, str(d), tmp, "--config", config]
            + (["--upstream-step"] if upstream_step else [])
            + ["--layers", str(layers)],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{arm} d={d} failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    summed = {k: sum(r[k] for r in ranks) for k in ("before_setup", "after_setup", "between_steps", "step_peak")}
    summed["optimizer_step_peak"] = sum(r["optimizer_step_peak"] for r in ranks)
    summed["params"] = ranks[0]["params"]
    summed["model_state_b_per_param"] = ranks[0]["model_state_b_per_param"]
    return summed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d = 512 and 1024")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--sizes", nargs="+", type=int, default=None, help="layer widths d (default 1024 2048 4096)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--label", default="", help="a note for the report (say, the commit)")
    parser.add_argument("--config", default="{}", help="JSON merged into each arm's DeepSpeed config")
    parser.add_argument(
        "--upstream-step",
        action="store_true",
        help="DeepSpeed's own optimizer step (its gradient copy and float64 norm), for the comparison",
    )
    parser.add_argument("--layers", type=int, default=LAYERS, help="linear layers in the module (default 8)")
    parser.add_argument("--name", default=None, help="results file name (default: peak_memory, peak_memory_quick)")
    parser.add_argument("--worker", nargs=3, metavar=("ARM", "D", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(
            args.worker[0],
            int(args.worker[1]),
            Path(args.worker[2]),
            json.loads(args.config),
            args.upstream_step,
            args.layers,
        )
        return 0
    sizes = args.sizes or ([512, 1024] if args.quick else [1024, 2048, 4096])
    rows = []
    for arm in args.arms:
        for d in sizes:
            r = measure(arm, d, args.config, args.upstream_step, args.layers)
            rows.append({"arm": arm, "d": d, **r})
            gib = 1024**3
            print(
                f"{arm:10s} d={d:5d} {r['params'] / 1e6:7.1f}M params: before {r['before_setup'] / gib:.2f} GiB,"
                f" after setup {r['after_setup'] / gib:.2f}, between steps {r['between_steps'] / gib:.2f}, step peak"
                f" {r['step_peak'] / gib:.2f} (optimizer step {r['optimizer_step_peak'] / gib:.2f})",
                file=sys.stderr,
                flush=True,
            )
            # Written as it goes: a long run that stops keeps the fits it finished.
            write_report(rows, args, argv)
    return 0


def write_report(rows: list[dict], args: argparse.Namespace, argv: list[str] | None) -> None:
    command = shlex.join(["python", "benchmarks/peak_memory.py", *(argv or sys.argv[1:])])
    gib = 1024**3
    lines = [
        "# Memory by phase of a fit, 2 CPU ranks (gloo), the sum of both ranks' anonymous resident memory",
        "",
        f"Command: `{command}`. {args.label} Module: {args.layers} bias-free d x d linear layers, batch {BATCH}, "
        f"{STEPS} steps; the step peaks are the largest over steps 2-{STEPS}.",
        "",
        "| arm | d | parameters | model state B/param | before setup GiB | after setup GiB | between steps GiB |"
        " step peak GiB | optimizer step peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['d']} | {r['params'] / 1e6:.1f}M | {r['model_state_b_per_param']:.2f} |"
            f" {r['before_setup'] / gib:.2f} | {r['after_setup'] / gib:.2f} | {r['between_steps'] / gib:.2f} |"
            f" {r['step_peak'] / gib:.2f} | {r['optimizer_step_peak'] / gib:.2f} |"
        )
    lines += [
        "",
        "Growth per parameter between the smallest and the largest size (bytes per parameter of the model, both ranks"
        " together; fixed costs drop out):",
        "",
        "| arm | after setup | between steps | step peak | optimizer step peak | step peak over between steps |"
        " step peak minus FSDP2's |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    slopes = {}
    for arm in sorted(dict.fromkeys(r["arm"] for r in rows), key=lambda a: a != "fsdp2"):
        mine = [r for r in rows if r["arm"] == arm]
        if len(mine) < 2:
            continue
        lo, hi = mine[0], mine[-1]
        dp = hi["params"] - lo["params"]

        def slope(key: str, lo: dict = lo, hi: dict = hi, dp: int = dp) -> float:
            return (hi[key] - lo[key]) / dp

        row = slopes[arm] = {k: slope(k) for k in ("after_setup", "between_steps", "step_peak", "optimizer_step_peak")}
        versus = f"{row['step_peak'] - slopes['fsdp2']['step_peak']:+.2f}" if "fsdp2" in slopes else "-"
        lines.append(
            f"| {arm} | {row['after_setup']:.2f} | {row['between_steps']:.2f} | **{row['step_peak']:.2f}** |"
            f" {row['optimizer_step_peak']:.2f} | {row['step_peak'] - row['between_steps']:.2f} | {versus} |"
        )
    sys.path.insert(0, str(Path(__file__).parent))
    from _results import write_results

    name = args.name or ("peak_memory_quick" if args.quick else "peak_memory")
    write_results(args.out, name, rows, lines, command)


if __name__ == "__main__":
    raise SystemExit(main())
