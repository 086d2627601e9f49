"""What ZeRO-3 keeps gathered, beyond its own settings: the next module gathered while one computes
(``gather_cache="next"``, the pattern of FSDP2's prefetch) and ``gather_cache="auto"``, which turns that on after the
first step where every rank has room for it. The coordinator's internals are read through
:class:`lightning_pure_bf16._internals.Zero3Coordinator`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_pure_bf16 import _internals
from lightning_pure_bf16._log import rank_zero_info
from lightning_pure_bf16.memory import PeakMeter


def prefetch_next_module(zero_optimizer: Any, active: Callable[[], bool] = lambda: True) -> None:
    """Gather the next module of the step ahead of its use, one module at a time (``gather_cache="next"``).

    With ``gather_cache="layer"`` every module's all-gather starts when its forward or backward needs it and nothing
    overlaps it. ZeRO-3's own prefetcher cannot be used with a release after each use: it does not release a
    parameter it scanned past while that parameter was gathered, and with any prefetch bucket a step held every layer
    again. Here, once ZeRO-3 has gathered the module it is about to run, the next module of the recorded order (the
    same order ZeRO-3 checks each step against) that has partitioned parameters starts its all-gather, registered as
    in flight, so that ZeRO-3's own fetch of it waits on that gather instead of starting one. At most the module in use
    and the next one are gathered; each is still released after its use. Before the order is recorded (ZeRO-3's first
    two steps), after the last module and while ``active()`` is false nothing is prefetched. Wrapped on this engine's
    coordinator only.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    coordinator = _internals.Zero3Coordinator(zero_optimizer)
    fetch = coordinator.fetch

    def fetch_then_prefetch(current_submodule: Any, forward: bool) -> None:
        fetch(current_submodule, forward)
        if not (coordinator.is_complete_trace() and active()):
            return
        # The next module of the order that has partitioned parameters (containers and activations have none).
        for following in coordinator.modules_ahead():
            if params := partitioned_params(following):
                missing = {p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE}
                if missing:
                    coordinator.all_gather(missing, forward)
                return

    coordinator.wrap_fetch(fetch_then_prefetch)


def partitioned_params(module: torch.nn.Module) -> list[Any]:
    """The parameters ZeRO-3 gathers when it fetches ``module`` (its own, or all of a ZeRO-3 leaf module's), less the
    persistent ones it never partitions."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    return [p for p in iter_params(module, recurse=z3_leaf_module(module)) if not p.ds_persist]


def largest_gathered_module_bytes(module: torch.nn.Module) -> int:
    """The bytes of the largest set of parameters ZeRO-3 gathers at once for one module of ``module``: what
    :func:`prefetch_next_module` adds at most."""
    return max((sum(p.ds_numel * p.element_size() for p in partitioned_params(m)) for m in module.modules()), default=0)


class NextLayerIfItFits:
    """``gather_cache="auto"``: the first optimizer step runs as ``"layer"`` (one layer gathered at a time); right
    after it, every rank measures the memory it could still take at that step's peak, and if every rank has room for
    twice what gathering the next layer ahead adds, the following steps run as ``"next"``.

    The decision needs the step's activations, which are unknown at setup. What gathering ahead adds is the largest
    module's gathered parameters (twice that on the CPU, where gloo stages the all-gather in a copy of its own); the
    factor of two leaves room for fragmentation and for batches larger than the first. On the CPU the ranks of a
    machine share its memory, so their peaks and the layers they would add are summed against it. Every rank takes the
    same decision (ZeRO-3's all-gathers must be issued in the same order everywhere), and it is logged once.
    """

    MARGIN = 2

    def __init__(self, engine: Any, meter: PeakMeter, strategy_name: str) -> None:
        self.engine, self.meter, self.strategy_name = engine, meter, strategy_name
        self.on = False
        self.decided = False

    def install(self) -> None:
        """Gather ahead on this engine while :attr:`on` (decided by :meth:`after_step`)."""
        prefetch_next_module(self.engine.optimizer, active=lambda: self.on)

    def after_step(self) -> None:
        """After each optimizer step: the first one decides."""
        if not self.decided:
            self.decided = True
            self.on = self.decide()

    def decide(self) -> bool:
        device = self.meter.device
        need = self.MARGIN * largest_gathered_module_bytes(self.engine.module)
        if device.type == "cpu":
            need *= 2
        measured = self.meter.headroom()
        if _reduce(0.0 if measured is None else 1.0, "min", device) == 0.0:
            rank_zero_info(
                f"{self.strategy_name}: gather_cache='auto': no peak memory can be measured here, so the layers stay"
                " gathered one at a time (as gather_cache='layer'); gather_cache='next' gathers the next one ahead."
            )
            return False
        available, above = measured
        if device.type == "cpu":  # one machine's memory for all its ranks
            demand = _reduce(above + need, "sum", device)
            room = _reduce(available, "min", device) - demand
        else:
            room = _reduce(available - above - need, "min", device)
        fits = room >= 0
        gib = 1024**3
        where = "of the memory this machine's ranks share" if device.type == "cpu" else "on the tightest rank"
        rank_zero_info(
            f"{self.strategy_name}: gather_cache='auto': gathering the next layer ahead needs {need / gib:.2f} GiB per"
            " rank (twice its gathered parameters"
            + (", and gloo's copy of them" if device.type == "cpu" else "")
            + "); at the peak of the first step that "
            + (f"leaves {room / gib:.2f} GiB {where}" if fits else f"is {-room / gib:.2f} GiB short {where}")
            + ": "
            + (
                "the next layer is gathered ahead from now on (as gather_cache='next')."
                if fits
                else "the layers stay gathered one at a time (as gather_cache='layer')."
            )
        )
        return fits


def _reduce(value: float, op: str, device: torch.device) -> float:
    """``value`` reduced over every rank (``"min"`` or ``"sum"``); itself without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM)
    return tensor.item()


__all__ = ["NextLayerIfItFits", "largest_gathered_module_bytes", "partitioned_params", "prefetch_next_module"]
