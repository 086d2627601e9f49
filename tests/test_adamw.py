import io

import pytest
import torch

from lightning_pure_bf16 import Adam, AdamW
from tests.reference.bf16 import TOLERANCES

SHAPES = [(6,), (42, 3), (123,), (431, 7), (0,), (0, 5)]


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run(opt_cls, params, steps, groups_kw, start=0, **kw):
    params = [p.clone().requires_grad_() for p in params]
    groups = [{"params": params[:3], **groups_kw[0]}, {"params": params[3:], **groups_kw[1]}]
    opt = opt_cls(groups, **kw)
    for t in range(start, start + steps):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g.to(p.dtype)
        opt.step()
    return params, opt


GROUPS = [{"lr": 3e-2, "weight_decay": 0.1}, {"lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6}]


@pytest.mark.parametrize(("ours", "theirs"), [(AdamW, torch.optim.AdamW), (Adam, torch.optim.Adam)])
def test_fp32_params_match_torch(ours, theirs):
    init = _params(torch.float32)
    got, _ = _run(ours, init, 10, GROUPS)
    expected, _ = _run(theirs, [p.double() for p in init], 10, GROUPS)
    tol = TOLERANCES[torch.float32]
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opt_cls", [AdamW, Adam])
def test_the_step_leaves_the_gradients_as_they_were(opt_cls, dtype, backend):
    # As torch.optim's: a float32 gradient was updated in place as the update's working copy (AdamW left
    # (1 - beta1) * g there).
    params, opt = _run(opt_cls, _params(dtype), 1, GROUPS, backend=backend)
    for p, g in zip(params, _grads(params, 0)):
        assert torch.equal(p.grad, g.to(dtype))
    opt.step(grad_scale=0.5)  # a clip factor is applied inside the update, not to the gradient either
    assert all(torch.equal(p.grad, g.to(dtype)) for p, g in zip(params, _grads(params, 0)))


@pytest.mark.parametrize("name", ["grad_scale", "grads_finite"])
def test_the_former_one_step_attributes_say_they_are_arguments_of_the_step(name):
    # Setting one used to apply to the next step; now it would do nothing, so it is refused with what to call.
    params, opt = _run(AdamW, _params(torch.bfloat16), 1, GROUPS)
    with pytest.raises(AttributeError, match=rf"AdamW.{name}` is an argument of the step.*step\({name}=\.\.\.\)"):
        setattr(opt, name, 0.5)
    assert not hasattr(opt, name)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize(("ours", "theirs"), [(AdamW, torch.optim.AdamW), (Adam, torch.optim.Adam)])
def test_bf16_params_follow_fp64_torch(ours, theirs, rounding):
    init = _params(torch.bfloat16)
    got, opt = _run(ours, init, 5, GROUPS, rounding=rounding, seed=0)
    expected, _ = _run(theirs, [p.double() for p in init], 5, GROUPS)
    tol = TOLERANCES[torch.bfloat16]
    for a, b in zip(got, expected):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, rtol=tol.rtol, atol=tol.atol)
    # Every state buffer the size of a parameter is bf16; the Kahan buffer exists only in Kahan mode.
    for p in got:
        state = opt.state[p]
        big = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape and v.ndim > 0}
        assert set(big) == ({"exp_avg", "exp_avg_sq"} | ({"kahan_comp"} if rounding == "kahan" else set()))
        assert all(v.dtype == torch.bfloat16 for v in big.values())


def _stall_run(rounding, steps, lr, wd, grad_value, n=4096):
    p = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([p], lr=lr, weight_decay=wd, rounding=rounding, seed=5)
    for _ in range(steps):
        p.grad = torch.full_like(p, grad_value)
        opt.step()
    return p.detach().double(), opt.state[p]


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_sub_ulp_updates_move_weights(rounding):
    # Adam's step with a constant gradient is ~lr = 1e-3 per step: a quarter of a bf16 ulp at 1.0.
    p, _ = _stall_run(rounding, 200, lr=1e-3, wd=0.0, grad_value=1.0)
    assert p.mean().item() == pytest.approx(0.8, abs=2e-3)


def test_sub_ulp_updates_vanish_with_nearest():
    p, _ = _stall_run("nearest", 200, lr=1e-3, wd=0.0, grad_value=1.0)
    assert torch.all(p == 1.0)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_sub_ulp_weight_decay_shrinks_weights(rounding):
    # lr * wd = 1e-4 per step, zero gradient: only the decoupled decay acts.
    p, _ = _stall_run(rounding, 1000, lr=1e-2, wd=1e-2, grad_value=0.0)
    assert p.mean().item() == pytest.approx((1 - 1e-4) ** 1000, abs=2e-3)


def test_sub_ulp_weight_decay_vanishes_with_nearest():
    p, _ = _stall_run("nearest", 1000, lr=1e-2, wd=1e-2, grad_value=0.0)
    assert torch.all(p == 1.0)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_second_moment_tracks_ema(rounding):
    _, state = _stall_run(rounding, 1000, lr=1e-6, wd=0.0, grad_value=1.0)
    expected = 1 - 0.999**1000
    assert state["exp_avg_sq"].double().mean().item() == pytest.approx(expected, rel=5e-3)


