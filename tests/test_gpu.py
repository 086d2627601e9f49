"""On a CUDA machine: the strategy on one GPU, with the Triton kernel doing the update (skipped without CUDA)."""

import re

import pytest
import torch

from tests.strategy_runs import fit, load_ranks


@pytest.mark.gpu
@pytest.mark.parametrize(("rounding", "expected"), [("stochastic", 8.0), ("kahan", 10.0)])
def test_strategy_on_one_gpu(tmp_path, rounding, expected):
    strategy = {"rounding": rounding, "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    # gather_cache="auto" measures the device's free memory after the first step and decides (either way, said).
    strategy["gather_cache"] = "auto"
    proc = fit(tmp_path, accelerator="gpu", devices=1, steps=4, strategy=strategy, count_updates=True)
    assert re.search(r"gather_cache='auto': gathering the next layer ahead needs [\d.]+ GiB per rank", proc.stderr)
    (r,) = load_ranks(tmp_path, world_size=1)
    assert r["memory_report"]["total"] == pytest.approx(expected)
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in r["flat_params"])
    assert r["update_calls"] == r["sub_group_numels"] * 4
    assert torch.isfinite(torch.tensor(r["losses"])).all()


@pytest.mark.gpu
def test_fabric_on_one_gpu(tmp_path):
    from tests.test_fabric import fabric_run

    opts = {"accelerator": "gpu", "devices": 1, "steps": 4, "exact": True, "scheduler": True, "clip": 0.05}
    fabric_run(tmp_path, strategy={"rounding": "kahan"}, save_at=2, save_path=str(tmp_path / "ck"), **opts)
    (r,) = load_ranks(tmp_path, world_size=1)
    assert r["memory_report"]["total"] == pytest.approx(10.0)
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in r["flat_params"])
    assert r["engine_global_steps"] == 4 and torch.isfinite(torch.tensor(r["losses"])).all()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    fabric_run(resumed, strategy={"rounding": "kahan"}, resume=str(tmp_path / "ck"), **opts)
    (b,) = load_ranks(resumed, world_size=1)
    # cuBLAS may pick other kernels in a new process: close, not necessarily bit for bit (the CPU tests check that).
    assert b["losses"] == pytest.approx(r["losses"][2:], rel=1e-2)


@pytest.mark.gpu
def test_torch_path_temporaries_stay_bounded():
    from lightning_pure_bf16.ops.algorithms import UpdateArgs
    from lightning_pure_bf16.ops.update_torch import update_torch_

    n = 1 << 26  # 128 MiB per bf16 buffer
    p, g, m, v = (torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(4))
    m.zero_()
    v.zero_()
    args = UpdateArgs(1e-3, 0.9, 0.999, 1e-8, 0.01, True, 1, "stochastic", (1, 2, 3))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    update_torch_(p, g, (m, v), None, args)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 64 * 2**20


@pytest.mark.gpu
def test_mmap_states_on_cuda_equal_in_memory_states(tmp_path):
    from lightning_pure_bf16 import AdamW

    n = 3 * (1 << 22) + 12345  # several streamed chunks and a short last one
    init = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).cuda()
    a, b = init.clone().requires_grad_(), init.clone().requires_grad_()
    in_memory = AdamW([a], lr=1e-3, seed=1, rounding="kahan")
    in_files = AdamW([b], lr=1e-3, seed=1, rounding="kahan", state_storage="mmap", state_dir=tmp_path)
    in_files.init_state(b, in_files.param_groups[0])
    keys = ("exp_avg", "exp_avg_sq", "kahan_comp")
    assert all(not in_files.state[b][k].is_cuda for k in keys)
    for step in range(3):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(step + 1)).to(torch.bfloat16).cuda()
        a.grad, b.grad = grad, grad.clone()
        in_memory.step()
        in_files.step()
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    for k in keys:
        assert torch.equal(in_memory.state[a][k].cpu(), in_files.state[b][k])
    in_files.close()


