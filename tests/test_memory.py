"""The peak meter behind the end-of-fit memory line: it measures from its reset, not from the start of the process."""

import sys

import pytest
import torch

from lightning_pure_bf16.memory import PeakMeter, format_peak, peak_report

MIB = 1024**2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident high-water mark is reset through /proc")
def test_the_cpu_peak_counts_from_the_reset_and_sees_a_buffer_freed_since():
    before = torch.ones(96 * MIB, dtype=torch.uint8)  # a peak before the reset, which must not count
    del before
    meter = PeakMeter(torch.device("cpu"))
    meter.reset()
    during = torch.ones(48 * MIB, dtype=torch.uint8)  # resident (written), then freed before the read
    del during
    peak, at_reset = meter.read()
    assert 40 * MIB < peak - at_reset < 90 * MIB
    # What gather_cache="auto" decides by: the machine's free memory, and how far the peak rose above what is held now.
    available, above = meter.headroom()
    assert 40 * MIB < above < 90 * MIB and available > 0
    report = peak_report(meter, {"params_on_rank": float(MIB), "total": 8.0})
    assert report["above_setup_per_param"] == pytest.approx((peak - at_reset) / MIB, rel=0.05)
    # 8 MiB of model state: fixed costs dominate what the steps add, no figure per parameter.
    assert "GiB at the peak" in format_peak(report) and "no figure per parameter" in format_peak(report)
    assert "B per parameter" not in format_peak(report)
    large = {**report, "params_on_rank": 256.0 * MIB}  # 2 GiB of model state: the figure means something
    assert "B per parameter of this rank's partition on top of 8.00 B/param" in format_peak(large)


def test_without_a_resettable_peak_nothing_is_claimed(monkeypatch):
    import builtins

    real_open = builtins.open

    def no_clear_refs(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_clear_refs)
    meter = PeakMeter(torch.device("cpu"))
    meter.reset()
    assert meter.read() is None and meter.headroom() is None
    assert peak_report(meter, {"params_on_rank": 1.0, "total": 8.0}) is None
    assert "no peak measured" in format_peak(None)


@pytest.mark.gpu
def test_the_cuda_headroom_counts_what_the_allocator_keeps_reserved_as_free():
    device = torch.device("cuda", torch.cuda.current_device())
    meter = PeakMeter(device)
    meter.reset()
    during = torch.ones(256 * MIB, dtype=torch.uint8, device=device)
    del during  # back to the caching allocator: reserved, not in use
    available, above = meter.headroom()
    free, _ = torch.cuda.mem_get_info(device)
    assert 256 * MIB <= above < 300 * MIB
    assert available >= free + 256 * MIB
