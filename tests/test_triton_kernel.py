"""The fused Triton kernel against the PyTorch path: on CPU through TRITON_INTERPRET=1 (set in conftest.py)."""

import os

import pytest
import torch

from lightning_pure_bf16 import Adam, AdamW

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from lightning_pure_bf16.ops.update_triton import _stochastic_round_sum_bits  # noqa: E402

SHAPES = [(6,), (42,), (123,), (431,), (1025,), (33, 129), (0,)]
CPU_INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # bf16 values of the same sign are ordered like their 16-bit patterns; distance in representable steps.
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs()


def _run_both(opt_cls, shape, rounding, device, steps=3, **kw):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    init = (torch.randn(shape, generator=g) * 0.5).to(torch.bfloat16).to(device)
    results = []
    for backend in ("torch", "triton"):
        p = init.clone().requires_grad_()
        opt = opt_cls([p], lr=1e-2, weight_decay=0.05, rounding=rounding, seed=2024, backend=backend, **kw)
        for t in range(steps):
            gt = torch.Generator().manual_seed(t)
            p.grad = torch.randn(shape, generator=gt).to(torch.bfloat16).to(device)
            opt.step()
        results.append((p.detach(), opt.state[p]))
    return results


def _assert_agree(results, rounding):
    (p_torch, s_torch), (p_triton, s_triton) = results
    pairs = [(p_torch, p_triton), (s_torch["exp_avg"], s_triton["exp_avg"])]
    pairs.append((s_torch["exp_avg_sq"], s_triton["exp_avg_sq"]))
    if rounding == "kahan":
        # The compensation holds the fp32 detail below the parameter's last bit, so an fp32 rounding difference
        # anywhere in the update shows in it; what must agree is the value it represents, parameter + compensation.
        c_torch, c_triton = s_torch["kahan_comp"], s_triton["kahan_comp"]
        assert c_torch.dtype == c_triton.dtype == torch.bfloat16
        total_torch = p_torch.double() + c_torch.double()
        total_triton = p_triton.double() + c_triton.double()
        torch.testing.assert_close(total_torch, total_triton, rtol=2**-16, atol=1e-9)
    for a, b in pairs:
        assert a.dtype == b.dtype == torch.bfloat16
        if a.numel() == 0:
            continue
        identical = (a == b).float().mean().item()
        assert identical >= 0.999, identical
        assert _ulp_distance(a.cpu(), b.cpu()).max().item() <= 1


@pytest.mark.skipif(not CPU_INTERPRETED, reason="runs the kernel through the Triton interpreter on CPU")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("opt_cls", [AdamW, Adam])
def test_interpreted_kernel_agrees_with_torch_path(opt_cls, shape, rounding):
    _assert_agree(_run_both(opt_cls, shape, rounding, "cpu"), rounding)


@pytest.mark.skipif(not CPU_INTERPRETED, reason="runs the kernel through the Triton interpreter on CPU")
def test_interpreted_kernel_draws_the_same_random_bits():
    # lr=0 with an fp32 moment that is not a bf16 value: the written moment is decided by the random bits alone.
    n = 2048
    results = []
    for backend in ("torch", "triton"):
        p = torch.zeros(n, dtype=torch.bfloat16, requires_grad=True)
        opt = AdamW([p], lr=0.0, betas=(1 / 3, 0.0), rounding="stochastic", seed=99, backend=backend)
        p.grad = torch.ones(n, dtype=torch.bfloat16)  # exp_avg = 2/3, between two bf16 values
        opt.step()
        results.append(opt.state[p]["exp_avg"])
    assert torch.equal(results[0], results[1])
    rounded_up = (results[0].double() > 2 / 3).double().mean().item()
    assert 0.1 < rounded_up < 0.9


@triton.jit
def _sum_rounding_kernel(a_ptr, b_ptr, r_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # The Triton kernel's stochastic rounding of an exact sum, applied to given random bits.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0)
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0)
    r = tl.load(r_ptr + offsets, mask=mask, other=0).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + offsets, _stochastic_round_sum_bits(a, b, r), mask=mask)


def _sum_rounding(a: torch.Tensor, b: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape, dtype=torch.bfloat16)
    _sum_rounding_kernel[(triton.cdiv(a.numel(), 1024),)](a, b, bits, out, a.numel(), BLOCK=1024)
    return out


