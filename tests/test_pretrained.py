"""Pretrained weights into ZeRO-3's partitions (`load_pretrained`): each rank reads its own slices of a Hugging Face
checkpoint, under the Trainer strategy's ``configure_model`` and Fabric's ``init_module``; names, shapes and dtypes
checked before anything is written."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_pure_bf16 import PretrainedError, load_pretrained
from lightning_pure_bf16.pretrained import _flat_range
from tests.scripts._models import MLP


def pretrained_weights(seed: int = 7) -> dict[str, torch.Tensor]:
    """The small MLP's weights as a pretrained checkpoint holds them: without the LightningModule's ``net.``,
    random, bf16 but one float32 tensor (converted on load, with a message)."""
    g = torch.Generator().manual_seed(seed)
    state = {k[len("net.") :]: torch.randn(v.shape, generator=g) for k, v in MLP().state_dict().items()}
    return {k: v if k == "0.bias" else v.to(torch.bfloat16) for k, v in state.items()}


def test_every_flat_range_reads_exactly_its_elements(tmp_path):
    t = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    save_file({"t": t}, tmp_path / "t.safetensors")
    with safe_open(tmp_path / "t.safetensors", "pt") as f:
        sl = f.get_slice("t")
        for start in range(t.numel() + 1):
            for stop in range(start, t.numel() + 1):
                pieces = list(_flat_range(sl, tuple(t.shape), start, stop))
                got = torch.cat(pieces) if pieces else torch.empty(0)
                assert sum(p.numel() for p in pieces) == stop - start  # nothing outside the range read
                assert torch.equal(got, t.reshape(-1)[start:stop]), (start, stop)


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, caplog):
    weights = pretrained_weights()
    save_file(weights, tmp_path / "model.safetensors")
    module = MLP()
    before = {k: v.clone() for k, v in module.state_dict().items()}

    def refused(path, match, **kw):
        with pytest.raises(PretrainedError, match=match):
            load_pretrained(module, path, **kw)
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # nothing written

    refused(tmp_path, r"6 of the module's names are not in the checkpoint.*6 of the checkpoint's.*key_map=")
    extra = {**weights, "head.weight": torch.zeros(2)}
    save_file({("net." + k): v for k, v in extra.items()}, tmp_path / "extra.safetensors")
    refused(tmp_path / "extra.safetensors", r"1 of the checkpoint's names are not in the module: 'net.head.weight'")
    wrong = {**weights, "2.weight": torch.zeros(64, 63, dtype=torch.bfloat16)}
    save_file(wrong, tmp_path / "shape.safetensors")
    refused(
        tmp_path / "shape.safetensors",
        r"'2.weight' .* shape \[64, 63\]; the module's 'net.2.weight' is \[64, 64\]",
        key_map={"": "net."},
    )
    ints = {**weights, "4.bias": torch.zeros(1, dtype=torch.int64)}
    save_file(ints, tmp_path / "ints.safetensors")
    refused(
        tmp_path / "ints.safetensors",
        r"'4.bias' .* is I64; the module's 'net.4.bias' is torch.float32",
        key_map={"": "net."},
    )
    torch.save(weights, tmp_path / "model.bin")
    refused(tmp_path / "model.bin", r"No safetensors checkpoint .* convert it with safetensors first")
    (tmp_path / "sharded").mkdir()
    index = {"metadata": {}, "weight_map": {"net.0.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(tmp_path / "sharded", r"model-00001-of-00002.safetensors', named by .* is missing")
    refused(tmp_path, r"gives .* one name", key_map={"0.": "net.2.", "2.": "net.2."})

    # strict=False: what matches is loaded, the rest reported; float32 converted to the module's dtype with a message.
    module.to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="lightning_pure_bf16"):
        loaded = load_pretrained(module, tmp_path / "extra.safetensors", strict=False)
    assert loaded.unexpected_keys == ["net.head.weight"] and loaded.missing_keys == []
    assert loaded.converted_keys == ["net.0.bias"] and "1 tensors of" in caplog.text
    for name, value in module.state_dict().items():
        assert torch.equal(value, weights[name[len("net.") :]].to(torch.bfloat16)), name


def test_save_pretrained_replaces_the_previous_weights_and_refuses_bad_input_before_writing(tmp_path):
    from safetensors.torch import load_file

    from lightning_pure_bf16 import save_pretrained

    module = MLP().to(torch.bfloat16)
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # a host's own file beside the weights
    save_pretrained(module, out, max_shard_size=3000, key_map={"net.": ""})
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        module.net[0].weight.add_(1)
    save_pretrained(module, out, key_map={"net.": ""})  # fits one file: the shards and their index are stale
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert all(torch.equal(v, module.state_dict()["net." + k]) for k, v in load_file(out / "model.safetensors").items())

    before = set(tmp_path.rglob("*"))
    with pytest.raises(PretrainedError, match=r"1 names to save are not in the module: 'net.9.weight'"):
        save_pretrained(module, tmp_path / "new", names=["net.0.weight", "net.9.weight"])
    with pytest.raises(ValueError, match="is not a size"):
        save_pretrained(module, tmp_path / "new", max_shard_size="big")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        save_pretrained(module, tmp_path / "file")
    assert set(tmp_path.rglob("*")) == before | {tmp_path / "file"}  # nothing else written
