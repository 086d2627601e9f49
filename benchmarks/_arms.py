"""The training arms the scale benchmarks compare, each a few steps of the same GPT on the same data in fresh processes.

Arms (the ``ARMS`` keys):

- ``ds_bf16_mixed``: DeepSpeed ZeRO-3 with bf16 mixed precision (fp32 master weights and moments, torch AdamW), what
  Lightning's ``DeepSpeedStrategy(stage=3)`` with ``precision="bf16-mixed"`` runs;
- ``ds_bf16_flags``: the same with DeepSpeed's own ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``;
- ``pure_bf16``, ``pure_bf16_kahan``, ``pure_bf16_int8``, ``pure_bf16_int8_kahan``, ``pure_bf16_mmap``,
  ``pure_bf16_release``, ``pure_bf16_int8_release``: this package's Fabric strategy with its defaults (the gathers as
  ``gather_cache="auto"``) and stochastic rounding, Kahan,
  8-bit moments, 8-bit moments with an 8-bit Kahan remainder, optimizer states in memory-mapped files, gradient
  release with bf16 or 8-bit moments);
- ``pure_bf16_keep``, ``pure_bf16_next``, ``pure_bf16_layer``: stochastic rounding with ``gather_cache="keep"``
  (ZeRO-3 keeps the layers it gathers for the forward until their backward), with ``gather_cache="next"`` (the next
  layer gathered while one computes, always) and with ``gather_cache="layer"`` (one layer gathered at a time, no
  gather overlapped: the tightest budgets' option);
- ``fsdp2_bf16``: PyTorch FSDP2 (``fully_shard``, what Lightning's ``ModelParallelStrategy`` wraps) with bf16
  parameters and torch AdamW (bf16 states, round to nearest);
- ``fsdp2_torchao_sr``: the same with torchao's ``_AdamW(bf16_stochastic_round=True)``;
- ``fsdp2_pure_bf16``, ``fsdp2_pure_bf16_int8``: the same with this package's ``AdamW`` over the sharded parameters
  (stochastic rounding; 8-bit moments);
- ``ds_muon``: DeepSpeed ZeRO-3 bf16 mixed with its own Muon (``"optimizer": {"type": "Muon"}``,
  ``MuonWithAuxAdam``: fp32 masters, the momentum and Adam moments as DeepSpeed keeps them);
- ``pure_bf16_muon``: this package's Fabric strategy with its ``Muon`` (stochastic rounding, AdamW for the rest). Both
  Muon arms put the same parameters in Muon, by DeepSpeed's rule: every parameter of two or more dimensions whose name
  holds neither ``embed`` nor ``lm_head`` (in this GPT the two position and token embeddings ``wpe``/``wte`` too).

With ``Spec.probe_step``, the optimizer step of the last step is measured on each rank (:class:`StepProbe`): the
bytes of the tensors it allocates that are alive at once at its peak (above what was allocated before it: the model
state, the gradient partition), and the bytes of the tensors it hands to each ``torch.distributed`` collective.

DeepSpeed's own arms run through ``deepspeed.initialize`` with this package's CPU setup for DeepSpeed (its CPU
accelerator and communication buckets), so that they run on a CPU as this package's arms do. Every arm builds the
model already partitioned (``deepspeed.zero.Init``, ``fabric.init_module``, or on the meta device for FSDP2), runs
the same loop (forward, backward, optimizer step) on the same token batches, and reports per rank: steps finished,
the time of forward+backward and of the optimizer step (after the warm-up steps), and the peak memory: the resident
memory the process holds (anonymous and shared pages, sampled every millisecond; the page cache of files, such as the
state files of ``state_storage="mmap"``, is left out: the kernel drops it under pressure) on the CPU,
``torch.cuda.max_memory_allocated`` on CUDA.

:func:`launch` starts one process per rank and, on the CPU, stops an arm whose summed resident memory passes the
budget (so that a search never takes the machine down).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "ds_bf16_mixed": "DeepSpeed ZeRO-3 bf16 mixed (fp32 masters and moments, torch AdamW)",
    "ds_bf16_flags": "DeepSpeed ZeRO-3, bf16_master_weights_and_grads + bf16_optimizer_states",
    "pure_bf16": "this strategy's default (stochastic rounding, gather_cache='auto')",
    "pure_bf16_kahan": "this strategy, Kahan",
    "pure_bf16_int8": "this strategy, 8-bit moments",
    "pure_bf16_int8_kahan": "this strategy, 8-bit moments + 8-bit Kahan",
    "pure_bf16_mmap": "this strategy, states in memory-mapped files",
    "pure_bf16_release": "this strategy, gradient release",
    "pure_bf16_int8_release": "this strategy, 8-bit moments, gradient release",
    "pure_bf16_mmap_release": "this strategy, states in memory-mapped files, gradient release",
    "pure_bf16_int8_mmap_release": "this strategy, 8-bit moments in memory-mapped files, gradient release",
    "pure_bf16_keep": "this strategy, stochastic rounding, gather_cache='keep' (DeepSpeed's cache of gathered layers)",
    "pure_bf16_next": "this strategy, stochastic rounding, gather_cache='next' (the next layer gathered ahead)",
    "pure_bf16_layer": "this strategy, stochastic rounding, gather_cache='layer' (one layer gathered at a time)",
    "fsdp2_bf16": "FSDP2 bf16 parameters, torch AdamW (bf16 states, nearest)",
    "fsdp2_torchao_sr": "FSDP2 bf16 parameters, torchao _AdamW(bf16_stochastic_round=True)",
    "fsdp2_pure_bf16": "FSDP2 bf16 parameters, this package's AdamW (stochastic rounding)",
    "fsdp2_pure_bf16_int8": "FSDP2 bf16 parameters, this package's AdamW, 8-bit moments",
    "ds_muon": "DeepSpeed ZeRO-3 bf16 mixed, its own Muon (fp32 masters)",
    "pure_bf16_muon": "this strategy, Muon (stochastic rounding; AdamW on the rest)",
}
OURS = {
    "pure_bf16": {},
    "pure_bf16_kahan": {"rounding": "kahan"},
    "pure_bf16_int8": {"moments": "int8"},
    "pure_bf16_int8_kahan": {"rounding": "kahan", "moments": "int8", "compensation": "int8"},
    "pure_bf16_mmap": {"state_storage": "mmap"},
    "pure_bf16_release": {"gradient_release": True},
    "pure_bf16_int8_release": {"moments": "int8", "gradient_release": True},
    "pure_bf16_mmap_release": {"state_storage": "mmap", "gradient_release": True},
    "pure_bf16_int8_mmap_release": {"moments": "int8", "state_storage": "mmap", "gradient_release": True},
    "pure_bf16_keep": {"gather_cache": "keep"},
    "pure_bf16_next": {"gather_cache": "next"},
    "pure_bf16_layer": {"gather_cache": "layer"},
    "pure_bf16_muon": {},
}
REFERENCE = "ds_bf16_mixed"
# Arms of optional peers: the package each needs and how to install it (a missing one is skipped with that line).
NEEDS = {"fsdp2_torchao_sr": ("torchao", "pip install torchao")}


def missing_peer(arm: str) -> str | None:
    """Why ``arm`` cannot run here (its optional peer is not installed), or ``None``."""
    import importlib.util

    if arm not in NEEDS:
        return None
    package, install = NEEDS[arm]
    return None if importlib.util.find_spec(package) else f"skipped: needs {package} (`{install}`)"


@dataclass
class Spec:
    """One model and run: the GPT of ``examples/gpt.py`` (byte vocabulary) and the loop's sizes."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int = 64
    batch_size: int = 2
    steps: int = 3
    warmup: int = 1
    lr: float = 1e-4
    device: str = "cpu"
    world_size: int = 2
    # How every arm computes matrix products on a CPU: "auto" as each ships (this package: float32 where the CPU has
    # no native bf16 dot products; DeepSpeed and FSDP2: bf16), "float32" every arm from the bf16 values in float32
    # (this package's Float32Matmul around the others' forward, whose backward follows), "bf16" every arm in bf16.
    cpu_matmul: str = "auto"
    # Measure the last step's optimizer step (StepProbe): its allocations' peak and the bytes of its collectives.
    probe_step: bool = False

    @property
    def float32_products(self) -> bool:
        """Whether every arm computes its matrix products in float32 (``cpu_matmul="float32"`` on the CPU)."""
        return self.device == "cpu" and self.cpu_matmul == "float32"

    def params(self) -> int:
        """Trainable parameters of the GPT (embeddings, blocks, final norm and head)."""
        d, v, t = self.n_embd, 256, self.block_size
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return v * d + t * d + self.n_layer * block + 2 * d + d * v


