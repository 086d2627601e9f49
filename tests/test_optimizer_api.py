"""The optimizer behaves like torch.optim.AdamW wherever a user reaches it: groups, names, copies, compile, hooks,
state dicts of either kind, bad input. torch.optim.AdamW is the reference throughout."""

import copy
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_pure_bf16
from lightning_pure_bf16 import Adam, AdamW


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach()


def _model(dtype=torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(dtype)


def _step(params, opt, t):
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(100 * t + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()


# ----------------------------------------------------------------------------------------------- param groups
@pytest.mark.parametrize("cls", [AdamW, torch.optim.AdamW])
def test_groups_from_generators_keep_their_parameters(cls):
    model = _model()
    base, head = model[0], model[1]
    opt = cls([{"params": base.parameters()}, {"params": head.parameters(), "lr": 1e-2}], lr=1e-3)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    before = [p.detach().clone() for p in model.parameters()]
    _step(list(model.parameters()), opt, 0)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters())), "a group trained nothing"


def test_nested_generators_and_add_param_group_match_torch():
    ours_model, torch_model = _model(), _model(torch.float32)
    layers = [ours_model[0], ours_model[1]]
    ours = AdamW(({"params": (p for p in m.parameters())} for m in layers[:1]), lr=1e-3)
    ours.add_param_group({"params": (p for p in layers[1].parameters()), "lr": 5e-3})
    theirs = torch.optim.AdamW(({"params": (p for p in m.parameters())} for m in [torch_model[0]]), lr=1e-3)
    theirs.add_param_group({"params": (p for p in torch_model[1].parameters()), "lr": 5e-3})
    assert [len(g["params"]) for g in ours.param_groups] == [len(g["params"]) for g in theirs.param_groups] == [2, 2]
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in theirs.param_groups]


def test_a_bad_group_is_refused_before_it_is_stored():
    model = _model()
    opt = AdamW(model[0].parameters())
    with pytest.raises(TypeError, match="bfloat16 and float32"):
        opt.add_param_group({"params": (p.to(torch.float16) for p in model[1].parameters())})
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group({"params": model[1].parameters(), "lr": -1.0})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [AdamW, torch.optim.AdamW])
def test_sets_and_non_tensors_are_torch_errors(cls):
    p = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(TypeError, match="ordered collections"):
        cls([{"params": {p}}])
    with pytest.raises(TypeError, match="can only optimize Tensors"):
        cls([p, 3.0])


# ----------------------------------------------------------------------------------------------- named parameters
def test_named_parameters_keep_their_names_like_torch():
    model = _model()
    ours = AdamW(model.named_parameters())
    theirs = torch.optim.AdamW(_model(torch.float32).named_parameters())
    assert (
        ours.param_groups[0]["param_names"]
        == theirs.param_groups[0]["param_names"]
        == [
            "0.weight",
            "0.bias",
            "1.weight",
            "1.bias",
        ]
    )
    assert [g["param_names"] for g in ours.state_dict()["param_groups"]] == [
        g["param_names"] for g in theirs.state_dict()["param_groups"]
    ]
    _step(list(model.parameters()), ours, 0)
    assert all(len(ours.state[p]) > 0 for p in model.parameters())


def test_named_parameters_in_groups():
    model = _model()
    opt = AdamW([{"params": model[0].named_parameters()}, {"params": model[1].named_parameters(), "lr": 0.1}])
    assert [g["param_names"] for g in opt.param_groups] == [["weight", "bias"], ["weight", "bias"]]


@pytest.mark.parametrize("cls", [AdamW, torch.optim.AdamW])
def test_mixing_named_and_unnamed_parameters_is_torchs_value_error(cls):
    model = _model()
    named = list(model[0].named_parameters())
    with pytest.raises(ValueError, match="with/without names"):
        cls([named[0], named[1][1]])
    opt = cls(model[0].named_parameters())
    with pytest.raises(ValueError, match="with/without names"):
        opt.add_param_group({"params": model[1].parameters()})


