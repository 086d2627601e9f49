"""Lion and SGD on the family's update path: the reference optimizers' arithmetic, the same bytes on every backend,
unbiased rounding, the inf/NaN skip, resumes and state dicts (to and from the reference optimizers), refused options."""

import copy
import io

import pytest
import torch

from lightning_pure_bf16 import SGD, Lion
from lightning_pure_bf16.optim import fused_cpu_available
from tests.reference.bf16 import TOLERANCES
from tests.reference.lion import ReferenceLion

SHAPES = [(6,), (42, 3), (123,), (431, 7), (0,)]
# Per algorithm: ours, the reference, two param groups (the second on the defaults where it can be).
ALGORITHMS = {
    "lion": (Lion, ReferenceLion, [{"lr": 3e-3, "weight_decay": 0.1}, {"lr": 1e-3, "betas": (0.8, 0.95)}]),
    "sgd": (
        SGD,
        torch.optim.SGD,
        [{"lr": 3e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.1}, {"lr": 1e-2}],
    ),
    "sgd_nesterov": (
        SGD,
        torch.optim.SGD,
        [{"lr": 3e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05}, {"lr": 1e-2, "momentum": 0.5}],
    ),
}


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in params]


def _run(opt_cls, params, steps, groups_kw, start=0, opt=None, grad_scale=1.0, **kw):
    if opt is None:
        params = [p.clone().requires_grad_() for p in params]
        opt = opt_cls([{"params": params[:2], **groups_kw[0]}, {"params": params[2:], **groups_kw[1]}], **kw)
    for t in range(start, start + steps):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g.to(p.dtype)
        opt.step(grad_scale=grad_scale) if grad_scale != 1.0 else opt.step()  # the references take no factor
    return params, opt


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().reshape(-1).view(torch.uint8) for t in tensors]


def _state_tensors(params, opt) -> list[torch.Tensor]:
    return [v for p in params for k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor) and v.ndim]


@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_float32_arithmetic_equals_the_reference(name, steps):
    ours, reference, groups = ALGORITHMS[name]
    init = _params(torch.float32)
    got, _ = _run(ours, init, steps, groups)
    expected, _ = _run(reference, [p.double() for p in init], steps, groups)
    tol = TOLERANCES[torch.float32]
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_bf16_params_follow_the_reference_and_keep_bf16_states(name, rounding):
    ours, reference, groups = ALGORITHMS[name]
    init = _params(torch.bfloat16)
    got, opt = _run(ours, init, 5, groups, rounding=rounding, seed=0)
    expected, _ = _run(reference, [p.double() for p in init], 5, groups)
    tol = TOLERANCES[torch.bfloat16]
    # Lion's update is a sign: where bf16 momentum flips a near-zero interpolation, a weight is one step of 2 lr off.
    atol = tol.atol + (2 * 3e-3 if name == "lion" else 0.0)
    for a, b in zip(got, expected):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, rtol=tol.rtol, atol=atol)
    for p, group in ((p, g) for g in opt.param_groups for p in g["params"]):
        big = {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.ndim}
        kept = set(opt.state_keys(group)) | ({"kahan_comp"} if rounding == "kahan" else set())
        assert set(big) == kept and all(v.dtype == torch.bfloat16 and v.shape == p.shape for v in big.values())
    if name == "sgd":  # the second group has no momentum: no state but the counters (and Kahan's remainder)
        counters = {"step", "stream"} | ({"kahan_comp"} if rounding == "kahan" else set())
        assert all(set(opt.state[p]) == counters for p in opt.param_groups[1]["params"] if p.numel())


def _backends() -> list[str]:
    out = ["torch", "triton"]
    if fused_cpu_available():
        out.append("cpu")
    return out


