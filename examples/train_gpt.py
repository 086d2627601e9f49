"""Train the small byte-level GPT of ``gpt.py`` with ``Trainer(strategy="deepspeed_pure_bf16")``.

On a CPU-only machine it runs 2 processes (gloo) for a few minutes; on a GPU machine it uses the GPUs. It ends by
printing the validation loss, the training throughput and the measured model-state memory per parameter.

    python examples/train_gpt.py                        # the defaults below
    python examples/train_gpt.py --rounding kahan --max-steps 500
    python examples/train_gpt.py --state-dir /local/nvme/tmp     # optimizer states in memory-mapped files
    python examples/train_gpt.py --gradient-release     # each partition updated as its gradient arrives (6 B/param)
    python examples/train_gpt.py --ckpt-dir ckpts --ckpt-every 100     # checkpoints; then, on any number of devices:
    python examples/train_gpt.py --ckpt-dir ckpts --resume ckpts/last.ckpt
"""

from __future__ import annotations

import torch
from gpt import GPTModule, StdlibBytes, TrainingReport, job_arguments
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pure_bf16 import DeepSpeedPureBF16Strategy, PureBF16Precision


def main() -> None:
    on_gpu = torch.cuda.is_available()
    parser = job_arguments(__doc__.splitlines()[0])
    parser.add_argument("--state-dir", default=None, help="keep the optimizer states in memory-mapped files there")
    parser.add_argument("--gradient-release", action="store_true", help="update each partition as its gradient arrives")
    args = parser.parse_args()

    seed_everything(args.seed)
    model = GPTModule(
        n_layer=args.n_layer, n_embd=args.n_embd, n_head=max(4, args.n_embd // 64), lr=args.lr, max_steps=args.max_steps
    )
    data = StdlibBytes(batch_size=args.batch_size, train_windows=args.max_steps * args.batch_size * args.devices)
    checkpoints = []
    if args.ckpt_dir:
        checkpoints.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="step-{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=args.ckpt_every or args.max_steps,
                save_top_k=-1,
                save_last=True,
            )
        )
    trainer = Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=args.devices,
        strategy=DeepSpeedPureBF16Strategy(
            rounding=args.rounding,
            state_storage="mmap" if args.state_dir else "memory",
            state_dir=args.state_dir,
            gradient_release=args.gradient_release,
        ),
        plugins=[PureBF16Precision(cpu_matmul=args.cpu_matmul)],
        max_steps=args.max_steps,
        # The data module's epoch is exactly max_steps batches per process: one epoch (the progress bar says 0/0).
        max_epochs=1,
        val_check_interval=max(1, args.max_steps // 3),
        limit_val_batches=16 if on_gpu else 4,
        num_sanity_val_steps=0,
        callbacks=[TrainingReport()] + checkpoints,
        logger=False,
        enable_checkpointing=bool(checkpoints),
        log_every_n_steps=10,
    )
    trainer.fit(model, data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
