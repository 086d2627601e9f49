"""Resume anywhere: another world size or sub-group layout, DeepSpeed's own checkpoints both ways, a kill at any instant
of a save, the manifest's format."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_pure_bf16 import CheckpointError, consolidate_checkpoint
from lightning_pure_bf16.checkpoint import (
    MANIFEST,
    consolidate_optimizer_state,
    export_optimizer_state,
    export_universal_checkpoint,
    validate_checkpoint,
)
from lightning_pure_bf16.zero_checkpoint import ZeroCheckpoint
from tests.strategy_runs import fit_nodes, fit_runs, load_ranks, output, run_script

# Kahan, a scheduler, and an inf/NaN step (2) on one rank: every counter and buffer a checkpoint holds is non-trivial.
RUN = {"strategy": {"rounding": "kahan"}, "scheduler": True, "nan_rank": 0, "nan_step": 2}


INT8 = {"rounding": "kahan", "moments": "int8", "compensation": "int8"}
# The other algorithms of the family as tests/scripts/fit_mlp.py builds them, and the state each keeps.
FAMILY = {"torch_sgd": "momentum_buffer", "lion": "exp_avg", "muon": "exp_avg"}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every fit of this module, grouped by world size into launches in three phases (each reads what the one before
    wrote):
    - the sources: 2 ranks, 11 steps with a checkpoint at step 8 (Kahan), and 6 steps of 8-bit states; 2 nodes of 2
      ranks, 4 steps (two launches with NODE_RANK 0 and 1 over gloo on 127.0.0.1, as a cluster runs them); a DeepSpeed
      bf16 mixed checkpoint of DeepSpeed's own engine.
    - the step-8 checkpoint loaded and saved again at once (before a step) by runs that then train on to step 11: on
      1 rank into states in files, and on 3 ranks with 64-element sub-groups (11 sub-groups instead of 2); on 1 rank,
      the 8-bit checkpoint into 8-bit states in files, the 4-rank one resaved, the DeepSpeed one trained on.
    - on 2 ranks: the 1-rank resave resaved, the 4-rank one resaved, the DeepSpeed one resaved, and a checkpoint
      loaded into another model (refused)."""
    out = tmp_path_factory.mktemp("launches")
    (out / "to1_states").mkdir(parents=True)
    (out / "int8_to1_states").mkdir(parents=True)
    step_8 = out / "two" / "source" / "ckpts" / "epoch=0-step=8.ckpt"
    run_script("ds_mixed_checkpoint.py", out / "deepspeed")
    mixed = out / "deepspeed" / "mixed"
    fit_nodes(out / "nodes", 2, devices=2, steps=4, save_at_end=str(out / "nodes" / "final"), **RUN)
    runs = [
        {"name": "source", "steps": 11, "ckpt_every": 8},
        {
            "name": "int8_source",
            "steps": 6,
            "save_at_end": str(out / "two" / "int8_source" / "final"),
            "strategy": INT8,
            "scheduler": False,
            "nan_rank": None,
        },
        # The other algorithms: torch.optim.SGD (bf16 momentum, Kahan), Lion (8-bit momentum), Muon (bf16 momentum
        # on the matrices, AdamW's moments on the biases) and torch.optim.Adafactor (row and column statistics).
        *(
            {"name": f"{kind}_source", "steps": 4, "optimizer": kind, "save_at_end": str(out / "two" / kind / "final")}
            for kind in (*FAMILY, "torch_adafactor")
        ),
    ]
    fit_runs(out / "two", runs, devices=2, **RUN)
    files = {"state_storage": "mmap", "state_dir": str(out / "to1_states")}
    int8_files = {**INT8, "state_storage": "mmap", "state_dir": str(out / "int8_to1_states")}
    runs = [
        {
            "name": "to1",
            "steps": 11,
            "ckpt_path": str(step_8),
            "save_at_start": str(out / "one" / "to1" / "resaved"),
            "strategy": {**RUN["strategy"], **files},
        },
        _resave(out / "one", "int8_to1", out / "two" / "int8_source" / "final", steps=6, strategy=int8_files),
        _resave(out / "one", "nodes_to1", out / "nodes" / "final", steps=4),
        {"name": "from_mixed_more", "steps": 3, "ckpt_path": str(mixed), "nan_rank": None},
        *(_resave(out / "one", f"{kind}_to1", out / "two" / kind / "final", 4, optimizer=kind) for kind in FAMILY),
        _resave(
            out / "one", "adafactor_to1", out / "two" / "torch_adafactor" / "final", 4, optimizer="torch_adafactor"
        ),
    ]
    fit_runs(out / "one", runs, devices=1, **RUN)
    to3 = {
        "name": "to3",
        "steps": 11,
        "ckpt_path": str(step_8),
        "save_at_start": str(out / "three" / "to3" / "resaved"),
        "strategy": {**RUN["strategy"], "sub_group_size": 64},
    }
    fit_runs(out / "three", [to3], devices=3, **RUN)
    runs = [
        _resave(out / "two", "to2", out / "one" / "to1" / "resaved"),
        _resave(out / "two", "nodes_to2", out / "nodes" / "final", steps=4),
        _resave(out / "two", "from_mixed", mixed, steps=0, nan_rank=None),
        *(
            _resave(out / "two", f"{kind}_to2", out / "one" / f"{kind}_to1" / "resaved", 4, optimizer=kind)
            for kind in FAMILY
        ),
        _resave(
            out / "two", "adafactor_to2", out / "two" / "torch_adafactor" / "final", 4, optimizer="torch_adafactor"
        ),
        _resave(
            out / "two", "adafactor_1to2", out / "one" / "adafactor_to1" / "resaved", 4, optimizer="torch_adafactor"
        ),
        {"name": "another_model", "steps": 9, "ckpt_path": str(step_8), "hidden": 32, "expect_error": True},
    ]
    fit_runs(out / "two", runs, devices=2, **RUN)
    return out