@pytest.mark.parametrize(
    ("rounding", "formats"),
    [
        ("stochastic", {}),
        ("nearest", {}),
        ("kahan", {}),
        ("stochastic", {"moments": "int8"}),
        ("kahan", {"moments": "int8", "compensation": "int8"}),
    ],
    ids=["stochastic", "nearest", "kahan", "int8", "int8-kahan-int8"],
)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_backend_writes_the_same_bytes(name, rounding, formats):
    """The PyTorch path, the Triton kernel (through the interpreter) and the C++ loop: parameters and every state,
    byte for byte, over three steps, one of them with a gradient factor (a clip factor folded into the update)."""
    pytest.importorskip("triton")
    ours, _, groups = ALGORITHMS[name]
    init = _params(torch.bfloat16, seed=3)
    results = {}
    for backend in _backends():
        params, opt = _run(ours, init, 2, groups, rounding=rounding, seed=11, backend=backend, **formats)
        _run(ours, params, 1, groups, start=2, opt=opt, grad_scale=0.37)
        results[backend] = _bits(params) + _bits(_state_tensors(params, opt))
    reference = results.pop("torch")
    for backend, got in results.items():
        assert len(got) == len(reference)
        for i, (a, b) in enumerate(zip(got, reference)):
            assert torch.equal(a, b), f"{backend}: tensor {i}: {int((a != b).sum())} bytes differ from the PyTorch path"


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("name", ["lion", "sgd"])
def test_updates_of_a_tenth_of_an_ulp_move_the_weights_on_average(name, rounding):
    # Both updates are -lr per step with a constant gradient of 1 (Lion: the sign; SGD without momentum: lr * g);
    # 1e-3 is an eighth of a bf16 ulp at 1.0. Round-to-nearest loses every one.
    p = torch.ones(4096, dtype=torch.bfloat16, requires_grad=True)
    opt = Lion([p], lr=1e-3, rounding=rounding, seed=5) if name == "lion" else SGD([p], lr=1e-3, rounding=rounding)
    for _ in range(200):
        p.grad = torch.ones_like(p)
        opt.step()
    if rounding == "nearest":
        assert torch.all(p == 1.0)
    else:
        assert p.double().mean().item() == pytest.approx(0.8, abs=2e-3)


def _momentum_after(name: str, rounding: str) -> float:
    """The mean momentum after 1000 steps whose every change is 1e-3 of its distance to the gradient (beta 0.999),
    below half a bf16 ulp once the distance is small: Lion's (gradient 1, from 0), SGD's (momentum 0.999 and
    dampening 0.999; gradient 1 at the first step, where the buffer starts at it, then 0)."""
    p = torch.zeros(4096, dtype=torch.bfloat16, requires_grad=True)
    if name == "lion":
        opt = Lion([p], lr=0.0, betas=(0.9, 0.999), rounding=rounding, seed=2)
    else:
        opt = SGD([p], lr=0.0, momentum=0.999, dampening=0.999, rounding=rounding, seed=2)
    for step in range(1000):
        p.grad = torch.full_like(p, 1.0 if name == "lion" or step == 0 else 0.0)
        opt.step()
    return opt.state[p][opt.state_names[0]].double().mean().item()


@pytest.mark.parametrize(("name", "expected"), [("lion", 1 - 0.999**1000), ("sgd", 0.999**999)])
def test_the_momentum_tracks_its_average_where_nearest_rounding_freezes_it(name, expected):
    assert _momentum_after(name, "stochastic") == pytest.approx(expected, rel=5e-3)
    assert abs(_momentum_after(name, "nearest") - expected) > 0.05


@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_inf_or_nan_gradient_skips_the_whole_step(name):
    ours, _, groups = ALGORITHMS[name]
    params, opt = _run(ours, _params(torch.bfloat16), 2, groups, rounding="kahan", moments="int8", seed=1)
    before = [t.clone() for t in [p.detach() for p in params] + _state_tensors(params, opt)]
    for p, g in zip(params, _grads(params, 99)):
        p.grad = g.to(p.dtype)
    params[3].grad[0, 1] = float("nan")
    opt.step()
    after = [p.detach() for p in params] + _state_tensors(params, opt)
    assert opt.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, after))
    assert int(opt.state[params[0]]["step"]) == 2


