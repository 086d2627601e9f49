"""8-bit optimizer states: the codes (unbiased, always a neighbouring level), the backends (same bytes), the optimizer
(memory, state dicts, conversion, errors) and the property that matters: a slowly moving second moment moves."""

import copy
import os

import pytest
import torch

from lightning_pure_bf16 import Adam, AdamW
from lightning_pure_bf16.ops import quant

CPU_INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", "cpu", *(["triton"] if CPU_INTERPRETED else [])]
CONFIGS = [
    {"moments": "int8"},
    {"moments": "int8", "rounding": "kahan"},
    {"moments": "int8", "rounding": "kahan", "compensation": "int8"},
    {"moments": "bf16", "rounding": "kahan", "compensation": "int8"},
    {"moments": "int8", "rounding": "nearest"},
]


def _words(n, seed):
    return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------------ codes
def test_scale_is_the_smallest_bf16_at_or_above_the_largest_magnitude():
    x = torch.randn(1000) * torch.logspace(-30, 30, 1000)
    up = quant.bf16_ceil(x.abs()).float()
    assert (up >= x.abs()).all()
    below = torch.nextafter(up.bfloat16(), torch.zeros((), dtype=torch.bfloat16)).float()
    assert (below < x.abs()).all()
    assert quant.bf16_ceil(torch.zeros(1)).float().item() == 0.0


@pytest.mark.parametrize("kind", ["m", "v"])
def test_a_write_lands_on_one_of_the_two_neighbouring_levels_and_is_unbiased(kind):
    n, draws = 4 * quant.QBLOCK, 4000
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * torch.logspace(-5, 0, n)
    if kind == "v":
        x = x * x
    encode, decode = (quant.encode_m, quant.decode_m) if kind == "m" else (quant.encode_v, quant.decode_v)
    scales = quant.block_scales(x)
    low = decode(encode(x, scales, torch.full((n,), -1, dtype=torch.int32)), scales)  # u just below 1: rounds down
    high = decode(encode(x, scales, torch.zeros(n, dtype=torch.int32)), scales)  # u = 0: rounds up
    assert (low.abs() <= x.abs() * (1 + 1e-6)).all() and (high.abs() >= x.abs() * (1 - 1e-6)).all()
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(draws):
        out = decode(encode(x, scales, _words(n, seed)), scales).double()
        assert ((out == low.double()) | (out == high.double())).all()
        total += out
    spacing = (high - low).double().abs()
    error = (total / draws - x.double()).abs()
    # The mean of `draws` two-valued draws is within 5 standard deviations (at most spacing / 2 / sqrt(draws)).
    assert (error <= 5 * spacing / 2 / draws**0.5 + 1e-12 * x.double().abs()).all()


def test_residual_unit_is_a_256th_of_the_bf16_spacing():
    p = torch.tensor([1.0, -3.0, 1e-30, 2.0**-126, 1e-39, 0.0, 3e38], dtype=torch.bfloat16)
    up = torch.nextafter(p.abs(), torch.full_like(p, float("inf")))
    spacing = (up.double() - p.abs().double()) / 256
    assert torch.equal(quant.residual_unit(p).double(), spacing)


# ------------------------------------------------------------------------------------------------------- backends
def _run(shape, backend, steps=3, opt_cls=AdamW, device="cpu", grad_scale=1.0, **kw):
    init = (torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.5).to(torch.bfloat16)
    p = init.to(device).requires_grad_()
    opt = opt_cls([p], lr=1e-2, weight_decay=0.05, seed=11, backend=backend, **kw)
    for t in range(steps):
        p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(device)
        opt.step(grad_scale=grad_scale if t == 0 else 1.0)
    return opt, p


def _bytes(opt, p):
    return [p.detach().view(torch.uint8)] + [
        v.view(torch.uint8) for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.ndim
    ]