# ----------------------------------------------------------------------------------------------- copies
def _copy(obj, how):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_copy_after_some_steps_continues_bit_for_bit(how, rounding):
    params = list(_model().parameters())
    opt = AdamW(params, lr=1e-2, rounding=rounding)
    for t in range(3):
        _step(params, opt, t)
    opt.skipped_steps = 2
    params2, opt2 = _copy((params, opt), how)
    assert (opt2.seed, opt2.skipped_steps, opt2._next_stream) == (opt.seed, 2, opt._next_stream)
    for t in range(3, 6):
        _step(params, opt, t)
        _step(params2, opt2, t)
    for a, b in zip(params, params2):
        assert torch.equal(_bits(a), _bits(b))
        assert all(
            torch.equal(_bits(x), _bits(y))
            for x, y in zip(opt.state[a].values(), opt2.state[b].values())
            if isinstance(x, torch.Tensor)
        )


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_steps_its_own_float32_parameters(how):
    # The copy's parameters are new tensors: they are the ones it was given, not float32 masters put in their place.
    params = [torch.nn.Parameter(torch.randn(8))]
    params2, opt2 = _copy((params, AdamW(params, lr=1e-2)), how)
    params2[0].grad = torch.ones_like(params2[0])
    before = params2[0].detach().clone()
    opt2.step()
    assert not torch.equal(params2[0], before)


def test_a_copy_checks_its_own_gradients_until_given_a_reduce():
    params = list(_model().parameters())
    opt = AdamW(params)
    opt.nonfinite_reduce = lambda flag: flag
    assert copy.deepcopy(opt).nonfinite_reduce is None


def test_an_mmap_copy_makes_its_own_files_and_never_removes_the_originals(tmp_path):
    params = list(_model().parameters())
    opt = AdamW(params, lr=1e-2, state_storage="mmap", state_dir=tmp_path)
    for t in range(2):
        _step(params, opt, t)
    params2, opt2 = copy.deepcopy((params, opt))
    assert opt2.state_dir != opt.state_dir and os.path.isdir(opt2.state_dir)
    original_files = sorted(os.listdir(opt.state_dir))
    for t in range(2, 4):
        _step(params, opt, t)
        _step(params2, opt2, t)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(params, params2))
    copy_dir = opt2.state_dir
    opt2.close()
    assert not os.path.exists(copy_dir)
    assert sorted(os.listdir(opt.state_dir)) == original_files
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        copy.deepcopy(opt)


# ----------------------------------------------------------------------------------------------- noise streams
def test_compiled_step_draws_the_same_bits_as_eager():
    def run(compiled):
        torch.manual_seed(0)
        groups = [[torch.randn(5, 3, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)] for _ in range(2)]
        opts = [AdamW(ps, lr=1e-2, seed=10 + i, backend="torch") for i, ps in enumerate(groups)]
        steps = [torch.compile(o.step) if compiled else o.step for o in opts]
        for t in range(2):
            for ps, step in zip(groups, steps):
                for i, p in enumerate(ps):
                    p.grad = torch.full_like(p, 0.1 * (i + t + 1))
                step()
        return groups, opts

    eager, eager_opts = run(False)
    compiled, compiled_opts = run(True)
    for o in compiled_opts:
        assert [o.state[p]["stream"] for p in o.param_groups[0]["params"]] == [0, 1, 2]
    for a, b in zip(sum(eager, []), sum(compiled, [])):
        assert torch.equal(_bits(a), _bits(b))