@pytest.mark.parametrize("formats", [{}, {"moments": "int8", "rounding": "kahan", "compensation": "int8"}])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_resumed_run_equals_an_uninterrupted_one(name, formats):
    ours, _, groups = ALGORITHMS[name]
    init = _params(torch.bfloat16)
    full, _ = _run(ours, init, 6, groups, seed=77, **formats)
    first, opt = _run(ours, init, 3, groups, seed=77, **formats)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [p.clone().requires_grad_() for p in saved["params"]]
    opt2 = ours([{"params": resumed[:2], **groups[0]}, {"params": resumed[2:], **groups[1]}], seed=1, **formats)
    opt2.load_state_dict(saved["opt"])
    _run(ours, resumed, 3, groups, start=3, opt=opt2)
    assert all(torch.equal(a, b) for a, b in zip(_bits(full), _bits(resumed)))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_state_dicts_load_from_and_into_the_reference_optimizer(name):
    ours, reference, groups = ALGORITHMS[name]
    init = _params(torch.float32)
    # The reference's state dict into ours: the run continues as the reference does.
    theirs, ref_opt = _run(reference, init, 2, groups)
    mine = [p.detach().clone().requires_grad_() for p in theirs]
    opt = ours([{"params": mine[:2], **groups[0]}, {"params": mine[2:], **groups[1]}], seed=3)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # as saved: torch's loader keeps the tensors it is given
    _run(reference, theirs, 2, groups, start=2, opt=ref_opt)
    _run(ours, mine, 2, groups, start=2, opt=opt)
    tol = TOLERANCES[torch.float32]
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol)
    # Ours into the reference: the same.
    mine, opt = _run(ours, init, 2, groups)
    theirs = [p.detach().clone().requires_grad_() for p in mine]
    ref_opt = reference([{"params": theirs[:2], **groups[0]}, {"params": theirs[2:], **groups[1]}])
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _run(reference, theirs, 2, groups, start=2, opt=ref_opt)
    _run(ours, mine, 2, groups, start=2, opt=opt)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p: SGD(p, nesterov=True), ValueError, r"nesterov=True\)` needs momentum > 0"),
        (lambda p: SGD(p, momentum=0.9, dampening=0.1, nesterov=True), ValueError, "dampening == 0"),
        (lambda p: SGD(p, momentum=-0.9), ValueError, r"momentum=-0.9\)"),
        (lambda p: SGD(p, lr=float("nan")), ValueError, "learning rate"),
        (lambda p: SGD(p, maximize=True), ValueError, r"SGD\(maximize=True\)` is not supported"),
        (lambda p: SGD(p, differentiable=True), ValueError, r"SGD\(differentiable=True\)` is not supported"),
        (lambda p: SGD(p, foreach=True), ValueError, r"SGD\(foreach=True\)` selects a torch.optim implementation"),
        (lambda p: Lion(p, betas=(0.9, 1.5)), ValueError, "betas"),
        (lambda p: Lion(p, weight_decay=-1.0), ValueError, "weight decay"),
        (lambda p: Lion(p, eps=1e-8), TypeError, "unexpected keyword argument 'eps'"),
        (lambda p: Lion([{"params": p, "rounding": "up"}]), ValueError, "rounding"),
    ],
)
def test_bad_options_are_refused_by_name_before_any_state(make, error, match):
    p = [torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)]
    with pytest.raises(error, match=match):
        make(p)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("name", ["lion", "sgd"])
def test_the_cpu_loop_equals_the_torch_path_across_the_2_32_boundary_and_on_huge_weights(name, rounding, int8):
    """The generic C++ loop against the PyTorch path on a piece whose indices cross 2**32 (the random bits' high word
    changes inside a block of bf16 states), with weights near bf16's largest (where the loop decides the stochastic
    sum again exactly) and an 8-bit Kahan remainder with 8-bit states."""
    if not fused_cpu_available():
        pytest.skip("the fused CPU loop did not compile")
    from lightning_pure_bf16.ops import quant
    from lightning_pure_bf16.ops.algorithms import LionArgs, SGDArgs
    from lightning_pure_bf16.ops.update_cpu import update_cpu_
    from lightning_pure_bf16.ops.update_torch import update_torch_

    n, offset = (20 * 128 + 50, 2**32 - 5 * 128) if int8 else (2000, 2**32 - 777)
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g)
    p[::97] *= 1e38
    state = torch.randn(n, generator=g) * 0.1
    keys = (0x1234567, 0x7654321, 0x0BADF00D)
    if name == "lion":
        args = LionArgs(1e-2, 0.9, 0.99, 0.1, step=3, rounding=rounding, keys=keys, grad_scale=0.5)
    else:
        args = SGDArgs(1e-2, 0.9, 0.0, 0.1, nesterov=True, step=3, rounding=rounding, keys=keys, grad_scale=0.5)
    outputs = []
    for update in (update_torch_, update_cpu_):
        weight, grad = p.to(torch.bfloat16), torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
        scales = [quant.block_scales(state)] if int8 else []
        states = [quant.encode_m(state, scales[0], torch.zeros(n, dtype=torch.int32)) if int8 else state.bfloat16()]
        comp = None
        if rounding == "kahan":
            comp = torch.randint(-100, 100, (n,), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
            comp = comp if int8 else (comp.float() * 1e-6).bfloat16()
        kw = {"chunk_size": 128} if update is update_torch_ else {}
        update(weight, grad, states, comp, args, scales=scales, index_offset=offset, **kw)
        outputs.append([t.view(torch.uint8) for t in (weight, *states, *scales, *([comp] if comp is not None else []))])
    for i, (a, b) in enumerate(zip(*outputs)):
        assert torch.equal(a, b), f"tensor {i}: {int((a != b).sum())} bytes differ"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rounding", "formats"),
    [("stochastic", {}), ("kahan", {}), ("stochastic", {"moments": "int8"})],
    ids=["stochastic", "kahan", "int8"],
)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_cuda_kernel_writes_the_bytes_of_the_torch_path_on_cuda(name, rounding, formats):
    ours, _, groups = ALGORITHMS[name]
    init = [p.cuda() for p in _params(torch.bfloat16, seed=3)]
    results = []
    for backend in ("torch", "triton"):
        params, opt = _run(ours, init, 3, groups, rounding=rounding, seed=11, backend=backend, **formats)
        results.append(_bits(params) + _bits(_state_tensors(params, opt)))
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"tensor {i}: {int((a != b).sum())} bytes differ from the PyTorch path on CUDA"