@pytest.mark.parametrize("shape", [(5,), (128,), (300, 7), ((1 << 15) + 77,)])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_backends_write_the_same_bytes(backend, config, shape):
    reference = _bytes(*_run(shape, "torch", **config))
    other = _bytes(*_run(shape, backend, **config))
    assert len(other) == len(reference)
    for a, b in zip(other, reference):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "config", [{}, {"rounding": "kahan"}, *CONFIGS[:2]], ids=["bf16", "bf16-kahan", "int8", "int8-kahan"]
)
@pytest.mark.parametrize("opt_cls", [AdamW, Adam])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_a_gradient_factor_gives_the_same_bytes_on_every_backend(backend, opt_cls, config):
    # A clip factor folded into the update (`step(grad_scale=...)`, what ZeRO-3's clipping hands over): every backend
    # multiplies each widened gradient element by it in float32, before Adam's L2 term, and writes the same bytes.
    shape = ((1 << 12) + 77,)
    reference = _bytes(*_run(shape, "torch", opt_cls=opt_cls, grad_scale=0.3, **config))
    other = _bytes(*_run(shape, backend, opt_cls=opt_cls, grad_scale=0.3, **config))
    assert all(torch.equal(a, b) for a, b in zip(other, reference))
    assert not torch.equal(reference[0], _bytes(*_run(shape, "torch", opt_cls=opt_cls, **config))[0])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_the_torch_path_never_divides_by_a_python_number(config):
    # On CUDA, torch computes `tensor / number` as a multiplication by the number's reciprocal, which is not correctly
    # rounded: the torch path on a GPU then wrote other 8-bit codes than the Triton kernel (seen on an H200).
    from torch.utils._python_dispatch import TorchDispatchMode

    divisions = []

    class Divisions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_):
                divisions.append(type(args[1]).__name__)
            return func(*args, **(kwargs or {}))

    with Divisions():
        _run((300,), "torch", **config)
    assert divisions and set(divisions) == {"Tensor"}, divisions


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grad_scale", [1.0, 0.3], ids=["no factor", "a clip factor"])
@pytest.mark.parametrize("config", [{}, *CONFIGS], ids=lambda c: "-".join(f"{v}" for v in c.values()) or "bf16")
def test_cuda_kernel_writes_the_same_bytes_as_the_torch_path(config, grad_scale):
    shape = ((1 << 20) + 77,)
    reference = _bytes(*_run(shape, "torch", device="cuda", grad_scale=grad_scale, **config))
    kernel = _bytes(*_run(shape, "triton", device="cuda", grad_scale=grad_scale, **config))
    assert all(torch.equal(a, b) for a, b in zip(kernel, reference))


def test_adam_l2_decay_with_int8_moments_matches_too():
    a = _bytes(*_run((1000,), "torch", opt_cls=Adam, moments="int8"))
    b = _bytes(*_run((1000,), "cpu", opt_cls=Adam, moments="int8"))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------------ optimizer
@pytest.mark.parametrize(
    ("config", "state_bytes"),
    [
        ({}, 4.0),
        ({"moments": "int8"}, 2.0 + 4 / 128),
        ({"moments": "int8", "rounding": "kahan", "compensation": "int8"}, 3.0 + 4 / 128),
        ({"rounding": "kahan", "compensation": "int8"}, 5.0),
    ],
)
def test_state_bytes_per_parameter(config, state_bytes):
    opt, p = _run((64, 128), "auto", steps=1, **config)
    held = sum(v.numel() * v.element_size() for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.ndim)
    assert held / p.numel() == pytest.approx(state_bytes)


def test_dequantized_state_has_the_parameter_shape_and_values():
    opt, p = _run((40, 9), "auto", moments="int8", rounding="kahan", compensation="int8")
    state = opt.dequantized_state(p)
    assert set(state) == {"exp_avg", "exp_avg_sq", "kahan_comp"}
    assert all(v.shape == p.shape and v.dtype == torch.float32 for v in state.values())
    flat = opt.state[p]
    assert torch.equal(state["exp_avg"].view(-1), quant.decode_m(flat["exp_avg"].view(-1), flat["exp_avg_scale"]))
    assert (state["exp_avg_sq"] >= 0).all()
    # The remainder is at most half a spacing of the weight: 128 units.
    assert (state["kahan_comp"].abs() <= 128 * quant.residual_unit(p.detach())).all()


@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_resume_from_a_state_dict_continues_bit_for_bit(config):
    opt, p = _run((700,), "auto", steps=2, **config)
    saved_p, saved = p.detach().clone(), copy.deepcopy(opt.state_dict())
    for t in range(2):
        p.grad = torch.randn(700, generator=torch.Generator().manual_seed(100 + t)).to(torch.bfloat16)
        opt.step()
    q = saved_p.clone().requires_grad_()
    resumed = AdamW([q], lr=1e-2, weight_decay=0.05, backend="auto", **config)
    resumed.load_state_dict(saved)
    assert resumed.state[q]["exp_avg"].dtype == (torch.int8 if config.get("moments") == "int8" else torch.bfloat16)
    for t in range(2):
        q.grad = torch.randn(700, generator=torch.Generator().manual_seed(100 + t)).to(torch.bfloat16)
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(_bytes(opt, p), _bytes(resumed, q)))


