"""Train a GPT-2 (byte-level, on the standard library's source as in ``gpt.py``) with the Hugging Face ``Trainer`` in
pure bf16: ``PureBF16Trainer`` in place of ``Trainer``, DeepSpeed ZeRO-3 at 8 bytes/param.

Launch it with ``torchrun`` (or ``accelerate launch``); without CUDA it runs on the CPU over gloo. ``--gpt2-small``
is GPT-2 124M's shape (12 layers x 768, 1024 positions) with a 256-byte vocabulary.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_trainer.py --max-steps 100
    torchrun --nproc_per_node 8 examples/hf_trainer.py --gpt2-small --ckpt-dir ckpts --ckpt-every 500
    torchrun --nproc_per_node 4 examples/hf_trainer.py --ckpt-dir ckpts --resume ckpts/checkpoint-500   # any ranks
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from gpt import ByteWindows, load_bytes, stdlib_files
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from lightning_pure_bf16.integrations.transformers import PureBF16Trainer, deepspeed_config
from lightning_pure_bf16.memory import format_report


class Windows(Dataset):
    """``ByteWindows`` as the Trainer takes them: the model shifts the labels itself."""

    def __init__(self, windows: ByteWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.windows[i]
        return {"input_ids": x, "labels": x}


def main() -> None:
    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=2000 if on_gpu else 200)
    parser.add_argument("--batch-size", type=int, default=16 if on_gpu else 8, help="per process")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--gpt2-small", action="store_true", help="12 layers x 768, 1024 positions")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounding", choices=("stochastic", "kahan", "nearest"), default="stochastic")
    parser.add_argument("--moments", choices=("bf16", "int8"), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-dir", default="hf_trainer_out", help="the Trainer's output_dir")
    parser.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps")
    parser.add_argument("--resume", default=None, help="a checkpoint-N directory (any number of ranks), or 'last'")
    args = parser.parse_args()
    if args.gpt2_small:
        args.n_layer, args.n_embd, args.block_size = 12, 768, 1024

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.block_size,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=max(2, args.n_embd // 64),
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    train_files, val_files = stdlib_files()
    windows = args.max_steps * args.batch_size * world
    train = Windows(ByteWindows(load_bytes(train_files), args.block_size, windows, args.seed))
    val = Windows(ByteWindows(load_bytes(val_files), args.block_size, 64 * world, args.seed + 1))
    training_args = TrainingArguments(
        output_dir=args.ckpt_dir,
        use_cpu=not on_gpu,
        bf16=True,
        deepspeed=deepspeed_config(),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=0.1,  # on the Trainer's decay group; biases and norms in its no-decay group
        adam_beta2=0.95,
        warmup_steps=min(50, args.max_steps // 10),
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        max_steps=args.max_steps,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=max(1, args.max_steps // 3),
        save_strategy="steps" if args.ckpt_every else "no",
        save_steps=args.ckpt_every or 1,
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = PureBF16Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=val,
        rounding=args.rounding,
        moments=args.moments,
    )
    resume = True if args.resume == "last" else args.resume
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(args.ckpt_dir, "final"))  # the consolidated bf16 weights: from_pretrained
    if trainer.is_world_process_zero():
        loss = metrics["eval_loss"]
        print(f"validation loss: {loss:.4f} nats/byte ({loss / math.log(2):.3f} bits/byte)")
        print(f"model state per parameter: {format_report(trainer.model_wrapped.pure_bf16.memory_report())}")


if __name__ == "__main__":
    main()