def test_second_moment_freezes_with_nearest():
    _, state = _stall_run("nearest", 1000, lr=1e-6, wd=0.0, grad_value=1.0)
    assert state["exp_avg_sq"].double().mean().item() < 0.4


def _snapshot(params, opt):
    tensors = [p.detach().clone() for p in params]
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                tensors.append(v.clone())
    return tensors


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_nonfinite_gradient_skips_the_whole_step(bad, rounding):
    params, opt = _run(AdamW, _params(torch.bfloat16), 2, GROUPS, rounding=rounding, seed=1)
    before = _snapshot(params, opt)
    for p, g in zip(params, _grads(params, 99)):
        p.grad = g.to(p.dtype)
    params[3].grad[0, 1] = bad
    opt.step()
    after = _snapshot(params, opt)
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    params[3].grad[0, 1] = 0.0
    opt.step()
    assert not torch.equal(params[0], before[0])
    assert int(opt.state[params[0]]["step"]) == 3


def test_nonfinite_reduce_lets_another_rank_decide():
    params, opt = _run(AdamW, _params(torch.bfloat16), 1, GROUPS)
    before = _snapshot(params, opt)
    opt.nonfinite_reduce = lambda local: torch.maximum(local, torch.ones(()))
    for p, g in zip(params, _grads(params, 5)):
        p.grad = g.to(p.dtype)
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(params, opt)))


def test_zero_lr_leaves_params_unchanged():
    init = _params(torch.bfloat16)
    groups = [{"lr": 0.0, "weight_decay": 0.1}, {"lr": 0.0}]
    got, _ = _run(AdamW, init, 3, groups)
    assert all(torch.equal(a.detach(), b) for a, b in zip(got, init))


def test_same_seed_same_result_and_different_seed_differs():
    init = _params(torch.bfloat16)
    a, _ = _run(AdamW, init, 4, GROUPS, seed=123)
    b, _ = _run(AdamW, init, 4, GROUPS, seed=123)
    c, _ = _run(AdamW, init, 4, GROUPS, seed=124)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_state_dict_round_trip_resumes_bit_for_bit(rounding):
    init = _params(torch.bfloat16)
    full, _ = _run(AdamW, init, 6, GROUPS, rounding=rounding, seed=77)

    first, opt = _run(AdamW, init, 3, GROUPS, rounding=rounding, seed=77)
    opt.skipped_steps = 2
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = [p.clone().requires_grad_() for p in saved["params"]]
    groups = [{"params": resumed[:3], **GROUPS[0]}, {"params": resumed[3:], **GROUPS[1]}]
    opt2 = AdamW(groups, rounding=rounding, seed=1)  # the saved seed wins
    opt2.load_state_dict(saved["opt"])
    assert opt2.seed == 77 and opt2.skipped_steps == 2
    for t in range(3, 6):
        for p, g in zip(resumed, _grads(resumed, t)):
            p.grad = g.to(p.dtype)
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(full, resumed))


def test_chunking_does_not_change_the_result():
    init = _params(torch.bfloat16)
    a, _ = _run(AdamW, init, 3, GROUPS, seed=9, chunk_size=1 << 18, backend="torch")
    b, _ = _run(AdamW, init, 3, GROUPS, seed=9, chunk_size=64, backend="torch")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_non_contiguous_parameter_matches_contiguous():
    base = torch.randn(37, 29).to(torch.bfloat16)
    p1 = base.clone().requires_grad_()
    p2 = base.t().contiguous().t().requires_grad_()  # same values, transposed memory layout
    assert not p2.is_contiguous()
    o1, o2 = AdamW([p1], seed=3), AdamW([p2], seed=3)
    for t in range(3):
        g = torch.randn(37, 29, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert torch.equal(p1, p2)
    assert torch.equal(o1.state[p1]["exp_avg_sq"], o2.state[p2]["exp_avg_sq"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"amsgrad": True}, "amsgrad"),
        ({"maximize": True}, "maximize"),
        ({"capturable": True}, "capturable"),
        ({"differentiable": True}, "differentiable"),
        ({"fused": True}, "fused"),
        ({"foreach": True}, "foreach"),
        ({"rounding": "up"}, "rounding"),
        ({"backend": "cuda"}, "backend"),
        ({"lr": -1.0}, "learning rate"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": float("nan")}, "eps"),
        ({"weight_decay": -0.1}, "weight decay"),
        ({"seed": -3}, "seed"),
        ({"chunk_size": 1000}, "power of two"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AdamW([torch.zeros(2)], **kwargs)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'nesterov'"):
        AdamW([torch.zeros(2)], nesterov=True)


def test_float16_params_are_rejected():
    with pytest.raises(TypeError, match="bfloat16 and float32"):
        AdamW([torch.zeros(2, dtype=torch.float16)])


def test_bad_param_group_is_rejected():
    with pytest.raises(ValueError, match="rounding"):
        AdamW([{"params": [torch.zeros(2)], "rounding": "floor"}])


def test_triton_backend_refuses_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([p], backend="triton")
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        opt.step()
    assert len(opt.state[p]) == 0 and torch.equal(p, torch.zeros_like(p))
