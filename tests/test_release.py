"""Gradient release (``gradient_release=True``): each parameter's partition is updated as soon as ZeRO-3 has
reduce-scattered its gradient, and no gradient partition is kept. On 2 CPU processes: 6.00 / 4.03 B/param, the same bits
as without release for every rounding and state format, checkpoints both ways, the per-partition inf/NaN rule, and the
refusals. All runs share one launch of tests/scripts/ds_mlp.py (a 37-wide MLP: partitions that start anywhere inside
8-bit scale blocks, padding, and a parameter with no element on rank 1)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.strategy_runs import load_ranks, output, run_script

# rounding / state formats: the options of each pair of runs (with and without release).
FORMATS = {
    "stochastic": {},
    "kahan": {"rounding": "kahan"},
    "nearest": {"rounding": "nearest"},
    "int8": {"moments": "int8"},
    "int8_kahan": {"moments": "int8", "rounding": "kahan", "compensation": "int8"},
}
# Clipping off in the runs without release too: DeepSpeed's default (1.0) is what release turns off.
NO_CLIP = {"gradient_clipping": 0.0}
# Every parameter partitioned (none kept whole on every rank) in the main pair; the format pairs keep DeepSpeed's
# default threshold, under which all of this small model's parameters are kept whole (the other path).
PARTITIONED = {"zero_optimization": {"stage3_param_persistence_threshold": 0}, **NO_CLIP}


def _runs(tmp_path) -> list[dict]:
    runs = [
        {
            "name": "plain",
            "steps": 6,
            "save_at": 3,
            "save_path": str(tmp_path / "plain" / "mid"),
            "config": PARTITIONED,
        },
        {
            "name": "release",
            "steps": 6,
            "save_at": 3,
            "save_path": str(tmp_path / "release" / "mid"),
            "config": PARTITIONED,
            "options": {"gradient_release": True},
        },
        # A checkpoint written without release resumed with it, and back; and release to release.
        {
            "name": "release_from_plain",
            "steps": 6,
            "resume": str(tmp_path / "plain" / "mid"),
            "config": PARTITIONED,
            "options": {"gradient_release": True},
        },
        {"name": "plain_from_release", "steps": 6, "resume": str(tmp_path / "release" / "mid"), "config": PARTITIONED},
        {
            "name": "release_from_release",
            "steps": 6,
            "resume": str(tmp_path / "release" / "mid"),
            "config": PARTITIONED,
            "options": {"gradient_release": True},
        },
        # One element of one parameter's gradient is NaN on rank 0 at step 1.
        {"name": "nan", "steps": 3, "nan_element": 1, "snapshots": True, "options": {"gradient_release": True}},
        {"name": "twice", "steps": 1, "double_backward": True, "options": {"gradient_release": True}},
        # States in files with release: the bf16 weights alone in memory, the same bits as release in memory;
        # checkpoints across the two; the NaN rule.
        {
            "name": "mmap_release",
            "steps": 6,
            "save_at": 3,
            "save_path": str(tmp_path / "mmap_release" / "mid"),
            "config": PARTITIONED,
            "options": {"gradient_release": True, **_files(tmp_path, "mmap_release")},
        },
        {
            "name": "mmap_release_from_release",
            "steps": 6,
            "resume": str(tmp_path / "release" / "mid"),
            "config": PARTITIONED,
            "options": {"gradient_release": True, **_files(tmp_path, "mmap_release_from_release")},
        },
        {
            "name": "release_from_mmap_release",
            "steps": 6,
            "resume": str(tmp_path / "mmap_release" / "mid"),
            "config": PARTITIONED,
            "options": {"gradient_release": True},
        },
        {
            "name": "nan_mmap",
            "steps": 3,
            "nan_element": 1,
            "snapshots": True,
            "options": {"gradient_release": True, **_files(tmp_path, "nan_mmap")},
        },
    ]
    for name, options in FORMATS.items():
        if name == "stochastic":
            continue  # the main pair
        runs.append({"name": f"{name}_plain", "steps": 4, "config": NO_CLIP, "options": options})
        runs.append({"name": f"{name}_release", "steps": 4, "options": {**options, "gradient_release": True}})
        files = _files(tmp_path, f"{name}_mmap_release")
        runs.append(
            {"name": f"{name}_mmap_release", "steps": 4, "options": {**options, "gradient_release": True, **files}}
        )
    return runs


def _files(tmp_path, name: str) -> dict:
    (tmp_path / "states" / name).mkdir(parents=True, exist_ok=True)
    return {"state_storage": "mmap", "state_dir": str(tmp_path / "states" / name)}


def _one_rank_runs(tmp_path) -> list[dict]:
    """The 2-rank checkpoint of release with states in files resumed on 1 rank, that way and with neither."""
    resume = str(tmp_path / "mmap_release" / "mid")
    files = {"gradient_release": True, **_files(tmp_path, "one_rank_mmap_release")}
    return [
        {"name": "one_rank_mmap_release", "steps": 6, "resume": resume, "config": PARTITIONED, "options": files},
        {"name": "one_rank_plain", "steps": 6, "resume": resume, "config": PARTITIONED},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    run_script("ds_mlp.py", out, json.dumps({"hidden": 37, "runs": _runs(out)}))
    run_script("ds_mlp.py", out, json.dumps({"hidden": 37, "world": 1, "runs": _one_rank_runs(out)}))
    found = {run["name"]: load_ranks(out / run["name"]) for run in _runs(out)}
    return found | {run["name"]: load_ranks(out / run["name"], 1) for run in _one_rank_runs(out)}


def _same_bits(a: dict, b: dict) -> None:
    """Weights (where they hold a parameter: ZeRO-3 leaves its padding uninitialized), both moments, the Kahan buffer
    and the 8-bit scales, bit for bit."""
    for x, y, real in zip(a["flat_params"], b["flat_params"], a["real"]):
        assert torch.equal(x[real], y[real])
    assert a["state"].keys() == b["state"].keys()
    for sa, sb, real in zip(a["state"].values(), b["state"].values(), a["real"]):
        assert sa.keys() == sb.keys()
        for key in sa:
            x, y = sa[key].reshape(-1), sb[key].reshape(-1)
            if x.numel() == real.numel():  # per element: the Kahan remainder of padding follows its garbage
                x, y = x[real], y[real]
            assert torch.equal(x, y), key


def test_release_holds_6_bytes_per_param_by_the_report_and_by_a_walk_of_zero3s_buffers(runs):
    for r in runs["release"]:
        assert r["gradient_partition_freed"]  # nothing holds the buffer: its memory went back, not only the report
        report = r["memory_report"]
        assert report["total"] == pytest.approx(6.0, abs=0.01) and report["grad"] == 0
        skip = (".ipg_buckets.", ".persistent_parameters.")  # the reduce bucket; whole copies of small parameters
        walked = [b for n, _, b, f in r["zero_buffers"] if b > 16 and not any(k in n for k in skip) and not f]
        assert sum(walked) / report["params_on_rank"] == pytest.approx(6.0, rel=0.01)
    for r in runs["plain"]:
        assert r["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
    for r in runs["int8_release"]:
        assert r["memory_report"]["total"] == pytest.approx(2 + 2 * (1 + 2 / 128), abs=0.02)  # 4.03
        assert r["memory_report"]["grad"] == 0


def test_release_with_states_in_files_holds_2_bytes_per_param_and_streams_the_rest(runs):
    for name, files in (
        ("mmap_release", 4.0),
        ("int8_mmap_release", 2 * (1 + 2 / 128)),
        ("kahan_mmap_release", 6.0),
        ("int8_kahan_mmap_release", 2 * (1 + 2 / 128) + 1),
    ):
        for r in runs[name]:
            report = r["memory_report"]
            assert report["total"] == pytest.approx(2.0, abs=0.01) and report["grad"] == 0, name  # the weights alone
            assert report["state_files"] == pytest.approx(files, abs=0.02), name
            assert r["gradient_partition_freed"], name
            skip = (".ipg_buckets.", ".persistent_parameters.")
            held = [b for n, _, b, f in r["zero_buffers"] if b > 16 and not any(k in n for k in skip) and not f]
            assert sum(held) / report["params_on_rank"] == pytest.approx(2.0, rel=0.01), name


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_release_with_states_in_files_gives_the_bits_of_release_in_memory(runs, fmt):
    release, files = ("release", "mmap_release") if fmt == "stochastic" else (f"{fmt}_release", f"{fmt}_mmap_release")
    steps = len(runs[files][0]["losses"])
    for a, b in zip(runs[release], runs[files]):
        assert a["losses"][:steps] == b["losses"]
        if fmt != "stochastic":  # the main pair's in-memory run went on for 6 steps; compared through the resumes
            _same_bits(a, b)
    for a, b in zip(runs["release"], runs["mmap_release"]):
        assert a["losses"] == b["losses"]
        _same_bits(a, b)


def test_release_with_states_in_files_resumes_bit_for_bit_across_storage(runs):
    for name in ("mmap_release_from_release", "release_from_mmap_release"):
        for whole, resumed in zip(runs["plain"], runs[name]):
            assert resumed["losses"] == whole["losses"][3:], name
            _same_bits(whole, resumed)


def test_release_with_states_in_files_resumes_on_another_world_size_as_the_step_does(runs):
    (a,), (b,) = runs["one_rank_plain"], runs["one_rank_mmap_release"]
    assert b["memory_report"]["total"] == pytest.approx(2.0, abs=0.01)
    assert a["losses"] == b["losses"] and len(a["losses"]) == 3
    _same_bits(a, b)


def test_release_with_states_in_files_leaves_a_nonfinite_partition_as_release_in_memory_does(runs):
    for a, b in zip(runs["nan"], runs["nan_mmap"]):
        assert a["released_skipped"] == b["released_skipped"] > 0
        for x, y in zip(a["snapshots"], b["snapshots"]):  # after every step, the NaN step included
            assert all(torch.equal(u[m], v[m]) for u, v, m in zip(x, y, a["real"]))
        _same_bits(a, b)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_release_gives_the_same_bits_as_the_step(runs, fmt):
    plain, release = ("plain", "release") if fmt == "stochastic" else (f"{fmt}_plain", f"{fmt}_release")
    for a, b in zip(runs[plain], runs[release]):
        assert a["losses"] == b["losses"]
        _same_bits(a, b)
        assert b["overflows"] == [False] * len(b["losses"])
        assert float(a["grad_norm"]) == pytest.approx(b["grad_norm"], rel=1e-6)  # the engine's norm, as without


def test_checkpoints_resume_bit_for_bit_with_release_on_and_across_it(runs):
    for name in ("release_from_plain", "plain_from_release", "release_from_release"):
        for whole, resumed in zip(runs["plain"], runs[name]):
            assert resumed["losses"] == whole["losses"][3:], name
            _same_bits(whole, resumed)


def test_a_nonfinite_gradient_leaves_its_partition_as_it_was_and_the_rest_of_the_step_applies(runs):
    before, after = 0, 1  # snapshots after steps 0 and 1 (the NaN step)
    for rank, r in enumerate(runs["nan"]):
        sub_group, offset, numel = r["positions"]["net.2.weight"]
        flat_before, flat_after = r["snapshots"][before][sub_group], r["snapshots"][after][sub_group]
        part = slice(offset, offset + numel)
        if rank == 0:  # element 0 of net.2.weight is rank 0's: its whole partition was left as it was
            assert torch.equal(flat_before[part], flat_after[part])
        else:  # rank 1's partition of the same parameter had a finite gradient and was updated
            assert not torch.equal(flat_before[part], flat_after[part])
        rest = torch.ones(flat_after.numel(), dtype=torch.bool)
        rest[part] = False
        assert not torch.equal(flat_before[rest], flat_after[rest])  # the rest of the step applied
        assert all(torch.isfinite(t[m].float()).all() for t, m in zip(r["flat_params"], r["real"]))
        for state in r["state"].values():
            assert all(torch.isfinite(v.float()).all() for k, v in state.items() if k != "step")
        assert r["released_skipped"] == numel  # counted on every rank: rank 0's partition (no padding there)
        assert r["engine_skipped_steps"] == 0 and r["overflows"] == [False, False, False]


def test_a_second_backward_before_the_step_is_refused(runs):
    for r in runs["twice"]:
        assert "second backward ran before the optimizer step" in r["error"]


# ---------------------------------------------------------------------------------------------- Trainer, Fabric
@pytest.fixture(scope="module")
def front_end_runs(tmp_path_factory):
    """The Trainer's presets in one launch and Fabric's options in another, with and without release, and with the
    states in files (the Trainer's preset takes its directory from the environment)."""
    from tests.strategy_runs import fit_runs

    trainer, fabric = tmp_path_factory.mktemp("trainer"), tmp_path_factory.mktemp("fabric")
    for out in (trainer, fabric):
        (out / "states").mkdir()
    # Under Python's default warning filters (the runs hide warnings otherwise), the release fit first: a warning is
    # shown once per process, and the scheduler's order warning is looked for in its output.
    fit_runs(
        trainer,
        [
            {"name": "fit_release", "strategy": "deepspeed_pure_bf16_int8_release"},
            {"name": "fit", "strategy": "deepspeed_pure_bf16_int8"},
            {
                "name": "fit_mmap_release",
                "strategy": "deepspeed_pure_bf16_int8_mmap_release",
                "env": {"PURE_BF16_STATE_DIR": str(trainer / "states")},
            },
            {"name": "accumulate", "strategy": "deepspeed_pure_bf16_release", "accumulate": 2, "expect_error": True},
        ],
        env={"PYTHONWARNINGS": "default"},
        steps=4,
        scheduler=True,
    )
    files = {"state_storage": "mmap", "state_dir": str(fabric / "states")}
    fit_runs(
        fabric,
        [
            {"name": "fabric", "strategy": {"moments": "int8"}},
            {"name": "fabric_release", "strategy": "deepspeed_pure_bf16_int8_release"},
            {"name": "fabric_mmap_release", "strategy": {"moments": "int8", "gradient_release": True, **files}},
        ],
        script="fabric_mlp.py",
        steps=4,
    )
    found = {name: load_ranks(trainer / name) for name in ("fit", "fit_release", "fit_mmap_release")}
    found |= {name: load_ranks(fabric / name) for name in ("fabric", "fabric_release", "fabric_mmap_release")}
    return found | {"fit_release_output": output(trainer / "fit_release"), "accumulate": trainer / "accumulate"}


def test_the_trainer_and_fabric_presets_train_at_4_bytes_per_param_with_the_steps_bits(front_end_runs):
    for plain, release in (("fit", "fit_release"), ("fabric", "fabric_release")):
        for a, b in zip(front_end_runs[plain], front_end_runs[release]):
            assert b["memory_report"]["total"] == pytest.approx(2 + 2 * (1 + 2 / 128), abs=0.02)
            assert a["losses"] == b["losses"]
            masks = a.get("real_masks", [torch.ones(t.numel(), dtype=torch.bool) for t in a["flat_params"]])
            for x, y, real in zip(a["flat_params"], b["flat_params"], masks):
                assert torch.equal(x[real], y[real])


def test_the_trainer_and_fabric_train_at_2_bytes_per_param_with_release_and_states_in_files(front_end_runs):
    for memory, files in (("fit_release", "fit_mmap_release"), ("fabric_release", "fabric_mmap_release")):
        for a, b in zip(front_end_runs[memory], front_end_runs[files]):
            assert b["memory_report"]["total"] == pytest.approx(2.0, abs=0.01)  # the bf16 weights alone
            assert b["memory_report"]["state_files"] == pytest.approx(2 * (1 + 2 / 128), abs=0.02)
            assert a["losses"] == b["losses"]
            masks = a.get("real_masks", [torch.ones(t.numel(), dtype=torch.bool) for t in a["flat_params"]])
            for x, y, real in zip(a["flat_params"], b["flat_params"], masks):
                assert torch.equal(x[real], y[real])


def test_a_scheduler_follows_the_released_steps_without_a_warning(front_end_runs):
    # The inner optimizer's step() is never called under release: its steps are marked for torch's LRScheduler, so
    # the first scheduler.step() does not warn that it came before optimizer.step(), and the schedule is the same.
    assert "before `optimizer.step()`" not in front_end_runs["fit_release_output"]
    for a, b in zip(front_end_runs["fit"], front_end_runs["fit_release"]):
        assert a["lrs"] == b["lrs"] and len(set(b["lrs"])) > 1


def test_the_trainer_refuses_accumulation_with_release(front_end_runs):
    assert not (front_end_runs["accumulate"] / "rank0.pt").exists()
    assert "cannot accumulate gradients over 2 micro-batches" in output(front_end_runs["accumulate"])


# ------------------------------------------------------------------------------------------------ the optimizer
@pytest.mark.parametrize("storage", ["memory", "mmap"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_slices_of_a_step_applied_one_by_one_equal_the_step(fmt, storage, tmp_path):
    from lightning_pure_bf16 import AdamW

    # The slices' states in memory, or in files (streamed slice by slice, in chunks smaller than a slice).
    files = {"state_storage": "mmap", "state_dir": tmp_path, "state_chunk_size": 1024} if storage == "mmap" else {}
    options = FORMATS[fmt]
    # Slices that start anywhere; with 8-bit moments, at scale-block boundaries (or the end).
    cuts = [0, 128, 384, 3072, 5000] if options.get("moments") == "int8" else [0, 1, 7, 300, 2999, 5000]
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(5000, generator=gen).to(torch.bfloat16)
    sliced = whole.clone()
    a, b = AdamW([whole], lr=1e-2, seed=3, **options), AdamW([sliced], lr=1e-2, seed=3, **options, **files)
    b.init_states([(sliced, b.param_groups[0])])
    for _ in range(3):
        grad = torch.randn(5000, generator=gen).to(torch.bfloat16)
        whole.grad = grad
        a.step()
        for lo, hi in zip(cuts, cuts[1:]):
            b.update_slice(sliced, b.param_groups[0], grad[lo:hi], lo)
        b.advance_step(sliced)
    assert torch.equal(whole, sliced)
    for key, value in a.state[whole].items():
        other = b.state[sliced][key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    b.close()


def test_update_slice_refuses_what_it_cannot_do(tmp_path):
    from lightning_pure_bf16 import AdamW

    p = torch.zeros(300, dtype=torch.bfloat16)
    opt = AdamW([p], moments="int8")
    with pytest.raises(RuntimeError, match="call `init_states` first"):
        opt.update_slice(p, opt.param_groups[0], torch.zeros(10, dtype=torch.bfloat16), 0)
    opt.init_states([(p, opt.param_groups[0])])
    with pytest.raises(ValueError, match="whole blocks of 128"):
        opt.update_slice(p, opt.param_groups[0], torch.zeros(10, dtype=torch.bfloat16), 0)
    with pytest.raises(ValueError, match="outside a tensor of 300"):
        opt.update_slice(p, opt.param_groups[0], torch.zeros(256, dtype=torch.bfloat16), 128)


class _Stage3Construction:
    """The steps of ZeRO-3's ``_setup_for_real_optimizer`` that :func:`_internals._without_gradient_buffers` acts on,
    in upstream's order (the fingerprints in ``tests/upstream_names.COPIED_UPSTREAM`` hold that order to the installed
    DeepSpeed): the zero gradient of ``initialize_optimizer_states``, then the flat gradient partition on
    ``self.device``."""

    def __init__(self, offload: bool = False) -> None:
        self.device, self.offload_optimizer, self.swap_optimizer = "cpu", offload, False
        self.optimizer = torch.optim.SGD([torch.zeros(1)], lr=0.1)
        self.zero_gradient = None
        self._setup_for_real_optimizer()

    def _setup_for_real_optimizer(self) -> None:
        self.initialize_optimizer_states()
        self.grad_partitions_flat_buffer = torch.zeros(1000, dtype=torch.bfloat16, device=self.device)

    def initialize_optimizer_states(self) -> None:
        self.zero_gradient = torch.zeros(1000, dtype=torch.bfloat16, device=self.device)


def test_construction_under_release_allocates_neither_gradient_buffer():
    from lightning_pure_bf16 import _internals

    with _internals._without_gradient_buffers(_Stage3Construction):
        lean, offloaded = _Stage3Construction(), _Stage3Construction(offload=True)
    assert lean.zero_gradient is None and lean.grad_partitions_flat_buffer.is_meta
    assert lean.device == "cpu"  # its own device again once construction is over
    # With offload (or swapping, or Adagrad) upstream's steps run unchanged.
    assert offloaded.zero_gradient is not None and not offloaded.grad_partitions_flat_buffer.is_meta
    # Only within the context.
    plain = _Stage3Construction()
    assert plain.zero_gradient is not None and not plain.grad_partitions_flat_buffer.is_meta


# ------------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"gradient_accumulation_steps": 2}, "cannot accumulate gradients over 2 micro-batches"),
        ({"gradient_clipping": 1.0}, "cannot clip to a global norm"),
    ],
)
def test_accumulation_and_clipping_are_refused_before_anything_is_set_up(config, match):
    import torch.distributed as dist

    import lightning_pure_bf16.deepspeed as pure_bf16
    from lightning_pure_bf16 import DeepSpeedPureBF16Strategy

    with pytest.raises(ValueError, match=match):
        pure_bf16.initialize(
            model=torch.nn.Linear(4, 4),
            config={"train_micro_batch_size_per_gpu": 1, **config},
            gradient_release=True,
        )
    assert not dist.is_initialized()
    # The Lightning strategy checks the config Lightning completes (accumulate_grad_batches, gradient_clip_val) with
    # the same function before its engine is made.
    strategy = DeepSpeedPureBF16Strategy(gradient_release=True)
    with pytest.raises(ValueError, match=match):
        strategy.settings.check_engine_config({**strategy.config, **config})


def test_fabric_clip_gradients_is_refused_with_release():
    from lightning_pure_bf16.fabric import DeepSpeedPureBF16FabricStrategy

    strategy = DeepSpeedPureBF16FabricStrategy(gradient_release=True)
    with pytest.raises(ValueError, match="before the norm over all parameters exists"):
        strategy.clip_gradients_norm(None, None, max_norm=1.0)


def test_the_hf_trainer_refuses_its_default_clipping_with_release(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from lightning_pure_bf16.integrations.transformers import PureBF16Trainer, deepspeed_config

    args = TrainingArguments(str(tmp_path), use_cpu=True, bf16=True, deepspeed=deepspeed_config(), report_to=[])
    with pytest.raises(ValueError, match=r"max_grad_norm=0"):
        PureBF16Trainer(model=torch.nn.Linear(2, 2), args=args, gradient_release=True)
    args = TrainingArguments(
        str(tmp_path),
        use_cpu=True,
        bf16=True,
        deepspeed=deepspeed_config(),
        report_to=[],
        max_grad_norm=0.0,
        gradient_accumulation_steps=4,
    )
    with pytest.raises(ValueError, match="over 4 micro-batches"):
        PureBF16Trainer(model=torch.nn.Linear(2, 2), args=args, gradient_release=True)


def test_the_presets_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, expected in (
        ("deepspeed_pure_bf16_release", {"gradient_release": True}),
        ("deepspeed_pure_bf16_int8_release", {"moments": "int8", "gradient_release": True}),
    ):
        assert StrategyRegistry[name]["init_params"] == expected