def test_bf16_states_load_into_int8_ones_and_not_back():
    opt, p = _run((500,), "auto", steps=3)
    before = opt.dequantized_state(p)
    q = p.detach().clone().requires_grad_()
    int8 = AdamW([q], moments="int8")
    int8.load_state_dict(opt.state_dict())
    after = int8.dequantized_state(q)
    for key in ("exp_avg", "exp_avg_sq"):
        assert (after[key] - before[key]).abs().sum() <= 0.05 * before[key].abs().sum()
    with pytest.raises(ValueError, match="8-bit moments.*moments='int8'"):
        AdamW([p]).load_state_dict(int8.state_dict())


@pytest.mark.parametrize("config", CONFIGS[:4], ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_states_loaded_range_by_range_equal_the_state_dict_loaded_whole(config):
    # Moments and remainder in bf16 (as a bf16 checkpoint holds them), written a few blocks at a time into the run's
    # formats: the bytes a whole load_state_dict writes.
    opt, p = _run((1000,), "auto", steps=2)
    floats = {k: v.reshape(-1).bfloat16() for k, v in opt.dequantized_state(p).items()}
    if config.get("rounding") == "kahan":
        floats["kahan_comp"] = (torch.randn(1000) * quant.residual_unit(p.detach()) * 100).bfloat16()
    whole_p, ranges_p = p.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    whole, ranges = AdamW([whole_p], seed=5, **config), AdamW([ranges_p], seed=5, **config)
    sd = opt.state_dict()
    sd["state"][0] = {"step": sd["state"][0]["step"], "stream": 0, **{k: v.clone() for k, v in floats.items()}}
    sd["pure_bf16"]["seed"] = 5
    whole.load_state_dict(sd)
    ranges.init_state(ranges_p, ranges.param_groups[0])
    for start in range(0, 1000, 3 * quant.QBLOCK):
        ranges.load_state_range(ranges_p, start, {k: v[start : start + 3 * quant.QBLOCK] for k, v in floats.items()})
    for key, value in whole.state[whole_p].items():
        if isinstance(value, torch.Tensor) and key != "step":
            assert torch.equal(value, ranges.state[ranges_p][key]), key
    if config["moments"] == "int8":
        with pytest.raises(ValueError, match="whole blocks of 128"):
            ranges.load_state_range(ranges_p, 5, {k: v[5:10] for k, v in floats.items()})


def test_reblocking_keeps_every_block_whose_codes_share_a_scale():
    # A partition's codes moved by 37 elements (a parameter starting elsewhere in a re-partitioned flat partition):
    # each new block spans two old ones. Blocks whose elements share one scale keep codes and scale bit for bit; the
    # others are re-encoded within one level; padding (no scale, NaN) joins any block.
    n, shift = 10 * quant.QBLOCK, 37
    x = torch.randn(n) * torch.logspace(-3, 0, n)
    scales = quant.block_scales(x)
    scales[4] = scales[5]  # old blocks 4 and 5 share a scale: new block 5 (elements 640..767 - 37) keeps its codes
    codes = quant.encode_m(x, scales, _words(n, 1))
    each = torch.cat([torch.full((shift,), float("nan")), scales.float().repeat_interleave(quant.QBLOCK)])
    moved = torch.cat([torch.zeros(shift, dtype=torch.int8), codes])
    new_codes, new_scales = quant.reblock(moved, each, second=False, bits=_words(n + shift, 2))
    assert torch.equal(new_codes[: quant.QBLOCK], moved[: quant.QBLOCK])  # padding and old block 0
    assert new_scales[0] == scales[0]
    assert torch.equal(new_codes[5 * quant.QBLOCK : 6 * quant.QBLOCK], moved[5 * quant.QBLOCK : 6 * quant.QBLOCK])
    assert new_scales[5] == scales[5]
    before = quant.decode_m(codes, scales)
    after = quant.decode_m(new_codes, new_scales)[shift:]
    level = new_scales.float().repeat_interleave(quant.QBLOCK)[shift : shift + n] * 255 / 127**2
    assert ((after - before).abs() <= level).all()
    assert not torch.equal(after, before)


def test_bad_formats_are_refused():
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="moments='int4'"):
        AdamW([p], moments="int4")
    with pytest.raises(ValueError, match="compensation='fp8'"):
        AdamW([p], compensation="fp8")


