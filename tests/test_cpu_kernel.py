"""The fused CPU loop against the PyTorch path: the same operations in the same order, so the same bits."""

from pathlib import Path

import pytest
import torch

import lightning_pure_bf16.ops.update_cpu as update_cpu
from lightning_pure_bf16 import Adam, AdamW
from lightning_pure_bf16.ops.rounding import stochastic_round_sum_bf16

SHAPES = [(6,), (42,), (123,), (431, 7), (1 << 16) + 3, (0,)]


def _run(opt_cls, shape, rounding, backend, steps=3, grad_scale=1.0, **kw):
    shape = shape if isinstance(shape, tuple) else (shape,)
    init = (torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.5).to(torch.bfloat16)
    p = init.clone().requires_grad_()
    opt = opt_cls([p], lr=1e-2, weight_decay=0.05, rounding=rounding, seed=11, backend=backend, **kw)
    for t in range(steps):
        p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        opt.step(grad_scale=grad_scale if t == 0 else 1.0)
    return [p.detach(), *(v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.ndim)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("opt_cls", [AdamW, Adam])
def test_fused_cpu_loop_equals_torch_path_bit_for_bit(opt_cls, shape, rounding, loops):
    fused = _run(opt_cls, shape, rounding, "cpu")
    reference = _run(opt_cls, shape, rounding, "torch")
    assert len(fused) == len(reference) == (4 if rounding == "kahan" else 3)
    for a, b in zip(fused, reference):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_fused_cpu_loop_equals_torch_path_with_non_finite_values(rounding, loops):
    """Gradients with inf and NaN, applied anyway (no non-finite check): inf and NaN reach every buffer, in the same
    places as on the PyTorch path, and every other value is the same bit for bit."""

    def run(backend):
        gen = torch.Generator().manual_seed(5)
        p = (torch.randn(4099, generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
        opt = AdamW([p], lr=1e-2, weight_decay=0.05, rounding=rounding, seed=11, backend=backend)
        opt.check_nonfinite = False
        for t in range(3):
            g = torch.randn(4099, generator=gen)
            g[torch.randint(0, 4099, (40,), generator=gen)] = float("nan")
            g[torch.randint(0, 4099, (40,), generator=gen)] = float("inf") * (-1) ** t
            p.grad = g.to(torch.bfloat16)
            opt.step()
        return [p.detach(), *(v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.ndim)]

    fused, reference = run("cpu"), run("torch")
    assert fused[0].isnan().any()
    for a, b in zip(fused, reference):
        # A NaN is a NaN (torch's own cast to bf16 makes every NaN its canonical one; the loop keeps sign and payload).
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a[~a.isnan()].view(torch.int16), b[~b.isnan()].view(torch.int16))


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_both_cpu_loops_apply_a_gradient_factor_as_the_torch_path(moments, loops):
    for opt_cls, rounding in ((AdamW, "stochastic"), (Adam, "kahan")):
        fused = _run(opt_cls, (4099,), rounding, "cpu", grad_scale=0.3, moments=moments)
        reference = _run(opt_cls, (4099,), rounding, "torch", grad_scale=0.3, moments=moments)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fused, reference))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_gradient_factor_is_one_float32_product_per_element(backend):
    # adamw(grad_scale=f) on a bf16 gradient writes the bits of the update from the float32 gradient g * f (a product
    # rounded once, to float32, never to bf16), with Adam's L2 term added after it.
    from lightning_pure_bf16.optim.functional import adamw

    gen = torch.Generator().manual_seed(3)
    p0 = (torch.randn(4099, generator=gen) * 0.5).bfloat16()
    grad = torch.randn(4099, generator=gen).bfloat16()
    factor = 0.2917

    def update(g, backend, **kw):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        adamw(p, g, m, v, step=1, lr=1e-2, weight_decay=0.05, decoupled_weight_decay=False, backend=backend, **kw)
        return [t.view(torch.int16) for t in (p, m, v)]

    folded = update(grad, backend, grad_scale=factor)
    scaled_before = update(grad.float() * torch.tensor(factor, dtype=torch.float32), "torch")
    rounded_before = update((grad.float() * factor).bfloat16(), "torch")
    assert all(torch.equal(a, b) for a, b in zip(folded, scaled_before))
    assert not torch.equal(folded[1], rounded_before[1])  # not ZeRO-3's old product rounded to bf16


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf"), True, "0.5"])
def test_a_bad_gradient_factor_is_refused_before_anything_changes(bad):
    from lightning_pure_bf16.optim.functional import adamw

    p = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"AdamW.step\(grad_scale=...\)`: grad_scale=.*finite number > 0"):
        opt.step(grad_scale=bad)
    assert not opt.state and torch.equal(p.detach(), torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="adamw.*grad_scale=.*finite number > 0"):
        adamw(p.detach(), p.grad, torch.zeros_like(p), torch.zeros_like(p), step=1, grad_scale=bad)