def _status_bytes(pid: int | str, *keys: str) -> int:
    """The sum of ``keys`` (``VmRSS``, ``RssAnon``...) of ``/proc/PID/status`` in bytes (0 for a finished process)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.split(":")[0] in keys:
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


# What a process holds that the kernel cannot drop: anonymous and shared-memory pages. Pages of files (the optimizer
# states of ``state_storage="mmap"``, the libraries) are page cache the kernel reclaims under pressure.
HELD = ("RssAnon", "RssShmem")


class _PeakSampler:
    """The largest :data:`HELD` resident memory of this process, sampled every millisecond by a thread; ``reset``
    starts a new peak (``benchmarks/lifecycle_memory.py``: one per phase)."""

    def __init__(self) -> None:
        import threading

        self.peak = _status_bytes("self", *HELD)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            held = _status_bytes("self", *HELD)
            with self._lock:  # a sample taken before a reset never lands after it
                self.peak = max(self.peak, held)
            time.sleep(0.001)

    def reset(self) -> int:
        """Start a new peak from the memory held now, which it returns."""
        with self._lock:
            self.peak = _status_bytes("self", *HELD)
            return self.peak

    def current_peak(self) -> int:
        with self._lock:
            return max(self.peak, _status_bytes("self", *HELD))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.current_peak()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_environment(spec: Spec) -> dict:
    """The environment of every rank of a launch on this machine (``RANK`` and ``LOCAL_RANK`` are added per rank)."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(spec.world_size),
        "NODE_RANK": "0",
        "PYTHONWARNINGS": "ignore",
        "DS_ACCELERATOR": "cuda" if spec.device == "cuda" else "cpu",
    }