# --------------------------------------------------------------------------------------------- states in files
@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_8bit_states_in_files_train_exactly_like_in_memory(tmp_path, config, backend):
    shape = (3000,)  # three streamed chunks of 1024, the last one partial, scale blocks across chunk ends: none
    in_memory = _bytes(*_run(shape, backend, steps=3, **config))
    opt, p = _run(shape, backend, steps=3, state_storage="mmap", state_dir=tmp_path, state_chunk_size=1024, **config)
    try:
        assert all(t.untyped_storage().filename for k, t in opt.state[p].items() if k != "step" and k != "stream")
        assert all(torch.equal(a, b) for a, b in zip(_bytes(opt, p), in_memory))
        # One file per tensor holds them all: codes, scales (and the remainder), nothing else but alignment.
        buffers = [t for t in opt.state[p].values() if isinstance(t, torch.Tensor) and t.ndim]
        (name,) = {t.untyped_storage().filename for t in buffers}
        held = sum(t.numel() * t.element_size() for t in buffers)
        assert held <= os.path.getsize(name) < held + 8
        assert held / p.numel() == pytest.approx(
            2 + 4 / 128 + (1 if "compensation" in config else 2) * (config.get("rounding") == "kahan"), abs=0.01
        )
    finally:
        opt.close()


def test_8bit_state_files_load_and_save_like_in_memory_ones(tmp_path):
    opt, p = _run((700,), "auto", steps=2, moments="int8")
    q = p.detach().clone().requires_grad_()
    files = AdamW([q], moments="int8", state_storage="mmap", state_dir=tmp_path, backend="auto")
    try:
        files.load_state_dict(opt.state_dict())
        assert files.state[q]["exp_avg"].dtype == torch.int8 and files.state[q]["exp_avg"].untyped_storage().filename
        # torch.save writes it (codes and scales share one state file, viewed as different dtypes) and reads it back.
        torch.save(files.state_dict(), tmp_path / "sd.pt")
        back = torch.load(tmp_path / "sd.pt", weights_only=False)["state"][0]
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.equal(back[key], opt.state[p][key]), key
        # bf16 moments load into 8-bit files encoded, as into 8-bit states in memory (the same bytes).
        bf16_opt, _ = _run((700,), "auto", steps=1)
        files.load_state_dict(bf16_opt.state_dict())
        memory = AdamW([q.detach().clone().requires_grad_()], moments="int8", backend="auto")
        memory.load_state_dict(bf16_opt.state_dict())
        (mem_state,) = memory.state.values()
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.equal(files.state[q][key], mem_state[key]), key
        bf16_files = AdamW([q], state_storage="mmap", state_dir=tmp_path, backend="auto")
        try:
            with pytest.raises(ValueError, match="8-bit moments.*Create it with `moments='int8'`"):
                bf16_files.load_state_dict(opt.state_dict())
        finally:
            bf16_files.close()
    finally:
        files.close()


def test_float32_parameters_keep_float32_moments():
    p = torch.ones(4, requires_grad=True)
    p.grad = torch.ones(4)
    opt = AdamW([p], moments="int8")
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in opt.state[p]


# --------------------------------------------------------------------------------------------------- small changes
def test_a_second_moment_changing_by_a_fifth_of_a_percent_a_step_follows_its_average():
    """A saturated v, then a gradient 10% larger: v moves by about 0.2% a step, a tenth of the 8-bit spacing there
    (about 5%); rounded to nearest it would never move. Stochastic writes follow the exact average."""
    n, beta2 = 4096, 0.99
    p = torch.zeros(n, dtype=torch.bfloat16, requires_grad=True)
    # One large gradient per block sets the block scale; the rest are 10x smaller, so their v sits low in the code.
    big = torch.zeros(n, dtype=torch.bool)
    big[:: quant.QBLOCK] = True
    opt = AdamW([p], lr=0.0, betas=(0.9, beta2), weight_decay=0.0, moments="int8", seed=3)

    def steps(count, small_grad):
        for _ in range(count):
            p.grad = torch.where(big, 1.0, small_grad).to(torch.bfloat16)
            opt.step()

    steps(1000, 0.1)  # saturated: v = 0.01 within 5e-5
    before = opt.dequantized_state(p)["exp_avg_sq"][~big].double().mean().item()
    assert before == pytest.approx(0.01, rel=0.01)
    steps(200, 0.11)
    g2 = torch.tensor(0.11).bfloat16().double().item() ** 2
    expected = g2 - (g2 - 0.01) * beta2**200
    after = opt.dequantized_state(p)["exp_avg_sq"][~big].double().mean().item()
    assert after == pytest.approx(expected, rel=0.01)  # rounding to nearest would leave it at 0.01: 15% off


