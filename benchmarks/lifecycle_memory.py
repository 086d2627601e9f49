"""Host memory of every phase of a run, not only the step: construction, loading pretrained weights, the first steps,
a checkpoint save, the save in Hugging Face's layout, a resume, and the export, per rank.

A run at the seed's scale (a 70B fine-tune) dies wherever one phase holds the whole model in one process. This
benchmark runs one GPT of about 1B parameters on 2 CPU ranks through each phase and records, per rank and phase,
the peak of the memory the process holds (RssAnon + RssShmem, sampled every millisecond, as ``largest_model.py``
counts it: pages of memory-mapped files are page cache, which the kernel drops under pressure) and its rise over the
phase's start, as a multiple of that rank's partition of the bf16 weights (2 bytes x params / ranks).

Arms:

- ``pure_bf16``: this package's Fabric strategy. Construction in ``fabric.init_module()`` (partitioned as it is
  built), ``load_pretrained`` from a sharded Hugging Face checkpoint, ``fabric.setup`` and the first steps,
  ``fabric.save``, ``save_pretrained`` (what ``PureBF16Trainer.save_model`` runs), ``fabric.load`` into the live
  run, and ``python -m lightning_pure_bf16.consolidate`` (the export, one process).
- ``ds_bf16_mixed``: what Lightning's ``DeepSpeedStrategy(stage=3, precision="bf16-mixed")`` runs (through
  ``deepspeed.initialize`` with this package's CPU set-up for DeepSpeed, as every benchmark's peer arm): construction
  under ``deepspeed.zero.Init``, no way to load pretrained weights into the partitions, the first steps,
  ``engine.save_checkpoint``, the 16-bit weights gathered on rank 0 and written as ``transformers.Trainer.save_model``
  does under ZeRO-3 (``_zero3_consolidated_16bit_state_dict``), ``engine.load_checkpoint``, and DeepSpeed's
  ``zero_to_fp32.py`` for the export (on this arm's checkpoint and on ``pure_bf16``'s).

The bounds the report checks: the export's peak at most one shard plus the largest tensor plus 300 MB (the
interpreter and torch), and at least 5x below ``zero_to_fp32.py``'s; each rank's rise while loading pretrained weights
at most its partition of the bf16 weights plus the largest tensor plus 64 MB; the rise of the Hugging Face save at
most one shard plus the largest tensor plus 64 MB.

    python benchmarks/lifecycle_memory.py            # ~1B parameters (n_embd 2048, 20 layers), 256 MB shards
    python benchmarks/lifecycle_memory.py --quick    # ~26M parameters, seconds

Each arm's result is written under ``benchmarks/results/.partial/`` as it finishes; a rerun with the same arguments
skips the arms already measured (``--fresh`` measures them again).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _arms import (  # noqa: E402
    HELD,
    ROOT,
    Spec,
    _batches,
    _deepspeed_config,
    _PeakSampler,
    _status_bytes,
    build_gpt,
    ranks_environment,
    start_ranks,
)
from _results import write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ARMS = {
    "pure_bf16": "this strategy (Fabric), stochastic rounding",
    "ds_bf16_mixed": "DeepSpeed ZeRO-3 bf16 mixed (what Lightning's DeepSpeedStrategy runs)",
    "pure_bf16_world_size": "this strategy's checkpoint resumed at another world size: 2 ranks to 1, then 1 to 2",
    "pure_bf16_world_size_trainer": "the same through Lightning's Trainer (`trainer.fit(ckpt_path=...)`)",
}
WORLD_SIZE_PHASES = ("resume 2 ranks to 1", "resume 1 rank to 2")
PHASES = (
    "construction",
    "load pretrained",
    "setup",
    "first steps",
    "save",
    "save HF layout",
    "resume",
    *WORLD_SIZE_PHASES,
    "export",
)
MB = 10**6


class _Phases:
    """Per phase: the held memory at its start, its peak (sampled every millisecond) and at its end."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._sampler = _PeakSampler()

    @contextlib.contextmanager
    def phase(self, name: str):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every rank starts the phase together
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the allocator kept from earlier phases goes back first
        start = self._sampler.reset()
        t0 = time.perf_counter()
        yield
        if dist.is_initialized():
            dist.barrier()
        peak = self._sampler.current_peak()
        self.rows.append(
            {
                "phase": name,
                "start_bytes": start,
                "peak_bytes": peak,
                "end_bytes": _status_bytes("self", *HELD),
                "seconds": round(time.perf_counter() - t0, 2),
            }
        )

    def stop(self) -> list[dict]:
        self._sampler.stop()
        return self.rows


