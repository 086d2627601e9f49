"""Checkpoints with the pure-bf16 strategy: exact resume, consolidation, world-size change, bad and cut-off saves."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_pure_bf16 import CheckpointError, consolidate_checkpoint
from lightning_pure_bf16.checkpoint import (
    MANIFEST,
    UntrustedCheckpointError,
    consolidate_optimizer_state,
    export_universal_checkpoint,
    save_state_dict,
    staging_path,
    validate_checkpoint,
)
from tests.strategy_runs import assert_same_partitions, fit, fit_runs, load_ranks, output, run_script

# 256 samples, batch 16, 2 ranks: 8 steps per epoch; the checkpoint at step 8 is an epoch boundary (mid-epoch resume,
# shuffled too: tests/test_data.py).
RUN = {"devices": 2, "strategy": {"rounding": "kahan"}, "scheduler": True, "nan_rank": 0, "nan_step": 2}


INT8_RUN = {**RUN, "strategy": {"rounding": "kahan", "moments": "int8", "compensation": "int8"}}


def _mmap_run(state_dir) -> dict:
    return {**RUN, "strategy": {**RUN["strategy"], "state_storage": "mmap", "state_dir": str(state_dir)}}


def _step_8(run: Path) -> str:
    return str(run / "ckpts" / "epoch=0-step=8.ckpt")


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """The module's 2-rank fits that end well, in one launch: uninterrupted runs with checkpoints (bf16 states, 8-bit
    states, states in files), each resumed from its step-8 checkpoint; states in files resumed from a checkpoint in
    memory."""
    out = tmp_path_factory.mktemp("fits")
    for name in ("mmap_states", "mmap_from_mmap_states", "mmap_from_memory_states"):
        (out / name).mkdir()
    runs = [
        {
            "name": "uninterrupted",
            "ckpt_every": 8,
            "save_at_end": str(out / "uninterrupted" / "final"),
            "gather_full": True,
        },
        {"name": "resumed", "ckpt_path": _step_8(out / "uninterrupted")},
        {"name": "int8_uninterrupted", "ckpt_every": 8, **INT8_RUN},
        {"name": "int8_resumed", "ckpt_path": _step_8(out / "int8_uninterrupted"), **INT8_RUN},
        {
            "name": "mmap_uninterrupted",
            "ckpt_every": 8,
            "save_at_end": str(out / "mmap_uninterrupted" / "final"),
            **_mmap_run(out / "mmap_states"),
        },
        {
            "name": "mmap_from_mmap",
            "ckpt_path": _step_8(out / "mmap_uninterrupted"),
            **_mmap_run(out / "mmap_from_mmap_states"),
        },
        {
            "name": "mmap_from_memory",
            "ckpt_path": _step_8(out / "uninterrupted"),
            **_mmap_run(out / "mmap_from_memory_states"),
        },
    ]
    return fit_runs(out, runs, steps=11, **RUN)


@pytest.fixture(scope="module")
def uninterrupted(fits):
    return fits / "uninterrupted", load_ranks(fits / "uninterrupted")


@pytest.fixture(scope="module")
def resumed(fits):
    return load_ranks(fits / "resumed")


def test_resume_equals_uninterrupted_run_bit_for_bit(uninterrupted, resumed):
    for a, b in zip(uninterrupted[1], resumed):
        assert b["global_step"] == a["global_step"] == 11
        for sa, sb in zip(a["state"].values(), b["state"].values()):
            assert set(sa) == set(sb) == {"step", "stream", "exp_avg", "exp_avg_sq", "kahan_comp"}
        assert_same_partitions(a, b)
        assert b["seed"] == a["seed"] and b["skipped_steps"] == a["skipped_steps"] == 1
        assert b["lrs"] == a["lrs"][8:]  # the LR schedule continues where it stopped
        assert b["losses"] == a["losses"][8:]


@pytest.fixture(scope="module")
def int8_runs(fits):
    whole = fits / "int8_uninterrupted"
    return load_ranks(whole), load_ranks(fits / "int8_resumed"), whole


def test_int8_states_are_7_bytes_per_param_and_resume_bit_for_bit(int8_runs):
    uninterrupted, resumed, whole = int8_runs
    weights = consolidate_checkpoint(whole / "ckpts" / "epoch=0-step=8.ckpt")
    assert weights and all(t.dtype == torch.bfloat16 and torch.isfinite(t.float()).all() for t in weights.values())
    for a, b in zip(uninterrupted, resumed):
        report = a["memory_report"]
        assert 7.0 <= report["total"] <= 7.05 and report["kahan_comp"] == pytest.approx(1.0)
        assert b["global_step"] == a["global_step"] == 11 and b["losses"] == a["losses"][8:]
        for x, y, real in zip(a["flat_params"], b["flat_params"], a["real_masks"]):
            assert torch.equal(x[real], y[real])
        for sa, sb, real in zip(a["state"].values(), b["state"].values(), a["real_masks"]):
            assert sa["exp_avg"].dtype == torch.int8 and sa["exp_avg_sq"].dtype == torch.uint8
            assert sa["kahan_comp"].dtype == torch.int8
            for key in ("exp_avg", "exp_avg_sq", "kahan_comp"):
                assert torch.equal(sa[key][real], sb[key][real]), key
            for key in ("exp_avg_scale", "exp_avg_sq_scale"):
                assert torch.equal(sa[key], sb[key]), key
        assert b["seed"] == a["seed"] and b["skipped_steps"] == a["skipped_steps"] == 1


def _assert_same_final_state(expected: list[dict], got: list[dict]) -> None:
    for a, b in zip(expected, got):
        assert b["global_step"] == a["global_step"] == 11
        assert all({"exp_avg", "exp_avg_sq", "kahan_comp"} <= set(st) for st in a["state"].values())
        assert_same_partitions(a, b)
        assert b["seed"] == a["seed"] and b["skipped_steps"] == a["skipped_steps"] == 1


@pytest.fixture(scope="module")
def mmap_uninterrupted(fits):
    return fits / "mmap_uninterrupted", load_ranks(fits / "mmap_uninterrupted")


def test_saving_after_fit_with_mmap_states_keeps_the_moments(mmap_uninterrupted):
    # `trainer.save_checkpoint` after `fit`: the state files must still be there, and their contents saved.
    out, ranks = mmap_uninterrupted
    for r in ranks:
        saved = torch.load(
            out / "final" / "checkpoint" / f"bf16_zero_pp_rank_{r['rank']}_mp_rank_00_optim_states.pt",
            weights_only=False,
        )["optimizer_state_dict"]["optimizer_state_dict"]["state"]
        for (index, state), real in zip(r["state"].items(), r["real_masks"]):
            for key in ("exp_avg", "exp_avg_sq", "kahan_comp"):
                assert torch.equal(saved[index][key][real], state[key][real]), key


def test_mmap_states_with_a_skipped_step_and_a_schedule_equal_in_memory_states(uninterrupted, mmap_uninterrupted):
    _assert_same_final_state(uninterrupted[1], mmap_uninterrupted[1])
    # repr: the loss of the step with the NaN gradient is NaN in both (and NaN != NaN).
    assert list(map(repr, mmap_uninterrupted[1][0]["losses"])) == list(map(repr, uninterrupted[1][0]["losses"]))


@pytest.mark.parametrize("saved_with", ["mmap", "memory"])
def test_resume_into_mmap_states_equals_uninterrupted_run(fits, uninterrupted, saved_with):
    resumed = load_ranks(fits / f"mmap_from_{saved_with}")
    _assert_same_final_state(uninterrupted[1], resumed)
    assert resumed[0]["losses"] == uninterrupted[1][0]["losses"][8:]
    assert list((fits / f"mmap_from_{saved_with}_states").iterdir()) == []


def test_consolidated_weights_equal_live_weights_and_load_strict(uninterrupted):
    out, ranks = uninterrupted
    state = consolidate_checkpoint(out / "final")
    live = ranks[0]["full_state"]
    assert set(state) == set(live)
    for key, value in live.items():
        assert state[key].dtype == torch.bfloat16
        assert torch.equal(state[key], value), key
    from tests.scripts.fit_mlp import MLP

    MLP({}).to(torch.bfloat16).load_state_dict(state, strict=True)


def _consolidate(capsys, *args: str) -> tuple[int, str, str]:
    """The command's ``main`` in this process (the command line itself is run once, in test_consolidate_command)."""
    from lightning_pure_bf16.consolidate import main as consolidate_main

    capsys.readouterr()
    code = consolidate_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_consolidate_command(uninterrupted, tmp_path, suffix, capsys):
    target = tmp_path / f"weights{suffix}"
    args = [str(uninterrupted[0] / "final"), str(target)]
    if suffix == ".safetensors":  # the command line, as a user types it
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_pure_bf16.consolidate", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, out, err = _consolidate(capsys, *args)
    assert code == 0, err
    assert f"wrote {target}" in out and "bfloat16" in out
    loaded = load_file(target) if suffix == ".safetensors" else torch.load(target, weights_only=True)
    expected = uninterrupted[1][0]["full_state"]
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_export_writes_hugging_face_shards_streamed_bit_for_bit(uninterrupted, tmp_path, capsys):
    from safetensors import safe_open

    expected = uninterrupted[1][0]["full_state"]
    largest = max(v.numel() * 2 for v in expected.values())
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "mlp"}')
    target = tmp_path / "hf"
    args = [str(uninterrupted[0] / "final"), str(target)]
    args += ["--max-shard-size", str(largest), "--config", str(config), "--key-map", "net.=layers."]
    args += ["--optimizer-state", str(tmp_path / "optimizer")]
    code, _, err = _consolidate(capsys, *args)
    assert code == 0, err
    index = json.loads((target / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 1 and files == sorted(p.name for p in target.glob("model-*-of-*.safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    renamed = {("layers." + k[4:] if k.startswith("net.") else k): v for k, v in expected.items()}
    assert set(index["weight_map"]) == set(renamed) and any(k.startswith("layers.") for k in renamed)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in expected.values())
    for file in files:  # at most the bound, in safetensors' own reader's view of the header
        with safe_open(target / file, "pt") as f:
            assert sum(math.prod(f.get_slice(k).get_shape()) * 2 for k in f.keys()) <= largest
        for key, value in load_file(target / file).items():
            assert index["weight_map"][key] == file and value.dtype == torch.bfloat16
            assert torch.equal(value, renamed[key]), key
    assert (target / "config.json").read_text() == config.read_text()
    assert not list(tmp_path.glob(".*.part"))
    # The optimizer state, streamed the same way: equal to the whole-tensor reader's.
    states = consolidate_optimizer_state(uninterrupted[0] / "final")
    opt = {}
    for file in (tmp_path / "optimizer").glob("optimizer*.safetensors"):
        opt.update(load_file(file))
    for name, entry in states.items():
        for key, value in entry.items():
            mapped = ("layers." + name[4:] if name.startswith("net.") else name) + f".{key}"
            assert torch.equal(opt[mapped].reshape(value.shape), value), mapped


def test_export_refuses_bad_arguments_before_writing(uninterrupted, tmp_path, capsys):
    source = str(uninterrupted[0] / "final")
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("saved")
    (tmp_path / "bad.json").write_text("[1, 2]")
    cases = {
        "exists and is not an empty directory": [str(kept)],
        "not a size": [str(tmp_path / "a"), "--max-shard-size", "lots"],
        "give OLD=NEW": [str(tmp_path / "b"), "--key-map", "model."],
        "not a model config": [str(tmp_path / "c"), "--config", str(tmp_path / "bad.json")],
        "goes with a directory output": [str(tmp_path / "w.safetensors"), "--config", str(tmp_path / "bad.json")],
    }
    for message, args in cases.items():
        code, _, err = _consolidate(capsys, source, *args)
        assert code == 1 and message in err, (args, err)
    assert _consolidate(capsys, source, str(tmp_path / "d"), "--key-map", "net.=")[0] == 0  # prefixes dropped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "d", "kept"]
    assert (kept / "mine.txt").read_text() == "saved" and len(list(kept.iterdir())) == 1


def test_consolidate_command_refuses_unknown_extension(uninterrupted, tmp_path, capsys):
    code, _, err = _consolidate(capsys, str(uninterrupted[0] / "final"), str(tmp_path / "w.txt"))
    assert code == 1 and "use .safetensors or .pt" in err
    assert not list(tmp_path.iterdir())


def test_world_size_change_through_consolidation(uninterrupted, damaged):
    one_rank = damaged / "one_rank" / "from_weights"
    loaded = torch.load(one_rank / "init_weights_loaded.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in uninterrupted[1][0]["full_state"].items())
    assert load_ranks(one_rank, 1)[0]["global_step"] == 2


def test_interrupted_save_keeps_the_previous_checkpoint(uninterrupted, tmp_path):
    target = tmp_path / "last.ckpt"
    shutil.copytree(uninterrupted[0] / "final", target)
    proc = fit(tmp_path, check=False, devices=1, steps=2, seed=7, save_at_end=str(target), kill_during_save=True)
    assert proc.returncode != 0
    staged = staging_path(target)
    assert staged.is_dir() and not (staged / MANIFEST).exists()  # the save really was cut off midway
    validate_checkpoint(target)
    state = consolidate_checkpoint(target)
    assert all(torch.equal(state[k], v) for k, v in uninterrupted[1][0]["full_state"].items())
    with pytest.raises(CheckpointError, match="did not finish"):
        validate_checkpoint(staged)


def test_a_rank_killed_mid_training_ends_every_rank_and_the_last_checkpoint_resumes(uninterrupted, damaged):
    # Rank 1 gets SIGKILL after step 10's backward (the checkpoint of step 8 written, no save running): rank 0 is
    # left in the step's collectives and must end too, not wait for the peer forever.
    killed = damaged / "killed"
    returncode, stderr = json.loads((damaged / "killed.json").read_text())
    # Rank 0 ends by gloo's error (it names the lost peer in one of two ways, by when the socket closed) or, where
    # Lightning's launcher sees the dead child first, by the launcher ending every process.
    ends = ("Connection reset by peer", "remote worker crashing", "terminated with code -9. Forcefully terminating")
    assert returncode != 0 and any(m in stderr for m in ends), stderr[-2000:]
    assert not list(killed.glob("rank*.pt"))  # neither rank finished
    validate_checkpoint(_step_8(killed))
    for a, b in zip(uninterrupted[1], load_ranks(damaged / "two_ranks" / "killed_resumed")):
        assert b["global_step"] == 11 and b["losses"] == a["losses"][8:]
        for x, y, real in zip(a["flat_params"], b["flat_params"], a["real_masks"]):
            assert torch.equal(x[real], y[real])


@pytest.fixture
def small_file_system(tmp_path):
    """A tmpfs of a given size (bytes), made by the test; skipped where mounting is not allowed."""
    mounts = []

    def make(size: int) -> Path:
        where = tmp_path / f"fs{len(mounts)}"
        where.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
        if shutil.which("mount") is None or subprocess.run(cmd, capture_output=True).returncode != 0:
            pytest.skip("cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN)")
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_save_that_runs_out_of_space_fails_clearly_and_leaves_the_previous_checkpoint_whole(
    uninterrupted, small_file_system, tmp_path
):
    previous = uninterrupted[0] / "final"
    size = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file())
    where = small_file_system(2 * size + 1024 * 1024)
    target = where / "last.ckpt"
    shutil.copytree(previous, target)
    # The rest filled but 16 KiB: the new save (1 rank, the same model, some 100 KiB) cannot finish.
    with open(where / "filler", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(where).free - 16 * 1024))
    proc = fit(tmp_path, check=False, devices=1, steps=2, seed=7, save_at_end=str(target))
    assert proc.returncode != 0
    assert f"Saving the checkpoint to '{target}' failed" in proc.stderr and "free some or save elsewhere" in proc.stderr
    assert not staging_path(target).exists()  # the partial copy gave its space back
    validate_checkpoint(target)
    state = consolidate_checkpoint(target)
    assert all(torch.equal(state[k], v) for k, v in uninterrupted[1][0]["full_state"].items())


def _flip_a_byte_of_a_tensor(path: Path) -> str:
    """Change one byte in the middle of the largest tensor record of a torch file; returns the record's name."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        where = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x10]))
    return info.filename


def test_a_changed_byte_in_a_state_file_is_reported_by_every_reader_naming_the_file(damaged):
    target = damaged / "changed_byte.ckpt"
    victim, record = json.loads(
        (damaged / "changed_byte.json").read_text()
    )  # the size stays: the manifest sees nothing wrong
    victim = Path(victim)
    corrupted = rf"'{victim}' is corrupted: {record} does not match the checksum"
    for read in (validate_checkpoint, consolidate_checkpoint, consolidate_optimizer_state):
        with pytest.raises(CheckpointError, match=corrupted):
            read(target)
    # A 2-rank resume shares out the checking (rank 1 reads rank 1's optimizer state): rank 1 names the file, rank 0
    # hears of it, and both stop before loading.
    assert victim.name.startswith("bf16_zero_pp_rank_1_")
    resume = damaged / "two_ranks" / "changed_byte"
    assert not (resume / "rank0.pt").exists() and not (resume / "rank1.pt").exists()
    assert f"'{victim}' is corrupted" in output(resume) and "Another rank found a corrupted file" in output(resume)


def _copy(uninterrupted, tmp_path):
    target = tmp_path / "copy.ckpt"
    shutil.copytree(uninterrupted[0] / "final", target)
    return target


@pytest.fixture(scope="module")
def damaged(tmp_path_factory, uninterrupted):
    """Copies of the uninterrupted run's final checkpoint, damaged three ways (one byte of a state changed, a state
    file cut short, code planted in a pickle: two copies, each touching its own marker), and the fits that meet them:
    a 2-rank launch (the two resumes that must fail on both ranks, the trusted resume, the resume of a run whose rank
    was killed) and a 1-rank launch (the untrusted resume, and a fit from consolidated weights); and a plain-DeepSpeed
    resume of the planted copy."""
    from tests.test_deepspeed_front_end import ds_run

    out = tmp_path_factory.mktemp("damaged")
    final = uninterrupted[0] / "final"
    for name in ("changed_byte", "truncated", "runs_code", "trusted_runs_code"):
        shutil.copytree(final, out / f"{name}.ckpt")
    victim = sorted((out / "changed_byte.ckpt" / "checkpoint").glob("*optim_states.pt"))[-1]
    (out / "changed_byte.json").write_text(json.dumps([str(victim), _flip_a_byte_of_a_tensor(victim)]))
    victim = sorted((out / "truncated.ckpt" / "checkpoint").glob("*optim_states.pt"))[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    _plant_code(out / "runs_code.ckpt", out / "code_ran")
    _plant_code(out / "trusted_runs_code.ckpt", out / "trusted_code_ran")
    save_state_dict(consolidate_checkpoint(final), out / "weights.safetensors")
    # Rank 1 killed after step 10's backward, the step-8 checkpoint written.
    killed = fit(out / "killed", check=False, steps=11, ckpt_every=8, kill_rank_at_step=[1, 10], **RUN)
    (out / "killed.json").write_text(json.dumps([killed.returncode, killed.stderr]))
    trusted = {**RUN, "strategy": {**RUN["strategy"], "trust_checkpoint": True}}
    runs = [
        {"name": "changed_byte", "ckpt_path": str(out / "changed_byte.ckpt"), "expect_error": True},
        {"name": "truncated", "ckpt_path": str(out / "truncated.ckpt"), "expect_error": True},
        {"name": "trusted", "ckpt_path": str(out / "trusted_runs_code.ckpt"), **trusted},
        {"name": "killed_resumed", "steps": 11, "ckpt_path": _step_8(out / "killed")},
    ]
    fit_runs(out / "two_ranks", runs, steps=12, **RUN)
    runs = [
        {"name": "runs_code", "steps": 12, "ckpt_path": str(out / "runs_code.ckpt"), "expect_error": True},
        {"name": "from_weights", "steps": 2, "init_weights": str(out / "weights.safetensors")},
    ]
    fit_runs(out / "one_rank", runs, devices=1)
    ds_run(out / "ds", world=1, steps=4, resume=str(out / "runs_code.ckpt"), record_load_error=True)
    return out


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        validate_checkpoint(tmp_path / "nope.ckpt")


def test_single_file_is_not_a_pure_bf16_checkpoint(tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        validate_checkpoint(tmp_path / "model.ckpt")


def test_truncated_file_is_named(uninterrupted, tmp_path):
    target = _copy(uninterrupted, tmp_path)
    victim = sorted((target / "checkpoint").glob("*optim_states.pt"))[1]
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"'{victim}' is truncated"):
        validate_checkpoint(target)
    with pytest.raises(CheckpointError, match="truncated"):
        consolidate_checkpoint(target)


def test_missing_file_is_named(uninterrupted, tmp_path):
    target = _copy(uninterrupted, tmp_path)
    victim = sorted((target / "checkpoint").glob("*model_states.pt"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"'{victim}' is missing"):
        validate_checkpoint(target)


def test_resuming_a_truncated_checkpoint_fails_before_training(damaged):
    resume = damaged / "two_ranks" / "truncated"
    assert "is truncated or was overwritten" in output(resume)
    assert not (resume / "rank0.pt").exists()


class _RunsCode:
    """Unpickles into a call of ``os.system``: what a checkpoint from a stranger may hold."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _plant_code(target: Path, marker: Path) -> Path:
    """A pickled call of ``touch MARKER`` in the first model-state file, the manifest's sizes made consistent."""
    victim = sorted((target / "checkpoint").glob("*model_states.pt"))[0]
    state = torch.load(victim, weights_only=True)
    torch.save({**state, "payload": _RunsCode(f"touch {marker}")}, victim)
    manifest = json.loads((target / MANIFEST).read_text())  # consistent sizes: the manifest sees nothing wrong
    manifest["files"] = {name: (target / name).stat().st_size for name in manifest["files"]}
    (target / MANIFEST).write_text(json.dumps(manifest))
    return victim


def test_a_checkpoint_that_runs_code_is_refused_by_every_reader_and_loads_only_when_trusted(damaged, tmp_path):
    from lightning_pure_bf16.consolidate import main as consolidate_main

    target, marker = damaged / "runs_code.ckpt", damaged / "code_ran"
    victim = sorted((target / "checkpoint").glob("*model_states.pt"))[0]
    refused = rf"'{victim}' needs the types posix.system to be read.*Nothing was loaded.*trust"
    export = lambda t: export_universal_checkpoint(t, tmp_path / "universal")  # noqa: E731
    for read in (consolidate_checkpoint, consolidate_optimizer_state, export):
        with pytest.raises(UntrustedCheckpointError, match=refused):
            read(target)
    assert consolidate_main([str(target), str(tmp_path / "w.safetensors")]) == 1
    # Resume through the Trainer (1 rank: the re-partitioning reader) and the plain-DeepSpeed front end.
    refused_fit = damaged / "one_rank" / "runs_code"
    assert "UntrustedCheckpointError" in output(refused_fit) and not (refused_fit / "rank0.pt").exists()
    assert "UntrustedCheckpointError" in torch.load(damaged / "ds" / "rank0.pt", weights_only=True)["load_error"]
    assert not marker.exists()
    # The opt-in reads it with the full unpickler, which runs the payload: the command line, then (a copy that runs
    # another command) a 2-rank Trainer resume with the strategy's `trust_checkpoint=True` (DeepSpeed's own loader),
    # which trains on.
    assert consolidate_main([str(target), str(tmp_path / "w.safetensors"), "--trust-checkpoint"]) == 0
    assert marker.exists()
    assert (damaged / "trusted_code_ran").exists()
    assert load_ranks(damaged / "two_ranks" / "trusted")[0]["global_step"] == 12


@pytest.fixture(scope="module")
def fp32_master_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed")
    run_script("ds_mixed_checkpoint.py", out)
    return out / "mixed"


def test_fp32_master_checkpoint_is_refused_unless_accepted(fp32_master_checkpoint):
    with pytest.raises(CheckpointError, match="fp32 master weights.*Resume it in pure bf16.*consolidate"):
        validate_checkpoint(fp32_master_checkpoint)
    assert validate_checkpoint(fp32_master_checkpoint, accept_fp32_masters=True) == (fp32_master_checkpoint, None)


def test_fp32_master_checkpoint_is_converted_with_a_message(fp32_master_checkpoint, caplog, capsys):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from lightning_pure_bf16.consolidate import main as consolidate_main

    with caplog.at_level(logging.INFO, logger="lightning_pure_bf16"):
        state = consolidate_checkpoint(fp32_master_checkpoint)
    assert "holds fp32 master weights" in caplog.text  # logged by the library, printed by the command
    capsys.readouterr()
    assert consolidate_main([str(fp32_master_checkpoint), str(fp32_master_checkpoint.parent / "w.safetensors")]) == 0
    assert "holds fp32 master weights" in capsys.readouterr().out
    reference = get_fp32_state_dict_from_zero_checkpoint(str(fp32_master_checkpoint), tag="checkpoint")
    assert set(state) == set(reference)
    for key, value in reference.items():
        assert value.dtype == torch.float32
        assert torch.equal(state[key], value.to(torch.bfloat16))


def test_plain_deepspeed_tag_is_found_through_latest(fp32_master_checkpoint):
    tagged = fp32_master_checkpoint.parent / "mixed_tagged"
    assert (tagged / "latest").read_text().strip().startswith("global_step")
    state = consolidate_checkpoint(tagged)
    assert set(state) == set(consolidate_checkpoint(fp32_master_checkpoint))
    assert all(v.dtype == torch.bfloat16 for v in state.values())


def test_a_state_file_in_torchs_legacy_format_is_refused_as_uncheckable(tmp_path):
    from lightning_pure_bf16.safe_load import verify_state_file

    legacy, current = tmp_path / "legacy.pt", tmp_path / "current.pt"
    torch.save({"w": torch.ones(4, dtype=torch.bfloat16)}, legacy, _use_new_zipfile_serialization=False)
    torch.save({"w": torch.ones(4, dtype=torch.bfloat16)}, current)
    verify_state_file(current)  # the zip format: checked, and intact
    with pytest.raises(CheckpointError, match=r"legacy \(pre-1.6, not zip\) format, which carries no checksums"):
        verify_state_file(legacy)