# ------------------------------------------------------------------------------------- the CPU loops, both of them
def test_the_loops_levels_equal_the_division(loops):
    """The vector loops compute k / 127 and k / 255 without a division (a product and a fused correction): every
    level of both codes equals the PyTorch path's division."""
    from lightning_pure_bf16.ops import update_cpu

    levels = update_cpu._extension.levels_8bit()
    assert torch.equal(levels[:128], quant._level(torch.arange(128, dtype=torch.float32), quant.M_LEVELS, 2))
    assert torch.equal(levels[128:], quant._level(torch.arange(256, dtype=torch.float32), quant.V_LEVELS, 4))


@pytest.mark.parametrize("shape", [(300, 7), ((1 << 15) + 77,)])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_both_cpu_loops_write_the_torch_paths_bytes(config, shape, loops):
    reference = _bytes(*_run(shape, "torch", **config))
    assert all(torch.equal(a, b) for a, b in zip(_bytes(*_run(shape, "cpu", **config)), reference))


def _extreme_states(n, config, seed=3):
    """States no training run would draw at random: zero, tiny (subnormal) and huge blocks, every code, exact bf16
    magnitudes (a normalized magnitude of exactly 1), negative zeros, subnormal gradients."""
    g = torch.Generator().manual_seed(seed)
    blocks = quant.scale_blocks(n)
    magnitude = 10.0 ** torch.randint(-38, 38, (n,), generator=g).float()
    param = (torch.randn(n, generator=g) * magnitude).bfloat16()
    param[::17] = 0.0
    param[5::31] = -0.0
    grad = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-40, 5, (n,), generator=g).float()).bfloat16()
    grad[: quant.QBLOCK] = 0.0  # block 0: no gradient at all
    state = {}
    if config.get("moments") == "int8":
        m = torch.randint(-127, 128, (n,), dtype=torch.int8, generator=g)
        m[: 2 * quant.QBLOCK] = torch.arange(-127, 129).clamp(max=127).to(torch.int8)  # every code, twice 127
        v = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        v[: 2 * quant.QBLOCK] = torch.arange(256, dtype=torch.uint8)
        v[2 * quant.QBLOCK : 3 * quant.QBLOCK] = 0
        m_scale = (10.0 ** torch.randint(-30, 30, (blocks,), generator=g).float()).bfloat16()
        v_scale = (10.0 ** torch.randint(-44, 30, (blocks,), generator=g).float()).bfloat16()  # down to subnormal
        m_scale[1] = v_scale[1] = 0.0
        v_scale[3] = torch.tensor(1e-40).bfloat16()
        state.update(exp_avg=m, exp_avg_sq=v, exp_avg_scale=m_scale, exp_avg_sq_scale=v_scale)
    else:
        state.update(
            exp_avg=(torch.randn(n, generator=g) * magnitude).bfloat16(), exp_avg_sq=param.float().square().bfloat16()
        )
    if config.get("rounding") == "kahan":
        if config.get("compensation") == "int8":
            state["kahan_comp"] = torch.randint(-127, 128, (n,), dtype=torch.int8, generator=g)
        else:
            state["kahan_comp"] = (torch.randn(n, generator=g) * magnitude * 2**-9).bfloat16()
    return param, grad, state


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_both_cpu_loops_equal_the_torch_path_on_extreme_states(config, decoupled, loops):
    """Both CPU loops against the PyTorch path on states from zero to subnormal to huge, every code, a partial last
    block, and an index crossing 2**32 (the random bits' high word changes between two blocks)."""
    from lightning_pure_bf16.ops.algorithms import UpdateArgs
    from lightning_pure_bf16.ops.update_cpu import update_cpu_
    from lightning_pure_bf16.ops.update_torch import update_torch_

    n = 20 * quant.QBLOCK + 50
    offset = 2**32 - 5 * quant.QBLOCK
    args = UpdateArgs(
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.05,
        decoupled=decoupled,
        step=3,
        rounding=config.get("rounding", "stochastic"),
        keys=(0x1234567, 0x7654321, 0x0BADF00D),
    )
    outputs = []
    for update in (update_torch_, update_cpu_):
        param, grad, state = _extreme_states(n, config)
        kw = {"index_offset": offset}
        if update is update_torch_:
            kw["chunk_size"] = quant.QBLOCK
        update(
            param,
            grad,
            (state["exp_avg"], state["exp_avg_sq"]),
            state.get("kahan_comp"),
            args,
            scales=(state.get("exp_avg_scale"), state.get("exp_avg_sq_scale")),
            **kw,
        )
        outputs.append([param.view(torch.uint8)] + [t.view(torch.uint8) for t in state.values()])
    reference, loop = outputs
    for name, a, b in zip(["param", *_extreme_states(n, config)[2]], loop, reference):
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} bytes differ"
