"""Train the byte-level GPT of ``gpt.py`` in a plain DeepSpeed loop with ``lightning_pure_bf16.deepspeed.initialize``.

The same model, data, optimizer, schedule and report as ``train_gpt.py``, written as a DeepSpeed user writes it:
``initialize``, ``engine.backward``, ``engine.step``. Launch it with ``torchrun`` (or ``deepspeed``); on a machine
without CUDA set ``DS_ACCELERATOR=cpu`` (it runs over gloo).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_gpt.py --max-steps 100
    torchrun --nproc_per_node 8 examples/deepspeed_gpt.py --ckpt-dir ckpts --ckpt-every 100
    torchrun --nproc_per_node 4 examples/deepspeed_gpt.py --resume ckpts   # the newest; or ckpts/global_step100
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import ByteWindows, adamw, job_arguments, job_model, load_bytes, lr_factor, stdlib_files
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import lightning_pure_bf16.deepspeed as pure_bf16
from lightning_pure_bf16.memory import format_report


def loss_of(engine, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = (t.to(engine.device) for t in batch)
    logits = engine(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


@torch.no_grad()
def validate(engine, loader, batches: int) -> float:
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for i, batch in enumerate(loader):
        if i == batches:
            break
        total += torch.stack(
            [loss_of(engine, batch).double(), torch.ones((), dtype=torch.float64, device=total.device)]
        )
    engine.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])  # the mean over every rank's batches


def main() -> None:
    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    parser = job_arguments(__doc__.splitlines()[0])
    parser.set_defaults(devices=None)  # the launcher decides the number of ranks
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = job_model(args)
    optimizer = adamw(model, args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(50, args.max_steps))
    # The torch AdamW becomes the pure-bf16 one; the scheduler follows it and is saved in the checkpoints.
    engine, optimizer, _, scheduler = pure_bf16.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config={"train_micro_batch_size_per_gpu": args.batch_size, "gradient_clipping": 1.0},
        rounding=args.rounding,
        seed=args.seed,
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    train_files, val_files = stdlib_files()
    train_set = ByteWindows(load_bytes(train_files), 128, args.max_steps * args.batch_size * world, args.seed)
    val_set = ByteWindows(load_bytes(val_files), 128, 256, args.seed + 1)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False))
    state = {"step": 0}
    if args.resume:
        # Written by any number of ranks: a checkpoint directory (its newest, named by `latest`) or one checkpoint.
        state.update(engine.load_checkpoint(args.resume)[1])
    # The windows are in random order already and read in order: step s reads windows [s*B*W, (s+1)*B*W) whatever
    # the number of ranks W, so a resumed run (on any number of ranks) starts at the window after the last one read.
    remaining = Subset(train_set, range(state["step"] * args.batch_size * world, len(train_set)))
    train_loader = DataLoader(
        remaining, batch_size=args.batch_size, sampler=DistributedSampler(remaining, shuffle=False)
    )
    val_every, val_batches = max(1, args.max_steps // 3), 16 if on_gpu else 4
    val_loss, tokens, start, first = None, 0, time.perf_counter(), state["step"]
    batches = iter(train_loader)
    while state["step"] < args.max_steps:
        batch = next(batches)
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()  # the optimizer step and the scheduler's
        state["step"] += 1
        tokens += batch[0].numel() * world
        if state["step"] % 10 == 0 and rank == 0:
            print(f"step {state['step']}: train loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
        if state["step"] % val_every == 0:
            val_loss = validate(engine, val_loader, val_batches)
            if rank == 0:
                print(f"step {state['step']}: validation loss {val_loss:.4f}")
        if args.ckpt_dir and args.ckpt_every and state["step"] % args.ckpt_every == 0:
            # Staged and fsynced: ckpt_dir/global_step<N>, then the `latest` file naming it.
            engine.save_checkpoint(args.ckpt_dir, client_state={"step": state["step"]})
    elapsed = time.perf_counter() - start
    if rank == 0:
        lines = [
            f"validation loss: {val_loss:.4f} nats/byte ({val_loss / math.log(2):.3f} bits/byte)"
            if val_loss is not None
            else "validation loss: not computed",
            f"training throughput: {tokens / elapsed:,.0f} tokens/s over {world} process(es),"
            f" {state['step'] - first} steps in {elapsed:.0f} s (global step {state['step']})",
            f"model state per parameter: {format_report(engine.pure_bf16.memory_report())}",
        ]
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