def _resave(where: Path, name: str, ckpt: Path, steps: int = 8, **extra) -> dict:
    """A run that loads ``ckpt`` and saves it again at once (no step between), to WHERE/NAME/resaved."""
    return {"name": name, "steps": steps, "ckpt_path": str(ckpt), "save_at_end": str(where / name / "resaved"), **extra}


@pytest.fixture(scope="module")
def source(launches):
    """2 ranks, 11 steps, a checkpoint at step 8."""
    return launches / "two" / "source" / "ckpts" / "epoch=0-step=8.ckpt", load_ranks(launches / "two" / "source")


@pytest.fixture(scope="module")
def chain(launches):
    """The step-8 checkpoint resaved 2 -> 1 (states in files), 2 -> 3 (64-element sub-groups), then 1 -> 2."""
    runs = {}
    for hop, world in (("1", "one"), ("3", "three")):
        out = launches / world / f"to{hop}"
        runs[hop], runs[f"log{hop}"] = out / "resaved", out
        runs[f"continued{hop}"] = (load_ranks(out, int(hop))[0], output(out))
    runs["2"] = launches / "two" / "to2" / "resaved"
    return runs


# torch.optim.Adafactor converted by the Kahan strategy: the remainder, the step, and a matrix's row and column
# statistics or a vector's variance, as torch.optim.Adafactor names them.
ADAFACTOR_KEPT = (
    frozenset({"kahan_comp", "step", "row_var", "col_var"}),
    frozenset({"kahan_comp", "step", "variance"}),
)


def _assert_same_state(a, b, kept=frozenset({"exp_avg", "exp_avg_sq", "kahan_comp", "step"})):
    """Two checkpoints hold the same weights and the same optimizer state (the keys ``kept``, or each parameter one of
    the sets ``kept`` holds) bit for bit."""
    wa, wb = consolidate_checkpoint(a), consolidate_checkpoint(b)
    assert set(wa) == set(wb)
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    oa, ob = consolidate_optimizer_state(a), consolidate_optimizer_state(b)
    assert set(oa) == set(ob)
    for name in oa:
        assert set(oa[name]) == set(ob[name]) and (set(oa[name]) == kept or frozenset(oa[name]) in kept), name
        for key in oa[name]:
            assert oa[name][key].dtype == ob[name][key].dtype
            assert torch.equal(oa[name][key], ob[name][key]), (name, key)