@pytest.mark.gpu
def test_strategy_with_mmap_states_on_one_gpu(tmp_path):
    states = tmp_path / "states"
    states.mkdir()
    strategy = {
        "rounding": "kahan",
        "state_storage": "mmap",
        "state_dir": str(states),
        "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    }
    fit(tmp_path, accelerator="gpu", devices=1, steps=4, strategy=strategy)
    (r,) = load_ranks(tmp_path, world_size=1)
    assert r["memory_report"]["total"] == pytest.approx(4.0)
    assert r["memory_report"]["state_files"] == pytest.approx(6.0)
    assert torch.isfinite(torch.tensor(r["losses"])).all()
    assert list(states.iterdir()) == []


@pytest.mark.gpu
def test_plain_deepspeed_front_end_on_one_gpu(tmp_path):
    import json

    from tests.strategy_runs import run_script

    run_script("ds_mlp.py", tmp_path, json.dumps({"world": 1, "steps": 4}), DS_ACCELERATOR="cuda")
    (r,) = load_ranks(tmp_path, world_size=1)
    assert r["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in r["flat_params"])
    assert torch.isfinite(torch.tensor(r["losses"])).all() and r["losses"][-1] < r["losses"][0]


@pytest.mark.gpu
@pytest.mark.parametrize("front", ["trainer", "accelerate"])
def test_hf_trainer_and_accelerate_on_one_gpu(tmp_path, front):
    pytest.importorskip("transformers")
    import json

    from tests.strategy_runs import run_script

    opts = {"front": front, "world": 1, "steps": 4, "cpu": False}
    run_script("hf_gpt2.py", tmp_path, json.dumps(opts), DS_ACCELERATOR="cuda")
    (r,) = load_ranks(tmp_path, world_size=1)
    assert r["memory_report"]["total"] == pytest.approx(8.0, abs=0.01)
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in r["flat_params"])
    assert torch.isfinite(torch.tensor(r["losses"])).all()


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"moments": "int8"}])
def test_gradient_release_on_one_gpu_gives_the_steps_bits(tmp_path, options):
    # The update runs on the stream DeepSpeed reduces on, slice by slice (Triton launches at odd offsets; 8-bit blocks
    # shared between parameters wait for their neighbours), its states in memory or in files: against the same run
    # without release, in one process.
    import json

    from tests.strategy_runs import run_script

    (tmp_path / "states").mkdir()
    files = {"state_storage": "mmap", "state_dir": str(tmp_path / "states")}
    runs = [
        {"name": "plain", "steps": 4, "config": {"gradient_clipping": 0.0}, "options": options},
        {"name": "release", "steps": 4, "options": {**options, "gradient_release": True}},
        # The states in files, streamed through the pinned slots as each slice's gradient arrives.
        {"name": "mmap_release", "steps": 4, "options": {**options, "gradient_release": True, **files}},
    ]
    run_script("ds_mlp.py", tmp_path, json.dumps({"world": 1, "hidden": 37, "runs": runs}), DS_ACCELERATOR="cuda")
    (a,) = load_ranks(tmp_path / "plain", world_size=1)
    expected = {"release": 4.03 if options else 6.0, "mmap_release": 2.0}
    for name, total in expected.items():
        (b,) = load_ranks(tmp_path / name, world_size=1)
        assert b["memory_report"]["total"] == pytest.approx(total, abs=0.01) and b["memory_report"]["grad"] == 0
        assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in b["flat_params"])
        assert a["losses"] == b["losses"], name
        for x, y, real in zip(a["flat_params"], b["flat_params"], a["real"]):
            assert torch.equal(x[real.to(x.device)], y[real.to(y.device)]), name
        for sa, sb in zip(a["state"].values(), b["state"].values()):
            for key in sa:
                assert torch.equal(sa[key].cpu(), sb[key].cpu()), (name, key)
