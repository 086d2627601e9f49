"""Fine-tune a pretrained Hugging Face causal LM in pure bf16 with ``Trainer(strategy="deepspeed_pure_bf16")``.

The run the package exists for: a model's config and weights read from its directory or the Hugging Face Hub, the
model built partitioned over the processes (each reads only its own slices of the weights), fine-tuned with 8 bytes
per parameter of model state, and written back with ``save_pretrained`` beside its tokenizer, ready for transformers,
vLLM or the Hub. It prints the evaluation loss before and after, the memory per parameter, and a greedy generation
of the saved model reloaded by transformers.

    python examples/finetune.py --model HuggingFaceTB/SmolLM2-135M --out finetuned/        # a hub id (network)
    python examples/finetune.py --model path/to/model --data my_texts/ --max-steps 500     # a local directory
    python examples/finetune.py --model path/to/model --strategy deepspeed_pure_bf16_int8  # 6 B/param

The data is text files (``--data``: files or directories, read recursively; default: the Python standard library's
source), tokenized with the model's tokenizer and packed into blocks, split into training and evaluation by file.
On a CPU-only machine it runs 2 processes (gloo); on a GPU machine it uses the GPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sysconfig
import time
from pathlib import Path

import torch
from gpt import adamw, lr_factor
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

import lightning_pure_bf16

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl")


def text_files(paths: list[str] | None) -> list[Path]:
    """The text files under ``paths`` (files, or directories read recursively), sorted; the standard library's
    top-level source files without ``paths``."""
    if not paths:
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files.extend(p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"--data '{path}' is neither a file nor a directory.")
    if not files:
        raise FileNotFoundError(f"No text files ({', '.join(TEXT_SUFFIXES)}) under {paths}.")
    return files


def is_evaluation(path: Path) -> bool:
    """About one file in ten, by a hash of its name: the same split on every process and every run."""
    return int(hashlib.sha1(path.name.encode()).hexdigest(), 16) % 10 == 0


class TextBlocks(LightningDataModule):
    """Text files tokenized with the model's tokenizer and packed into blocks of ``block_size`` tokens (documents
    joined by the end-of-sequence token); training and evaluation blocks from different files.

    Args:
        pretrained: the model's directory or hub id, whose tokenizer is used.
        data: text files or directories (default: ``None``, the standard library's source).
        block_size: tokens per block (default: ``256``).
        batch_size: blocks per batch and process (default: ``8``).
        train_blocks: training blocks in all (default: ``4096``): tokenized until there are this many.
        eval_blocks: evaluation blocks (default: ``64``).
    """

    def __init__(
        self,
        pretrained: str,
        data: list[str] | None = None,
        block_size: int = 256,
        batch_size: int = 8,
        train_blocks: int = 4096,
        eval_blocks: int = 64,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _blocks(self, files: list[Path], count: int) -> torch.Tensor:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.hparams.pretrained)
        size = self.hparams.block_size
        ids: list[int] = []
        for file in files:  # only as much text as the blocks need
            ids.extend(tokenizer(file.read_text(errors="replace"))["input_ids"])
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
            if len(ids) >= count * size:
                break
        n = min(count, len(ids) // size)
        if n == 0:
            raise ValueError(f"{len(ids)} tokens of text: not one block of {size}; give more --data.")
        return torch.tensor(ids[: n * size]).view(n, size)

    def setup(self, stage: str | None = None) -> None:
        files = text_files(self.hparams.data)
        self.train_set = self._blocks([f for f in files if not is_evaluation(f)], self.hparams.train_blocks)
        self.eval_set = self._blocks([f for f in files if is_evaluation(f)], self.hparams.eval_blocks)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_set, batch_size=self.hparams.batch_size)


class FineTune(LightningModule):
    """A Hugging Face causal LM fine-tuned with torch AdamW (the strategy makes it pure bf16), saved at the end.

    Args:
        pretrained: the model's directory or hub id.
        out: where the fine-tuned model is written with its config and tokenizer (default: ``None``: not saved).
        lr: peak learning rate (default: ``1e-4``).
        weight_decay: decoupled weight decay on matrices (default: ``0.0``).
        warmup_steps: linear warm-up (default: ``20``).
        max_steps: length of the cosine decay to 10% of ``lr``; keep it equal to the Trainer's (default: ``200``).
    """

    def __init__(
        self,
        pretrained: str,
        out: str | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 20,
        max_steps: int = 200,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = None
        self.eval_loss = MeanMetric()  # kept in float32 by the strategy's precision plugin
        self.eval_losses: list[tuple[int, float]] = []

    def configure_model(self) -> None:
        # Under the strategy this runs inside ZeRO-3's partitioned init: the model is built partitioned and each
        # process reads only its own slices of the weights.
        if self.model is None:
            self.model = lightning_pure_bf16.from_pretrained(self.hparams.pretrained)
            self.model.config.use_cache = False  # no key-value cache in training

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.eval_loss.update(self.model(input_ids=batch, labels=batch).loss)

    def on_validation_epoch_end(self) -> None:
        loss = float(self.eval_loss.compute())  # the mean over every process's blocks
        self.eval_loss.reset()
        self.eval_losses.append((self.global_step, loss))
        when = "before fine-tuning" if self.trainer.sanity_checking else f"after {self.global_step} steps"
        rank_zero_info(f"evaluation loss {when}: {loss:.4f} (perplexity {math.exp(min(loss, 50)):.2f})")
        if not self.trainer.sanity_checking:
            self.log("eval_loss", loss, sync_dist=False)

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own union type
        hp = self.hparams
        optimizer = adamw(self, hp.lr, hp.weight_decay)  # matrices decay; biases and norms do not
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(hp.warmup_steps, hp.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        self._start = time.perf_counter()

    def on_train_end(self) -> None:
        elapsed = time.perf_counter() - self._start
        report = getattr(self.trainer.strategy, "memory_report", None)
        if report is not None:
            from lightning_pure_bf16.memory import format_report

            rank_zero_info(f"model state per parameter: {format_report(report())}")
        rank_zero_info(f"{self.global_step} steps in {elapsed:.0f} s on {self.trainer.world_size} process(es)")
        if self.hparams.out:
            # Every process takes part: each parameter is gathered onto the first in turn and streamed to its shard.
            lightning_pure_bf16.save_pretrained(self, self.hparams.out, key_map={"model.": ""})
            if self.trainer.is_global_zero:
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(self.hparams.pretrained).save_pretrained(self.hparams.out)
                rank_zero_info(f"saved the fine-tuned model, its config and tokenizer to {self.hparams.out}")


def generate(directory: str, prompt: str, max_new_tokens: int) -> str:
    """The saved model reloaded by transformers, as anyone downstream loads it, and its greedy continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    # On a CPU, float32 arithmetic from the bf16 weights (exact): bf16 products are slow on many CPUs.
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    return tokenizer.decode(output[0], skip_special_tokens=True)


def main() -> None:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory or hub id")
    parser.add_argument("--data", nargs="*", default=None, help="text files or directories (default: the stdlib)")
    parser.add_argument("--out", default="finetuned", help="where the fine-tuned model is saved")
    parser.add_argument("--strategy", default="deepspeed_pure_bf16", help="any deepspeed_pure_bf16* preset")
    parser.add_argument("--devices", type=int, default=torch.cuda.device_count() if on_gpu else 2)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="blocks per process")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per block")
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default="def fibonacci(n):", help="the prompt of the generation at the end")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()

    seed_everything(args.seed)
    module = FineTune(args.model, out=args.out, lr=args.lr, max_steps=args.max_steps)
    data = TextBlocks(
        args.model,
        data=args.data,
        block_size=args.block_size,
        batch_size=args.batch_size,
        train_blocks=args.max_steps * args.batch_size * args.devices,  # one pass, no block repeated
        eval_blocks=args.eval_blocks,
    )
    trainer = Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        max_epochs=1,  # the training blocks are one pass of max_steps batches; evaluated again at its end
        num_sanity_val_steps=-1,  # the whole evaluation set before the first step: the loss before fine-tuning
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    trainer.fit(module, data)
    if trainer.is_global_zero:
        text = generate(args.out, args.prompt, args.max_new_tokens)
        print(f"greedy generation of the saved model, reloaded by transformers:\n{text}")


if __name__ == "__main__":
    main()
