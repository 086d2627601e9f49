"""Hugging Face models as users bring them, under the pure-bf16 Trainer strategy and Fabric: built partitioned
(transformers' initialisation and ties, or ``from_pretrained`` from each rank's slices), fine-tuned, saved in the
layout transformers reads back; the families users fine-tune, each with what sets it apart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from lightning_pure_bf16 import PretrainedError, export_pretrained, from_pretrained  # noqa: E402
from lightning_pure_bf16.hf_models import partitioned_construction  # noqa: E402
from lightning_pure_bf16.pretrained import checkpoint_files  # noqa: E402
from tests.hf_tiny import family_configs, save_families  # noqa: E402
from tests.strategy_runs import load_ranks, run_script  # noqa: E402

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A 1-rank gloo group in this process, for ZeRO-3's partitioned init."""
    import deepspeed
    import torch.distributed as dist

    environment = {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    before = {k: os.environ.get(k) for k in environment}
    os.environ.update(environment)
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {k: v.detach().clone() for k, v in params.items()}


def test_transformers_init_under_zero_init_bug_and_fix(one_rank):
    import deepspeed

    config = family_configs()["llama"]  # pad_token_id=2, tied embeddings
    llama = transformers.LlamaForCausalLM  # imported here: a class first imported in zero.Init is another bug (below)
    # The bug (transformers 5.x): its post_init initialises the partitions ZeRO-3 has already emptied, and the
    # padding row of the embedding is out of range. Fails here once transformers initialises under zero.Init itself.
    with pytest.raises(IndexError, match="index 2 is out of bounds for dimension 0 with size 0"):
        with deepspeed.zero.Init(config_dict_or_path=ZERO3):
            llama(config)
    # The fix, as the strategies enter it: transformers' initialisation on gathered partitions, then its ties.
    torch.manual_seed(0)
    with partitioned_construction(deepspeed.zero.Init(config_dict_or_path=ZERO3), ZERO3):
        model = llama(config)
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())  # partitioned as built
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = _gathered(model)
    embedding = weights["model.embed_tokens.weight"].float()
    assert torch.count_nonzero(embedding[2]) == 0  # the padding row, as transformers zeroes it
    assert embedding.std().item() == pytest.approx(config.initializer_range, rel=0.15)  # not torch's N(0, 1)
    assert torch.all(weights["model.norm.weight"] == 1)
    # Nothing left behind: transformers' own init and its ZeRO-3 flag as before.
    assert transformers.PreTrainedModel.init_weights.__module__ == "transformers.modeling_utils"
    assert not transformers.integrations.is_deepspeed_zero3_enabled()