@pytest.mark.parametrize("hop", ["1", "2", "3"])
def test_repartitioned_checkpoint_saved_again_holds_every_value_bit_for_bit(source, chain, hop):
    _assert_same_state(source[0], chain[hop])
    saved = ZeroCheckpoint(chain[hop] / "checkpoint")
    assert saved.world_size == int(hop)
    assert saved.extra["skipped_steps"] == 1 and saved.step() == 7  # 8 steps, one skipped
    assert json.loads((chain[hop] / MANIFEST).read_text())["world_size"] == int(hop)


@pytest.mark.parametrize("kind", FAMILY)
def test_sgd_lion_and_muon_checkpoints_resume_at_another_world_size(launches, kind):
    """2 ranks -> 1 -> 2: the weights, the step and (SGD, converted by the Kahan strategy) the Kahan remainder exactly;
    SGD's and Muon's bf16 states exactly (Muon's matrices keep a momentum, its AdamW biases two moments), Lion's 8-bit
    momentum (Lion given as is: stochastic rounding) re-encoded in the new blocks within a level of each hop's block
    (a block of a flat partition may hold several parameters: its scale is at most the largest magnitude of the whole
    model's momentum)."""
    src = launches / "two" / kind / "final"
    for hop in (launches / "one" / f"{kind}_to1" / "resaved", launches / "two" / f"{kind}_to2" / "resaved"):
        wa, wb = consolidate_checkpoint(src), consolidate_checkpoint(hop)
        assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
        oa, ob = consolidate_optimizer_state(src), consolidate_optimizer_state(hop)
        level = max(st[FAMILY[kind]].abs().max() for st in oa.values()) * (1 + 2**-7) * 255 / 127**2
        for name in oa:
            kept = {FAMILY[kind], "step"} | ({"kahan_comp"} if kind == "torch_sgd" else set())
            kept |= {"exp_avg_sq"} if kind == "muon" and name.endswith("bias") else set()
            assert set(oa[name]) == set(ob[name]) == kept, name
            assert int(ob[name]["step"]) == int(oa[name]["step"]) == 3  # 4 steps, one skipped
            for key in kept - {"step"}:
                a, b = oa[name][key], ob[name][key]
                assert key == "kahan_comp" or not torch.equal(a, torch.zeros_like(a)), (name, key)
                if kind == "lion":
                    assert ((a - b).abs() <= 2 * level + a.abs() * 2**-7).all(), name  # two hops
                else:
                    assert a.dtype == torch.bfloat16 and torch.equal(a, b), (name, key)


def test_adafactor_checkpoints_resume_at_the_saved_world_size_with_their_statistics(launches):
    """torch.optim.Adafactor converted (Kahan, as the strategy says), 2 ranks saved and loaded on 2 ranks: the
    weights, the Kahan remainder, the step and every rank's float32 row and column statistics exactly."""
    src, hop = launches / "two" / "torch_adafactor" / "final", launches / "two" / "adafactor_to2" / "resaved"
    _assert_same_state(src, hop, kept=ADAFACTOR_KEPT)
    a, b = ZeroCheckpoint(src / "checkpoint"), ZeroCheckpoint(hop / "checkpoint")
    assert a.holds_statistics()
    for rank in range(2):
        for sub_group in range(len(a.sub_groups)):
            sa = a.inner_state(rank, sub_group)["statistics"]
            sb = b.inner_state(rank, sub_group)["statistics"]
            assert set(sa) == {"row_var", "col_var", "variance"}
            assert all(sa[k].dtype == torch.float32 and torch.equal(sa[k], sb[k]) for k in sa)
    assert any(a.inner_state(0, s)["statistics"]["row_var"].abs().sum() > 0 for s in range(len(a.sub_groups)))


