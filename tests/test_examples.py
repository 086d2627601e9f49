"""The GPT example: its data split and model, and the two ways to run it (script and LightningCLI), briefly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import warm
from tests.strategy_runs import _env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from gpt import GPT, GPTConfig, StdlibBytes, stdlib_files  # noqa: E402


def test_stdlib_corpus_is_split_by_file():
    train, val = stdlib_files()
    assert train and val and not set(train) & set(val)
    assert 0.03 < len(val) / (len(train) + len(val)) < 0.2


def test_data_windows_are_next_byte_targets():
    data = StdlibBytes(block_size=16, batch_size=2, train_windows=8, val_windows=4)
    data.setup()
    x, y = data.train_set[3]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])


def test_gpt_shapes():
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    assert model(torch.randint(0, 256, (3, 16))).shape == (3, 16, 256)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    command, env = warm.command([sys.executable, *args], _env())
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=EXAMPLES)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _cli_run(cli_class, model_class, data_class, config: str, *args: str, monkeypatch):
    """The run a LightningCLI config describes, built in this process (nothing trained): every key must be one of the
    classes' or the Trainer's, and the strategy's name registered."""
    monkeypatch.chdir(EXAMPLES)
    environment = dict(os.environ)
    try:
        return cli_class(model_class, data_class, run=False, args=["--config", config, *args])
    finally:  # seed_everything's PL_GLOBAL_SEED and the like stay out of the fits this process launches later
        os.environ.clear()
        os.environ.update(environment)