def test_auto_picks_the_fused_loop_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "lightning_pure_bf16.optim.functional.update_cpu_",
        lambda *a, **k: calls.append(a) or update_cpu.update_cpu_(*a, **k),
    )
    _run(AdamW, (10,), "stochastic", "auto", steps=1)
    assert len(calls) == 1


def test_cpu_backend_refuses_non_contiguous_bf16_before_touching_state():
    q = torch.zeros(4, 4, dtype=torch.bfloat16).t().requires_grad_()
    q.grad = torch.ones(4, 4, dtype=torch.bfloat16)
    opt = AdamW([q], backend="cpu")
    with pytest.raises(RuntimeError, match="needs contiguous bf16 CPU tensors"):
        opt.step()
    assert len(opt.state[q]) == 0


def test_float32_parameters_take_the_torch_path_whatever_the_backend():
    p = torch.ones(4, requires_grad=True)
    p.grad = torch.ones(4)
    AdamW([p], lr=0.1, weight_decay=0.0, backend="cpu").step()
    assert torch.allclose(p.detach(), torch.full((4,), 0.9))


def test_failed_build_warns_and_falls_back(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(update_cpu, "_extension", None)
    monkeypatch.setattr(update_cpu, "_failure", None)
    monkeypatch.setattr("torch.utils.cpp_extension.load", broken)
    with pytest.warns(RuntimeWarning, match="did not compile.*no compiler here"):
        fallback = _run(AdamW, (50,), "stochastic", "auto", steps=2)
    monkeypatch.undo()
    reference = _run(AdamW, (50,), "stochastic", "torch", steps=2)
    assert all(torch.equal(a, b) for a, b in zip(fallback, reference))


def test_a_compiler_without_openmp_builds_the_serial_loop(monkeypatch):
    built = []

    def no_openmp(name, **kwargs):
        if "-fopenmp" in kwargs["extra_cflags"]:
            raise RuntimeError("unsupported option '-fopenmp'")
        built.append(name)
        return object()

    monkeypatch.setattr(update_cpu, "_extension", None)
    monkeypatch.setattr(update_cpu, "_failure", None)
    monkeypatch.setattr("torch.utils.cpp_extension.load", no_openmp)
    assert update_cpu.fused_cpu_available() and update_cpu._failure is None
    assert len(built) == 1 and built[0].endswith("_serial")


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 70_000, 131_071])
def test_fused_nonfinite_check_finds_every_kind_anywhere(bad, where):
    assert update_cpu.fused_cpu_available()
    g = torch.randn(131_072).to(torch.bfloat16)
    assert not update_cpu.any_nonfinite_cpu(g)
    g[where] = bad
    assert update_cpu.any_nonfinite_cpu(g)


def test_fused_nonfinite_check_accepts_extremes():
    assert update_cpu.fused_cpu_available()
    finfo = torch.finfo(torch.bfloat16)
    g = torch.tensor([finfo.max, -finfo.max, finfo.tiny, 0.0, -0.0, 1e-40], dtype=torch.bfloat16)
    assert not update_cpu.any_nonfinite_cpu(g)
    assert not update_cpu.any_nonfinite_cpu(torch.empty(0, dtype=torch.bfloat16))


def test_the_loop_is_ready_when_the_optimizer_is_made_not_at_its_first_step(monkeypatch):
    monkeypatch.setattr(update_cpu, "_extension", None)
    AdamW([torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)])
    assert update_cpu._extension is not None
    monkeypatch.setattr(update_cpu, "_extension", None)
    AdamW([torch.zeros(4, requires_grad=True)])  # float32 parameters never use it
    assert update_cpu._extension is None


def test_build_command_compiles_ahead_of_time():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "lightning_pure_bf16.build"], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fused CPU optimizer loop ready" in done.stdout