def start_ranks(cmd: list[str], env: dict, logs: list[Path], procs: list) -> None:
    """Start ``cmd`` once per rank (one per file of ``logs``, its output there), appending ``(process, log file)`` to
    ``procs``; the caller closes the files."""
    for rank, path in enumerate(logs):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        log = open(path, "w")  # noqa: SIM115 - closed by the caller
        procs.append((subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))


def _start_and_watch(
    arm: str, spec: Spec, env: dict, tmp: str, budget_bytes: int | None, timeout_s: float, procs: list
) -> tuple[str, int]:
    """Start the ranks (appended to ``procs``) and wait for them; stop them all when the budget or the time runs out.
    Returns why they were stopped ("" when they finished by themselves) and the largest summed memory sampled."""
    cmd = [sys.executable, __file__, arm, json.dumps(asdict(spec)), tmp]
    start_ranks(cmd, env, [Path(tmp) / f"log{rank}.txt" for rank in range(spec.world_size)], procs)
    why, sampled_peak, start = "", 0, time.monotonic()
    while any(p.poll() is None for p, _ in procs):
        if spec.device == "cpu":
            total = sum(_status_bytes(p.pid, *HELD) for p, _ in procs if p.poll() is None)
            sampled_peak = max(sampled_peak, total)
            if budget_bytes is not None and total > budget_bytes:
                why = f"over the budget: {total / 1024**3:.2f} GiB resident"
        if time.monotonic() - start > timeout_s:
            why = f"timed out after {timeout_s:.0f} s"
        if why:
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    return why, sampled_peak