# --------------------------------------------------------------------------------------------------- the ranks
def _run_ours(spec: Spec, work: Path, phases: _Phases, shard: str) -> None:
    import torch
    from lightning.fabric import Fabric

    import lightning_pure_bf16
    from lightning_pure_bf16 import DeepSpeedPureBF16FabricStrategy

    fabric = Fabric(accelerator="cpu", devices=spec.world_size, strategy=DeepSpeedPureBF16FabricStrategy())
    fabric.launch()
    with phases.phase("construction"), fabric.init_module():
        model = build_gpt(spec)
    with phases.phase("load pretrained"):
        lightning_pure_bf16.load_pretrained(model, work / "pretrained")
    with phases.phase("setup"):
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1))
    with phases.phase("first steps"):
        for x, y in _batches(spec, fabric.device):
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    state = {"model": model, "optimizer": optimizer, "step": spec.steps}
    with phases.phase("save"):
        fabric.save(work / "ours.ckpt", state)
    with phases.phase("save HF layout"):
        lightning_pure_bf16.save_pretrained(model, work / "ours_hf", max_shard_size=shard)
    with phases.phase("resume"):
        fabric.load(work / "ours.ckpt", state)


def _run_world_size_trainer(spec: Spec, work: Path, phases: _Phases, stage: str) -> None:
    """The world-size arm through Lightning's Trainer: ``source`` (2 ranks fit the first steps and save), ``to1`` (1
    rank: ``fit(ckpt_path=...)`` of that checkpoint at its last step, so the fit only loads it; measured around the
    strategy's ``load_checkpoint``; then saved again), ``to2`` (2 ranks resume the 1-rank checkpoint)."""
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pure_bf16 import DeepSpeedPureBF16Strategy, zero_checkpoint

    readers: list = []
    opened = zero_checkpoint.ZeroCheckpoint.__init__

    def record(self, *args, **kwargs) -> None:
        opened(self, *args, **kwargs)
        readers.append(self)

    zero_checkpoint.ZeroCheckpoint.__init__ = record

    class GPTModule(LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "gpt"):
                self.gpt = build_gpt(spec)  # partitioned as it is built (the strategy's zero.Init)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return torch.nn.functional.cross_entropy(self.gpt(x).float().flatten(0, 1), y.flatten())

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=spec.lr, weight_decay=0.1)

    strategy = DeepSpeedPureBF16Strategy()
    trainer = Trainer(
        accelerator="cpu",
        devices=spec.world_size,
        strategy=strategy,
        max_steps=spec.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    x, y = (torch.cat(t) for t in zip(*_batches(spec, torch.device("cpu"))))
    data = DataLoader(TensorDataset(x, y), batch_size=spec.batch_size)
    if stage == "source":
        trainer.fit(GPTModule(), data)
        trainer.save_checkpoint(work / "trainer_world_size_2.ckpt")
        return
    source, phase = ("trainer_world_size_2.ckpt", WORLD_SIZE_PHASES[0])
    if stage == "to2":
        source, phase = ("trainer_world_size_1.ckpt", WORLD_SIZE_PHASES[1])
    load = strategy.load_checkpoint

    def measured_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with phases.phase(phase):
            return load(*args, **kwargs)

    strategy.load_checkpoint = measured_load
    trainer.fit(GPTModule(), data, ckpt_path=str(work / source))
    read = [getattr(r, "bytes_read", None) for r in readers]
    phases.rows[-1]["bytes_read"] = None if None in read else sum(read)
    phases.rows[-1]["checkpoint_bytes"] = sum(f.stat().st_size for f in (work / source / "checkpoint").glob("*.pt"))
    if stage == "to1":
        trainer.save_checkpoint(work / "trainer_world_size_1.ckpt")


def _run_world_size(spec: Spec, work: Path, phases: _Phases, stage: str) -> None:
    """One launch of the world-size arm: ``source`` (2 ranks: the first steps and a save), ``to1`` (1 rank: that
    checkpoint loaded, measured, and saved again), ``to2`` (2 ranks: the 1-rank checkpoint loaded, measured). The
    load is what Lightning's Trainer runs too (both front ends call ``engine_checkpoints.load_checkpoint``)."""
    import torch
    from lightning.fabric import Fabric

    from lightning_pure_bf16 import DeepSpeedPureBF16FabricStrategy, zero_checkpoint

    readers: list = []
    opened = zero_checkpoint.ZeroCheckpoint.__init__

    def record(self, *args, **kwargs) -> None:  # the bytes each rank reads out of the checkpoint's tensors
        opened(self, *args, **kwargs)
        readers.append(self)

    zero_checkpoint.ZeroCheckpoint.__init__ = record
    fabric = Fabric(accelerator="cpu", devices=spec.world_size, strategy=DeepSpeedPureBF16FabricStrategy())
    fabric.launch()
    with fabric.init_module():
        model = build_gpt(spec)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if stage == "source":
        for x, y in _batches(spec, fabric.device):
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        fabric.save(work / "world_size_2.ckpt", state)
        return
    source, phase = (
        ("world_size_2.ckpt", WORLD_SIZE_PHASES[0]) if stage == "to1" else ("world_size_1.ckpt", WORLD_SIZE_PHASES[1])
    )
    with phases.phase(phase):
        fabric.load(work / source, state)
    # (None where the package does not count them: the releases before the count)
    read = [getattr(r, "bytes_read", None) for r in readers]
    phases.rows[-1]["bytes_read"] = None if None in read else sum(read)
    phases.rows[-1]["checkpoint_bytes"] = sum(f.stat().st_size for f in (work / source / "checkpoint").glob("*.pt"))
    if stage == "to1":
        fabric.save(work / "world_size_1.ckpt", state)


def _run_deepspeed(spec: Spec, work: Path, phases: _Phases, shard: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from lightning_pure_bf16 import _internals

    _internals.set_deepspeed_accelerator("cpu")
    deepspeed.init_distributed(dist_backend="gloo")
    config = _deepspeed_config("ds_bf16_mixed", spec)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    with phases.phase("construction"), deepspeed.zero.Init(config_dict_or_path=config):
        model = build_gpt(spec)
    with phases.phase("setup"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    with phases.phase("first steps"):
        for x, y in _batches(spec, torch.device("cpu")):
            loss = torch.nn.functional.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
    with phases.phase("save"):
        engine.save_checkpoint(str(work / "ds.ckpt"))
    with phases.phase("save HF layout"):
        # transformers.Trainer.save_model under ZeRO-3: every 16-bit weight gathered into one state dict on rank 0,
        # then save_pretrained's sharded files.
        state = engine._zero3_consolidated_16bit_state_dict()
        if dist.get_rank() == 0:
            from huggingface_hub import save_torch_state_dict

            (work / "ds_hf").mkdir()
            save_torch_state_dict(state, work / "ds_hf", max_shard_size=shard)
        del state
    with phases.phase("resume"):
        engine.load_checkpoint(str(work / "ds.ckpt"))


def worker(arm: str, spec: Spec, work: Path, shard: str) -> None:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    phases = _Phases()
    if arm.startswith("pure_bf16_world_size_trainer:"):
        _run_world_size_trainer(spec, work, phases, arm.split(":")[1])
    elif arm.startswith("pure_bf16_world_size:"):
        _run_world_size(spec, work, phases, arm.split(":")[1])
    else:
        (_run_ours if arm == "pure_bf16" else _run_deepspeed)(spec, work, phases, shard)
    rank = int(os.environ["RANK"])
    (work / f"{arm}_rank{rank}.json").write_text(json.dumps(phases.stop()))


# --------------------------------------------------------------------------------------------------- the parent
def _write_pretrained(spec: Spec, where: Path, shard: str) -> None:
    """The GPT's initial weights in bf16 as a sharded Hugging Face checkpoint, built here (not in a measured rank)."""
    import torch

    from lightning_pure_bf16 import save_pretrained

    torch.manual_seed(0)
    save_pretrained(build_gpt(spec).to(torch.bfloat16), where, max_shard_size=shard)


def _launch(arm: str, spec: Spec, work: Path, shard: str, timeout_s: float) -> list[list[dict]]:
    procs: list = []
    cmd = [sys.executable, __file__, "--worker", arm, json.dumps(asdict(spec)), str(work), shard]
    logs = [work / f"{arm}_log{rank}.txt" for rank in range(spec.world_size)]
    deadline = time.monotonic() + timeout_s
    try:
        start_ranks(cmd, ranks_environment(spec), logs, procs)
        for p, _ in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    ranks = []
    for rank in range(spec.world_size):
        path = work / f"{arm}_rank{rank}.json"
        if not path.exists():
            tail = (work / f"{arm}_log{rank}.txt").read_text()[-3000:]
            raise RuntimeError(f"{arm} rank {rank} wrote no result:\n{tail}")
        ranks.append(json.loads(path.read_text()))
    return ranks


def _launch_world_sizes(arm: str, spec: Spec, work: Path, shard: str, timeout_s: float) -> list[list[dict]]:
    """A world-size arm's three launches; per rank of 2, its rows (rank 0 also the 2 -> 1 resume's)."""
    one = replace(spec, world_size=1)
    _launch(f"{arm}:source", spec, work, shard, timeout_s)
    (to1,) = _launch(f"{arm}:to1", one, work, shard, timeout_s)
    to2 = _launch(f"{arm}:to2", spec, work, shard, timeout_s)
    return [to1 + to2[0], to2[1]]


def _peak_of_command(cmd: list[str]) -> dict:
    """Run a one-process command, sampling its held memory every millisecond."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _status_bytes(proc.pid, *HELD))
        time.sleep(0.001)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    return {"peak_bytes": peak, "seconds": round(time.perf_counter() - t0, 2)}


def _largest_tensor_bytes(spec: Spec) -> int:
    import torch

    with torch.device("meta"):
        model = build_gpt(spec)
    return max(p.numel() for p in model.parameters()) * 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~26M-parameter GPT: seconds, for checking the script")
    parser.add_argument("--n-embd", type=int, default=None, help="width (default 2048; 256 with --quick)")
    parser.add_argument("--n-layer", type=int, default=None, help="blocks (default 20; 4 with --quick)")
    parser.add_argument(
        "--shard", default=None, help="shard size of every Hugging Face file (default 256MB; 4MB quick)"
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--fresh", action="store_true", help="measure again the arms already measured")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds an arm may take")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    n_embd = args.n_embd or (256 if args.quick else 2048)
    n_layer = args.n_layer or (4 if args.quick else 20)
    shard = args.shard or ("4MB" if args.quick else "256MB")
    spec = Spec(n_layer=n_layer, n_head=max(1, n_embd // 128), n_embd=n_embd, block_size=64, batch_size=2, steps=2)
    params = spec.params()
    stem = "lifecycle_memory_quick" if args.quick else "lifecycle_memory"
    partial = RESULTS / ".partial" / f"{args.out.name}_{stem}_{n_embd}x{n_layer}_{shard}.json"
    done: dict = {} if args.fresh or not partial.exists() else json.loads(partial.read_text())
    partial.parent.mkdir(parents=True, exist_ok=True)
    largest = _largest_tensor_bytes(spec)
    print(
        f"GPT {params / 1e6:,.0f}M parameters ({n_embd} wide, {n_layer} blocks), largest tensor {largest / MB:.0f} MB,"
        f" shards {shard}, {spec.world_size} CPU ranks"
    )
    with tempfile.TemporaryDirectory(prefix="lifecycle_", dir=os.environ.get("LIFECYCLE_TMP")) as tmp:
        work = Path(tmp)
        _write_pretrained(spec, work / "pretrained", shard)
        for arm in args.arms:
            if arm in done:
                print(f"{arm}: measured before, kept ({partial}; --fresh measures it again)")
                continue
            print(f"{arm}: running ...", flush=True)
            try:
                if arm.startswith("pure_bf16_world_size"):
                    ranks = _launch_world_sizes(arm, spec, work, shard, args.timeout)
                else:
                    ranks = _launch(arm, spec, work, shard, args.timeout)
            except RuntimeError as err:  # a rank that died (killed for memory, say): said in the report, not hidden
                print(err)
                done[arm] = {"failed": str(err).splitlines()[0], "ranks": [], "exports": {}}
                partial.write_text(json.dumps(done))
                continue
            exports = {}
            if arm == "pure_bf16":
                consolidate = [sys.executable, "-m", "lightning_pure_bf16.consolidate"]
                exports["export"] = _peak_of_command(
                    [*consolidate, str(work / "ours.ckpt"), str(work / "ours_export"), "--max-shard-size", shard]
                )
                exports["export, default 5GB shards"] = _peak_of_command(
                    [*consolidate, str(work / "ours.ckpt"), str(work / "ours_export_5gb")]
                )
                z2f = [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(work / "ours.ckpt")]
                exports["export by zero_to_fp32.py"] = _peak_of_command(
                    [*z2f, str(work / "ours_z2f"), "--max_shard_size", shard, "--safe_serialization"]
                )
                exports["export by zero_to_fp32.py, default 5GB shards"] = _peak_of_command(
                    [*z2f, str(work / "ours_z2f_5gb"), "--safe_serialization"]
                )
                _check_export(work / "ours_export", work / "ours_hf")
            elif arm == "ds_bf16_mixed":
                exports["export by zero_to_fp32.py"] = _peak_of_command(
                    [
                        sys.executable,
                        "-m",
                        "deepspeed.utils.zero_to_fp32",
                        str(work / "ds.ckpt"),
                        str(work / "ds_z2f"),
                        "--max_shard_size",
                        shard,
                        "--safe_serialization",
                    ]
                )
            done[arm] = {"ranks": ranks, "exports": exports}
            partial.write_text(json.dumps(done))
    _report(args, argv, spec, shard, largest, done, stem)
    return 0


def _check_export(exported: Path, saved: Path) -> None:
    """The export of the checkpoint and the Hugging Face save of the live run hold the same bf16 weights."""
    import torch
    from safetensors import safe_open

    index = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    saved_index = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(saved_index), "the export and the save name different tensors"
    for name, file in index.items():
        with safe_open(exported / file, "pt") as a, safe_open(saved / saved_index[name], "pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == torch.bfloat16 and torch.equal(x, y), name


def _report(args, argv, spec: Spec, shard: str, largest: int, done: dict, stem: str) -> None:
    from lightning_pure_bf16.shards import parse_size

    params, world = spec.params(), spec.world_size
    weights = 2 * params
    partition = weights / world
    shard_bytes = parse_size(shard)
    rows, lines = [], []
    argv = sys.argv[1:] if argv is None else argv
    command = "python benchmarks/lifecycle_memory.py" + (" " + " ".join(argv) if argv else "")
    lines += [
        f"# Host memory of every phase: GPT {params / 1e6:,.0f}M, {world} CPU ranks",
        "",
        f"bf16 weights {weights / 2**30:.2f} GiB, each rank's partition {partition / 2**30:.2f} GiB, largest tensor"
        f" {largest / MB:.0f} MB, Hugging Face shards of {shard}. Memory is what a process holds (RssAnon + RssShmem,"
        " sampled every millisecond); the rise is over the phase's start; x partition is the rise divided by the"
        " rank's partition of the bf16 weights. Command: `" + command + "`.",
        "",
        "| arm | phase | rank | held at start GiB | peak GiB | rise GiB | rise x partition | seconds |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, result in done.items():
        if "failed" in result:
            lines.append(f"| {arm} | did not finish: {result['failed']} | | | | | | |")
            continue
        for phase in PHASES:
            for rank, phases in enumerate(result["ranks"]):
                row = next((r for r in phases if r["phase"] == phase), None)
                if row is None:
                    continue
                rise = row["peak_bytes"] - row["start_bytes"]
                rows.append(
                    {
                        "arm": arm,
                        "phase": phase,
                        "rank": rank,
                        **row,
                        "rise_bytes": rise,
                        "rise_x_partition": round(rise / partition, 3),
                        "params": params,
                    }
                )
                lines.append(
                    f"| {arm} | {phase} | {rank} | {row['start_bytes'] / 2**30:.2f} |"
                    f" {row['peak_bytes'] / 2**30:.2f} | {rise / 2**30:.2f} | {rise / partition:.2f} |"
                    f" {row['seconds']:.1f} |"
                )
        for name, row in result.get("exports", {}).items():
            rows.append({"arm": arm, "phase": name, "rank": "", **row, "params": params})
            lines.append(
                f"| {arm} | {name} (one process) | | | {row['peak_bytes'] / 2**30:.2f} |"
                f" | {row['peak_bytes'] / weights:.2f} x the weights | {row['seconds']:.1f} |"
            )
        if arm == "ds_bf16_mixed":
            lines.append("| ds_bf16_mixed | load pretrained | | | | | no way into the partitions | |")
    lines += ["", "## The bounds", ""]
    for arm in ("pure_bf16_world_size", "pure_bf16_world_size_trainer"):
        moved = done.get(arm)
        if moved is None or "failed" in moved:
            continue
        for rank, phases in enumerate(moved["ranks"]):
            for row in (r for r in phases if r["phase"] in WORLD_SIZE_PHASES):
                rise = row["peak_bytes"] - row["start_bytes"]
                bound = 2 * largest + 128 * 2**20
                ranks_after = 1 if "to 1" in row["phase"] else 2
                share = row["checkpoint_bytes"] / ranks_after
                read = "not counted" if row["bytes_read"] is None else f"{row['bytes_read'] / 2**20:,.0f} MiB"
                times = "" if row["bytes_read"] is None else f" ({row['bytes_read'] / share:.2f} x this rank's share)"
                verdict = "met" if rise <= bound else "MISSED"
                lines.append(
                    f"- {arm}, rank {rank}, {row['phase']}: rise {rise / 2**20:,.0f} MiB, bound twice the largest"
                    f" tensor + 128 MiB = {bound / 2**20:,.0f} MiB: {verdict}; read {read} of the checkpoint's"
                    f" {row['checkpoint_bytes'] / 2**20:,.0f} MiB of state files{times}."
                )
    ours = done.get("pure_bf16")
    if ours is not None and "failed" not in ours:
        base = 300 * MB
        export = ours["exports"]["export"]["peak_bytes"]
        bound = shard_bytes + largest + base
        lines.append(
            f"- Export ({shard} shards): peak {export / MB:,.0f} MB, bound one shard + largest tensor + 300 MB"
            f" = {bound / MB:,.0f} MB: {'met' if export <= bound else 'MISSED'}."
        )
        big = ours["exports"]["export, default 5GB shards"]["peak_bytes"]
        bound_big = parse_size("5GB") + largest + base
        lines.append(
            f"- Export (default 5GB shards): peak {big / MB:,.0f} MB, bound {bound_big / MB:,.0f} MB:"
            f" {'met' if big <= bound_big else 'MISSED'}."
        )
        z2f = ours["exports"]["export by zero_to_fp32.py"]["peak_bytes"]
        lines.append(
            f"- zero_to_fp32.py on the same checkpoint ({shard} shards): {z2f / MB:,.0f} MB, {z2f / export:.1f}x the"
            f" export's peak (at least 5x: {'met' if z2f >= 5 * export else 'MISSED'})."
        )
        z2f_big = ours["exports"]["export by zero_to_fp32.py, default 5GB shards"]["peak_bytes"]
        lines.append(
            f"- zero_to_fp32.py with its default 5GB shards: {z2f_big / MB:,.0f} MB, {z2f_big / big:.1f}x the export's"
            " peak with the same default."
        )
        for rank, phases in enumerate(ours["ranks"]):
            row = {r["phase"]: r for r in phases}
            load = row["load pretrained"]["peak_bytes"] - row["load pretrained"]["start_bytes"]
            bound = partition + largest + 64 * MB
            lines.append(
                f"- Rank {rank} loading pretrained weights: rise {load / MB:,.0f} MB, bound partition +"
                f" largest tensor + 64 MB = {bound / MB:,.0f} MB: {'met' if load <= bound else 'MISSED'}."
            )
            save = row["save HF layout"]["peak_bytes"] - row["save HF layout"]["start_bytes"]
            bound = shard_bytes + largest + 64 * MB
            lines.append(
                f"- Rank {rank} saving in Hugging Face's layout (save_pretrained, PureBF16Trainer.save_model's"
                f" writer): rise {save / MB:,.0f} MB, bound one shard + largest tensor + 64 MB ="
                f" {bound / MB:,.0f} MB: {'met' if save <= bound else 'MISSED'}."
            )
    write_results(args.out, stem, rows, lines, command)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, arm_name, spec_json, work_dir, shard_size = sys.argv
        worker(arm_name, Spec(**json.loads(spec_json)), Path(work_dir), shard_size)
    else:
        raise SystemExit(main())