def test_adafactor_checkpoints_resume_at_another_world_size_with_their_statistics(launches):
    """2 ranks -> 1 -> 2: the weights, the Kahan remainder and the step exactly, and every parameter's float32
    statistics (a matrix's rows and columns, which every rank holds whole; a vector's elements, each rank its run)
    as saved; back on 2 ranks every rank's statistics are the source's bit for bit."""
    src = launches / "two" / "torch_adafactor" / "final"
    one, back = launches / "one" / "adafactor_to1" / "resaved", launches / "two" / "adafactor_1to2" / "resaved"
    for hop in (one, back):
        _assert_same_state(src, hop, kept=ADAFACTOR_KEPT)
    a, b, c = (ZeroCheckpoint(x / "checkpoint") for x in (src, one, back))
    assert (a.world_size, b.world_size, c.world_size) == (2, 1, 2)
    kinds = set()
    for name in a.iter_params():
        sa, sb, sc = a.statistics(name), b.statistics(name), c.statistics(name)
        kinds.add(tuple(sorted(sa)))
        assert set(sa) == set(sb) == set(sc) and all(v.abs().sum() > 0 for v in sa.values()), name
        assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sc[k]) for k in sa), name
    assert kinds == {("col_var", "row_var"), ("variance",)}  # matrices and vectors both crossed
    for rank in range(2):
        for sub_group in range(len(a.sub_groups)):
            sa, sc = a.inner_state(rank, sub_group)["statistics"], c.inner_state(rank, sub_group)["statistics"]
            assert all(torch.equal(sa[k], sc[k]) for k in sa)


def test_adafactors_statistics_are_exported_as_torch_optim_adafactor_keeps_them(launches, tmp_path):
    """consolidate_optimizer_state and export_optimizer_state give each parameter's statistics whole, float32, in
    torch.optim.Adafactor's shapes (rows: the last dimension 1; columns: the second last 1; a vector's variance)."""
    from safetensors.torch import load_file

    src = launches / "two" / "torch_adafactor" / "final"
    reader, state = ZeroCheckpoint(src / "checkpoint"), consolidate_optimizer_state(src)
    export_optimizer_state(src, tmp_path / "state.safetensors")
    exported = load_file(tmp_path / "state.safetensors")
    for name in reader.iter_params():
        shape = reader.places[name].shape
        if len(shape) >= 2:
            shapes = {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1])}
        else:
            shapes = {"variance": shape}
        for key, want in shapes.items():
            value = state[name][key]
            assert value.dtype == torch.float32 and tuple(value.shape) == want, (name, key)
            assert torch.equal(exported[f"{name}.{key}"], value), (name, key)


def test_sub_group_size_changed_too(chain):
    assert len(ZeroCheckpoint(chain["3"] / "checkpoint").sub_groups) > 2
    assert len(ZeroCheckpoint(chain["2"] / "checkpoint").sub_groups) == 2


def test_two_nodes_of_two_ranks_save_and_resume_on_one_node_and_one_rank_bit_for_bit(launches):
    """num_nodes=2, devices=2: two launches with NODE_RANK 0 and 1 over gloo on 127.0.0.1, as a cluster runs them."""
    out = launches / "nodes"
    ranks = load_ranks(out, 4)
    assert [r["world_size"] for r in ranks] == [4] * 4 and ranks[0]["global_step"] == 4
    assert all(r["memory_report"]["total"] == pytest.approx(10.0) for r in ranks)  # Kahan: 10 bytes/param
    assert json.loads((out / "final" / MANIFEST).read_text())["world_size"] == 4
    for devices, world in ((2, "two"), (1, "one")):
        resaved = launches / world / f"nodes_to{devices}" / "resaved"
        _assert_same_state(out / "final", resaved)
        assert ZeroCheckpoint(resaved / "checkpoint").world_size == devices