def launch(arm: str, spec: Spec, *, budget_bytes: int | None = None, timeout_s: float = 1800) -> dict:
    """Run one arm on ``spec.world_size`` ranks in fresh processes.

    Returns:
        ``{"ok": bool, "why": str, "params": int, "peak_bytes": summed (CPU) or largest (CUDA) peak, "ranks": [...]}``;
        ``ok`` is false when the arm failed, ran out of the budget (CUDA: out of memory under the per-process
        fraction; CPU: stopped when the ranks' summed resident memory passed it) or timed out.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"arm_{arm}_") as tmp:
        env = ranks_environment(spec)
        if budget_bytes is not None:
            env["ARM_BUDGET_BYTES"] = str(budget_bytes)
        # A terminated search (timeout, Ctrl-C) takes its ranks with it.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        procs = []
        try:
            why, sampled_peak = _start_and_watch(arm, spec, env, tmp, budget_bytes, timeout_s, procs)
        finally:
            for p, log in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
                log.close()
        ranks = []
        for rank in range(spec.world_size):
            path = Path(tmp) / f"rank{rank}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else None)
        logs = [(Path(tmp) / f"log{r}.txt").read_text()[-2500:] for r in range(spec.world_size)]
    ok = not why and all(r is not None and r["steps_done"] == spec.steps for r in ranks)
    if not ok and not why:
        oom = any("out of memory" in log.lower() for log in logs)
        why = "out of memory within the budget" if oom else "failed:\n" + "\n".join(logs)
    peaks = [r["peak_bytes"] for r in ranks if r is not None]
    peak = (sum(peaks) if spec.device == "cpu" else max(peaks, default=0)) if ok else max(sampled_peak, sum(peaks))
    return {"ok": ok, "why": why, "params": spec.params(), "peak_bytes": peak, "ranks": ranks}


# --------------------------------------------------------------------------------------------------- the workers
def _batches(spec: Spec, device: object) -> list:
    import torch

    g = torch.Generator().manual_seed(1234 + int(os.environ.get("RANK", "0")))
    tokens = torch.randint(0, 256, (spec.steps, spec.batch_size, spec.block_size + 1), generator=g)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def build_gpt(spec: Spec) -> object:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=spec.block_size, n_layer=spec.n_layer, n_head=spec.n_head, n_embd=spec.n_embd))


def _deepspeed_config(arm: str, spec: Spec) -> dict:
    from lightning_pure_bf16.presets import CPU_BUCKET, GPU_BUCKET

    bucket = CPU_BUCKET if spec.device == "cpu" else GPU_BUCKET
    bf16 = {"enabled": True}
    if arm == "ds_bf16_flags":
        bf16 |= {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    zero = {"stage": 3, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if spec.float32_products:
        # As this package does for float32 products: ZeRO-3's memory-efficient linear is an autograd function whose
        # products Float32Matmul does not see; plain F.linear records the casts, so its backward runs in float32 too.
        zero["memory_efficient_linear"] = False
    config = {
        "train_micro_batch_size_per_gpu": spec.batch_size,
        "bf16": bf16,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }
    if arm == "ds_muon":
        # torch.optim.Muon's momentum; the Adam half takes DeepSpeed's defaults (betas (0.9, 0.999), eps 1e-8).
        # DeepSpeed's Muon under ZeRO-3 refuses its reduce-scatter of gradients ("Muon and reduce scatter cannot be
        # used together"): the gradients are all-reduced.
        config["optimizer"] = {"type": "Muon", "params": {"lr": spec.lr, "momentum": 0.95, "weight_decay": 0.1}}
        zero["reduce_scatter"] = False
    return config


def slowest_rank_phases(ranks: list[dict]) -> tuple[list[float], list[float]]:
    """Each measured step's forward+backward and optimizer-step times, the slowest rank's (the ranks wait for one
    another in the collectives)."""
    steps = range(len(ranks[0]["fwd_bwd_s"]))
    return (
        [max(x["fwd_bwd_s"][i] for x in ranks) for i in steps],
        [max(x["optimizer_s"][i] for x in ranks) for i in steps],
    )


def _run_deepspeed(arm: str, spec: Spec, out: dict) -> None:
    import deepspeed
    import torch

    from lightning_pure_bf16 import _internals

    _internals.set_deepspeed_accelerator(spec.device)
    deepspeed.init_distributed(dist_backend="gloo" if spec.device == "cpu" else "nccl")
    device = torch.device(spec.device, int(os.environ["LOCAL_RANK"]) if spec.device == "cuda" else None)
    if spec.device == "cuda":
        torch.cuda.set_device(device)
    config = _deepspeed_config(arm, spec)
    out["before_model_bytes"] = _status_bytes("self", *HELD)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_gpt(spec)
    if arm == "ds_muon":  # DeepSpeed builds its optimizer from the config
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        t0 = _now(spec)
        with _products(spec):
            loss = torch.nn.functional.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
        engine.backward(loss)
        t1 = _now(spec)
        with _probe(spec, out):
            engine.step()
        return t1 - t0, _now(spec) - t1

    _loop(spec, device, step, out)
    out["model_state_bytes_per_param"] = _model_state_per_param(engine.optimizer)


def ours_fabric(arm: str, spec: Spec, state_dir: Path) -> object:
    """This package's Fabric strategy with ``arm``'s options, launched (this process is one rank); states in files go
    under ``state_dir`` (created here)."""
    from lightning.fabric import Fabric

    from lightning_pure_bf16 import DeepSpeedPureBF16FabricStrategy

    options = dict(OURS[arm])
    if options.get("state_storage") == "mmap":
        state_dir.mkdir(parents=True, exist_ok=True)
        options["state_dir"] = str(state_dir)
    from lightning_pure_bf16 import PureBF16FabricPrecision

    fabric = Fabric(
        accelerator=spec.device,
        devices=spec.world_size,
        strategy=DeepSpeedPureBF16FabricStrategy(**options),
        plugins=[PureBF16FabricPrecision(cpu_matmul=spec.cpu_matmul)],
    )
    fabric.launch()
    return fabric


def _run_ours(arm: str, spec: Spec, out: dict, state_dir: Path) -> None:
    import torch

    fabric = ours_fabric(arm, spec, state_dir)
    out["before_model_bytes"] = _status_bytes("self", *HELD)
    with fabric.init_module():
        model = build_gpt(spec)
    if arm == "pure_bf16_muon":
        from lightning_pure_bf16 import Muon
        from lightning_pure_bf16.deepspeed import deepspeed_muon_rule

        named = list(model.named_parameters())
        matrices = [p for n, p in named if deepspeed_muon_rule(n, p)]
        rest = [p for n, p in named if not deepspeed_muon_rule(n, p)]
        groups = [{"params": matrices}, {"params": rest, "use_muon": False}]
        optimizer = Muon(groups, lr=spec.lr, momentum=0.95, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        t0 = _now(spec)
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        fabric.backward(loss)
        t1 = _now(spec)
        with _probe(spec, out):
            optimizer.step()
        optimizer.zero_grad()
        return t1 - t0, _now(spec) - t1

    _loop(spec, fabric.device, step, out)
    out["model_state_bytes_per_param"] = _model_state_per_param(fabric.strategy.model.optimizer)


def _run_fsdp2(arm: str, spec: Spec, out: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo" if spec.device == "cpu" else "nccl")
    device = torch.device(spec.device, int(os.environ["LOCAL_RANK"]) if spec.device == "cuda" else None)
    if spec.device == "cuda":
        torch.cuda.set_device(device)
    out["before_model_bytes"] = _status_bytes("self", *HELD)
    with torch.device("meta"):
        model = build_gpt(spec).to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=device)
    with torch.no_grad():  # every rank initialises its own shard (the values do not matter here)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    if arm == "fsdp2_torchao_sr":
        from torchao.optim import _AdamW

        optimizer = _AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, bf16_stochastic_round=True)
    elif arm.startswith("fsdp2_pure_bf16"):
        from lightning_pure_bf16 import AdamW

        moments = "int8" if arm.endswith("_int8") else "bf16"
        optimizer = AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, moments=moments)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        t0 = _now(spec)
        with _products(spec):
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        t1 = _now(spec)
        optimizer.step()
        optimizer.zero_grad()
        return t1 - t0, _now(spec) - t1

    _loop(spec, device, step, out)
    dist.destroy_process_group()


CPU_MATMUL = ("auto", "float32", "bf16")


def add_cpu_matmul_option(parser: argparse.ArgumentParser) -> None:
    """The scripts' ``--cpu-matmul`` (:attr:`Spec.cpu_matmul`)."""
    parser.add_argument(
        "--cpu-matmul",
        choices=CPU_MATMUL,
        default="auto",
        help="matrix products on the CPU: auto, as each arm ships (this package float32 where the CPU has no native"
        " bf16 dot products, the others bf16); float32 or bf16 for every arm (like with like)",
    )


