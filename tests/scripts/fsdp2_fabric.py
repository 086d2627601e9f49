"""Fabric with Lightning's ``ModelParallelStrategy`` (FSDP2 applied by ``parallelize_fn``), ``precision="bf16-true"``
and this package's AdamW built over the sharded parameters, on 2 CPU processes: 4 steps with a ``fabric.save`` after
2, then a fresh model and optimizer loaded from it for the last 2. Each rank writes what it saw.

    python fsdp2_fabric.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from _models import MLP, data, param_groups
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy

from lightning_pure_bf16 import AdamW
from lightning_pure_bf16.memory import sharded_model_state_report
from lightning_pure_bf16.safe_load import check_dcp_checkpoint

STEPS, BATCH = 4, 8


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:  # noqa: ANN001
    from torch.distributed.fsdp import fully_shard

    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def build(fabric: Fabric) -> tuple[torch.nn.Module, AdamW]:
    fabric.seed_everything(0)
    model = fabric.setup(MLP(64))
    optimizer = fabric.setup_optimizers(AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), seed=1234))
    return model, optimizer


def train(fabric: Fabric, model, optimizer, steps: range) -> tuple[list[float], list[dict]]:  # noqa: ANN001
    x, y = data(STEPS * BATCH * 2).tensors
    losses, reports = [], []
    for step in steps:
        lo = (step * 2 + fabric.global_rank) * BATCH
        loss = (model(x[lo : lo + BATCH]).float() - y[lo : lo + BATCH]).pow(2).mean()
        fabric.backward(loss)
        reports.append(sharded_model_state_report(optimizer.optimizer, model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, reports


def whole(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def main(out: Path) -> None:
    strategy = ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-true")
    fabric.launch()
    model, optimizer = build(fabric)
    losses, reports = train(fabric, model, optimizer, range(2))
    fabric.save(out / "mid.ckpt", {"model": model, "optimizer": optimizer})
    more, _ = train(fabric, model, optimizer, range(2, STEPS))
    model2, optimizer2 = build(fabric)
    check_dcp_checkpoint(out / "mid.ckpt")  # nothing in it would run code when read
    fabric.load(out / "mid.ckpt", {"model": model2, "optimizer": optimizer2})
    resumed, _ = train(fabric, model2, optimizer2, range(2, STEPS))
    torch.save(
        {
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "losses": losses + more,
            "resumed": resumed,
            "reports": reports,
            "params": whole(model),
            "resumed_params": whole(model2),
        },
        out / f"rank{fabric.global_rank}.pt",
    )


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    main(target)