@pytest.fixture(scope="module")
def continued(chain):
    """The step-8 checkpoint continued to step 11 on 1 rank (states in files) and on 3 (64-element sub-groups)."""
    return {1: chain["continued1"], 3: chain["continued3"]}


def test_training_continues_on_the_uninterrupted_curve(source, continued):
    whole = source[1][0]["losses"]
    # Steps 8-10 of the uninterrupted run; its own step-to-step spread over steps 4-10 sets the tolerance (the data a
    # rank sees differs with the world size, so the losses can only agree within that spread).
    spread = statistics.pstdev(whole[4:11])
    for devices, (rank0, _) in continued.items():
        assert rank0["global_step"] == 11
        assert rank0["lrs"] == source[1][0]["lrs"][8:11]  # the LR schedule continues
        assert rank0["skipped_steps"] == 1
        resumed = rank0["losses"]
        assert len(resumed) == 3
        assert abs(statistics.mean(resumed) - statistics.mean(whole[8:11])) <= 2 * spread, (devices, resumed, whole)
        # Adam's moments came along: every parameter has taken 7 + 3 steps.
        assert all(int(st["step"]) == 10 for st in rank0["state"].values())


def test_the_log_says_the_checkpoint_was_repartitioned(continued):
    _, log = continued[3]
    assert "re-partitioned the pure bf16 checkpoint" in log and "written by 2 rank(s)" in log and "to 3 rank(s)" in log
    assert "exp_avg, exp_avg_sq, kahan_comp, step 7, 1 skipped steps" in log
    # Each rank reads its own slices: rank 0 of 3 about a third of what 2 ranks saved (no whole tensor, no other rank's
    # files), where the rank of the 2 -> 1 hop reads every weight and state.
    read, total = (
        int(x.replace(",", "")) for x in re.search(r"rank 0 read ([\d,]+) bytes of the ([\d,]+)", log).groups()
    )
    one_read = int(re.search(r"rank 0 read ([\d,]+) bytes", continued[1][1]).group(1).replace(",", ""))
    assert 0.25 * one_read <= read <= 0.4 * one_read <= 0.4 * total


def test_repartition_into_state_files(chain):
    # The 2 -> 1 hop loaded the checkpoint into states in files (its values are checked with the other hops).
    assert all(f for files in load_ranks(chain["log1"], 1)[0]["state_files"] for f in files.values())  # file-backed


def test_int8_states_repartitioned_into_state_files(launches):
    # 2 ranks into 8-bit states in files on 1 rank.
    src, resaved = launches / "two" / "int8_source", launches / "one" / "int8_to1" / "resaved"
    wa, wb = consolidate_checkpoint(src / "final"), consolidate_checkpoint(resaved)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = consolidate_optimizer_state(src / "final"), consolidate_optimizer_state(resaved)
    for name in oa:
        # The remainder is in units of its own weight's spacing, which did not change: exact.
        assert torch.equal(oa[name]["kahan_comp"], ob[name]["kahan_comp"]), name
        assert int(ob[name]["step"]) == int(oa[name]["step"]) == 6
        # The 8-bit moments are re-encoded in the new blocks, stochastically rounded between neighbouring levels: off
        # by at most one level of the new block (its scale is at most the largest magnitude, rounded up to bf16),
        # plus the bf16 rounding of the decoded value on the way.
        for key, widest_level in (("exp_avg", 255 / 127**2), ("exp_avg_sq", 1 - (254 / 255) ** 4)):
            a, b = oa[name][key], ob[name][key]
            bound = a.abs().max() * (1 + 2**-7) * widest_level + a.abs() * 2**-8
            assert ((a - b).abs() <= bound).all(), (name, key)
            assert not torch.equal(a, torch.zeros_like(a))