@pytest.mark.parametrize("name", ALGORITHMS)
def test_dtensor_parameters_train_bit_for_bit_as_plain_tensors(name, tmp_path):
    """FSDP2's DTensors (a 1-rank mesh, in this process): each shard draws its bits by its elements' indices in the
    whole tensor, so Lion and SGD over DTensors write the bytes of the same optimizer over plain tensors, their states
    DTensors sharded like the parameters."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    ours, _, groups = ALGORITHMS[name]
    init = [p for p in _params(torch.bfloat16) if p.ndim == 2]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = [torch.nn.Parameter(distribute_tensor(p.clone(), mesh, [Shard(0)])) for p in init]
        opt = ours([{"params": sharded[:1], **groups[0]}, {"params": sharded[1:], **groups[1]}], seed=5)
        for t in range(3):
            for p, g in zip(sharded, _grads(init, t)):
                p.grad = distribute_tensor(g.to(torch.bfloat16), mesh, [Shard(0)])
            opt.step()
        plain = [p.clone().requires_grad_() for p in init]
        plain_opt = ours([{"params": plain[:1], **groups[0]}, {"params": plain[1:], **groups[1]}], seed=5)
        _run(ours, plain, 3, groups, opt=plain_opt)
        assert all(torch.equal(p.to_local(), q.detach()) for p, q in zip(sharded, plain))
        for p, q in zip(sharded, plain):
            for key, value in plain_opt.state[q].items():
                if isinstance(value, torch.Tensor) and value.ndim:
                    state = opt.state[p][key]
                    assert isinstance(state, DTensor) and torch.equal(state.to_local(), value), key
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("name", ["lion", "sgd"])
def test_the_functional_form_writes_the_bytes_of_the_optimizers_step(name, rounding, backend):
    # lion(...) and sgd(...) for a caller that keeps the states itself: the optimizer's seed, the tensor's stream (0,
    # its first tensor) and the step give the same noise, so three steps leave the same weight and states.
    from lightning_pure_bf16.optim.functional import lion, sgd

    p0 = (torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 0.5).bfloat16()
    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(t)).bfloat16() for t in range(1, 4)]
    if name == "lion":
        cls, update, key, hp = Lion, lion, "exp_avg", {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}
    else:
        cls, update, key = SGD, sgd, "momentum_buffer"
        hp = {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}
    p = p0.clone().requires_grad_()
    opt = cls([p], rounding=rounding, seed=11, backend=backend, **hp)
    for g in grads:
        p.grad = g
        opt.step()
    q, state = p0.clone(), torch.zeros_like(p0)
    comp = torch.zeros_like(p0) if rounding == "kahan" else None
    for t, g in enumerate(grads, start=1):
        update(q, g, state, step=t, rounding=rounding, kahan_comp=comp, seed=11, backend=backend, **hp)
    assert torch.equal(p.detach().view(torch.int16), q.view(torch.int16))
    assert torch.equal(opt.state[p][key].view(torch.int16), state.view(torch.int16))
    if comp is not None:
        assert torch.equal(opt.state[p]["kahan_comp"].view(torch.int16), comp.view(torch.int16))
    assert not torch.equal(q, p0)


def test_the_functional_forms_refuse_bad_input_by_name():
    from lightning_pure_bf16.optim.functional import lion, sgd

    p, g = torch.zeros(8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sgd\\(momentum=0.9\\)` needs `momentum_buffer`"):
        sgd(p, g, step=1, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov=True"):
        sgd(p, g, torch.zeros_like(p), step=1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="lion\\(betas"):
        lion(p, g, torch.zeros_like(p), step=1, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="needs `kahan_comp`"):
        lion(p, g, torch.zeros_like(p), step=1, rounding="kahan")
    assert torch.equal(p, torch.zeros(8, dtype=torch.bfloat16))  # nothing written
