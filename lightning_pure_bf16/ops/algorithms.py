"""The algorithms of the update family as the kernels see them: each one's step scalars and its float32 arithmetic.

An algorithm is what one element's update computes: from the widened weight ``p``, gradient ``g`` and states (none,
one or two per element), the new states and the weight's update ``delta``. Everything around it is shared and knows
no algorithm: widening and the gradient's factor, the 8-bit state codes, the weight's stochastic, Kahan or nearest
write, the states' rounded writes, the random bits. Each algorithm is written once per backend, the same float32
operations in the same order (no fused multiply-add): here for the PyTorch path (``*_torch``), in
``ops/update_triton.py`` (``_*_update``) and in ``ops/csrc/algorithms.h``.

The states of an algorithm fill slots: slot 0 is signed (a momentum: int8 codes in the 8-bit format), slot 1
non-negative (a second moment: uint8 codes). A bf16 slot 0 rounds with the low half of the ``EXP_AVG`` stream's word,
slot 1 with its high half; 8-bit slots draw from ``EXP_AVG`` and ``EXP_AVG_SQ`` (``ops.rng.Buffer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, NamedTuple

import torch

ROUNDING_CODES = {"nearest": 0, "stochastic": 1, "kahan": 2}
ROUNDING_MODES = tuple(ROUNDING_CODES)
# The kernels take this many float scalars of an algorithm (Adam's nine; the others pad with zeros), then the
# gradient's factor.
HYPER_SCALARS = 9


class Algorithm(IntEnum):
    """The kernels' compile-time choice of arithmetic."""

    ADAM = 0
    LION = 1
    SGD = 2
    DIRECTION = 3  # the write of Adafactor's and Muon's direction (see DirectionArgs)


class KernelScalars(NamedTuple):
    """Adam's float scalars, derived once in float64 (each backend then rounds them to float32, as torch does with a
    Python scalar in a float32 op). Order = the kernels' argument order."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    decay: float  # lr * weight_decay, the decoupled decay factor
    neg_step_size: float  # -lr / bias_correction1
    inv_bias_correction2_sqrt: float
    grad_scale: float  # the gradient's factor (a caller's clipping folded into the update); 1.0: no product


@dataclass(frozen=True)
class UpdateArgs:
    """Scalars of one Adam/AdamW step for one tensor (everything except the buffers)."""

    algorithm: ClassVar[Algorithm] = Algorithm.ADAM
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    step: int
    rounding: str
    keys: tuple[int, int, int]  # stream keys for param, exp_avg, exp_avg_sq (rng.Buffer order)
    # Every gradient element is multiplied by this factor in float32 before the update (a clipping factor computed
    # by the caller, folded into the update's one pass); 1.0: the gradient as it is, and no product at all.
    grad_scale: float = 1.0

    @property
    def variant(self) -> int:
        """The compile-time switch of the arithmetic: decoupled (1) or L2 (0) weight decay."""
        return int(self.decoupled)

    @property
    def bias_correction1(self) -> float:
        return 1.0 - self.beta1**self.step

    @property
    def bias_correction2_sqrt(self) -> float:
        return (1.0 - self.beta2**self.step) ** 0.5

    @property
    def scalars(self) -> KernelScalars:
        return KernelScalars(
            beta1=self.beta1,
            one_minus_beta1=1.0 - self.beta1,
            beta2=self.beta2,
            one_minus_beta2=1.0 - self.beta2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            decay=self.lr * self.weight_decay,
            neg_step_size=-(self.lr / self.bias_correction1),
            inv_bias_correction2_sqrt=1.0 / self.bias_correction2_sqrt,
            grad_scale=self.grad_scale,
        )


def adam_torch(
    p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], s: KernelScalars, variant: int
) -> torch.Tensor:
    """Adam's float32 step on the PyTorch path: ``states`` (m, v) updated in place, ``g`` used as scratch; returns
    the update of ``p``."""
    m, v = states
    if not variant and s.weight_decay != 0.0:
        g.add_(torch.mul(p, s.weight_decay))
    # Each product is rounded on its own (no fused multiply-add), in the kernels' order, so all backends land on
    # the same side of bf16 rounding ties, which moments of bf16 inputs hit often.
    v.mul_(s.beta2).add_(torch.mul(g, g).mul_(s.one_minus_beta2))
    m.mul_(s.beta1).add_(g.mul_(s.one_minus_beta1))
    # The denominator uses the fp32 moments: rounding happens only on the final writes. The square root goes
    # through float64 to be correctly rounded (torch's CPU float32 sqrt is not), as in the other backends.
    delta = v.double().sqrt_().float().mul_(s.inv_bias_correction2_sqrt).add_(s.eps)
    torch.div(m, delta, out=delta).mul_(s.neg_step_size)
    if variant and s.decay != 0.0:
        # Weight decay is part of the same fp32 update and the same rounded write: rounded on its own, a sub-ulp
        # lr*wd*p would vanish.
        delta.sub_(g.copy_(p).mul_(s.decay))
    return delta


class LionScalars(NamedTuple):
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    neg_lr: float
    decay: float  # lr * weight_decay (decoupled)
    grad_scale: float


@dataclass(frozen=True)
class LionArgs:
    """Scalars of one Lion step (Chen et al. 2023, lion-pytorch's semantics): the sign of ``beta1 * m + (1 - beta1)
    * g`` times ``-lr``, decoupled weight decay, then ``m = beta2 * m + (1 - beta2) * g``."""

    algorithm: ClassVar[Algorithm] = Algorithm.LION
    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    step: int
    rounding: str
    keys: tuple[int, int, int]
    grad_scale: float = 1.0

    @property
    def variant(self) -> int:
        """Whether the step decays the weight (1) or not (0)."""
        return int(self.weight_decay != 0.0)

    @property
    def scalars(self) -> LionScalars:
        return LionScalars(
            self.beta1,
            1.0 - self.beta1,
            self.beta2,
            1.0 - self.beta2,
            -self.lr,
            self.lr * self.weight_decay,
            self.grad_scale,
        )


def lion_torch(
    p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], s: LionScalars, variant: int
) -> torch.Tensor:
    """Lion's float32 step on the PyTorch path (see :class:`LionArgs`)."""
    (m,) = states
    c = torch.mul(m, s.beta1).add_(torch.mul(g, s.one_minus_beta1))
    m.mul_(s.beta2).add_(g.mul_(s.one_minus_beta2))
    # The sign as a select, the same in every backend (0 for 0 and NaN: torch.sign keeps a zero's sign).
    delta = torch.where(c > 0, 1.0, torch.where(c < 0, -1.0, 0.0)).mul_(s.neg_lr)
    if variant:
        delta.sub_(c.copy_(p).mul_(s.decay))
    return delta


class SGDScalars(NamedTuple):
    weight_decay: float
    keep: float  # momentum; 0 at the first step (torch starts the buffer at the gradient)
    take: float  # 1 - dampening; 1 at the first step
    momentum: float
    neg_lr: float
    grad_scale: float


@dataclass(frozen=True)
class SGDArgs:
    """Scalars of one SGD step (``torch.optim.SGD``'s semantics): L2 weight decay, momentum with dampening and
    Nesterov; no state without momentum."""

    algorithm: ClassVar[Algorithm] = Algorithm.SGD
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    step: int
    rounding: str
    keys: tuple[int, int, int]
    grad_scale: float = 1.0

    @property
    def variant(self) -> int:
        """Bit 0: the step adds ``weight_decay * p`` to the gradient; bit 1: Nesterov."""
        return int(self.weight_decay != 0.0) | int(self.nesterov) << 1

    @property
    def scalars(self) -> SGDScalars:
        first = self.step <= 1
        return SGDScalars(
            self.weight_decay,
            0.0 if first else self.momentum,
            1.0 if first else 1.0 - self.dampening,
            self.momentum,
            -self.lr,
            self.grad_scale,
        )


def sgd_torch(
    p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], s: SGDScalars, variant: int
) -> torch.Tensor:
    """SGD's float32 step on the PyTorch path (see :class:`SGDArgs`)."""
    if variant & 1:
        g.add_(torch.mul(p, s.weight_decay))
    if states:
        (buf,) = states
        buf.mul_(s.keep).add_(torch.mul(g, s.take))
        if variant & 2:
            return g.add_(torch.mul(buf, s.momentum)).mul_(s.neg_lr)
        return torch.mul(buf, s.neg_lr)
    return g.mul_(s.neg_lr)