def test_a_deepspeed_bf16_mixed_checkpoint_continues_in_pure_bf16(launches):
    deepspeed_mixed, resaved = launches / "deepspeed" / "mixed", launches / "two" / "from_mixed" / "resaved"
    src, dst = ZeroCheckpoint(deepspeed_mixed / "checkpoint"), ZeroCheckpoint(resaved / "checkpoint")
    assert src.master_dtype == torch.float32 and dst.master_dtype == torch.bfloat16
    assert dst.step() == src.step() == 2
    for name in src.iter_params():
        master, weight, comp = src.full(name), dst.full(name), dst.full(name, "kahan_comp")
        assert torch.equal(weight, master.to(torch.bfloat16)), name
        # The remainder holds what the bf16 weight does not: weight + remainder is the master to bf16's precision
        # of the remainder (16 more bits), instead of the weight's own rounding error.
        assert ((weight.float() + comp.float()) - master).abs().max() <= (master - weight.float()).abs().max() / 64
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(dst.full(name, key), src.full(name, key).to(torch.bfloat16)), (name, key)
    more = launches / "one" / "from_mixed_more"
    rank0 = load_ranks(more, 1)[0]
    assert "written by DeepSpeed without Lightning" in output(more)
    assert all(torch.isfinite(torch.tensor(rank0["losses"]))) and len(rank0["losses"]) == 3
    assert all(int(st["step"]) == 5 for st in rank0["state"].values())  # 2 DeepSpeed steps + 3 here


def test_exported_universal_checkpoint_loads_in_deepspeeds_own_engine(source, tmp_path):
    written = export_universal_checkpoint(source[0], tmp_path / "universal_out")
    assert (tmp_path / "universal_out" / "latest_universal").read_text() == "universal"
    assert {p.name for p in (written / "zero" / "net.0.weight").iterdir()} == {
        "fp32.pt",
        "exp_avg.pt",
        "exp_avg_sq.pt",
        "kahan_comp.pt",
    }
    run_script("ds_load_universal.py", tmp_path, str(tmp_path / "universal_out"))
    ours, theirs = ZeroCheckpoint(source[0] / "checkpoint"), ZeroCheckpoint(tmp_path / "reloaded" / "checkpoint")
    assert theirs.world_size == 1 and theirs.master_dtype == torch.float32 and theirs.step() == ours.step()
    for name in ours.iter_params():
        assert torch.equal(theirs.full(name), ours.full(name).float()), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(theirs.full(name, key), ours.full(name, key).float()), (name, key)


def test_export_command_refuses_an_existing_output(source, tmp_path, capsys):
    from lightning_pure_bf16.export_universal import main as export_main

    cmd = [sys.executable, "-m", "lightning_pure_bf16.export_universal", str(source[0]), str(tmp_path)]
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=120).returncode == 0  # the command line
    capsys.readouterr()
    assert export_main([str(source[0]), str(tmp_path)]) == 1
    assert "exists; export into a new directory" in capsys.readouterr().err


def test_consolidate_command_writes_the_optimizer_state(source, tmp_path):
    from safetensors.torch import load_file

    from lightning_pure_bf16.consolidate import main as consolidate_main

    args = [str(source[0]), str(tmp_path / "w.safetensors"), "--optimizer-state", str(tmp_path / "opt.safetensors")]
    assert consolidate_main(args) == 0
    saved = load_file(tmp_path / "opt.safetensors")
    expected = consolidate_optimizer_state(source[0])
    assert set(saved) == {f"{name}.{key}" for name, st in expected.items() for key in st}
    assert all(torch.equal(saved[f"{n}.{k}"], v) for n, st in expected.items() for k, v in st.items())


# ----------------------------------------------------------------------------------------- a kill during a save
# (instant, which checkpoint the path holds afterwards): between DeepSpeed's files, after all of them, with the
# manifest written but not in place, before the previous checkpoint is moved aside, between the two renames, and
# before the previous one is deleted.
INSTANTS = [
    ("file:1", "previous"),
    ("file:4", "previous"),
    ("replace:1", "previous"),
    ("replace:2", "previous"),
    ("replace:3", "new"),
    ("rmtree:1", "new"),
    ("none", "new"),
]


