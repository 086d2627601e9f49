"""``Trainer(strategy="fsdp2_pure_bf16...")`` on 2 CPU processes: a LightningModule that applies ``fully_shard`` in
``configure_model`` and returns a ``torch.optim.AdamW`` with an LR scheduler. Two fits per strategy in one launch: 4
steps with a checkpoint every 2 (mid-epoch, shuffled), and the last 2 resumed from the first checkpoint; each rank
writes what it saw.

    python fsdp2_lightning.py OUT '{"strategies": ["fsdp2_pure_bf16", "fsdp2_pure_bf16_int8"]}'
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from _models import MLP, data, param_groups
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_pure_bf16  # registers the strategies

STEPS = 4


class Sharded(LightningModule):
    def __init__(self, shard: bool = True, optimizer: str = "adamw") -> None:
        super().__init__()
        self.model = MLP(64)
        self.shard = shard
        self.optimizer = optimizer

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if not self.shard:  # a module that forgot to shard itself
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = (self.model(x).float() - y).pow(2).mean()
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        if self.optimizer == "torch_adafactor":
            return torch.optim.Adafactor(self.model.parameters(), lr=1e-2)
        if self.optimizer == "muon":  # the package's own form: its matrices orthogonalized, AdamW on the biases
            matrices = [p for p in self.model.parameters() if p.ndim == 2]
            rest = [p for p in self.model.parameters() if p.ndim != 2]
            groups = [{"params": matrices}, {"params": rest, "use_muon": False}]
            return lightning_pure_bf16.Muon(groups, lr=2e-2, weight_decay=0.01)
        optimizer = torch.optim.AdamW(param_groups(self.model), lr=1e-2, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.reports: list[dict] = []
        self.lrs: list[float] = []
        self.batches: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.initial = {n: p.detach().full_tensor().clone() for n, p in pl_module.model.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.reports.append(trainer.strategy.memory_report())  # gradients exist here: measured, not assumed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))
        self.batches.append(float(batch[0].float().sum()))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit(
    out: Path,
    strategy: str,
    ckpt_path: str | None = None,
    shard: bool = True,
    clip: float | None = None,
    optimizer: str = "adamw",
) -> dict:
    seed_everything(0)
    record = Record()
    # Every 2 steps (mid-epoch: 4 batches per epoch and rank) a checkpoint, a DCP folder.
    every = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, every],
        gradient_clip_val=clip,
    )
    module = Sharded(shard, optimizer)
    trainer.fit(module, DataLoader(data(64), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    params = {n: p.detach().full_tensor().clone() for n, p in module.model.named_parameters()}
    states = {
        f"{n}.{k}": v.full_tensor().clone()
        for n, p in module.model.named_parameters()
        for k, v in optimizer.state[p].items()
        if hasattr(v, "full_tensor")
    }
    local_states = {  # what each rank holds of every state: per-element states sharded like their parameter
        f"{n}.{k}": (v.dtype, tuple(v.to_local().shape) if hasattr(v, "to_local") else None, tuple(p.to_local().shape))
        for n, p in module.model.named_parameters()
        for k, v in optimizer.state[p].items()
        if isinstance(v, torch.Tensor) and v.ndim
    }
    return {
        "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        "seed": optimizer.seed,
        "scheduler_bound": [c.scheduler.optimizer is optimizer for c in trainer.lr_scheduler_configs],
        "losses": record.losses,
        "lrs": record.lrs,
        "batches": record.batches,
        "reports": record.reports,
        "params": params,
        "initial_params": record.initial,
        "states": states,
        "local_states": local_states,
        "rank": trainer.global_rank,
        "optimizer_object": optimizer,
    }


def main(out: Path, opts: dict) -> None:
    if opts.get("refusals"):
        errors = {}
        for name, kwargs in {
            "unsharded": {"strategy": "fsdp2_pure_bf16", "shard": False},
            "release_clip": {"strategy": "fsdp2_pure_bf16_release", "clip": 1.0},
        }.items():
            try:
                fit(out / name, **kwargs)
                errors[name] = None
            except (RuntimeError, ValueError) as err:
                errors[name] = str(err)
        torch.save(errors, out / f"refusals_rank{int(os.environ.get('LOCAL_RANK', 0))}.pt")
    if opts.get("clip"):
        # Clipping by norm: the factor the precision plugin establishes at each step, and the factor each step of
        # the optimizer is given.
        from lightning_pure_bf16 import AdamW
        from lightning_pure_bf16.fsdp2 import FSDP2PureBF16Precision

        factors, stepped = [], []
        clip, step = FSDP2PureBF16Precision.clip_grad_by_norm, AdamW.step  # the adopted optimizer's class

        def recorded(self, optimizer, clip_val):  # noqa: ANN001, ANN202
            clip(self, optimizer, clip_val)
            factors.append(self.clipped(optimizer)[0])

        def recorded_step(self, closure=None, **kwargs):  # noqa: ANN001, ANN202
            stepped.append((kwargs.get("grad_scale", 1.0), kwargs.get("grads_finite", False)))
            return step(self, closure, **kwargs)

        FSDP2PureBF16Precision.clip_grad_by_norm, AdamW.step = recorded, recorded_step
        clipped = fit(out / "clip", "fsdp2_pure_bf16", clip=opts["clip"])
        FSDP2PureBF16Precision.clip_grad_by_norm, AdamW.step = clip, step
        clipped.pop("optimizer_object")
        clipped |= {"factors": factors, "stepped": stepped}
        torch.save(clipped, out / f"clip_rank{clipped['rank']}.pt")
    for name in opts.get("optimizers", []):
        # Whole-parameter algorithms over FSDP2's row shards: a fit of STEPS steps, what each rank held.
        result = fit(out / name, "fsdp2_pure_bf16", optimizer=name)
        result.pop("optimizer_object")
        torch.save(result, out / f"{name}_rank{result['rank']}.pt")
    for strategy in opts.get("strategies", ["fsdp2_pure_bf16"]):
        where = out / strategy
        where.mkdir(parents=True, exist_ok=True)
        whole = fit(where, strategy)
        resumed = fit(where / "resumed", strategy, ckpt_path=str(where / "ckpts" / "step=2.ckpt"))
        for result in (whole, resumed):
            result.pop("optimizer_object")
        torch.save({"whole": whole, "resumed": resumed}, where / f"rank{whole['rank']}.pt")


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out, json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
