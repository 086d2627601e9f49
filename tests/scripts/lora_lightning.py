"""PEFT LoRA on the tiny GPT-2 under the Lightning strategy: ``Trainer(strategy="deepspeed_pure_bf16", devices=2)``
launches the second rank itself; each rank writes what it saw, rank 0 the adapters (PEFT's ``save_pretrained``).

    python lora_lightning.py OUT '{"steps": 4}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
from hf_gpt2 import dataset, lora_gpt2, lora_report
from lightning.pytorch import LightningModule, Trainer

from lightning_pure_bf16 import DeepSpeedPureBF16Strategy


class LoRA(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = lora_gpt2()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def main(out: Path, opts: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    module = LoRA()
    before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DeepSpeedPureBF16Strategy(),
        max_steps=opts["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    rank = trainer.global_rank
    result = lora_report(module.model, before, trainer.strategy.memory_report(), out, rank)
    result["losses"] = module.losses
    with deepspeed.zero.GatheredParameters(list(module.model.parameters())):  # every rank takes part
        if rank == 0:
            module.model.save_pretrained(str(out / "adapter"))
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
