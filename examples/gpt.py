"""A small GPT trained byte-level on the Python standard library's own source: model, data and LightningModule.

The model follows the shape of a single-file GPT (config dataclass, attention, MLP, block, model). The corpus is the
``.py`` files at the top of the running interpreter's standard library (found through ``sysconfig``), which every
machine with Python has; files are split into train and validation by a hash of their name.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MeanMetric

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as err:  # pragma: no cover - an install without the examples' extra
    raise ImportError(
        "The examples need torchdata (its StatefulDataLoader resumes a checkpoint mid-epoch): "
        'pip install -e ".[examples]" (or pip install "torchdata>=0.10").'
    ) from err

# torchdata 0.11 calls a torch function that torch 2.13 deprecates; nothing for a user to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


@dataclass
class GPTConfig:
    block_size: int = 128  # context length in bytes
    vocab_size: int = 256  # byte-level: every byte value is a token
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # off: the comparisons in benchmarks/ want identical runs to differ only by the optimizer


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                # Residual projections scaled down with depth (GPT-2).
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """The standard library's top-level ``.py`` files, split by a hash of the name: about 1 in 10 for validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"No .py files in the standard library directory '{root}'.")
    is_val = [int(hashlib.sha1(f.name.encode()).hexdigest(), 16) % 10 == 0 for f in files]
    return [f for f, v in zip(files, is_val) if not v], [f for f, v in zip(files, is_val) if v]


def load_bytes(files: list[Path]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"\n".join(f.read_bytes() for f in files)), dtype=torch.uint8).clone()


class ByteWindows(Dataset):
    """``n`` windows of ``block_size + 1`` bytes at fixed pseudo-random offsets (the same for every run and rank)."""

    def __init__(self, data: torch.Tensor, block_size: int, n: int, seed: int) -> None:
        self.data, self.block_size = data, block_size
        g = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(data) - block_size - 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[self.offsets[i] : self.offsets[i] + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibBytes(LightningDataModule):
    """Train/validation byte windows from the standard library's source.

    Args:
        block_size: context length (default: ``128``).
        batch_size: windows per batch per process (default: ``16``).
        train_windows: windows in one training epoch (default: ``100000``).
        val_windows: fixed validation windows (default: ``256``).
        seed: seed of the window offsets (default: ``0``).
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        train_windows: int = 100_000,
        val_windows: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.block_size, self.batch_size = block_size, batch_size
        self.train_windows, self.val_windows, self.seed = train_windows, val_windows, seed

    def setup(self, stage: str | None = None) -> None:
        train_files, val_files = stdlib_files()
        self.train_bytes, self.val_bytes = load_bytes(train_files), load_bytes(val_files)
        self.train_set = ByteWindows(self.train_bytes, self.block_size, self.train_windows, self.seed)
        self.val_set = ByteWindows(self.val_bytes, self.block_size, self.val_windows, self.seed + 1)

    def train_dataloader(self) -> StatefulDataLoader:
        # Stateful: a checkpoint records how far into the epoch training was, and a run resumed from it continues
        # with the next batch, exactly as if it had not stopped. (The windows are already in random order.)
        return StatefulDataLoader(self.train_set, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)


class GPTModule(LightningModule):
    """A plain fp32 LightningModule: nothing in it knows about bf16.

    Args:
        block_size, n_layer, n_head, n_embd: the :class:`GPTConfig` fields.
        lr: peak learning rate of AdamW (default: ``3e-4``).
        weight_decay: decoupled weight decay on matrices (default: ``0.1``).
        warmup_steps: linear warm-up (default: ``50``).
        max_steps: length of the cosine decay to 10% of ``lr`` (default: ``1000``).
    """

    def __init__(
        self,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
        self.val_loss = MeanMetric()
        # One window: Lightning's model summary measures the forward's FLOPs on it (without it, it prints 0).
        self.example_input_array = torch.zeros(1, block_size, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        # Cross-entropy in fp32 whatever the model's dtype: a bf16 softmax over 256 classes loses precision.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch))

    def on_validation_epoch_end(self) -> None:
        self.log("val_loss", self.val_loss.compute(), prog_bar=True, sync_dist=True)
        self.val_loss.reset()

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own union type
        hp = self.hparams
        optimizer = adamw(self, hp.lr, hp.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(hp.warmup_steps, hp.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def adamw(module: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """torch AdamW with weight decay on the matrices only (biases and norms in a group without), betas (0.9, 0.95).

    A model built in ``configure_model`` is already partitioned by ZeRO-3 into flat pieces here, so a parameter's
    shape is read from ``ds_shape`` where it has one."""
    decay = [p for p in module.parameters() if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for p in module.parameters() if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def job_model(args: argparse.Namespace) -> GPT:
    """The GPT of the command-line jobs: 128-byte context, ``--n-layer`` x ``--n-embd``, 64-wide heads (at least 4)."""
    return GPT(GPTConfig(block_size=128, n_layer=args.n_layer, n_head=max(4, args.n_embd // 64), n_embd=args.n_embd))


def job_arguments(description: str) -> argparse.ArgumentParser:
    """The command-line options train_gpt.py (Trainer) and fabric_gpt.py (Fabric) share, with the same defaults."""
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", type=int, default=torch.cuda.device_count() if on_gpu else 2)
    parser.add_argument("--max-steps", type=int, default=2000 if on_gpu else 400)
    parser.add_argument("--rounding", choices=("stochastic", "kahan", "nearest"), default="stochastic")
    parser.add_argument("--batch-size", type=int, default=64 if on_gpu else 16, help="per process")
    parser.add_argument("--n-layer", type=int, default=6 if on_gpu else 4)
    parser.add_argument("--n-embd", type=int, default=384 if on_gpu else 128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-dir", default=None, help="save checkpoints there (step-N.ckpt)")
    parser.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps (with --ckpt-dir)")
    parser.add_argument("--resume", default=None, help="continue from this checkpoint (any world size, mid-epoch too)")
    parser.add_argument(
        "--cpu-matmul",
        choices=("auto", "bf16", "float32"),
        default="auto",
        help="CPU only: matrix products in float32 from the bf16 values (auto: where the CPU has no native bf16)",
    )
    return parser


def lr_factor(warmup_steps: int, max_steps: int):  # noqa: ANN201
    """Linear warm-up, then cosine decay to 10% at ``max_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class TrainingReport(Callback):
    """At the end of fit, rank 0 prints the validation loss, training tokens/s and the model-state memory report."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._tokens, self._start, self._first_step = 0, time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:  # noqa: ANN001
        self._tokens += batch[0].numel() * trainer.world_size

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        elapsed = time.perf_counter() - self._start
        self.tokens_per_s = self._tokens / elapsed
        val = trainer.callback_metrics.get("val_loss")
        lines = [
            f"validation loss: {float(val):.4f} nats/byte ({float(val) / math.log(2):.3f} bits/byte)"
            if val is not None
            else "validation loss: not computed",
            f"training throughput: {self.tokens_per_s:,.0f} tokens/s over {trainer.world_size} process(es),"
            f" {trainer.global_step - self._first_step} steps in {elapsed:.0f} s (global step {trainer.global_step})",
        ]
        report = getattr(trainer.strategy, "memory_report", None)
        if report is not None:
            from lightning_pure_bf16.memory import format_report

            lines.append(f"model state per parameter: {format_report(report())}")
        rank_zero_info("\n".join(lines))