def _decorated_inside(zero_init_context):
    """A module class defined inside ``zero_init_context`` whose ``__init__`` a decorator then replaces (as the
    ``kernels`` package's ``use_kernelized_func`` does to transformers' attention classes at import), built inside
    and again after the context closed."""

    def adds_kernels(cls):
        original = cls.__init__

        def new_init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.kernels = "set"

        cls.__init__ = new_init
        return cls

    with zero_init_context:

        @adds_kernels
        class Layer(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(4, 4)

        inside = Layer()
    return inside, Layer()


def test_a_class_defined_inside_zero_init_keeps_a_later_init_bug_and_fix(one_rank):
    import deepspeed

    from lightning_pure_bf16._internals import zero_init_keeping_later_inits

    # The bug (DeepSpeed 0.19.8): on leaving, zero.Init puts back the __init__ it wrapped, dropping the replacement.
    inside, after = _decorated_inside(deepspeed.zero.Init(config_dict_or_path=ZERO3))
    assert inside.kernels == "set" and hasattr(inside.linear.weight, "ds_id")
    assert not hasattr(after, "kernels")  # fails here once DeepSpeed keeps it
    # The fix: the replacement kept, calling the class's own __init__ (nothing partitioned outside zero.Init).
    inside, after = _decorated_inside(zero_init_keeping_later_inits(deepspeed.zero.Init(config_dict_or_path=ZERO3)))
    assert inside.kernels == "set" and hasattr(inside.linear.weight, "ds_id")
    assert after.kernels == "set" and not hasattr(after.linear.weight, "ds_id") and after.linear.weight.numel() == 16


def test_from_pretrained_refuses_what_it_cannot_build_before_building(one_rank, tmp_path):
    import deepspeed

    families = save_families(tmp_path / "families", max_shard_size="5GB")
    llama = Path(families["llama"])
    with pytest.raises(ValueError, match=r"from_pretrained\(dtype='int8'\).*bfloat16"):
        from_pretrained(llama, dtype="int8")
    with pytest.raises(PretrainedError, match="call it where the strategy partitions what is built"):
        from_pretrained(llama)
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-family", "architectures": ["X"]}))
    (unknown / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    config = json.loads((llama / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForTheFuture"]}))
    (renamed / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((llama / "config.json").read_text())
    kept = {k: v for k, v in load_file(llama / "model.safetensors").items() if k != "model.norm.weight"}
    save_file(kept, partial / "model.safetensors")
    with partitioned_construction(deepspeed.zero.Init(config_dict_or_path=ZERO3), ZERO3):
        with pytest.raises(PretrainedError, match="is not a transformers checkpoint: it has no config.json"):
            from_pretrained(tmp_path / "weights_only")
        with pytest.raises(PretrainedError, match=r"cannot read .*config.json': .*`no-such-family`.* upgrade it"):
            from_pretrained(unknown)
        with pytest.raises(PretrainedError, match=r"architectures \['LlamaForTheFuture'\].*model_class="):
            from_pretrained(renamed)
        with pytest.raises(PretrainedError, match="LlamaConfig has no 'use_cach'"):
            from_pretrained(llama, use_cach=False)
        with pytest.raises(PretrainedError, match="No directory './nowhere'"):
            from_pretrained("./nowhere")
        with pytest.raises(PretrainedError, match="No safetensors checkpoint"):
            (tmp_path / "config_only").mkdir()
            (tmp_path / "config_only" / "config.json").write_text(json.dumps(config))
            from_pretrained(tmp_path / "config_only")
        # The Auto class of the family, a config override, and strict=False: what the file lacks is initialised as
        # transformers initialises it, the rest loaded.
        model = from_pretrained(partial, model_class=transformers.AutoModelForCausalLM, use_cache=False, strict=False)
        assert type(model) is transformers.LlamaForCausalLM and model.training
        assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.use_cache is False
        weights = _gathered(model)
    assert torch.all(weights["model.norm.weight"] == 1)  # initialised, not left as the empty build's memory
    assert all(torch.equal(weights[name], value) for name, value in kept.items())


FRONTS = ("trainer", "fabric")


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """Every family fine-tuned on 2 ranks under the Trainer strategy and under Fabric (one process group each); the
    Llama model built by the docs' hand-written recipe under the Trainer, by from_pretrained under Fabric."""
    where = tmp_path_factory.mktemp("hf_families")
    families = save_families(where / "pretrained")
    for front in FRONTS:
        opts = {
            "front": front,
            "families": families,
            "constructor": ["llama"] if front == "trainer" else ["gpt2"],
            "checkpoint": ["llama"] if front == "trainer" else [],
        }
        run_script("hf_families.py", where / front, json.dumps(opts))
    return where, families


def _file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name, file in checkpoint_files(directory).items():
        with safe_open(file, "pt") as f:
            out[name] = f.get_tensor(name)
    return out


@pytest.mark.parametrize("family", list(family_configs()))
def test_each_family_loads_its_slices_matches_transformers_trains_and_saves_what_transformers_reads(fine_tuned, family):
    where, families = fine_tuned
    pretrained = Path(families[family])
    files = _file_tensors(pretrained)
    reference = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.bfloat16)
    tied = family_configs()[family].tie_word_embeddings
    for front in FRONTS:
        ranks = load_ranks(where / front / family)
        for rank, result in enumerate(ranks):
            # Each rank's partitions are its slices of the files, bit for bit.
            for name, (part, n) in result["loaded"].items():
                flat = files[name].reshape(-1)[rank * n : (rank + 1) * n]
                assert part is not None and torch.equal(part[: flat.numel()], flat), (front, name)
            # The first loss is plain transformers' on the same weights and batch (bf16 arithmetic apart).
            batch = result["first_batch"]
            with torch.no_grad():
                expected = reference(input_ids=batch, labels=batch).loss.item()
            assert result["losses"][0] == pytest.approx(expected, rel=1e-2), (front, rank)
            assert result["losses"][-1] < result["losses"][0], (front, result["losses"])
            assert result["memory_report"]["total"] == pytest.approx(8.0, abs=0.01), front
            assert result["tied"] == tied, front
        # What save_pretrained wrote, transformers loads: the trained weights bit for bit, its config beside them,
        # a tied weight once.
        saved = where / front / family / "saved"
        assert {"config.json", "generation_config.json"} <= {p.name for p in saved.iterdir()}
        assert json.loads((saved / "config.json").read_text())["architectures"] == [type(reference).__name__]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
        trained = ranks[0]["trained"]
        state = loaded.state_dict()
        assert all(torch.equal(state[name], value) for name, value in trained.items()), front
        assert any(not torch.equal(trained[name], files[name]) for name in files)  # trained, not the file read in
        assert set(_file_tensors(saved)) == set(files)  # the names transformers wrote, tied ones once


def test_the_export_of_a_checkpoint_writes_tied_weights_once_and_loads_in_transformers(fine_tuned, tmp_path):
    where, families = fine_tuned
    out = tmp_path / "exported"
    export_pretrained(where / "trainer" / "llama" / "ckpt", out, config=families["llama"], key_map={"model.": ""})
    assert set(_file_tensors(out)) == set(_file_tensors(Path(families["llama"])))  # no lm_head.weight of its own
    assert (out / "generation_config.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    trained = load_ranks(where / "trainer" / "llama")[0]["trained"]
    assert all(torch.equal(model.state_dict()[name], value) for name, value in trained.items())