class DirectionScalars(NamedTuple):
    neg_step_size: float
    decay: float  # lr * weight_decay (decoupled)
    grad_scale: float


@dataclass(frozen=True)
class DirectionArgs:
    """Scalars of the write of an algorithm whose direction needs the whole matrix (Adafactor's factored
    preconditioning, Muon's orthogonalization): the direction ``u`` is computed beforehand, in float32, and handed
    as the gradient; the weight moves by ``-step_size * u - lr * weight_decay * p`` in one rounded write. No state per
    element. Every backend writes a bf16 direction (Muon's); a float32 one (Adafactor's) takes the PyTorch path, the
    fused kernels reading bf16 gradients only."""

    algorithm: ClassVar[Algorithm] = Algorithm.DIRECTION
    step_size: float
    decay: float
    step: int
    rounding: str
    keys: tuple[int, int, int]
    grad_scale: float = 1.0

    @property
    def variant(self) -> int:
        """Whether the step decays the weight (1) or not (0)."""
        return int(self.decay != 0.0)

    @property
    def scalars(self) -> DirectionScalars:
        return DirectionScalars(-self.step_size, self.decay, self.grad_scale)


def direction_torch(
    p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], s: DirectionScalars, variant: int
) -> torch.Tensor:
    """The write of a precomputed direction ``g`` (see :class:`DirectionArgs`)."""
    delta = g.mul_(s.neg_step_size)
    if variant:
        delta.sub_(torch.mul(p, s.decay))
    return delta


Args = UpdateArgs | LionArgs | SGDArgs | DirectionArgs
TORCH_STEPS = {
    Algorithm.ADAM: adam_torch,
    Algorithm.LION: lion_torch,
    Algorithm.SGD: sgd_torch,
    Algorithm.DIRECTION: direction_torch,
}


def hyper_scalars(args: Args) -> tuple[float, ...]:
    """An algorithm's float scalars as the kernels take them: :data:`HYPER_SCALARS` of them (zero-padded), then the
    gradient's factor."""
    scalars = tuple(args.scalars)[:-1]
    return (*scalars, *(0.0,) * (HYPER_SCALARS - len(scalars)), args.grad_scale)


__all__ = [
    "Algorithm",
    "Args",
    "DirectionArgs",
    "DirectionScalars",
    "HYPER_SCALARS",
    "KernelScalars",
    "LionArgs",
    "LionScalars",
    "ROUNDING_CODES",
    "ROUNDING_MODES",
    "SGDArgs",
    "SGDScalars",
    "TORCH_STEPS",
    "UpdateArgs",
    "adam_torch",
    "direction_torch",
    "hyper_scalars",
    "lion_torch",
    "sgd_torch",
]
