"""A LightningCLI script that only imports the package; the strategy comes from the command line or a YAML config.

python tests/scripts/cli_mlp.py OUT fit --config cfg.yaml
python tests/scripts/cli_mlp.py OUT fit --trainer.strategy deepspeed_pure_bf16 ...
python tests/scripts/cli_mlp.py OUT '{"runs": [{"name": ..., "args": [...], "env": {...}}, ...]}'   # 1 rank each
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _runs import run_all
from fit_mlp import MLP, data
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

import lightning_pure_bf16  # noqa: F401  (registers the strategy names)


class CLIModel(MLP):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__({"optimizer": "torch_adamw"})
        self.lr = lr


class Data(LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(), batch_size=16)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(data(32), batch_size=16)


def main(out: Path, args: list[str]) -> None:
    cli = LightningCLI(CLIModel, Data, save_config_kwargs={"overwrite": True}, args=args)
    trainer = cli.trainer
    torch.save(
        {
            "strategy": type(trainer.strategy).__name__,
            "rounding": trainer.strategy.rounding,
            "optimizer": type(trainer.strategy.pure_bf16_optimizer).__name__,
            "memory_report": trainer.strategy.memory_report(),
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
        },
        out / f"cli_rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    # sys.argv stays whole: Lightning starts the other ranks by re-running this command line.
    if sys.argv[2].startswith("{"):
        run_all(lambda out, run: main(out, run["args"]), Path(sys.argv[1]), json.loads(sys.argv[2]))
    else:
        main(Path(sys.argv[1]), sys.argv[2:])
