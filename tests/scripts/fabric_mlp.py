"""Trains a small MLP in a plain Fabric loop with the pure-bf16 strategy and writes what the tests check to
OUT/rank{R}.pt. Fabric's launcher starts the other ranks by re-running it:

    python tests/scripts/fabric_mlp.py OUT '{"devices": 2, "steps": 6}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _inspect import reachable_tensors, record_sub_group_steps
from _models import MLP, data, param_groups, partitions
from _runs import run_all
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

import lightning_pure_bf16
import lightning_pure_bf16.collectives
from lightning_pure_bf16.memory import is_file_backed


def record_clipping() -> list:
    """At each sub-group update of every step: the norm ZeRO-3 clips to, the gradient's norm, and the factor the
    update multiplies the gradient by (the clip factor, folded into the update: the step's argument)."""
    seen = []

    def record(zero, master, kwargs):  # noqa: ANN001, ANN202
        seen.append((float(zero.clip_grad), float(zero._global_grad_norm), float(kwargs["grad_scale"])))

    record_sub_group_steps(record)
    return seen


def fixed_batches(fabric, model, optimizer, scheduler, state, opts, accumulate):
    """The same batch list every epoch, indexed by step: a resumed loop needs no data position."""
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=16 // accumulate, shuffle=False))
    batches = list(loader)
    if opts.get("resume"):
        remainder = fabric.load(opts["resume"], state)
        assert not remainder, remainder
    losses, lrs, norms = [], [], []
    for step in range(state["step"], opts.get("steps", 6)):
        for micro in range(accumulate):
            x, y = batches[(step * accumulate + micro) % len(batches)]
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = nn.functional.mse_loss(model(x).float(), y.float())
                if fabric.global_rank == opts.get("nan_rank") and step == opts.get("nan_step", 2):
                    loss = loss * float("nan")
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
        if opts.get("clip"):
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=opts["clip"])))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        state["step"] = step + 1
        if opts.get("save_at") == step + 1:
            fabric.save(opts["save_path"], state)
    return losses, lrs, norms, []


def shuffled_epochs(fabric, model, optimizer, state, opts):
    """Epochs of a shuffled loader, as a Fabric user writes them (Fabric sets the sampler's epoch at each pass); on
    resume, ``resume_fabric_dataloader`` puts the loader at the checkpoint's epoch and batch."""
    if opts.get("stateful_data"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = fabric.setup_dataloaders(StatefulDataLoader(data(), batch_size=16, shuffle=True))
        state["data"] = loader
    else:
        loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=16, shuffle=True))
    if opts.get("resume"):
        remainder = fabric.load(opts["resume"], state)
        assert not remainder, remainder
        epoch, done = divmod(state["step"], len(loader))
        lightning_pure_bf16.resume_fabric_dataloader(loader, epoch=epoch, batches_done=done)
    losses, first_inputs = [], []
    while state["step"] < opts["steps"]:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x).float(), y.float())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            first_inputs.append(float(x[0, 0]))
            state["step"] += 1
            if opts.get("save_at") == state["step"]:
                fabric.save(opts["save_path"], state)
            if state["step"] == opts["steps"]:
                break
    return losses, [], [], first_inputs


def main(out: Path, opts: dict) -> None:
    if opts.get("record_exit"):
        from fit_mlp import _record_process_group_at_exit

        _record_process_group_at_exit(out)
    clip_seen = record_clipping()
    if opts.get("norm_row"):
        # Short rows and pieces, so that the gradient norms read every partition in several pieces, rows and a rest.
        lightning_pure_bf16.collectives.NORM_ROW = opts["norm_row"]
        lightning_pure_bf16.collectives.NORM_PIECE = 4 * opts["norm_row"]
    strategy = opts.get("strategy", "deepspeed_pure_bf16")
    if opts.get("exact"):
        # Every parameter partitioned (no gathered "persistent" small parameters) and small buckets, so that every
        # buffer the ZeRO-3 optimizer holds scales with the partition.
        exact = {
            "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
            "reduce_bucket_size": 10_000,
        }
        strategy = {**exact, **(strategy if isinstance(strategy, dict) else {})}
    if isinstance(strategy, dict):
        strategy = lightning_pure_bf16.DeepSpeedPureBF16FabricStrategy(**strategy)
    fabric = Fabric(
        accelerator=opts.get("accelerator", "cpu"),
        devices=opts.get("devices", 2),
        strategy=strategy,
        precision=opts.get("precision"),
    )
    fabric.launch()
    fabric.seed_everything(1234)
    loaded = None
    if opts.get("pretrained"):
        with fabric.init_module():  # partitioned as it is built
            model = MLP()
        lightning_pure_bf16.load_pretrained(model, opts["pretrained"], key_map=opts.get("key_map"))
        loaded = partitions(model)
    else:
        model = MLP()
    groups = param_groups(model)
    kind = opts.get("optimizer", "adamw")
    optimizer = torch.optim.AdamW(groups, lr=1e-2) if kind == "adamw" else torch.optim.RMSprop(groups, lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = None
    if opts.get("scheduler"):
        # Built on the optimizer fabric.setup returned, as with any torch optimizer.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    accumulate = opts.get("accumulate", 1)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if scheduler is not None:
        state["scheduler"] = scheduler
    if opts.get("shuffle"):
        losses, lrs, norms, first_inputs = shuffled_epochs(fabric, model, optimizer, state, opts)
    else:
        losses, lrs, norms, first_inputs = fixed_batches(fabric, model, optimizer, scheduler, state, opts, accumulate)
    strat = fabric.strategy
    engine = strat.model
    zero = engine.optimizer
    real_masks = []
    for group in zero.fp16_groups:
        parts = []
        for param in group:
            pn = param.partition_numel()
            parts.append(torch.arange(pn) < max(0, min(pn, param.ds_numel - fabric.global_rank * pn)))
        real_masks.append(torch.cat(parts))
    inner = strat.pure_bf16_optimizer
    result = {
        "optimizer_class": type(optimizer.optimizer).__name__,
        "returned_is_inner": optimizer.optimizer is inner,
        "precision": type(strat.precision).__name__,
        "flat_params": [t.detach().clone() for t in zero.fp16_partitioned_groups_flat],
        "real_masks": real_masks,
        "state": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for i, st in enumerate(inner.state.values())
        },
        "rounding": [g["rounding"] for g in inner.param_groups],
        "group_wd": [g["weight_decay"] for g in inner.param_groups],
        "seed": inner.seed,
        "skipped_steps": strat.skipped_steps,
        "memory_report": strat.memory_report(),
        "zero_buffers": [
            (name, t.dtype, t.untyped_storage().nbytes(), is_file_backed(t))
            for name, t in reachable_tensors(zero, "zero")
        ],
        "losses": losses,
        "lrs": lrs,
        "norms": norms,
        "clip_seen": clip_seen,
        "engine_global_steps": engine.global_steps,
        "ds_global_norm": float(engine.get_global_grad_norm() or 0.0),
        "step": state["step"],
        "first_inputs": first_inputs,
        "loaded_partitions": loaded,
    }
    if opts.get("save_pretrained"):
        # Out of the live run in Hugging Face's layout, from the partitions (on every rank), beside the weights whole.
        import deepspeed

        lightning_pure_bf16.save_pretrained(model, out / "saved", key_map={"net.": ""}, max_shard_size=3000)
        params = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            result["trained"] = {k: v.detach().clone() for k, v in params.items()}
    torch.save(result, out / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    run_all(main, Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