def test_optimizers_with_default_seeds_draw_different_noise():
    torch.manual_seed(3)
    params = [torch.full((4096,), 1.0, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    # One optimizer per parameter, as in the gradient-release recipe.
    opts = [AdamW([p], lr=1e-3, weight_decay=0.0) for p in params]
    assert len({o.seed for o in opts}) == 3
    for p, o in zip(params, opts):
        p.grad = torch.ones_like(p)
        o.step()
    # The same update on the same values: only the rounding noise can tell them apart.
    assert not torch.equal(params[0], params[1]) and not torch.equal(params[1], params[2])


def _train_from_seed(seed: int, steps: int = 3) -> list[torch.Tensor]:
    params = list(_model().parameters())
    torch.manual_seed(seed)
    opt = AdamW(params, lr=1e-3)
    for i in range(steps):
        _step(params, opt, i)
    return [_bits(p) for p in params] + [_bits(opt.state[p]["exp_avg"]) for p in params]


def test_reseeding_torch_in_one_process_repeats_the_run_bit_for_bit():
    first, again = _train_from_seed(0), _train_from_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = _train_from_seed(1)
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_a_default_seed_is_one_draw_from_torchs_generator_and_an_explicit_one_draws_nothing():
    params = [torch.ones(8, dtype=torch.bfloat16, requires_grad=True)]
    torch.manual_seed(7)
    s1 = AdamW(params).seed
    after_default = torch.get_rng_state()
    torch.manual_seed(7)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(after_default, torch.get_rng_state()), "building should draw exactly one int64"
    torch.manual_seed(7)
    assert AdamW(params).seed == s1
    before = torch.get_rng_state()
    assert AdamW(params, seed=5).seed == 5
    assert torch.equal(before, torch.get_rng_state()), "an explicit seed consumed global RNG state"


def test_a_loaded_state_dict_keeps_its_seed_over_a_drawn_one():
    params = list(_model().parameters())
    torch.manual_seed(0)
    saved = AdamW(params)
    _step(params, saved, 0)
    torch.manual_seed(1)
    loaded = AdamW(params)
    assert loaded.seed != saved.seed
    loaded.load_state_dict(saved.state_dict())
    assert loaded.seed == saved.seed


def test_streams_and_seed_survive_a_resume():
    params = list(_model().parameters())
    opt = AdamW(params)
    _step(params, opt, 0)
    opt2 = AdamW(params)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.seed == opt.seed and opt2._next_stream == opt._next_stream
    assert [opt2.state[p]["stream"] for p in params] == [opt.state[p]["stream"] for p in params]


# ----------------------------------------------------------------------------------------------- bad gradients
@pytest.mark.parametrize("cls", [AdamW, torch.optim.AdamW])
def test_sparse_gradients_are_a_runtime_error_before_anything_changes(cls):
    emb = nn.Embedding(10, 3, sparse=True).to(torch.bfloat16)
    opt = cls(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert torch.equal(before, emb.weight) and len(opt.state[emb.weight]) == 0


# ----------------------------------------------------------------------------------------------- load hooks
def test_load_state_dict_hooks_see_the_whole_dict_and_the_restored_optimizer():
    params = list(_model().parameters())
    opt = AdamW(params, seed=5)
    _step(params, opt, 0)
    saved = opt.state_dict()
    seen = {}

    def pre(o, sd):
        seen["extra"] = sd.get("pure_bf16")

    def post(o):
        seen["seed"] = o.seed
        for p in params:
            o.state[p]["note"] = "written by a hook"

    opt2 = AdamW(params, seed=9)
    opt2.register_load_state_dict_pre_hook(pre)
    opt2.register_load_state_dict_post_hook(post)
    opt2.load_state_dict(saved)
    assert seen == {"extra": saved["pure_bf16"], "seed": 5}
    assert opt2.state[params[0]]["note"] == "written by a hook"
    _step(params, opt2, 1)


# ----------------------------------------------------------------------------------------------- torch state dicts
@pytest.mark.parametrize(("theirs", "ours"), [(torch.optim.AdamW, AdamW), (torch.optim.Adam, Adam)])
def test_a_torch_state_dict_loads_with_its_moments(theirs, ours):
    model32 = _model(torch.float32)
    params32 = list(model32.parameters())
    torch_opt = theirs(params32, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.05)
    for t in range(3):
        _step(params32, torch_opt, t)
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in params32]
    opt = ours(params, lr=1.0, rounding="kahan")
    opt.load_state_dict(torch_opt.state_dict())
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], group["rounding"]) == (3e-3, (0.8, 0.95), 0.05, "kahan")
    assert "foreach" not in group and "amsgrad" not in group
    for p, q in zip(params, params32):
        state, torch_state = opt.state[p], torch_opt.state[q]
        assert state["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(state["exp_avg"], torch_state["exp_avg"].to(torch.bfloat16))
        assert torch.equal(state["exp_avg_sq"], torch_state["exp_avg_sq"].to(torch.bfloat16))
        assert state["step"].dtype == torch.int64 and int(state["step"]) == 3
    assert sorted(opt.state[p]["stream"] for p in params) == list(range(len(params)))
    _step(params, opt, 3)
    assert int(opt.state[params[0]]["step"]) == 4


def test_torch_loads_our_state_dict():
    params = list(_model().parameters())
    opt = AdamW(params, lr=1e-2)
    _step(params, opt, 0)
    params32 = [p.detach().float().requires_grad_() for p in params]
    torch_opt = torch.optim.AdamW(params32, lr=1e-2)
    torch_opt.load_state_dict(opt.state_dict())
    assert torch.equal(torch_opt.state[params32[0]]["exp_avg"], opt.state[params[0]]["exp_avg"].float())
    _step(params32, torch_opt, 1)
    assert int(torch_opt.state[params32[0]]["step"]) == 2


def test_unconvertible_state_dicts_are_refused_before_anything_changes():
    params32 = list(_model(torch.float32).parameters())
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in params32]
    amsgrad = torch.optim.AdamW(params32, amsgrad=True)
    _step(params32, amsgrad, 0)
    opt = AdamW(params, lr=1e-3)
    with pytest.raises(KeyError, match="amsgrad"):
        opt.load_state_dict(amsgrad.state_dict())
    coupled = torch.optim.Adam(params32, weight_decay=0.1)
    with pytest.raises(ValueError, match="lightning_pure_bf16.Adam instead"):
        opt.load_state_dict(coupled.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-3 and len(opt.state) == 0


# ----------------------------------------------------------------------------------------------- kernel entries
def test_cpu_loop_entry_checks_every_buffer():
    import lightning_pure_bf16.ops.update_cpu as update_cpu

    assert update_cpu.fused_cpu_available()
    p = torch.zeros(8, dtype=torch.bfloat16)
    good = [p, p.clone(), p.clone(), p.clone(), p.clone()]
    scalars = [0, True, 0.9, 0.1, 0.999, 0.001, 1e-8, 0.0, 0.0, -1e-3, 1.0, 1.0, 1, 2, 3, 0]
    update_cpu._extension.adamw_update_bf16(*good, *scalars)
    cases = {
        "must be bfloat16": [p, p, p.float(), p, p],
        "must be contiguous": [p, p, torch.zeros(16, dtype=torch.bfloat16)[::2], p, p],
        "has 4 elements": [p, p, p, p[:4], p],
    }
    for message, buffers in cases.items():
        with pytest.raises(RuntimeError, match=message):
            update_cpu._extension.adamw_update_bf16(*[b.clone() if b.is_contiguous() else b for b in buffers], *scalars)


def test_triton_launch_checks_every_buffer():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or the Triton interpreter")
    from lightning_pure_bf16.ops.algorithms import UpdateArgs
    from lightning_pure_bf16.ops.update_triton import update_triton_

    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = torch.zeros(64, dtype=torch.bfloat16, device=device)
    args = UpdateArgs(1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1, "kahan", (1, 2, 3))
    with pytest.raises(ValueError, match="`kahan_comp` is not"):
        update_triton_(p, p.clone(), (p.clone(), p.clone()), torch.zeros(128, dtype=p.dtype, device=device)[::2], args)
    with pytest.raises(ValueError, match="`exp_avg` has 32 elements, it needs 64"):
        update_triton_(p, p.clone(), (p[:32].clone(), p.clone()), p.clone(), args)
    with pytest.raises(ValueError, match="needs bfloat16 `exp_avg_sq`"):
        update_triton_(p, p.clone(), (p.clone(), p.float()), p.clone(), args)


def test_a_torch_state_dict_loads_into_state_files(tmp_path):
    params32 = list(_model(torch.float32).parameters())
    torch_opt = torch.optim.AdamW(params32, lr=1e-2)
    _step(params32, torch_opt, 0)
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in params32]
    opt = AdamW(params, state_storage="mmap", state_dir=tmp_path)
    opt.load_state_dict(torch_opt.state_dict())
    for p, q in zip(params, params32):
        assert torch.equal(opt.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"].to(torch.bfloat16))
    _step(params, opt, 1)
    assert int(opt.state[params[0]]["step"]) == 2
    opt.close()


# ----------------------------------------------------------------------------------------------- tensor kinds
class _Wrapper(torch.Tensor):
    """The smallest wrapper subclass: no memory of its own, every operation goes to the tensor it wraps."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, _Wrapper) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


@pytest.fixture
def dtensor(tmp_path):
    """A bf16 DTensor of FSDP2's kind (sharded on a 1-rank gloo group in this process), as its Parameter."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        yield nn.Parameter(distribute_tensor(torch.randn(8, 4).to(torch.bfloat16), mesh, [Shard(0)]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_dtensor_layouts_the_update_cannot_take_are_refused_not_crashed_on(dtensor, backend):
    """DTensor parameters train (tests/test_fsdp2.py); what cannot be trained is refused before anything changes."""
    from torch.distributed.tensor import DTensor, Partial

    import lightning_pure_bf16.ops.update_cpu as update_cpu

    with pytest.raises(ValueError, match=r"state_storage='mmap'.*DTensor parameter of shape \(8, 4\).*'memory'"):
        AdamW([dtensor], backend=backend, state_storage="mmap", state_dir=".")
    pending = nn.Parameter(DTensor.from_local(dtensor.to_local(), dtensor.device_mesh, [Partial()]))
    with pytest.raises(TypeError, match=r"shape \(8, 4\) cannot be trained: .*pending reduction"):
        AdamW([pending], backend=backend)
    # A DTensor parameter whose gradient is a plain tensor, and a plain one whose gradient is a DTensor: refused at
    # the first step, before anything changes.
    opt = AdamW([dtensor], backend=backend)
    before = dtensor.detach().to_local().clone()
    dtensor.grad = torch.ones(8, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"has a gradient that is a plain Tensor.*sharded like it"):
        opt.step()
    assert len(opt.state[dtensor]) == 0 and torch.equal(dtensor.detach().to_local(), before)
    p = nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16))
    opt = AdamW([p], backend=backend)
    p.grad = dtensor.detach()
    with pytest.raises(TypeError, match="the gradient of a parameter of shape .* is a DTensor"):
        opt.step()
    assert len(opt.state[p]) == 0 and not p.any()
    # The loops refuse it too when called directly (the C++ loop took it for memory and crashed the process).
    assert update_cpu.fused_cpu_available()
    scalars = [0, True, 0.9, 0.1, 0.999, 0.001, 1e-8, 0.0, 0.0, -1e-3, 1.0, 1.0, 1, 2, 3, 0]
    plain = [torch.zeros(8, 4, dtype=torch.bfloat16) for _ in range(4)]
    with pytest.raises(RuntimeError, match="`param` is a tensor subclass with no memory of its own"):
        update_cpu._extension.adamw_update_bf16(dtensor.detach(), *plain, *scalars)
    with pytest.raises(RuntimeError, match="tensor subclass with no memory"):
        update_cpu._extension.any_nonfinite_bf16(dtensor.detach())


