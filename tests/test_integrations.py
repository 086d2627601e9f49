"""The Hugging Face Trainer (``PureBF16Trainer``) and Accelerate (``PureBF16Accelerator``) on 2 CPU processes: 8
bytes/param (6.03 with 8-bit moments) by the report and by a walk of ZeRO-3's buffers, the loss falls, checkpoints
resume bit for bit and on another world size, the exported weights load with ``from_pretrained``; the silent paths to
float32 masters speak; bad options are refused with the words of the other front ends; TRL's SFT and DPO trainers
through the class factory."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.strategy_runs import load_ranks, run_script  # noqa: E402


@pytest.fixture(autouse=True)
def _no_state_left_behind():
    # TrainingArguments and Accelerator set environment variables and process-wide singletons: undone after each test.
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every run of this module on 2 ranks in one launch, and every run on 1 rank in another, one after the other in
    the same processes (transformers' and Accelerate's process-wide state reset between them, the process group
    kept)."""
    out = tmp_path_factory.mktemp("launches")
    two, one = out / "two", out / "one"
    checkpoint = two / "hf_whole" / "run" / "checkpoint-3"
    from tests.scripts.hf_gpt2 import tiny_gpt2

    tiny_gpt2().to(torch.bfloat16).save_pretrained(out / "gpt2", max_shard_size="20KB")  # in shards
    accelerate = {"front": "accelerate", "steps": 6, "options": {"moments": "int8"}}
    runs = [
        {"name": "hf_whole", "steps": 6, "save_steps": 3, "export": True},
        {"name": "hf_resumed", "steps": 6, "resume": str(checkpoint)},
        {"name": "lora", "steps": 3, "lora": True},
        {"name": "from_pretrained", "steps": 4, "from_pretrained": str(out / "gpt2")},
    ]
    if importlib.util.find_spec("trl"):
        runs += [{"name": f"trl_{kind}", "front": "trl", "trl": kind, "steps": 6} for kind in ("sft", "dpo")]
    # After Accelerate's engine or a stock Trainer's, DeepSpeed keeps groups that the next engine does not find (its
    # first broadcast fails, or waits): a stock Trainer's run ends its launch, Accelerate's runs have one of their own.
    runs.append({"name": "stock_given", "front": "stock_trainer", "given": True})
    run_script("hf_gpt2.py", two, json.dumps({"world": 2, "runs": runs}))
    runs = [
        {"name": "acc_whole", "save_at": 3, "save_path": str(two / "acc_whole" / "mid"), **accelerate},
        {"name": "acc_resumed", "resume": str(two / "acc_whole" / "mid"), **accelerate},
    ]
    run_script("hf_gpt2.py", two, json.dumps({"world": 2, "runs": runs}))
    runs = [
        {"name": "hf_one_rank", "steps": 6, "resume": str(checkpoint)},
        {"name": "given_optimizer", "steps": 2, "given_optimizer": True},
        {"name": "hf_sgd", "steps": 3, "optim": "sgd", "optim_args": "momentum=0.9,nesterov=true"},
        {"name": "stock", "front": "stock_trainer"},
    ]
    run_script("hf_gpt2.py", one, json.dumps({"world": 1, "runs": runs}))
    run = {"name": "stock_given", "front": "stock_trainer", "given": True}
    run_script("hf_gpt2.py", one, json.dumps({"world": 1, "runs": [run]}))
    return out


@pytest.fixture(scope="module")
def trainer_runs(launches):
    whole = launches / "two" / "hf_whole"
    resumed, one_rank = load_ranks(launches / "two" / "hf_resumed"), load_ranks(launches / "one" / "hf_one_rank", 1)
    return load_ranks(whole), resumed, one_rank, whole


@pytest.fixture(scope="module")
def accelerate_runs(launches):
    return load_ranks(launches / "two" / "acc_whole"), load_ranks(launches / "two" / "acc_resumed")