def _sums_near_every_carry_boundary(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums a + b with TwoSum errors of every size, and random bits chosen so that the 16 discarded bits of the float32
    sum plus the bits land within 2**17 of a carry (where only the exact sum decides), or anywhere."""
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16).float()
    scale = torch.pow(10.0, -torch.randint(1, 9, (n,), generator=gen).float())
    b = torch.randn(n, generator=gen) * scale * a.abs().clamp(min=1e-30)
    b[: n // 8] = -a[: n // 8] * 0.5  # steps down to and across powers of two
    a[n // 8 : n // 4] = torch.ldexp(torch.ones(n // 8), torch.randint(-120, 120, (n // 8,), generator=gen))
    b[n // 8 : n // 4] = -a[n // 8 : n // 4] * torch.rand(n // 8, generator=gen) * 1e-6  # just below a power of two
    s_bits = (a + b).view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    low = (s_bits << 16) & 0xFFFFFFFF
    offset = torch.randint(-(1 << 17), 1 << 17, (n,), generator=gen)
    bits = (offset - low) & 0xFFFFFFFF
    anywhere = torch.rand(n, generator=gen) < 0.25
    bits[anywhere] = torch.randint(0, 1 << 32, (int(anywhere.sum()),), generator=gen)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    return a, b, bits


def test_fast_sum_rounding_equals_the_exact_one_at_every_carry_boundary(loops):
    a, b, bits = _sums_near_every_carry_boundary(40_003)
    extremes = torch.tensor(
        [3.0e38, -3.0e38, 1.7e38, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-45, 2.0**-126]
    )
    # NaNs whose low bits are set (the rounding keeps them NaN, quiet, and drops those bits), and sums near the top
    # of the float32 range.
    payloads = torch.tensor([0x7FC0FFFF, -0x3E0001, 0x7F80FFFF, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    extremes = torch.cat([extremes, payloads, torch.tensor([3.39e38, -3.4e38, 2.0**127, -(2.0**126)])])
    a = torch.cat([a, extremes, extremes.flip(0)])
    b = torch.cat([b, extremes.flip(0) * 0.75, -extremes * 1e-3])
    bits = torch.cat([bits, (torch.arange(2 * len(extremes), dtype=torch.int64) * 0x3C6EF372 % (1 << 31)).int()])
    got = update_cpu._extension.stochastic_round_sum_bf16(a, b, bits)
    want = stochastic_round_sum_bf16(a, b, bits)
    # A NaN stays a NaN (which NaN's sign and payload a NaN + NaN sum keeps is the compiler's choice of operand order).
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) >= 8
    assert torch.equal(got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))
    # The fast decision alone (the carry of the float32 sum's discarded bits plus the random bits) differs from the
    # exact one on a good share of these inputs: the test reaches the exact decision.
    fast_alone = (((a + b).view(torch.int32).to(torch.int64) & 0xFFFF) << 16) + (bits.to(torch.int64) & 0xFFFFFFFF)
    fast_up = (fast_alone >> 32) != 0
    sum_bits = (a + b).view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    exact_up = (want.view(torch.int16).to(torch.int64) & 0x7FFF) > (sum_bits >> 16)
    finite = torch.isfinite(a + b)
    assert int(((fast_up != exact_up) & finite).sum()) > 1000


def test_the_avx2_loop_where_the_cpu_also_has_avx512():
    """The AVX2 build of the loops (what CPUs without AVX-512 run), bf16 and 8-bit states, built and checked on this
    CPU in a subprocess told to dispatch as an AVX2 CPU (torch's ATEN_CPU_CAPABILITY)."""
    import os
    import subprocess
    import sys

    # A CPU that dispatches as AVX2 already ran these tests on its AVX2 loop in this session.
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"this CPU dispatches as {torch.backends.cpu.get_cpu_capability()}: the session ran its own loop")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    selection = "(loop_equals or every_carry_boundary or non_finite or cpu_loops or loops_levels) and not portable"
    int8_tests = str(Path(__file__).with_name("test_int8_states.py"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, int8_tests, "-k", selection],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-1000:]


def test_the_hash_constants_have_one_source_and_the_loop_draws_rngs_bits():
    # The C++ names the constants; ops/rng.py gives them (as defines), and nothing else does.
    from lightning_pure_bf16.ops import rng

    constants = {rng.MIX_MUL1, rng.MIX_MUL2}
    for path in update_cpu.CSRC.glob("*.[ch]*"):
        text = path.read_text().lower()
        assert not any(f"{c:#x}" in text or str(c) in text for c in constants), path.name
    assert f"-DMIX_MUL1={rng.MIX_MUL1:#x}u" in update_cpu.hash_defines()
    # The loop hashes with them: one stochastic step draws the PyTorch path's bits (which ops/rng.py computes).
    ours = _run(AdamW, (4099,), "stochastic", "cpu", steps=1)
    reference = _run(AdamW, (4099,), "stochastic", "torch", steps=1)
    assert all(torch.equal(x, y) for x, y in zip(ours, reference))
