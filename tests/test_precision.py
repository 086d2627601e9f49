"""PureBF16Precision: matrix products in float32 from bf16 values on CPUs without native bf16 (bf16 storage kept)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lightning_pure_bf16.precision as precision_module
from lightning_pure_bf16 import PureBF16Precision
from tests.strategy_runs import fit_runs, load_ranks, output


def _plugin(cpu_matmul: str, device_type: str = "cpu") -> PureBF16Precision:
    plugin = PureBF16Precision(cpu_matmul=cpu_matmul)
    plugin.use_float32_matmul(device_type)
    return plugin


def test_float32_products_equal_float32_arithmetic_rounded_to_bf16_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g).bfloat16().requires_grad_()
    w = torch.randn(48, 96, generator=g).bfloat16().requires_grad_()
    with _plugin("float32").forward_context():
        y = F.linear(x, w)
        attn = F.scaled_dot_product_attention(y[None, None], y[None, None], y[None, None])
    assert y.dtype == attn.dtype == torch.bfloat16
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y32 = F.linear(x32, w32)
    assert torch.equal(y, y32.bfloat16())
    y.float().square().sum().backward()
    y32.bfloat16().float().square().sum().backward()
    # The backward products ran in float32 too: the gradients are float32 ones rounded once, to bf16.
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, x32.grad.bfloat16())
    assert torch.equal(w.grad, w32.grad.bfloat16())


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident memory from /proc")
def test_float32_products_hold_no_float32_copy_from_the_forward_to_the_backward():
    # A product saves the bf16 tensors it widened, widened again in the backward: a float32 copy of the weight kept
    # for the backward would hold twice the weight's bytes (in a fit, of every weight of the model). 128 MiB copies:
    # allocations this large are mapped and unmapped on their own, so the resident memory shows them.
    w = torch.randn(8192, 4096, dtype=torch.bfloat16).requires_grad_()
    x = torch.randn(4, 4096, dtype=torch.bfloat16).requires_grad_()
    before = _resident_bytes()
    with _plugin("float32").forward_context():
        y = F.linear(x, w)
    held = _resident_bytes() - before
    assert held < 32 * 2**20, f"{held / 2**20:.0f} MiB held for the backward"
    y.float().sum().backward()
    # The backward widened the weight again (the equality of its gradients with float32 ones: the test above).
    assert w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad[0].float(), x.detach().float().sum(0), rtol=2**-7, atol=0.0)


def test_other_functions_and_float32_tensors_pass_through():
    a = torch.randn(8, 8)
    b = a.bfloat16()
    outside = (F.gelu(b), torch.softmax(b, dim=-1), a @ a)
    with _plugin("float32").forward_context():
        inside = (F.gelu(b), torch.softmax(b, dim=-1), a @ a)
    # Only bf16 matrix products change: other functions keep their dtype and bits, float32 products stay float32.
    assert [t.dtype for t in inside] == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert all(torch.equal(x, y) for x, y in zip(inside, outside))


@pytest.mark.parametrize(
    ("cpu_matmul", "device_type", "native", "expected"),
    [
        ("auto", "cpu", False, True),
        ("auto", "cpu", True, False),
        ("float32", "cpu", True, True),
        ("bf16", "cpu", False, False),
        ("float32", "cuda", False, False),
        ("auto", "cuda", False, False),
    ],
)
def test_when_products_run_in_float32(monkeypatch, cpu_matmul, device_type, native, expected):
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: native)
    plugin = PureBF16Precision(cpu_matmul=cpu_matmul)
    reason = plugin.use_float32_matmul(device_type)
    assert plugin.float32_matmul is expected and (reason is not None) is expected


def test_native_bf16_follows_torchs_cpu_capabilities(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_f": True})
    assert not precision_module.cpu_has_native_bf16()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": True})
    assert precision_module.cpu_has_native_bf16()


@pytest.mark.parametrize("plugin", [PureBF16Precision, precision_module.PureBF16FabricPrecision])
def test_the_module_is_bf16_but_its_metrics_keep_their_dtype(plugin):
    from torchmetrics import MeanMetric

    module = torch.nn.Module()
    module.linear, module.val_loss = torch.nn.Linear(4, 4), MeanMetric()
    module = plugin().convert_module(module)
    assert module.linear.weight.dtype == torch.bfloat16
    module.val_loss.update(torch.tensor(5.6))
    assert module.val_loss.compute().dtype == torch.float32 and module.val_loss.compute().item() == pytest.approx(5.6)


def test_bad_option_is_refused():
    with pytest.raises(ValueError, match="cpu_matmul='fp16'"):
        PureBF16Precision(cpu_matmul="fp16")


def test_a_fit_with_float32_products_trains_like_bf16_ones(tmp_path):
    # Both fits in one launch (the precision plugin decides per fit, nothing process-wide).
    runs = [{"name": "f32", "cpu_matmul": "float32"}, {"name": "bf16", "cpu_matmul": "bf16"}]
    fit_runs(tmp_path, runs, devices=2, steps=4)
    assert "matrix products are computed in float32" in output(tmp_path / "f32")
    assert "matrix products are computed in float32" not in output(tmp_path / "bf16")
    f32, bf16 = load_ranks(tmp_path / "f32"), load_ranks(tmp_path / "bf16")
    assert f32[0]["memory_report"] == bf16[0]["memory_report"]  # the same bf16 storage
    assert f32[0]["losses"][-1] < f32[0]["losses"][0]
    assert f32[0]["losses"] == pytest.approx(bf16[0]["losses"], rel=2e-2)