def test_other_wrapper_subclasses_are_refused_by_the_optimizer_and_the_triton_launch():
    inner = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"shape \(64,\) is a _Wrapper, a tensor subclass"):
        AdamW([_Wrapper(inner)])
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    from lightning_pure_bf16.ops.algorithms import UpdateArgs
    from lightning_pure_bf16.ops.update_triton import update_triton_

    args = UpdateArgs(1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1, "stochastic", (1, 2, 3))
    with pytest.raises(ValueError, match="`grad` is a _Wrapper, a tensor subclass without memory"):
        update_triton_(inner.clone(), _Wrapper(inner), (inner.clone(), inner.clone()), None, args)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_meta_parameters_are_refused_at_the_first_step_with_how_to_materialize(backend):
    with torch.device("meta"):
        model = nn.Linear(4, 3).to(torch.bfloat16)
    opt = AdamW(model.parameters(), backend=backend)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match=r"shape \(3, 4\) is on the meta device.*model.to_empty"):
        opt.step()
    assert all(len(s) == 0 for s in opt.state.values())


@pytest.mark.gpu
def test_cuda_tensors_given_the_cpu_loop_are_refused_before_anything_changes():
    p = nn.Parameter(torch.zeros(8, dtype=torch.bfloat16, device="cuda"))
    opt = AdamW([p], backend="cpu")
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="`backend='cpu'` needs contiguous bf16 CPU tensors.*on cuda"):
        opt.step()
    assert len(opt.state[p]) == 0 and not p.any()


