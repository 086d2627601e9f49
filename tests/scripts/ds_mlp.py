"""Plain DeepSpeed through ``lightning_pure_bf16.deepspeed.initialize`` on 2 CPU processes (spawned here, or each
started by torchrun): the user's
own loop (``engine.backward``, ``engine.step``), a checkpoint mid-way and a resume; each rank writes what it saw.

    python ds_mlp.py OUT '{"steps": 6, "save_at": 3, ...}'
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from _models import MLP, data, param_groups


def worker(rank: int, out: Path, opts: dict) -> None:
    if not opts.get("launched"):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(opts.get("world", 2)))
    # Several runs one after the other in the same processes (each in its own folder), to share the start-up.
    for run in opts.get("runs", [{}]):
        if "name" in run:
            (out / run["name"]).mkdir(parents=True, exist_ok=True)
        one_run(rank, out / run.get("name", ""), {**opts, **run})


def one_run(rank: int, out: Path, opts: dict) -> None:
    # The package in the ranks only: the launching process stays light.
    from _inspect import reachable_tensors

    import lightning_pure_bf16.deepspeed as pure_bf16
    from lightning_pure_bf16.memory import is_file_backed

    torch.manual_seed(0)
    model = MLP(opts.get("hidden", 64))
    config = {"train_micro_batch_size_per_gpu": 8, **opts.get("config", {})}
    kind = opts.get("optimizer", "torch_adamw")
    if opts.get("plain_deepspeed"):  # DeepSpeed's own initialize with bf16 mixed precision and this package's AdamW
        import deepspeed

        from lightning_pure_bf16 import AdamW

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=AdamW(param_groups(model), lr=1e-2),
            config={
                **config,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": opts["stage"]},
                "zero_allow_untested_optimizer": True,
            },
        )
        x, y = data(16).tensors
        loss = (engine(x[rank * 8 : rank * 8 + 8].to(torch.bfloat16)).float() - y[rank * 8 : rank * 8 + 8]).pow(2)
        engine.backward(loss.mean())
        try:
            engine.step()
            error = None
        except RuntimeError as err:
            error = str(err)
        torch.save({"error": error}, out / f"rank{rank}.pt")
        return
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2) if kind == "torch_adamw" else None
    engine, opt, _, _ = pure_bf16.initialize(
        model=model, optimizer=optimizer, config=config, seed=7, **opts.get("options", {})
    )
    x, y = data(64).tensors
    state = {"step": 0}
    if opts.get("resume"):
        try:
            state.update(pure_bf16.load_checkpoint(engine, opts["resume"], trust_checkpoint=opts.get("trust", False)))
        except RuntimeError as err:
            if not opts.get("record_load_error"):
                raise
            torch.save({"load_error": f"{type(err).__name__}: {err}"}, out / f"rank{rank}.pt")
            return
    losses, overflows, snapshots = [], [], []
    if opts.get("nan_element") is not None and rank == 0:
        # One element of one parameter's local gradient is NaN on rank 0 at that step: after the reduce-scatter only
        # the partition holding element 0 (rank 0's) is NaN.
        def poison(g: torch.Tensor) -> torch.Tensor:
            if state["step"] != opts["nan_element"]:
                return g
            g = g.clone()
            g.view(-1)[0] = float("nan")
            return g

        engine.module.net[2].weight.register_hook(poison)
    while state["step"] < opts["steps"]:
        i = state["step"] % 4
        xb = x[i * 16 + rank * 8 : i * 16 + rank * 8 + 8].to(engine.device, torch.bfloat16)
        yb = y[i * 16 + rank * 8 : i * 16 + rank * 8 + 8].to(engine.device)
        if opts.get("nan_step") == state["step"] and rank == 0:
            xb = xb * float("nan")
        loss = (engine(xb).float() - yb).pow(2).mean()
        engine.backward(loss)
        if opts.get("double_backward"):
            try:
                engine.backward((engine(xb).float() - yb).pow(2).mean())
            except RuntimeError as err:
                torch.save({"error": str(err)}, out / f"rank{rank}.pt")
                return
        engine.step()
        overflows.append(opt.overflow)
        if opts.get("snapshots"):
            snapshots.append([t.detach().clone() for t in engine.optimizer.fp16_partitioned_groups_flat])
        losses.append(float(loss))
        state["step"] += 1
        if opts.get("save_at") == state["step"]:
            pure_bf16.save_checkpoint(engine, opts["save_path"], client_state={"step": state["step"]})
    inner = engine.optimizer.optimizer
    torch.save(
        {
            "losses": losses,
            "save_path": opts.get("save_path"),
            "overflows": overflows,
            "snapshots": snapshots,
            "grad_norm": engine.get_global_grad_norm(),
            "released_skipped": getattr(_release(engine), "skipped_elements", None),
            "gradient_partition_freed": getattr(_release(engine), "gradient_partition_freed", None),
            "positions": _positions(engine),
            "real": _real_elements(engine, rank),
            "flat_params": [t.detach().clone() for t in engine.optimizer.fp16_partitioned_groups_flat],
            "state": {
                i: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
                for i, st in enumerate(inner.state.values())
            },
            "optimizer_class": type(inner).__name__,
            "returned_is_inner": opt is inner,
            "lr": [g["lr"] for g in inner.param_groups],
            "weight_decay": [g["weight_decay"] for g in inner.param_groups],
            "rounding": [g["rounding"] for g in inner.param_groups],
            "memory_report": engine.pure_bf16.memory_report(),
            "zero_buffers": [
                (name, t.dtype, t.untyped_storage().nbytes(), is_file_backed(t))
                for name, t in reachable_tensors(engine.optimizer, "zero")
            ],
            "peak_memory": engine.pure_bf16.peak_memory(),
            "skipped_steps": inner.skipped_steps,
            "engine_skipped_steps": engine.skipped_steps,
        },
        out / f"rank{rank}.pt",
    )


def _release(engine):  # noqa: ANN001, ANN202
    from lightning_pure_bf16 import zero3_engine

    return zero3_engine.gradient_release(engine)


def _positions(engine):  # noqa: ANN001, ANN202
    from lightning_pure_bf16 import _internals

    names = {p.ds_id: n for n, p in engine.module.named_parameters()}
    return {names[k]: v for k, v in _internals.zero3_param_positions(engine.optimizer).items()}


def _real_elements(engine, rank):  # noqa: ANN001, ANN202
    """Per flat partition, a mask of the elements that hold a parameter's values (not ZeRO-3's padding, which it
    leaves uninitialized)."""
    from lightning_pure_bf16 import _internals

    flats = engine.optimizer.fp16_partitioned_groups_flat
    masks = [torch.zeros(f.numel(), dtype=torch.bool) for f in flats]
    positions = _internals.zero3_param_positions(engine.optimizer)
    for p in engine.module.parameters():
        sub_group, offset, numel = positions[p.ds_id]
        real = max(0, min(numel, p.ds_numel - rank * numel))
        masks[sub_group][offset : offset + real] = True
    return masks


if __name__ == "__main__":
    from _runs import start_ranks

    out, opts = Path(sys.argv[1]), json.loads(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: this process is one rank of its node
        worker(int(os.environ["RANK"]), out, {**opts, "world": int(os.environ["WORLD_SIZE"]), "launched": True})
        sys.exit(0)
    start_ranks(worker, opts.get("world", 2), (out, opts))
