"""Fine-tunes tiny pretrained Hugging Face models of several families (as transformers' ``save_pretrained`` wrote
them) under the pure-bf16 Trainer strategy or Fabric, on 2 CPU ranks, one after the other in one process group; each
rank writes what the tests check to OUT/FAMILY/rank{R}.pt and the trained model to OUT/FAMILY/saved/.

    python tests/scripts/hf_families.py OUT '{"front": "trainer", "families": {"llama": "DIR", ...}, "steps": 3}'

A family named in ``"checkpoint"`` is also saved as a Trainer checkpoint (OUT/FAMILY/ckpt). A family named in
``"constructor"`` is built as the docs' hand-written recipe builds it (the model class called
in ``configure_model`` or ``init_module``, then ``load_pretrained``); the others by ``from_pretrained``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _models import partitions
from hf_gpt2 import gathered

import lightning_pure_bf16

BATCH, SEQUENCE = 2, 16


def batches(vocab_size: int, rank: int, steps: int) -> list[torch.Tensor]:
    """Each rank's batch, the same at every step, so that the loss falls within a few steps."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab_size, (BATCH, SEQUENCE), generator=g)] * steps


def build(path: str, hand_written: bool) -> torch.nn.Module:
    """The model, inside the strategy's partitioned init."""
    if not hand_written:
        return lightning_pure_bf16.from_pretrained(path)
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    return getattr(transformers, config.architectures[0])(config)


def record(out: Path, rank: int, **result: object) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")


def trainer_family(out: Path, path: str, hand_written: bool, steps: int, checkpoint: bool) -> None:
    from lightning.pytorch import LightningModule, Trainer, seed_everything
    from torch.utils.data import DataLoader

    class FineTune(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build(path, hand_written)
                if hand_written:  # the LightningModule keeps the model as self.model
                    lightning_pure_bf16.load_pretrained(self, path, key_map={"": "model."})
                self.loaded = partitions(self.model)

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_train_end(self) -> None:
            lightning_pure_bf16.save_pretrained(self, out / "saved", key_map={"model.": ""})

    seed_everything(0)
    module = FineTune()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="deepspeed_pure_bf16",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    rank = trainer.global_rank
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    # Each rank's own batches (no distributed sampler), so the first is known to the test.
    loader = DataLoader([row for batch in batches(vocab, rank, steps) for row in batch], batch_size=BATCH)
    trainer.fit(module, loader)
    if checkpoint:
        trainer.save_checkpoint(out / "ckpt")
    record(
        out,
        rank,
        loaded=module.loaded,
        losses=module.losses,
        first_batch=batches(vocab, rank, 1)[0],
        memory_report=trainer.strategy.memory_report(),
        trained=gathered(module.model),
        tied=_tied(module.model),
    )


def _tied(model: torch.nn.Module) -> bool:
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    return head is not None and head.weight is embeddings


def fabric_families(out: Path, families: dict[str, str], hand_written: list[str], steps: int) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="deepspeed_pure_bf16")
    fabric.launch()
    rank = fabric.global_rank
    for family, path in families.items():
        fabric.seed_everything(0)
        with fabric.init_module():
            model = build(path, family in hand_written)
        if family in hand_written:
            lightning_pure_bf16.load_pretrained(model, path)
        loaded = partitions(model)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        model.train()
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        losses = []
        for batch in batches(vocab, rank, steps):
            loss = model(input_ids=batch, labels=batch).loss
            fabric.backward(loss, model=model)  # one engine per family in this process
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        lightning_pure_bf16.save_pretrained(model, out / family / "saved")
        inner = model.module
        record(
            out / family,
            rank,
            loaded=loaded,
            losses=losses,
            first_batch=batches(vocab, rank, 1)[0],
            memory_report=fabric.strategy.memory_report(),
            trained=gathered(inner),
            tied=_tied(inner),
        )


if __name__ == "__main__":
    out, opts = Path(sys.argv[1]), json.loads(sys.argv[2])
    steps = opts.get("steps", 3)
    hand_written = opts.get("constructor", [])
    if opts["front"] == "fabric":
        fabric_families(out, opts["families"], hand_written, steps)
    else:
        for family, path in opts["families"].items():
            trainer_family(out / family, path, family in hand_written, steps, family in opts.get("checkpoint", []))
