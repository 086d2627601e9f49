"""The optimizers of the quality studies (``convergence.py --study width`` and ``--study finetune``), one per arm.

Every arm trains the same bf16 model (``model.to(torch.bfloat16)``); the arms differ only in how the optimizer keeps
and writes the weights and the moments:

- ``fp32_masters``: DeepSpeed's bf16 mixed precision arithmetic (float32 master weights and moments, torch AdamW, the
  masters rounded to nearest into the bf16 weights): the reference, 16 B/param of model state;
- ``stochastic``, ``kahan``, ``int8``, ``int8_kahan``: this package's ``AdamW`` (8, 10, ~6 and ~7 B/param);
- ``nearest_bf16_adamw``: torch AdamW directly on the bf16 parameters (bf16 moments, every write rounded to nearest),
  the arithmetic of FSDP2 + torch AdamW and of llama-recipes' ``pure_bf16`` mode;
- ``torchao_sr``: torchao's ``_AdamW(bf16_stochastic_round=True)`` (optional: ``pip install torchao``);
- ``anyprecision_kahan``: llama-recipes' ``AnyPrecisionAdamW(use_kahan_summation=True)`` with bf16 moments and a
  bf16 compensation buffer, from the published ``llama-cookbook`` package (optional: ``pip install --no-deps
  llama-cookbook``; its module file is loaded on its own, so the package's other dependencies are not needed);
- ``sr_weights_fp32_moments`` and ``fp32_weights_sr_moments``: the attribution arms. Both run torch AdamW's
  arithmetic in float32; the first stores the weights in bf16 by stochastic rounding of the exact sum (as this package
  does) and the moments in float32, the second keeps float32 master weights and stores the moments in bf16 by
  stochastic rounding. Beside ``fp32_masters`` and ``stochastic`` they say whether the gap comes from the weights'
  rounding or the moments'.

``ARM_BYTES`` is each arm's model state in bytes per parameter (bf16 weight and gradient included);
``state_bytes_per_param`` measures it on a built optimizer, so a mislabelled arm shows.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from lightning_pure_bf16 import AdamW
from lightning_pure_bf16.ops.rounding import stochastic_round_bf16, stochastic_round_sum_bf16

BETAS = (0.9, 0.95)
STUDY_ARMS = (
    "fp32_masters",
    "stochastic",
    "kahan",
    "int8",
    "int8_kahan",
    "nearest_bf16_adamw",
    "torchao_sr",
    "anyprecision_kahan",
    "sr_weights_fp32_moments",
    "fp32_weights_sr_moments",
)
LABELS = {
    "fp32_masters": "fp32 masters and moments (DeepSpeed bf16 mixed arithmetic, reference)",
    "stochastic": "this package, rounding='stochastic'",
    "kahan": "this package, rounding='kahan'",
    "int8": "this package, moments='int8'",
    "int8_kahan": "this package, moments='int8', 8-bit Kahan",
    "nearest_bf16_adamw": "torch AdamW on bf16 weights (round to nearest; FSDP2, llama-recipes pure_bf16)",
    "torchao_sr": "torchao _AdamW(bf16_stochastic_round=True)",
    "anyprecision_kahan": "llama-recipes AnyPrecisionAdamW, Kahan, bf16 moments",
    "sr_weights_fp32_moments": "attribution: SR bf16 weights, fp32 moments",
    "fp32_weights_sr_moments": "attribution: fp32 master weights, SR bf16 moments",
}
# Model state in bytes per parameter: bf16 weight (2) and gradient (2) plus what the optimizer keeps. The 8-bit
# formats keep one bf16 scale per 128 elements per 8-bit state (2/128 B each).
ARM_BYTES = {
    "fp32_masters": 16.0,
    "stochastic": 8.0,
    "kahan": 10.0,
    "int8": 6.0 + 2 * 2 / 128,
    "int8_kahan": 7.0 + 2 * 2 / 128,  # the 8-bit Kahan remainder keeps no block scale of its own
    "nearest_bf16_adamw": 8.0,
    "torchao_sr": 8.0,
    "anyprecision_kahan": 10.0,
    "sr_weights_fp32_moments": 12.0,
    "fp32_weights_sr_moments": 12.0,
}
# Optional peers: the package to find and the line that installs it.
PEERS = {
    "torchao_sr": ("torchao", "pip install torchao"),
    "anyprecision_kahan": ("llama_cookbook", "pip install --no-deps llama-cookbook"),
}


def missing_peer(arm: str) -> str | None:
    """Why ``arm`` cannot run here (its optional peer is not installed), or ``None``."""
    if arm not in PEERS:
        return None
    package, install = PEERS[arm]
    return None if importlib.util.find_spec(package) else f"skipped: needs {package} (`{install}`)"


class FP32Masters:
    """The arithmetic of DeepSpeed's bf16 mixed precision on one process, for any torch optimizer it is mixed into
    (``class FP32MasterAdamW(FP32Masters, torch.optim.AdamW)``): the model's weights and gradients are bf16; each step
    casts the gradients to float32, updates float32 master weights and states with the optimizer's own step, and
    rounds the masters to nearest into the bf16 weights. (Its param groups are the masters', for the scheduler.)"""

    def __init__(self, groups: list[dict], **hyperparameters: object) -> None:
        self.bf16_groups = [list(g["params"]) for g in groups]
        masters = [{**g, "params": [p.detach().float() for p in g["params"]]} for g in groups]
        super().__init__(masters, **hyperparameters)  # type: ignore[call-arg]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        pairs = [(m, p) for g, ps in zip(self.param_groups, self.bf16_groups) for m, p in zip(g["params"], ps)]
        for master, p in pairs:
            master.grad = None if p.grad is None else p.grad.float()
        super().step()
        for master, p in pairs:
            p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for ps in self.bf16_groups:
            for p in ps:
                p.grad = None
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]