@pytest.mark.skipif(not CPU_INTERPRETED, reason="runs the kernel through the Triton interpreter on CPU")
def test_the_kernels_exact_sum_rounding_equals_the_pytorch_paths_at_every_carry_boundary():
    # The kernel's stochastic rounding of p + delta (and of Kahan's remainder) with given random bits: the same bits as
    # the PyTorch path's on sums whose discarded bits plus random bits land within 2**17 of a carry, across and below
    # powers of two, with every TwoSum error size, and at the float32 extremes (inf, NaN, subnormals).
    from lightning_pure_bf16.ops.rounding import stochastic_round_sum_bf16
    from tests.test_cpu_kernel import _sums_near_every_carry_boundary

    a, b, bits = _sums_near_every_carry_boundary(20_003)
    extremes = torch.tensor([3.0e38, -3.0e38, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, 2.0**-126])
    a = torch.cat([a, extremes, extremes.flip(0)])
    b = torch.cat([b, extremes.flip(0) * 0.75, -extremes * 1e-3])
    bits = torch.cat([bits, (torch.arange(2 * len(extremes), dtype=torch.int64) * 0x3C6EF372 % (1 << 31)).int()])
    got, want = _sum_rounding(a, b, bits), stochastic_round_sum_bf16(a, b, bits)
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) >= 2
    assert torch.equal(got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1 << 20,), (4097, 33)])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_cuda_kernel_agrees_with_torch_path(shape, rounding):
    _assert_agree(_run_both(AdamW, shape, rounding, "cuda"), rounding)


def test_each_state_formats_launched_and_widest_builds_compile_for_hopper_without_a_gpu():
    # Triton's compile API with a CUDA target and the ptxas in the triton wheel (benchmarks/kernel_resources.py --quick
    # --corners, sm_90, in its own process: this session imports the kernel for the interpreter). Of each state format
    # the launched build and the widest (every option away from the launched one at once: the most registers); the
    # benchmark without --corners compiles every specialisation, without --quick for sm_80 too. A kernel that would not
    # compile, would spill to local memory or would fuse multiply-adds (the backends would then disagree) fails here.
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip(f"triton {triton.__version__} has no CUDA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parents[1] / "benchmarks" / "kernel_resources.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--corners", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    everything = json.loads(done.stdout.strip().splitlines()[-1])
    builds = [b for b in everything if b["algorithm"] == "adamw"]
    # bf16 states: 3 roundings; 8-bit states: 5 state formats; each launched and widest.
    assert len(builds) == 2 * (3 + 5) and {build["arch"] for build in builds} == {"sm_90"}
    assert {build["aligned"] for build in builds} == {True, False} and {build["ints"] for build in builds} == {
        "i32",
        "i64",
    }
    for build in builds:
        assert build["cubin_bytes"] > 0 and build["fma"] == 0, build
        if build["sass"] is not None:  # the wheel's cuobjdump disassembled it: instructions counted per element
            assert build["sass_per_element"] > 10, build
        if build["local_bytes"] is not None:
            # No spills; what the strategies launch keeps 6 blocks of 64 threads on an SM (16 elements in flight per
            # thread: more bytes than Hopper's memory latency needs).
            assert build["local_bytes"] == 0 and (build["registers"] <= 168 or not build["aligned"]), build
        assert (build["vector_loads"] > 0) == build["aligned"], build
    # What the strategies launch (AdamW, bf16 gradient, 32-bit sizes, aligned): at most 110 SASS instructions per
    # element with stochastic rounding and 125 with Kahan's, and the instructions a thread executes no more than an
    # H100 or an H200 issues in the time its memory moves the update's bytes (benchmarks/results/kernel_resources.md).
    launched = {
        b["rounding"]: b
        for b in builds
        if (b["weight_decay"], b["grad"], b["ints"], b["aligned"]) == ("decoupled", "bf16", "i32", True)
    }
    if launched["stochastic"]["sass"] is not None:
        assert launched["stochastic"]["sass_per_element"] <= 110 and launched["kahan"]["sass_per_element"] <= 125
        for rounding in ("nearest", "stochastic", "kahan"):
            assert set(launched[rounding]["bound"].values()) == {"memory"}, launched[rounding]
    # The other algorithms and Muon's write, as launched: no more instructions per element than AdamW's with the same
    # rounding and state format, and with bf16 states memory-bound on an H100 (on an H200, whose memory is faster,
    # Lion's, plain SGD's and Muon's write's stochastic builds move so few bytes that the issue rate bounds them).
    family = [b for b in everything if b["algorithm"] != "adamw"]
    assert {b["algorithm"] for b in family} == {"lion", "sgd_momentum", "sgd", "muon_write"}
    for build in family:
        assert build["cubin_bytes"] > 0 and build["fma"] == 0 and build["local_bytes"] in (0, None), build
        if build["sass"] is not None:
            assert build["sass_per_element"] <= launched[build["rounding"]]["sass_per_element"], build
            assert "int8" in build["rounding"] or build["bound"]["H100 SXM"] == "memory", build
