"""The Hugging Face Trainer (``PureBF16Trainer``) or an Accelerate loop (``PureBF16Accelerator``) on a tiny GPT-2, on
CPU processes spawned here; each rank writes what it saw.

    python hf_gpt2.py OUT '{"front": "trainer", "steps": 6, "save_steps": 3, "resume": null, "world": 2}'
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0)
    config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def lora_gpt2():
    """The tiny GPT-2 with PEFT LoRA adapters on its attention projections; the base frozen."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_" in name:  # PEFT starts B at zero; a nonzero start makes the adapters' effect visible at once
            torch.nn.init.normal_(p, std=0.02)
    return model


def gathered(module) -> dict[str, torch.Tensor]:
    """Every parameter of a ZeRO-3 module, whole, by name."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {k: v.detach().clone() for k, v in params.items()}


def lora_report(module, before: dict[str, torch.Tensor], memory_report: dict, out: Path, rank: int) -> dict:
    """What a LoRA test checks: trainable names, the base against its start, the report; adapters saved by PEFT."""
    after = gathered(module)
    base = [k for k in after if "lora_" not in k]
    result = {
        "trainable": sorted(k for k, p in module.named_parameters() if p.requires_grad),
        "base_exact": all(torch.equal(after[k], before[k].to(after[k].dtype)) for k in base),
        "adapters_moved": [
            k for k in after if "lora_" in k and not torch.equal(after[k], before[k].to(torch.bfloat16))
        ],
        "adapters": {k: v for k, v in after.items() if "lora_" in k},
        "memory_report": memory_report,
    }
    return result


def dataset(n: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # A learnable sequence: each token is the previous plus a per-sequence step, modulo the vocabulary.
    start, step = torch.randint(0, 64, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + step * torch.arange(16)) % 64
    return [{"input_ids": row, "labels": row} for row in ids]


def engine_state(engine, rank: int) -> dict:
    from _inspect import reachable_tensors

    from lightning_pure_bf16 import _internals
    from lightning_pure_bf16.memory import is_file_backed

    zero = engine.optimizer
    inner = _internals.zero3_inner_optimizer(zero)
    return {
        "flat_params": [t.detach().clone() for t in _internals.zero3_param_partitions(zero)],
        "state": {
            i: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
            for i, st in enumerate(inner.state.values())
        },
        "optimizer_class": f"{type(inner).__module__}.{type(inner).__name__}",
        "lr": [g["lr"] for g in inner.param_groups],
        "weight_decay": [g["weight_decay"] for g in inner.param_groups],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "moments": inner.moments,
        "memory_report": engine.pure_bf16.memory_report(),
        "global_steps": engine.global_steps,
        "zero_buffers": [
            (name, t.dtype, t.untyped_storage().nbytes(), is_file_backed(t))
            for name, t in reachable_tensors(zero, "zero")
        ],
    }


def run_trainer(rank: int, out: Path, opts: dict) -> dict:
    from transformers import TrainerCallback, TrainingArguments

    from lightning_pure_bf16.integrations.transformers import PureBF16Trainer, deepspeed_config

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = TrainingArguments(
        output_dir=str(out / "run"),
        use_cpu=opts.get("cpu", True),
        bf16=True,
        deepspeed=deepspeed_config(
            zero_optimization={
                "reduce_bucket_size": 4096,
                "stage3_param_persistence_threshold": 0,
                # Without it the stock save_model writes no weights; PureBF16Trainer streams them from the partitions.
                "stage3_gather_16bit_weights_on_model_save": not opts.get("export", False),
            }
        ),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=opts.get("accumulate", 1),
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        max_grad_norm=opts.get("max_grad_norm", 1.0),
        **{k: opts[k] for k in ("optim", "optim_args") if k in opts},
        max_steps=opts["steps"],
        logging_steps=1,
        save_steps=opts.get("save_steps", 1000),
        save_strategy="steps",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    loaded = None
    if opts.get("from_pretrained"):
        # After the TrainingArguments, whose DeepSpeed config tells transformers to build under zero.Init.
        import deepspeed
        from _models import partitions
        from transformers import GPT2LMHeadModel

        # On CUDA the arguments' Accelerate state starts DeepSpeed's communication; with use_cpu it does not, and
        # zero.Init would count one rank.
        deepspeed.init_distributed(dist_backend="gloo")

        model = GPT2LMHeadModel.from_pretrained(opts["from_pretrained"], dtype=torch.bfloat16)
        loaded = partitions(model)
    else:
        model = lora_gpt2() if opts.get("lora") else tiny_gpt2()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizers = (None, None)
    if opts.get("given_optimizer"):
        from lightning_pure_bf16 import AdamW

        opt = AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5))
    trainer = PureBF16Trainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        callbacks=[Losses()],
        optimizers=optimizers,
        seed=7,
        **({"max_shard_size": "16KB"} if opts.get("export") else {}),
        **opts.get("options", {}),
    )
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=opts.get("resume"))
    result = {"losses": losses, **engine_state(trainer.model_wrapped, rank), "loaded_partitions": loaded}
    if opts.get("lora"):
        result["lora"] = lora_report(trainer.model_wrapped.module, before, result["memory_report"], out, rank)
        trainer.save_model(str(out / "adapter"))  # PEFT's save_pretrained: the adapters only
    result["replaced_warnings"] = [str(w.message) for w in seen if "the host replaced it" in str(w.message)]
    result["scheduler_lr"] = trainer.lr_scheduler.get_last_lr()
    if opts.get("export"):
        trainer.save_model(str(out / "export"))  # loaded by the parent process, outside DeepSpeed
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(trainer.model_wrapped.module.parameters())):
            result["live"] = {k: v.detach().clone() for k, v in trainer.model_wrapped.module.state_dict().items()}
    return result


def run_stock_trainer(rank: int, out: Path, opts: dict) -> dict:
    """A stock ``transformers.Trainer`` asked to build this package's AdamW under DeepSpeed's bf16 mixed precision."""
    from transformers import Trainer, TrainingArguments

    from lightning_pure_bf16 import AdamW

    args = TrainingArguments(
        output_dir=str(out / "run"),
        use_cpu=opts.get("cpu", True),
        bf16=True,
        deepspeed={
            "zero_optimization": {"stage": 3},
            "bf16": {"enabled": "auto"},
            "train_micro_batch_size_per_gpu": "auto",
        },
        per_device_train_batch_size=4,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    model = tiny_gpt2()
    if opts.get("given"):
        # The optimizer written inline in `optimizers=`, as most users write it: the stock Trainer drops it under
        # DeepSpeed, and nothing else refers to it, so it is collected before the first step.
        trainer = Trainer(
            model=model, args=args, train_dataset=dataset(), optimizers=(AdamW(model.parameters(), lr=1e-3), None)
        )
    else:  # the optimizer the stock Trainer builds itself and hands to DeepSpeed's bf16 mixed precision
        trainer = Trainer(
            model=model, args=args, train_dataset=dataset(), optimizer_cls_and_kwargs=(AdamW, {"lr": 1e-3})
        )
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            trainer.train()
            error = None
        except RuntimeError as err:
            error = str(err)
    # The stock Trainer leaves the group TrainingArguments made to the interpreter's teardown, where gloo's threads
    # can abort a finished run (pytorch/pytorch#190489; this package's integrations destroy theirs at exit): here it
    # is destroyed once the run is over, so that the test sees the warning, not that abort.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return {"error": error, "warnings": [str(w.message) for w in seen if "lightning_pure_bf16" in str(w.message)]}


def word_tokenizer():
    """A tokenizer of the tiny GPT-2's 64 tokens, made here (nothing downloaded): words ``w0`` .. ``w61``, then
    ``<pad>`` and ``<eos>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(62)} | {"<pad>": 62, "<eos>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def text_dataset(kind: str, n: int = 32):
    """The learnable sequences of :func:`dataset` as text: ``{"text"}`` rows for SFT; for DPO a prompt of 6 words,
    the sequence's continuation chosen and a continuation with another step rejected."""
    from datasets import Dataset

    words = [" ".join(f"w{int(t) % 62}" for t in row["input_ids"]) for row in dataset(n)]
    if kind == "sft":
        return Dataset.from_dict({"text": words})
    prompts = [" ".join(w.split()[:6]) for w in words]
    chosen = [" " + " ".join(w.split()[6:12]) for w in words]
    rejected = [" " + " ".join(f"w{(int(x[1:]) * 7 + 3) % 62}" for x in w.split()[6:12]) for w in words]
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def run_trl(rank: int, out: Path, opts: dict) -> dict:
    """TRL's ``SFTTrainer`` or ``DPOTrainer`` made pure bf16 by ``pure_bf16_trainer``, with ZeRO-3 (DPO's reference
    model a second tiny GPT-2, prepared by TRL itself)."""
    import trl
    from transformers import TrainerCallback

    from lightning_pure_bf16.integrations.transformers import deepspeed_config, pure_bf16_trainer

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    kind = opts["trl"]
    config_cls = {"sft": trl.SFTConfig, "dpo": trl.DPOConfig}[kind]
    args = config_cls(
        output_dir=str(out / "run"),
        use_cpu=True,
        bf16=True,
        deepspeed=deepspeed_config(
            zero_optimization={
                "reduce_bucket_size": 4096,
                "stage3_param_persistence_threshold": 0,
                # Without it the stock save_model writes no weights; PureBF16Trainer streams them from the partitions.
                "stage3_gather_16bit_weights_on_model_save": not opts.get("export", False),
            }
        ),
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        max_steps=opts["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **({"max_length": 16} if kind == "sft" else {"max_length": 16, "beta": 0.5}),
    )
    host = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer}[kind]
    extra = {"ref_model": tiny_gpt2()} if kind == "dpo" else {}
    trainer = pure_bf16_trainer(host)(
        model=tiny_gpt2(),
        args=args,
        train_dataset=text_dataset(kind),
        processing_class=word_tokenizer(),
        callbacks=[Losses()],
        seed=7,
        **extra,
    )
    trainer.train()
    result = {"losses": losses, "class": type(trainer).__name__, **engine_state(trainer.model_wrapped, rank)}
    if kind == "dpo":
        # The reference model, partitioned by TRL's own DeepSpeed set-up: bf16, and never trained.
        ref, start = trainer.ref_model.module, tiny_gpt2()
        result["ref_dtypes"] = sorted({str(p.dtype) for p in ref.parameters()})
        result["ref_partitioned"] = all(hasattr(p, "ds_id") for p in ref.parameters())
        after = gathered(ref)
        result["ref_exact"] = all(torch.equal(after[k], v.to(torch.bfloat16)) for k, v in start.named_parameters())
    return result


def run_accelerate(rank: int, out: Path, opts: dict) -> dict:
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from lightning_pure_bf16.integrations.accelerate import PureBF16Accelerator

    accelerator = PureBF16Accelerator(cpu=opts.get("cpu", True), seed=7, **opts.get("options", {}))
    model = tiny_gpt2()
    data = dataset()
    loader = DataLoader(data, batch_size=4, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    del DistributedSampler
    step = 0
    if opts.get("resume"):
        accelerator.load_state(opts["resume"])
        step = int(json.loads((Path(opts["resume"]) / "step.json").read_text())["step"])
    losses = []
    batches = list(loader)
    while step < opts["steps"]:
        batch = batches[step % len(batches)]
        loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        step += 1
        if opts.get("save_at") == step:
            accelerator.save_state(opts["save_path"])
            if accelerator.is_main_process:
                (Path(opts["save_path"]) / "step.json").write_text(json.dumps({"step": step}))
            accelerator.wait_for_everyone()
    return {"losses": losses, **engine_state(model, rank), "scheduler_lr": scheduler.get_last_lr()}


def worker(rank: int, out: Path, opts: dict) -> None:
    world = opts.get("world", 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    # Registered first, so it runs after every exit handler of the run: was the process group left alive at exit?
    import atexit

    atexit.register(lambda: (out / f"exit_rank{rank}.txt").write_text(str(torch.distributed.is_initialized())))
    # Several runs one after the other in the same processes, each in OUT/<name>, as a notebook runs them: the
    # Trainer's and Accelerate's process-wide state (not the process group) and the environment reset between them.
    for run in opts.get("runs", [{}]):
        run_out = out / run.get("name", "")
        run_out.mkdir(parents=True, exist_ok=True)
        run = {**opts, **run}
        front = {
            "trainer": run_trainer,
            "accelerate": run_accelerate,
            "stock_trainer": run_stock_trainer,
            "trl": run_trl,
        }
        environment = dict(os.environ)
        torch.save(front[run.get("front", "trainer")](rank, run_out, run), run_out / f"rank{rank}.pt")
        os.environ.clear()  # TrainingArguments and Accelerator set variables the next run would read
        os.environ.update(environment)
        _reset_process_state()
    # No teardown here: the integrations destroy the group Accelerate or TrainingArguments made, at exit.


def _reset_process_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


if __name__ == "__main__":
    from _runs import start_ranks

    out, opts = Path(sys.argv[1]), json.loads(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    start_ranks(worker, opts.get("world", 2), (out, opts))
    for run in opts.get("runs", [opts]):
        if run.get("export"):
            from transformers import GPT2LMHeadModel

            run_out = out / run.get("name", "")
            loaded = GPT2LMHeadModel.from_pretrained(str(run_out / "export"), dtype=torch.bfloat16)
            torch.save(loaded.state_dict(), run_out / "exported.pt")