class FP32MasterAdamW(FP32Masters, torch.optim.AdamW):
    """:class:`FP32Masters` over torch AdamW: the ``fp32_masters`` arm."""


class AttributionAdamW(torch.optim.Optimizer):
    """torch AdamW's arithmetic in float32 over bf16 parameters, with one of the two stores rounded stochastically.

    ``sr_weights=True``: float32 moments; the weight is written as the stochastic rounding of the exact sum of the
    bf16 weight and the float32 update (``stochastic_round_sum_bf16``, as this package writes it).
    ``sr_weights=False``: float32 master weights, rounded to nearest into the bf16 parameter; the moments are stored
    in bf16 by stochastic rounding (``stochastic_round_bf16``, as this package writes them).
    """

    def __init__(
        self, groups: list[dict], lr: float, betas: tuple[float, float], *, sr_weights: bool, seed: int
    ) -> None:
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": 1e-8, "weight_decay": 0.0})
        self.sr_weights = sr_weights
        self.generator = torch.Generator().manual_seed(seed)

    def _bits(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, like.shape, dtype=torch.int32, generator=self.generator)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the float32 states (the master weights, or the moments) come back in float32: torch casts
        every floating-point state to its parameter's dtype, here bf16, which turned a resumed run's float32 masters
        into bf16 weights rounded to nearest."""
        saved = {
            index: {name: value.clone() for name, value in state.items() if torch.is_tensor(value)}
            for index, state in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in saved.items():
            for name, value in values.items():
                self.state[params[index]][name] = value.to(self.state[params[index]][name].device)

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    moments = torch.float32 if self.sr_weights else torch.bfloat16
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros(p.shape, dtype=moments)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=moments)
                    if not self.sr_weights:
                        state["master"] = p.detach().float().clone()
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                m = state["exp_avg"].float().mul_(beta1).add_(g, alpha=1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                weight = p.float() if self.sr_weights else state["master"]
                denom = v.sqrt().div_(math.sqrt(1 - beta2**t)).add_(eps)
                delta = m.div(denom).mul_(-lr / (1 - beta1**t)).sub_(weight, alpha=lr * wd)
                if self.sr_weights:
                    state["exp_avg"], state["exp_avg_sq"] = m, v
                    p.copy_(stochastic_round_sum_bf16(weight.contiguous(), delta, self._bits(p)).view(p.shape))
                else:
                    state["exp_avg"].copy_(stochastic_round_bf16(m.contiguous(), self._bits(m)).view(m.shape))
                    state["exp_avg_sq"].copy_(stochastic_round_bf16(v.contiguous(), self._bits(v)).view(v.shape))
                    weight.add_(delta)
                    p.copy_(weight)


def _anyprecision_class() -> type:
    """llama-recipes' ``AnyPrecisionAdamW``, loaded from the installed ``llama-cookbook`` package's module file alone
    (``llama_cookbook.policies`` imports transformers' Llama classes on the way)."""
    spec = importlib.util.find_spec("llama_cookbook")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llama-cookbook is not installed (`pip install --no-deps llama-cookbook`)")
    path = Path(next(iter(spec.submodule_search_locations))) / "policies" / "anyprecision_optimizer.py"
    module_spec = importlib.util.spec_from_file_location("_anyprecision_optimizer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.AnyPrecisionAdamW


def make_optimizer(arm: str, groups: list[dict], lr: float, seed: int) -> torch.optim.Optimizer:
    """The optimizer of one study arm over bf16 parameter groups."""
    if arm == "fp32_masters":
        return FP32MasterAdamW(groups, lr=lr, betas=BETAS)
    if arm in ("stochastic", "kahan"):
        return AdamW(groups, lr=lr, betas=BETAS, rounding=arm, seed=seed)
    if arm == "int8":
        return AdamW(groups, lr=lr, betas=BETAS, moments="int8", seed=seed)
    if arm == "int8_kahan":
        return AdamW(groups, lr=lr, betas=BETAS, rounding="kahan", moments="int8", compensation="int8", seed=seed)
    if arm == "nearest_bf16_adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=BETAS)
    if arm == "torchao_sr":
        from torchao.optim import _AdamW

        return _AdamW(groups, lr=lr, betas=BETAS, bf16_stochastic_round=True)
    if arm == "anyprecision_kahan":
        return _anyprecision_class()(
            groups,
            lr=lr,
            betas=BETAS,
            use_kahan_summation=True,
            momentum_dtype=torch.bfloat16,
            variance_dtype=torch.bfloat16,
            compensation_buffer_dtype=torch.bfloat16,
        )
    if arm in ("sr_weights_fp32_moments", "fp32_weights_sr_moments"):
        return AttributionAdamW(groups, lr=lr, betas=BETAS, sr_weights=arm.startswith("sr_weights"), seed=seed)
    raise ValueError(f"unknown arm {arm!r}; the arms are {', '.join(STUDY_ARMS)}")


def optimizer_tensors(opt: torch.optim.Optimizer, model_params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor the optimizer holds beyond the model's own parameters: its state and any master copies that
    stand in its param groups."""
    seen = {id(p) for p in model_params}
    out = [p for g in opt.param_groups for p in g["params"] if id(p) not in seen]
    for state in opt.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return out


def state_bytes_per_param(opt: torch.optim.Optimizer, model_params: list[torch.Tensor]) -> float:
    """Model state in bytes per parameter after at least one step: the bf16 weights and gradients plus every tensor
    the optimizer holds (one-element step counters left out)."""
    n = sum(p.numel() for p in model_params)
    weights_and_grads = sum(p.numel() * p.element_size() * 2 for p in model_params)
    return (weights_and_grads + sum(t.numel() * t.element_size() for t in optimizer_tensors(opt, model_params))) / n


# The family study (``convergence.py --study family``): per algorithm other than AdamW, its reference optimizer
# (torch's, or the tests' reference Lion with lion-pytorch's semantics), this package's class, the hyperparameters of
# every arm, and the weight decay on matrices (Lion's 3x AdamW's, as its authors advise; SGD's L2 penalty; Muon's on
# the AdamW scale with `match_rms_adamw`, its hidden matrices in Muon and the rest in AdamW, as nanochat trains).
FAMILY_ARMS = ("fp32_masters", "stochastic", "kahan", "nearest_bf16")
FAMILY = {
    "lion": {"hyperparameters": {"betas": (0.9, 0.99)}, "weight_decay": 0.3},
    "sgd": {"hyperparameters": {"momentum": 0.9, "nesterov": True}, "weight_decay": 1e-4},
    "adafactor": {"hyperparameters": {}, "weight_decay": 0.0},
    "muon": {"hyperparameters": {"adjust_lr_fn": "match_rms_adamw"}, "weight_decay": 0.1},
}
FAMILY_LABELS = {
    "fp32_masters": "fp32 masters and states (the reference optimizer, DeepSpeed bf16 mixed arithmetic)",
    "stochastic": "this package, rounding='stochastic'",
    "kahan": "this package, rounding='kahan'",
    "nearest_bf16": "the reference optimizer on bf16 weights (round to nearest)",
}
# Model state per parameter of each arm (the bf16 weight and gradient, then what the optimizer keeps), per
# algorithm's number of states per element: Lion, SGD and Muon one, Adafactor none (its factored statistics and
# Muon's AdamW-stepped embeddings left out).
FAMILY_BYTES = {"fp32_masters": 12.0, "stochastic": 6.0, "kahan": 8.0, "nearest_bf16": 6.0}
FAMILY_BYTES_NO_STATE = {"fp32_masters": 8.0, "stochastic": 4.0, "kahan": 6.0, "nearest_bf16": 4.0}


def _family_classes(algorithm: str) -> tuple[type, type]:
    """The reference optimizer and this package's, for ``algorithm``."""
    if algorithm == "lion":
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from lightning_pure_bf16 import Lion
        from tests.reference.lion import ReferenceLion

        return ReferenceLion, Lion
    if algorithm == "muon":
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from lightning_pure_bf16 import Muon
        from tests.reference.muon import ReferenceMuonAdamW

        return ReferenceMuonAdamW, Muon
    if algorithm == "adafactor":
        from lightning_pure_bf16 import Adafactor

        return torch.optim.Adafactor, Adafactor
    from lightning_pure_bf16 import SGD

    return torch.optim.SGD, SGD


def make_family_optimizer(algorithm: str, arm: str, groups: list[dict], lr: float, seed: int) -> torch.optim.Optimizer:
    """The optimizer of one arm of the family study over bf16 parameter groups."""
    reference, ours = _family_classes(algorithm)
    hyperparameters = FAMILY[algorithm]["hyperparameters"]
    if arm == "fp32_masters":
        return type(f"FP32Master{reference.__name__}", (FP32Masters, reference), {})(groups, lr=lr, **hyperparameters)
    if arm == "nearest_bf16":
        return reference(groups, lr=lr, **hyperparameters)
    if arm in ("stochastic", "kahan"):
        return ours(groups, lr=lr, rounding=arm, seed=seed, **hyperparameters)
    raise ValueError(f"unknown arm {arm!r}; the arms are {', '.join(FAMILY_ARMS)}")