def test_gpt_yaml_builds_the_main_jobs_run_through_lightning_cli(monkeypatch):
    # The run itself is train_gpt.py's (the same module, data and report), tested above and below.
    from gpt import GPTModule, StdlibBytes, TrainingReport
    from lightning.pytorch.cli import LightningCLI

    import lightning_pure_bf16  # noqa: F401  (as gpt_cli.py: registers the config's strategy name)

    cli = _cli_run(LightningCLI, GPTModule, StdlibBytes, "gpt.yaml", monkeypatch=monkeypatch)
    trainer, data = cli.trainer, cli.datamodule
    assert type(trainer.strategy).__name__ == "DeepSpeedPureBF16Strategy"
    assert any(isinstance(c, TrainingReport) for c in trainer.callbacks)
    assert trainer.max_steps == cli.model.hparams.max_steps
    # One pass of max_steps batches on every process, as the config's comment says.
    assert data.train_windows == trainer.max_steps * data.batch_size * trainer.num_devices


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny Llama-architecture model with a trained BPE tokenizer, as examples/local_model.py makes it."""
    from local_model import save_local_model

    return save_local_model(tmp_path_factory.mktemp("local") / "model", size="tiny")


def test_finetune_example_fine_tunes_a_pretrained_model_and_saves_what_transformers_loads(local_model, tmp_path):
    out = tmp_path / "tuned"
    small = ["--max-steps", "6", "--batch-size", "2", "--block-size", "32", "--eval-blocks", "4", "--lr", "1e-2"]
    proc = _run(["finetune.py", "--model", str(local_model), "--out", str(out), *small, "--max-new-tokens", "8"])
    text = proc.stdout + proc.stderr
    before = float(re.search(r"evaluation loss before fine-tuning: ([0-9.]+)", text).group(1))
    after = float(re.search(r"evaluation loss after 6 steps: ([0-9.]+)", text).group(1))
    assert after < before
    assert "model state per parameter: 8.00 B/param" in text
    assert "greedy generation of the saved model, reloaded by transformers:\ndef fibonacci(n):" in text
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= files
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    start = AutoModelForCausalLM.from_pretrained(local_model, dtype=torch.bfloat16)
    assert tuned.lm_head.weight is tuned.model.embed_tokens.weight  # tied, as the config says
    assert not torch.equal(tuned.model.embed_tokens.weight, start.model.embed_tokens.weight)


def test_finetune_yaml_builds_the_run_through_lightning_cli(local_model, monkeypatch):
    # The model's directory reaches the data's tokenizer (the run itself is finetune.py's, tested above).
    from finetune import FineTune, TextBlocks
    from finetune_cli import FineTuneCLI

    args = [f"--model.pretrained={local_model}"]
    cli = _cli_run(FineTuneCLI, FineTune, TextBlocks, "finetune.yaml", *args, monkeypatch=monkeypatch)
    assert cli.model.hparams.pretrained == str(local_model) == cli.datamodule.hparams.pretrained
    assert type(cli.trainer.strategy).__name__ == "DeepSpeedPureBF16Strategy"
    assert cli.trainer.max_steps == cli.model.hparams.max_steps
    hp = cli.datamodule.hparams
    assert hp.train_blocks == cli.trainer.max_steps * hp.batch_size * cli.trainer.num_devices


def test_gpt_example_reports_loss_throughput_and_memory_and_resumes_mid_epoch_into_state_files_bit_for_bit(tmp_path):
    # One epoch is --max-steps steps; the checkpoint at step 3 of 6 is mid-epoch. The resumed run keeps its moments in
    # memory-mapped files (--state-dir), which it removes at the end.
    small = ["--max-steps", "6", "--n-layer", "1", "--n-embd", "32", "--batch-size", "4", "--ckpt-every", "3"]
    proc = _run(["train_gpt.py", *small, "--ckpt-dir", str(tmp_path / "whole")])
    out = proc.stdout + proc.stderr
    assert "validation loss:" in out and "tokens/s over 2 process(es)" in out
    assert "model state per parameter: 8.00 B/param" in out
    (tmp_path / "states").mkdir()
    resume = ["--resume", str(tmp_path / "whole/step-3.ckpt"), "--state-dir", str(tmp_path / "states")]
    proc = _run(["train_gpt.py", *small, "--ckpt-dir", str(tmp_path / "resumed"), *resume])
    out = proc.stdout + proc.stderr
    assert "3 steps in" in out and "validation loss:" in out
    assert "model state per parameter: 4.00 B/param" in out
    assert "plus 4.00 B/param of optimizer state in memory-mapped files" in out
    assert list((tmp_path / "states").iterdir()) == []
    from lightning_pure_bf16 import consolidate_checkpoint
    from lightning_pure_bf16.checkpoint import consolidate_optimizer_state

    whole, resumed = tmp_path / "whole/step-6.ckpt", tmp_path / "resumed/step-6.ckpt"
    a, b = consolidate_checkpoint(whole), consolidate_checkpoint(resumed)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = consolidate_optimizer_state(whole), consolidate_optimizer_state(resumed)
    assert all(torch.equal(oa[n][k], ob[n][k]) for n in oa for k in oa[n])
    # Not a coincidence of an untrained model: the weights moved from the step-3 checkpoint.
    mid = consolidate_checkpoint(tmp_path / "whole/step-3.ckpt")
    assert any(not torch.equal(mid[k], a[k]) for k in a)


def test_fabric_example_trains_and_resumes_mid_epoch(tmp_path):
    small = ["--max-steps", "6", "--n-layer", "1", "--n-embd", "32", "--batch-size", "4", "--ckpt-every", "3"]
    whole = _run(["fabric_gpt.py", *small, "--ckpt-dir", str(tmp_path / "whole")])
    out = whole.stdout + whole.stderr
    assert "validation loss:" in out and "8.00 B/param" in out and "6 steps in" in out
    resume = ["--resume", str(tmp_path / "whole/step-3.ckpt")]
    resumed = _run(["fabric_gpt.py", *small, "--ckpt-dir", str(tmp_path / "resumed"), *resume])
    assert "3 steps in" in resumed.stdout + resumed.stderr
    from lightning_pure_bf16 import consolidate_checkpoint

    a = consolidate_checkpoint(tmp_path / "whole/step-6.ckpt")
    b = consolidate_checkpoint(tmp_path / "resumed/step-6.ckpt")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _torchrun(script: str, *args: str, nproc: int = 2) -> str:
    # --standalone: torchrun binds a free port itself (no port chosen here that another process could take first).
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = _run([*launcher, script, *args])
    return proc.stdout + proc.stderr


def test_plain_deepspeed_example_trains_and_resumes_bit_for_bit(tmp_path):
    small = ["--max-steps", "6", "--n-layer", "1", "--n-embd", "32", "--batch-size", "4", "--ckpt-every", "3"]
    out = _torchrun("deepspeed_gpt.py", *small, "--ckpt-dir", str(tmp_path / "whole"))
    assert "validation loss:" in out and "model state per parameter: 8.00 B/param" in out and "6 steps in" in out
    resumed = _torchrun(
        "deepspeed_gpt.py",
        *small,
        "--ckpt-dir",
        str(tmp_path / "resumed"),
        "--resume",
        str(tmp_path / "whole/global_step3"),
    )
    assert "3 steps in" in resumed
    from lightning_pure_bf16 import consolidate_checkpoint

    a = consolidate_checkpoint(tmp_path / "whole/global_step6")
    b = consolidate_checkpoint(tmp_path / "resumed/global_step6")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "resumed/latest").read_text() == "global_step6"


def test_hf_trainer_example_trains_at_8_bytes_per_param(tmp_path):
    pytest.importorskip("transformers")
    small = ["--max-steps", "4", "--n-layer", "1", "--n-embd", "32", "--batch-size", "4"]
    # One rank (the Trainer on 2 ranks: tests/test_integrations.py).
    out = _torchrun("hf_trainer.py", *small, "--ckpt-dir", str(tmp_path), nproc=1)
    assert "validation loss:" in out and "model state per parameter: 8.00 B/param" in out
    from transformers import GPT2LMHeadModel

    assert sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(tmp_path / "final").parameters()) > 0
