"""The quality studies' arms (benchmarks/_quality_arms.py) build the optimizers their names say: the class, the
rounding and state formats, and the model state each keeps, measured after one step. A mislabelled arm (an "8-bit
Kahan" built without its compensation, say) fails here, not in a table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _quality_arms as arms  # noqa: E402

# arm -> (optimizer class name, the attributes of this package's AdamW it must carry)
EXPECTED = {
    "fp32_masters": ("FP32MasterAdamW", {}),
    "stochastic": ("AdamW", {"rounding": "stochastic", "moments": "bf16"}),
    "kahan": ("AdamW", {"rounding": "kahan", "moments": "bf16"}),
    "int8": ("AdamW", {"rounding": "stochastic", "moments": "int8"}),
    "int8_kahan": ("AdamW", {"rounding": "kahan", "moments": "int8", "compensation": "int8"}),
    "nearest_bf16_adamw": ("AdamW", {}),
    "torchao_sr": ("_AdamW", {}),
    "anyprecision_kahan": ("AnyPrecisionAdamW", {}),
    "sr_weights_fp32_moments": ("AttributionAdamW", {}),
    "fp32_weights_sr_moments": ("AttributionAdamW", {}),
}


def test_every_arm_is_listed_with_its_label_and_bytes() -> None:
    assert set(EXPECTED) == set(arms.STUDY_ARMS) == set(arms.LABELS) == set(arms.ARM_BYTES)


@pytest.mark.parametrize("arm", arms.STUDY_ARMS)
def test_arm_builds_the_optimizer_it_names(arm: str) -> None:
    if why := arms.missing_peer(arm):
        pytest.skip(why)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256, 64).bfloat16()), torch.nn.Parameter(torch.randn(256).bfloat16())]
    opt = arms.make_optimizer(arm, [{"params": params, "weight_decay": 0.1}], 1e-3, seed=0)
    cls, options = EXPECTED[arm]
    assert type(opt).__name__ == cls
    group_options = {k: opt.param_groups[0].get(k, getattr(opt, k, None)) for k in options}
    assert group_options == options
    if arm == "nearest_bf16_adamw":
        assert type(opt).__module__.startswith("torch.optim")
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(p.dtype == torch.bfloat16 and not torch.equal(p, b) for p, b in zip(params, before))
    assert arms.state_bytes_per_param(opt, params) == pytest.approx(arms.ARM_BYTES[arm], rel=2e-3)


def test_the_attribution_arms_round_what_they_say() -> None:
    # SR weights / fp32 moments: float32 moments, no master. fp32 weights / SR moments: bf16 moments and a master.
    for arm, moment_dtype, has_master in (
        ("sr_weights_fp32_moments", torch.float32, False),
        ("fp32_weights_sr_moments", torch.bfloat16, True),
    ):
        p = torch.nn.Parameter(torch.ones(1024, dtype=torch.bfloat16))
        opt = arms.make_optimizer(arm, [{"params": [p], "weight_decay": 0.0}], 1e-4, seed=0)
        p.grad = torch.ones_like(p)
        opt.step()
        state = opt.state[p]
        assert state["exp_avg"].dtype == moment_dtype and ("master" in state) == has_master
        # An update of 1e-4 of a weight of 1.0 is far below bf16's spacing just below 1.0 (2**-8): round to nearest
        # keeps every weight at 1.0; stochastic rounding moves about 1e-4 / 2**-8 of them, to 1 - 2**-8.
        moved = (p != 1.0).float().mean().item()
        if has_master:
            assert moved == 0.0 and torch.allclose(state["master"], torch.full_like(state["master"], 1 - 1e-4))
        else:
            assert 0.0 < moved < 0.1


@pytest.mark.parametrize("arm", ["fp32_masters", "sr_weights_fp32_moments", "fp32_weights_sr_moments"])
def test_a_resumed_arm_keeps_its_float32_states_bit_for_bit(arm: str) -> None:
    # The studies resume a run from the optimizer's state_dict; torch's load casts floating-point states to the
    # parameter's dtype (bf16), which once turned the resumed attribution arm's float32 masters into bf16 weights.
    def build() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
        p = torch.nn.Parameter(torch.linspace(-1, 1, 512).bfloat16())
        return p, arms.make_optimizer(arm, [{"params": [p], "weight_decay": 0.0}], 1e-3, seed=0)

    p, opt = build()
    for _ in range(2):
        p.grad = torch.linspace(1, -1, 512).bfloat16()
        opt.step()
    q, resumed = build()
    q.data.copy_(p.data)
    resumed.load_state_dict(opt.state_dict())
    # fp32_masters keeps its masters in the param groups (the study saves them beside the state_dict).
    for a, b in zip(opt.param_groups[0]["params"], resumed.param_groups[0]["params"]):
        b.data.copy_(a.data)
    before = {k: v for k, v in opt.state[opt.param_groups[0]["params"][0]].items() if torch.is_tensor(v)}
    after = {k: v for k, v in resumed.state[resumed.param_groups[0]["params"][0]].items() if torch.is_tensor(v)}
    assert before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), name