def _walked_bytes_per_param(rank: dict) -> float:
    # Every tensor reachable from DeepSpeed's ZeRO-3 optimizer, by storage, less scalars, the reduce bucket and the
    # whole copies ZeRO-3 keeps of parameters under `stage3_param_persistence_threshold` (Accelerate's default plugin
    # keeps every parameter of this tiny model whole; a working set bounded by the threshold, not partition state).
    skip = (".ipg_buckets.", ".persistent_parameters.")
    buffers = [b for n, _, b, f in rank["zero_buffers"] if b > 16 and not any(k in n for k in skip) and not f]
    return sum(buffers) / rank["memory_report"]["params_on_rank"]


def test_hf_trainer_trains_at_8_bytes_per_param_with_its_groups(trainer_runs):
    whole, _, _, _ = trainer_runs
    for rank in whole:
        assert rank["optimizer_class"] == "lightning_pure_bf16.optim.adamw.AdamW"
        assert rank["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
        assert _walked_bytes_per_param(rank) == pytest.approx(8.0, rel=0.01)
        assert rank["weight_decay"] == [0.1, 0.0]  # the Trainer's decay and no-decay groups
        assert rank["global_steps"] == 6
        assert sum(rank["losses"][-2:]) / 2 < rank["losses"][0] - 0.05


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_trainers_train_pure_bf16_through_the_class_factory(kind, launches):
    pytest.importorskip("trl")
    ranks = load_ranks(launches / "two" / f"trl_{kind}")
    for rank in ranks:
        assert rank["class"] == f"PureBF16{kind.upper()}Trainer"
        assert rank["optimizer_class"] == "lightning_pure_bf16.optim.adamw.AdamW"
        assert all(p.dtype == torch.bfloat16 for p in rank["flat_params"])
        assert rank["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
        assert _walked_bytes_per_param(rank) == pytest.approx(8.0, rel=0.01)
        assert sum(rank["losses"][-2:]) / 2 < rank["losses"][0] - 0.05
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one loss, reduced over the ranks
    if kind == "dpo":
        assert ranks[0]["ref_dtypes"] == ["torch.bfloat16"] and ranks[0]["ref_partitioned"] and ranks[0]["ref_exact"]


def test_the_class_factory_takes_trainer_subclasses_only():
    import transformers

    from lightning_pure_bf16.integrations.transformers import PureBF16Trainer, pure_bf16_trainer

    class MyTrainer(transformers.Trainer):
        pass

    made = pure_bf16_trainer(MyTrainer)
    assert made.__name__ == "PureBF16MyTrainer" and issubclass(made, MyTrainer)
    assert pure_bf16_trainer(MyTrainer) is made and pure_bf16_trainer(PureBF16Trainer) is PureBF16Trainer
    with pytest.raises(TypeError, match="subclass of `transformers.Trainer`"):
        pure_bf16_trainer(torch.nn.Module)


def test_the_process_group_the_libraries_made_is_destroyed_at_exit(launches):
    # Left alive, it can end a finished run in `terminate called without an active exception` (exit 134; issue 26,
    # seen once with the HF example in a loaded CI run). The integrations destroy it at exit, ranks together (the
    # 2-rank launch ran the Trainer, Accelerate, TRL and PEFT; the 1-rank one the Trainer).
    assert [(launches / "two" / f"exit_rank{r}.txt").read_text() for r in range(2)] == ["False", "False"]
    assert (launches / "one" / "exit_rank0.txt").read_text() == "False"


def test_hf_trainer_resume_from_checkpoint_continues_bit_for_bit(trainer_runs):
    whole, resumed, _, _ = trainer_runs
    for a, b in zip(whole, resumed):
        assert b["losses"] == a["losses"][3:]
        assert all(torch.equal(x, y) for x, y in zip(a["flat_params"], b["flat_params"]))
        for sa, sb in zip(a["state"].values(), b["state"].values()):
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert a["scheduler_lr"] == b["scheduler_lr"]


def test_hf_trainer_checkpoint_of_2_ranks_resumes_on_1(trainer_runs):
    _, _, one_rank, _ = trainer_runs
    (rank,) = one_rank
    assert rank["global_steps"] == 6 and len(rank["losses"]) == 3
    assert rank["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)


def test_hf_save_model_streams_shards_from_the_partitions_from_pretrained_loads(trainer_runs):
    # The run's DeepSpeed config has stage3_gather_16bit_weights_on_model_save off: the Trainer's own save_model would
    # write a DeepSpeed checkpoint and no weights; PureBF16Trainer writes them from the partitions, in shards.
    whole, _, _, out = trainer_runs
    export = out / "export"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in export.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert "lm_head.weight" not in index["weight_map"]  # tied to wte: written once, as save_pretrained writes it
    assert (export / "config.json").is_file() and (export / "training_args.bin").is_file()
    assert not (export / "model.safetensors").exists() and not list(export.glob(".*"))  # no dummy, no staging
    assert (out / "run" / "checkpoint-3" / "model.safetensors.index.json").is_file()  # the Trainer's checkpoints too
    exported = torch.load(out / "exported.pt")
    live = whole[0]["live"]
    assert set(live) <= set(exported)
    for name, value in live.items():
        assert torch.equal(exported[name], value), name  # the bf16 weights themselves: no rounding on export


def test_the_trainers_deepspeed_checkpoint_exports_to_shards_from_pretrained_loads(trainer_runs, tmp_path):
    from transformers import GPT2LMHeadModel

    from lightning_pure_bf16.consolidate import main as consolidate_main

    whole, _, _, out = trainer_runs
    target = tmp_path / "pretrained"
    args = [str(out / "run" / "checkpoint-6"), str(target), "--max-shard-size", "16KB"]
    assert consolidate_main([*args, "--config", str(out / "export" / "config.json")]) == 0
    assert len(list(target.glob("model-*.safetensors"))) > 1 and (target / "model.safetensors.index.json").is_file()
    model = GPT2LMHeadModel.from_pretrained(target, dtype=torch.bfloat16)
    loaded = model.state_dict()
    for name, value in whole[0]["live"].items():
        assert torch.equal(loaded[name], value), name  # step 6's trained weights, bit for bit


def test_accelerate_trains_at_6_bytes_per_param_with_8_bit_moments_and_resumes_bit_for_bit(accelerate_runs):
    whole, resumed = accelerate_runs
    for a, b in zip(whole, resumed):
        assert a["moments"] == "int8"
        assert a["memory_report"]["total"] == pytest.approx(6.03, abs=0.01)
        assert _walked_bytes_per_param(a) == pytest.approx(a["memory_report"]["total"], rel=0.01)
        assert b["losses"] == a["losses"][3:]
        assert all(torch.equal(x, y) for x, y in zip(a["flat_params"], b["flat_params"]))
        assert a["scheduler_lr"] == b["scheduler_lr"]
        assert sum(a["losses"][-2:]) / 2 < a["losses"][0]


def test_a_stock_trainer_handing_the_optimizer_float32_masters_is_refused(launches):
    (rank,) = load_ranks(launches / "one" / "stock", 1)
    assert rank["error"] is not None and "float32 master weights" in rank["error"]
    assert "PureBF16Trainer" in rank["error"]


@pytest.mark.parametrize("world", [1, 2])
def test_a_stock_trainer_that_drops_the_given_optimizer_says_so_once(launches, world):
    # transformers.Trainer(..., optimizers=(lightning_pure_bf16.AdamW(model.parameters()), None)), written inline, with
    # DeepSpeed trains with torch AdamW on float32 masters: said once, on rank 0, though nothing refers to the
    # dropped optimizer any more.
    ranks = load_ranks(launches / {1: "one", 2: "two"}[world] / "stock_given", world)
    assert all(rank["error"] is None for rank in ranks)
    (said,) = ranks[0]["warnings"]
    assert "the host replaced it" in said and "torch.optim.adamw.AdamW` is stepping" in said
    assert "PureBF16Trainer" in said
    assert all(rank["warnings"] == [] for rank in ranks[1:])


def test_the_trainers_sgd_trains_as_this_packages_sgd_with_its_optim_args(launches):
    (rank,) = load_ranks(launches / "one" / "hf_sgd", 1)
    assert rank["optimizer_class"] == "lightning_pure_bf16.optim.sgd.SGD" and rank["global_steps"] == 3
    assert [(g["momentum"], g["nesterov"], g["weight_decay"]) for g in rank["groups"]] == [
        (0.9, True, 0.1),
        (0.9, True, 0.0),
    ]
    # The weights, their gradients and the momentum buffer: 6 bytes/param, every buffer bf16.
    assert rank["memory_report"]["total"] == pytest.approx(6.0, abs=0.01)
    assert rank["memory_report"]["momentum_buffer"] == pytest.approx(2.0, abs=0.01)
    assert all(v.dtype == torch.bfloat16 for st in rank["state"].values() for k, v in st.items() if k != "step")


def test_the_optimizer_given_to_the_trainer_is_used_not_replaced(launches):
    (rank,) = load_ranks(launches / "one" / "given_optimizer", 1)
    assert rank["optimizer_class"] == "lightning_pure_bf16.optim.adamw.AdamW"
    assert rank["weight_decay"] == [0.0] and rank["lr"] == [pytest.approx(1e-3)]  # its group, its scheduler (x0.5)
    assert rank["replaced_warnings"] == []  # this package's own integration: nothing to say


@pytest.mark.parametrize(
    "option", [{"rounding": "up"}, {"moments": "int4"}, {"state_storage": "nvme"}, {"gather_cache": "all"}]
)
def test_bad_options_are_refused_with_the_words_of_the_other_front_ends(option, tmp_path):
    import torch.distributed as dist
    from transformers import TrainingArguments

    import lightning_pure_bf16.deepspeed as pure_bf16
    from lightning_pure_bf16 import DeepSpeedPureBF16Strategy
    from lightning_pure_bf16.integrations.accelerate import PureBF16Accelerator
    from lightning_pure_bf16.integrations.transformers import PureBF16Trainer, deepspeed_config

    messages = {}
    with pytest.raises(ValueError) as err:
        DeepSpeedPureBF16Strategy(**option)
    messages["DeepSpeedPureBF16Strategy"] = str(err.value)
    with pytest.raises(ValueError) as err:
        pure_bf16.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1}, **option)
    messages[pure_bf16.WHO] = str(err.value)
    with pytest.raises(ValueError) as err:
        PureBF16Accelerator(**option)
    messages["PureBF16Accelerator"] = str(err.value)
    args = TrainingArguments(str(tmp_path), use_cpu=True, bf16=True, deepspeed=deepspeed_config(), report_to=[])
    with pytest.raises(ValueError) as err:
        PureBF16Trainer(model=torch.nn.Linear(2, 2), args=args, **option)
    messages["PureBF16Trainer"] = str(err.value)
    words = {message.replace(who, "X") for who, message in messages.items()}
    assert len(words) == 1, messages
    assert not dist.is_initialized()  # refused before any process group


def test_the_trainer_refuses_arguments_that_would_not_train_pure_bf16(tmp_path):
    from transformers import TrainingArguments

    from lightning_pure_bf16.integrations.transformers import PureBF16Trainer, deepspeed_config

    cases = [
        (dict(use_cpu=True, bf16=True), "`TrainingArguments.deepspeed` is not set"),
        (
            dict(use_cpu=True, bf16=True, deepspeed=deepspeed_config(), optim="adafactor"),
            "optim='adafactor'.* is transformers' own Adafactor",
        ),
        (dict(use_cpu=True, bf16=True, deepspeed=deepspeed_config(), optim="rmsprop"), "optim='rmsprop'"),
    ]
    for kwargs, match in cases:
        args = TrainingArguments(str(tmp_path), report_to=[], **kwargs)
        with pytest.raises(ValueError, match=match):
            PureBF16Trainer(model=torch.nn.Linear(2, 2), args=args)
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        from lightning_pure_bf16.integrations.accelerate import PureBF16Accelerator

        PureBF16Accelerator(mixed_precision="fp16")


def test_peft_lora_trains_its_adapters_only_with_the_base_bit_exact_under_both_front_ends(launches, tmp_path):
    # The seed user's recipe at small scale: a PEFT LoRA model (r=4 on the attention projections) under
    # PureBF16Trainer and under Trainer(strategy="deepspeed_pure_bf16"), 2 ranks each; the adapters saved by PEFT
    # load with PeftModel.from_pretrained into a fresh base.
    from peft import PeftModel

    from tests.scripts.hf_gpt2 import tiny_gpt2

    lightning, hf = tmp_path / "lightning", launches / "two" / "lora"
    run_script("lora_lightning.py", lightning, json.dumps({"steps": 3}))
    runs = {lightning: load_ranks(lightning), hf: [r["lora"] for r in load_ranks(hf)]}
    for out, ranks in runs.items():
        for rank in ranks:
            assert rank["trainable"] and all(".lora_" in name for name in rank["trainable"])
            assert rank["base_exact"] and sorted(rank["adapters_moved"]) == rank["trainable"]
            report = rank["memory_report"]  # gradients and moments for the adapters only; the base at 2 B/param
            assert report["total"] == pytest.approx(8.0) and report["frozen"] == pytest.approx(2.0)
            adapters = sum(t.numel() for t in rank["adapters"].values())
            assert report["params_on_rank"] * 2 == pytest.approx(adapters, abs=64)  # partitions, padding aside
        loaded = dict(PeftModel.from_pretrained(tiny_gpt2(), str(out / "adapter")).named_parameters())
        for name, live in ranks[0]["adapters"].items():
            assert torch.equal(loaded[name].to(live.dtype), live), f"{out.name}: {name}"


def test_transformers_from_pretrained_under_the_trainers_zero3_gives_the_files_partitions(launches):
    # transformers' own path: with the DeepSpeed TrainingArguments made first, from_pretrained builds the model under
    # zero.Init and loads each tensor into its partitions; the Trainer then trains those partitions at 8 B/param.
    from transformers import GPT2LMHeadModel

    assert len(list((launches / "gpt2").glob("model-*.safetensors"))) > 1
    model = GPT2LMHeadModel.from_pretrained(launches / "gpt2", dtype=torch.bfloat16)
    files = {k: v for k, v in model.state_dict().items()}
    ranks = load_ranks(launches / "two" / "from_pretrained")
    for rank, result in enumerate(ranks):
        loaded = result["loaded_partitions"]
        assert set(loaded) == {n for n, _ in model.named_parameters()}  # lm_head tied to wte: one tensor
        for name, (part, n) in loaded.items():
            flat = files[name].reshape(-1)[rank * n : (rank + 1) * n]
            assert part is not None and part.dtype == torch.bfloat16 and torch.equal(part[: flat.numel()], flat), name
        assert result["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
        assert result["global_steps"] == 4 and result["losses"][-1] < result["losses"][0]


def test_accelerate_launch_with_a_deepspeed_config_file(tmp_path):
    # `accelerate launch --config_file` with DeepSpeed and a DeepSpeed config file of the user's: the launcher starts
    # both processes and sets ACCELERATE_USE_DEEPSPEED; PureBF16Accelerator takes the file's ZeRO-3 settings.
    import subprocess
    import sys

    from tests.strategy_runs import SCRIPTS, _env, free_port

    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3, "reduce_bucket_size": 4096, "stage3_param_persistence_threshold": 0},
                "bf16": {"enabled": True},
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0,
            }
        )
    )
    (tmp_path / "accelerate.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero3_init_flag: false\nnum_machines: 1\n"
        f"num_processes: 2\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\nmain_process_port: {free_port()}\n"
        "use_cpu: true\n"
    )
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml")]
    command += [str(SCRIPTS / "accelerate_launch_gpt2.py"), str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in load_ranks(tmp_path):
        assert rank["world"] == 2 and rank["zero_stage"] == 3 and rank["config_bucket"] == 4096
        assert rank["optimizer_class"] == "lightning_pure_bf16.optim.adamw.AdamW"
        assert rank["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
        assert rank["global_steps"] == 4 and all(torch.isfinite(torch.tensor(rank["losses"])))