def test_a_dtensor_shard_draws_by_its_index_in_the_whole_tensor_or_from_a_seed_of_its_own(tmp_path):
    """``Shard(0)`` and ``Replicate`` shards are contiguous runs of the tensor: the update equals the plain tensor's bit
    for bit. A ``Shard(1)`` shard is not: it draws from a seed of its own (``rank_seed(seed, shard)``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from lightning_pure_bf16.ops.rng import rank_seed
    from lightning_pure_bf16.optim import sharded

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        w, g = torch.randn(16, 8).to(torch.bfloat16), torch.randn(16, 8).to(torch.bfloat16) * 1e-3

        def trained(placement, seed=7):
            if placement is None:
                p = nn.Parameter(w.clone())
                p.grad = g.clone()
            else:
                p = nn.Parameter(distribute_tensor(w.clone(), mesh, [placement]))
                p.grad = distribute_tensor(g.clone(), mesh, [placement])
            opt = AdamW([p], lr=1e-3, seed=seed)
            for _ in range(3):
                opt.step()
            return sharded.local(p.detach()).clone(), p

        plain, _ = trained(None)
        for placement in (Shard(0), Replicate()):
            assert torch.equal(trained(placement)[0], plain)
        by_column, p = trained(Shard(1))
        assert sharded.layout(p).shard == 0 and not torch.equal(by_column, plain)
        assert torch.equal(by_column, trained(None, seed=rank_seed(7, 0))[0])
    finally:
        dist.destroy_process_group()


def test_construction_hooks_see_every_optimizer_built_until_removed():
    from lightning_pure_bf16.optim import register_construction_hook

    seen = []
    handle = register_construction_hook(seen.append)
    built = [AdamW([torch.zeros(3, dtype=torch.bfloat16)]), Adam([torch.zeros(3, dtype=torch.bfloat16)])]
    handle.remove()
    AdamW([torch.zeros(3, dtype=torch.bfloat16)])
    assert seen == built


def test_the_optimizer_and_kernel_layers_read_no_host_state():
    # Lookups that no import contract sees: a host's module through sys.modules, a launcher's variables.
    package = Path(lightning_pure_bf16.__file__).parent
    for path in [*(package / "optim").glob("*.py"), *(package / "ops").glob("*.py")]:
        source = path.read_text()
        for needle in ("sys.modules", "ACCELERATE_", "_hf_deepspeed", "import transformers", "import accelerate"):
            assert needle not in source, f"{path.name}: {needle}"


@pytest.mark.parametrize("first", ["torch", "ours"])
def test_a_dropped_optimizer_of_this_package_is_told_about_when_another_steps_first(monkeypatch, first):
    import gc
    import warnings

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # a Hugging Face host set up for DeepSpeed
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones_like(p)
    ours = AdamW([p])  # built, then dropped by the host: nothing refers to it any more
    if first == "ours":
        ours.step()
    del ours
    gc.collect()
    other = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        other.step()
        other.step()
    said = [str(w.message) for w in seen if "lightning_pure_bf16" in str(w.message)]
    if first == "ours":
        assert said == []
    else:
        (message,) = said
        assert "torch.optim.sgd.SGD` is stepping" in message and "PureBF16Trainer" in message


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_the_functional_update_writes_the_optimizers_bits(rounding, moments):
    from lightning_pure_bf16.optim.functional import adamw

    init = torch.randn(300, generator=torch.Generator().manual_seed(3)).bfloat16()
    p, q = init.clone().requires_grad_(), init.clone()
    opt = AdamW([p], lr=1e-2, weight_decay=0.1, seed=17, rounding=rounding, moments=moments)
    opt.init_state(p, opt.param_groups[0])
    state = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.ndim}
    for step in (1, 2, 3):
        grad = torch.randn(300, generator=torch.Generator().manual_seed(step)).bfloat16()
        p.grad = grad
        opt.step()
        m, v = state.pop("exp_avg"), state.pop("exp_avg_sq")
        adamw(q, grad, m, v, step=step, lr=1e-2, weight_decay=0.1, rounding=rounding, seed=17, stream=0, **state)
        state.update(exp_avg=m, exp_avg_sq=v)
    assert torch.equal(p.detach(), q)
    for key, value in state.items():
        assert torch.equal(opt.state[p][key], value), key
    with pytest.raises(ValueError, match="needs `kahan_comp`"):
        adamw(q, grad, m, v, step=4, rounding="kahan")
    with pytest.raises(ValueError, match="betas"):
        adamw(q, grad, m, v, step=4, betas=(0.9, 1.5))
