"""Small updates add up: the mean of many sub-ulp updates of bf16 weights lands on the float64 reference, for update /
weight ratios 1e-4 ... 1e-7 and weights of magnitudes 1e-3 ... 1e2, with weight decay alone or a gradient alone,
within the rounding's own noise (tests/reference/small_updates.py states the tolerance). Round-to-nearest fails the
same check.

The fused CPU loop runs the sweep (the backends are bit-identical: tests/test_cpu_kernel.py and
tests/test_triton_kernel.py). The exact rounding probability of the primitive is pinned in tests/test_rounding.py;
benchmarks/small_updates.py runs the sweep at larger sizes and writes the figures.
"""

import pytest

from tests.reference.small_updates import drift_sweep


@pytest.mark.parametrize("mode", ["decay", "gradient"])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_small_updates_land_on_the_fp64_reference(mode, rounding):
    for ratio, magnitude, error, tolerance, _ in drift_sweep(mode, rounding):
        assert abs(error) <= tolerance, f"ratio {ratio:g}, |w| ~ {magnitude:g}: off by {error:.2%} of the drift"


@pytest.mark.parametrize("mode", ["decay", "gradient"])
def test_round_to_nearest_fails_the_same_check(mode):
    for ratio, magnitude, error, tolerance, _ in drift_sweep(mode, "nearest"):
        assert abs(error) > tolerance and error > 0.9, f"ratio {ratio:g}, |w| ~ {magnitude:g}: nearest moved"