def cpu_matmul_sentence(device: str, cpu_matmul: str) -> str:
    """What a report says of ``--cpu-matmul`` (nothing where each arm computes its products as it ships)."""
    if device != "cpu" or cpu_matmul == "auto":
        return ""
    return f" Matrix products: {cpu_matmul}, in every arm (from the bf16 values; results rounded to bf16)."


def cpu_sentence(device: str) -> str:
    """Which CPU a report was measured on, and whether it has native bf16 dot products (times on CPUs of the same
    machine kind differ by that: bf16 products are 14-30x slower without)."""
    if device != "cpu":
        return ""
    import platform

    from lightning_pure_bf16.precision import cpu_has_native_bf16

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    native = "with" if cpu_has_native_bf16() else "without"
    return f" CPU: {name}, {native} native bf16 dot products."


def _products(spec: Spec) -> object:
    """The forward's context for the DeepSpeed and FSDP2 arms: float32 matrix products under ``cpu_matmul="float32"``
    on the CPU (their backward follows, as the casts are recorded), else as they ship."""
    from contextlib import nullcontext

    from lightning_pure_bf16.precision import Float32Matmul

    return Float32Matmul() if spec.float32_products else nullcontext()


def _now(spec: Spec) -> float:
    if spec.device == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def _model_state_per_param(zero_optimizer: object) -> dict[str, float]:
    """This rank's model state per parameter of its partition, by category and in total, from the live buffers of a
    ZeRO-3 optimizer (``lightning_pure_bf16.memory.zero3_model_state_report``)."""
    from lightning_pure_bf16.memory import zero3_model_state_report

    report = zero3_model_state_report(zero_optimizer)
    counts = ("params_on_rank", "frozen_params_on_rank", "whole_model")  # not bytes per parameter of the partition
    return {k: v for k, v in report.items() if k not in counts and isinstance(v, float) and (v or k == "total")}


