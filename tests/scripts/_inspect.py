"""What a ZeRO optimizer holds, counted independently of the package's own memory report (for the test scripts and
``benchmarks/memory.py``)."""

from __future__ import annotations

from typing import Any

import torch


def reachable_tensors(obj: Any, prefix: str = "", *, max_depth: int = 6) -> list[tuple[str, torch.Tensor]]:
    """Every distinct tensor storage reachable through the attributes, dicts and lists of ``obj``.

    Follows objects from DeepSpeed, torch.optim and lightning_pure_bf16 only.
    """
    seen: set[int] = set()
    found: list[tuple[str, torch.Tensor]] = []

    def walk(o: Any, path: str, depth: int) -> None:
        if depth > max_depth:
            return
        if isinstance(o, torch.Tensor):
            storage = o.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                found.append((path, o))
            return
        if isinstance(o, dict):
            items = [(k if isinstance(k, (str, int)) else type(k).__name__, v) for k, v in o.items()]
        elif isinstance(o, (list, tuple)):
            items = list(enumerate(o))
        elif hasattr(o, "__dict__") and type(o).__module__.startswith(
            ("deepspeed", "lightning_pure_bf16", "torch.optim")
        ):
            items = list(vars(o).items())
        else:
            return
        for k, v in items:
            walk(v, f"{path}.{k}" if path else str(k), depth + 1)

    walk(obj, prefix, 0)
    return found


def record_sub_group_steps(record: Any) -> None:
    """From the next engine set up in this process on: at each ZeRO-3 sub-group's update, ``record(zero_optimizer,
    master, kwargs)`` with the master partition the pure-bf16 optimizer steps and the arguments of its step (the
    clip factor). Hooks where the package hands the factor to the step (``_internals.fold_gradient_scale``)."""
    import lightning_pure_bf16

    fold = lightning_pure_bf16._internals.fold_gradient_scale

    def fold_and_record(zero_optimizer: Any) -> None:
        fold(zero_optimizer)
        optimizer = zero_optimizer.optimizer
        step = optimizer.step

        def recorded(closure: Any = None, **kwargs: Any) -> Any:
            (master,) = [p for group in optimizer.param_groups for p in group["params"]]
            record(zero_optimizer, master, kwargs)
            return step(closure, **kwargs)

        optimizer.step = recorded

    lightning_pure_bf16._internals.fold_gradient_scale = fold_and_record
