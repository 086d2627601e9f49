"""Train the byte-level GPT of ``gpt.py`` in a plain Fabric loop with ``Fabric(strategy="deepspeed_pure_bf16")``.

The same model, data, optimizer, schedule and validation as ``train_gpt.py`` (the Trainer main job), written the way
litgpt-style scripts are: ``fabric.setup``, ``fabric.backward``, the step in the loop. It ends by printing the same
report: validation loss, training throughput, model-state memory per parameter.

    python examples/fabric_gpt.py                                  # the defaults of train_gpt.py
    python examples/fabric_gpt.py --ckpt-dir ckpts --ckpt-every 100
    python examples/fabric_gpt.py --ckpt-dir ckpts --resume ckpts/step-100.ckpt   # any number of devices
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpt import StdlibBytes, adamw, job_arguments, job_model, lr_factor
from lightning.fabric import Fabric
from torchmetrics import MeanMetric

from lightning_pure_bf16 import DeepSpeedPureBF16FabricStrategy, PureBF16FabricPrecision
from lightning_pure_bf16.memory import format_report


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    # Cross-entropy in fp32 whatever the model's dtype: a bf16 softmax over 256 classes loses precision.
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


@torch.no_grad()
def validate(fabric: Fabric, model: torch.nn.Module, loader, batches: int) -> float:
    model.eval()
    metric = MeanMetric().to(fabric.device)
    for i, batch in enumerate(loader):
        if i == batches:
            break
        metric.update(loss_of(model, batch))
    model.train()
    return float(metric.compute())  # the mean over every rank's batches


def main() -> None:
    on_gpu = torch.cuda.is_available()
    parser = job_arguments(__doc__.splitlines()[0])
    args = parser.parse_args()

    fabric = Fabric(
        accelerator="gpu" if on_gpu else "cpu",
        devices=args.devices,
        strategy=DeepSpeedPureBF16FabricStrategy(rounding=args.rounding),
        plugins=[PureBF16FabricPrecision(cpu_matmul=args.cpu_matmul)],
    )
    fabric.launch()
    fabric.seed_everything(args.seed)
    model = job_model(args)
    optimizer = adamw(model, args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    # The optimizer fabric.setup returned is a torch optimizer: schedulers are built on it as usual.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(50, args.max_steps))

    data = StdlibBytes(batch_size=args.batch_size, train_windows=args.max_steps * args.batch_size * args.devices)
    data.setup()
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())
    # The train loader is stateful: a checkpoint records how far into the epoch training was.
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": train_loader, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    val_every, val_batches = max(1, args.max_steps // 3), 16 if on_gpu else 4
    val_loss, tokens, start, first = None, 0, time.perf_counter(), state["step"]
    batches = iter(train_loader)
    while state["step"] < args.max_steps:
        batch = next(batches)
        loss = loss_of(model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        tokens += batch[0].numel() * fabric.world_size
        if state["step"] % 10 == 0:
            fabric.print(f"step {state['step']}: train loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
        # Validation after the same steps as the Trainer job's `val_check_interval`.
        if state["step"] % val_every == 0:
            val_loss = validate(fabric, model, val_loader, val_batches)
            fabric.print(f"step {state['step']}: validation loss {val_loss:.4f}")
        if args.ckpt_dir and args.ckpt_every and state["step"] % args.ckpt_every == 0:
            fabric.save(Path(args.ckpt_dir) / f"step-{state['step']}.ckpt", state)
    elapsed = time.perf_counter() - start
    report = fabric.strategy.memory_report()
    lines = [
        f"validation loss: {val_loss:.4f} nats/byte ({val_loss / math.log(2):.3f} bits/byte)"
        if val_loss is not None
        else "validation loss: not computed",
        f"training throughput: {tokens / elapsed:,.0f} tokens/s over {fabric.world_size} process(es),"
        f" {state['step'] - first} steps in {elapsed:.0f} s (global step {state['step']})",
        f"model state per parameter: {format_report(report)}",
    ]
    if fabric.strategy.skipped_steps:
        lines.append(f"steps skipped on an inf/NaN gradient: {fabric.strategy.skipped_steps}")
    fabric.print("\n".join(lines))


if __name__ == "__main__":
    main()