class StepProbe:
    """What one optimizer step does on this rank, measured while it runs: every tensor an operation allocates inside
    it (a ``TorchDispatchMode``: an output whose storage no input shares), alive from then until it is freed, with the
    peak of their sum (``peak_bytes``); and the bytes of the tensors handed to each ``torch.distributed`` collective
    (``exchanged``, by name: what this rank sends or receives through it). Allocations made inside compiled
    extensions without torch's dispatcher (this package's C++ loop, chunk-sized) are not seen."""

    COLLECTIVES = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "reduce_scatter",
        "gather",
        "scatter",
        "broadcast",
        "all_to_all_single",
    )

    def __init__(self) -> None:
        self.live = self.peak_bytes = 0
        self.exchanged: dict[str, int] = {}
        self._alive: dict[int, object] = {}

    def __enter__(self) -> StepProbe:
        import torch
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        probe = self

        class Allocations(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
                out = func(*args, **(kwargs or {}))
                inputs = {
                    t.untyped_storage().data_ptr()
                    for t in tree_leaves((args, kwargs or {}))
                    if isinstance(t, torch.Tensor)
                }
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                        probe._allocated(t.untyped_storage())
                return out

        self._originals = {name: getattr(dist, name) for name in self.COLLECTIVES if hasattr(dist, name)}
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(name, original))
        self._mode = Allocations()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        self._mode.__exit__(*exc)
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _allocated(self, storage: object) -> None:
        import weakref

        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or key in self._alive:
            return
        self.live += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live)

        def freed(_: object, key: int = key, nbytes: int = nbytes) -> None:
            self.live -= nbytes
            self._alive.pop(key, None)

        self._alive[key] = weakref.ref(storage, freed)

    def _counted(self, name: str, original: object) -> object:
        import torch
        from torch.utils._pytree import tree_leaves

        def collective(*args: object, **kwargs: object) -> object:
            tensors = {id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self.exchanged[name] = self.exchanged.get(name, 0) + nbytes
            return original(*args, **kwargs)

        return collective


_PROBING: list[bool] = [False]  # whether the step running now is the one to measure


def _probe(spec: Spec, out: dict) -> object:
    """A :class:`StepProbe` around the optimizer step of the step being measured (its figures into ``out``), else
    nothing."""
    import contextlib

    if not _PROBING[0]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def probed() -> object:
        with StepProbe() as probe:
            yield
        out["step_alloc_peak_bytes"] = probe.peak_bytes
        out["step_exchanged_bytes"] = probe.exchanged

    return probed()


def _loop(spec: Spec, device: object, step: object, out: dict) -> None:
    batches = _batches(spec, device)
    for i, (x, y) in enumerate(batches):
        _PROBING[0] = spec.probe_step and i == len(batches) - 1
        fwd_bwd, opt = step(x, y)
        out["steps_done"] = i + 1
        if i >= spec.warmup:
            out["fwd_bwd_s"].append(fwd_bwd)
            out["optimizer_s"].append(opt)


def worker(arm: str, spec: Spec, tmp: Path) -> None:
    import torch

    if spec.device == "cuda" and os.environ.get("ARM_BUDGET_BYTES"):
        torch.cuda.set_per_process_memory_fraction(
            int(os.environ["ARM_BUDGET_BYTES"]) / torch.cuda.get_device_properties(0).total_memory
        )
    if spec.device == "cpu":  # the cores shared between the ranks, as a launcher such as torchrun does
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    sampler = _PeakSampler() if spec.device == "cpu" and os.environ.get("ARM_BUDGET_BYTES") else None
    out: dict = {"steps_done": 0, "fwd_bwd_s": [], "optimizer_s": [], "at_start_bytes": _status_bytes("self", *HELD)}
    if arm.startswith("ds_"):
        _run_deepspeed(arm, spec, out)
    elif arm in OURS:
        _run_ours(arm, spec, out, tmp / f"states{os.environ['RANK']}")
    elif arm.startswith("fsdp2_"):
        _run_fsdp2(arm, spec, out)
    else:
        raise ValueError(f"unknown arm {arm!r}; one of {sorted(ARMS)}")
    if spec.device == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    else:  # sampled when searching under a budget; otherwise the high-water mark of all resident pages
        out["peak_bytes"] = sampler.stop() if sampler is not None else _status_bytes("self", "VmHWM")
    out["hwm_bytes"] = _status_bytes("self", "VmHWM")
    (tmp / f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    worker(sys.argv[1], Spec(**json.loads(sys.argv[2])), Path(sys.argv[3]))