def _crash_save(target, new, instant) -> int:
    # In a forked child of this process, which dies at the instant as a kill would (os._exit: no clean-up).
    from tests.scripts.crash_save import in_a_child

    return in_a_child(target, new, instant)


@pytest.mark.parametrize(("instant", "expected"), INSTANTS)
def test_a_save_killed_at_any_instant_leaves_a_whole_checkpoint(source, tmp_path, instant, expected):
    previous = source[0]
    # The new checkpoint: the previous one with one weight changed, so the two are told apart.
    new = tmp_path / "new_source"
    shutil.copytree(previous, new)
    (new / MANIFEST).unlink()
    sd_path = next((new / "checkpoint").glob("*rank_0_*optim_states.pt"))
    sd = torch.load(sd_path, weights_only=False)
    with torch.no_grad():
        sd["optimizer_state_dict"]["fp32_flat_groups"][0][0] += 1.0
    torch.save(sd, sd_path)
    target = tmp_path / "last.ckpt"
    shutil.copytree(previous, target)
    assert _crash_save(target, new, instant) == (0 if instant == "none" else 9)
    _, manifest = validate_checkpoint(target)
    assert manifest is not None
    got, old = consolidate_checkpoint(target), consolidate_checkpoint(previous)
    changed = {k for k in old if not torch.equal(got[k], old[k])}
    if expected == "previous":
        assert not changed
    else:
        assert changed == {"net.0.weight"}
        assert got["net.0.weight"][0, 0] == (old["net.0.weight"][0, 0].float() + 1.0).to(torch.bfloat16)
    # The next save to the same path succeeds and leaves nothing else behind.
    assert _crash_save(target, new, "none") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "new_source"]


def test_an_unknown_manifest_format_is_refused(source, tmp_path):
    target = tmp_path / "future.ckpt"
    shutil.copytree(source[0], target)
    manifest = json.loads((target / MANIFEST).read_text())
    manifest["format"] = 2
    (target / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"'{target / MANIFEST}' has checkpoint format 2.*upgrade"):
        validate_checkpoint(target)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(launches):
    refused = launches / "two" / "another_model"
    assert "Parameter 'net.0.weight' has 512 elements here and 1024 in the checkpoint" in output(refused)
    assert "saved from another model" in output(refused) and not (refused / "rank0.pt").exists()


def test_missing_rank_files_are_named(source, tmp_path):
    target = tmp_path / "cut"
    shutil.copytree(source[0] / "checkpoint", target)
    next(target.glob("*rank_0_*optim_states.pt")).unlink()
    with pytest.raises(CheckpointError, match="ranks \\[1\\]: some ranks' files are missing"):
        ZeroCheckpoint(target)
    with pytest.raises(CheckpointError, match="not a DeepSpeed ZeRO-3 checkpoint"):
        ZeroCheckpoint(tmp_path)


def test_a_save_fsyncs_every_file_and_directory_before_the_manifest_and_the_parent_after(tmp_path, monkeypatch):
    import os

    from lightning_pure_bf16 import checkpoint

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "ck"

    def write(staged):
        (staged / "tag").mkdir(parents=True)
        for name in ("a.pt", "b.pt"):
            (staged / "tag" / name).write_bytes(b"x" * 10)

    checkpoint.save_staged(target, write, world_size=1, is_global_zero=True, barrier=lambda _: None)
    staged = str(checkpoint.staging_path(target))
    fsynced = [e[1] for e in events if e[0] == "fsync"]
    manifest_in_place = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2].endswith(MANIFEST))
    before = {e[1] for e in events[:manifest_in_place] if e[0] == "fsync"}
    assert {f"{staged}/tag/a.pt", f"{staged}/tag/b.pt", f"{staged}/tag", staged} <= before
    assert f"{staged}/{MANIFEST}.part" in before  # the manifest's own data
    commit = next(i for i, e in enumerate(events) if e[0] == "replace" and e[1] == staged)
    assert events[commit + 1] == ("fsync", str(tmp_path))  # the rename is durable before the save returns
    assert fsynced and (target / MANIFEST).is_file()
