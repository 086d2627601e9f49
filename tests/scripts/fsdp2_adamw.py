"""This package's AdamW over FSDP2 (``fully_shard``) parameters on CPU processes, as an FSDP2 user writes it: a model
sharded per layer with bf16 parameters, ``AdamW(model.parameters())``, a checkpoint through
``torch.distributed.checkpoint`` (DCP), a resume, and a resume at another world size. Each rank writes what it saw.

    python fsdp2_adamw.py OUT '{"world": 2, "runs": [{"name": "stochastic", "rounding": "stochastic"}, ...]}'

A run with ``"world": 1`` and ``"plain": true`` trains the same model unsharded (plain tensors), for comparison.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models import MLP, data, param_groups
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

if TYPE_CHECKING:
    from lightning_pure_bf16 import AdamW


STEPS = 6
BATCH = 32


def build(opts: dict, world: int) -> tuple[torch.nn.Module, AdamW]:
    torch.manual_seed(opts.get("model_seed", 0))
    model = MLP(opts.get("hidden", 64)).to(torch.bfloat16)
    if opts.get("hsdp"):  # HSDP: every rank a replica of one shard group of one rank (placements Replicate, Shard(0))
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    elif not opts.get("plain"):
        mesh = init_device_mesh("cpu", (world,))
    if not opts.get("plain"):
        for layer in model.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    from lightning_pure_bf16 import AdamW  # in the ranks only: the launching process stays light

    options = {k: opts[k] for k in ("rounding", "moments", "compensation") if k in opts}
    optimizer = AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), seed=opts.get("seed", 1234), **options)
    if opts.get("release"):  # each parameter updated from FSDP2's post-accumulate-grad hook, its gradient freed

        def release(p: torch.Tensor) -> None:
            optimizer.step_parameter(p)
            p.grad = None

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(release)
    return model, optimizer


def train(model: torch.nn.Module, optimizer: AdamW, rank: int, world: int, steps: range, opts: dict) -> list[float]:
    x, y = data(BATCH * STEPS).tensors
    losses = []
    per_rank = BATCH // world
    for step in steps:
        lo = step * BATCH + rank * per_rank
        xb, yb = x[lo : lo + per_rank].to(torch.bfloat16), y[lo : lo + per_rank]
        watched = opts.get("inf_at") == step
        if watched and opts.get("release"):
            # Released gradients are applied during the backward: one rank's input overflows instead, so that every
            # gradient of that rank is inf/NaN, and every rank must leave every parameter as it is.
            before = snapshot(model, optimizer)
            if rank == world - 1:
                xb = xb * float("inf")
        loss = (model(xb).float() - yb).pow(2).mean()
        loss.backward()
        if watched and not opts.get("release"):
            # One rank's gradient overflows: every rank must skip, and the step must change nothing anywhere.
            if rank == world - 1:
                model.net[0].weight.grad.to_local().view(-1)[0] = float("inf")
            before = snapshot(model, optimizer)
        optimizer.step()
        if watched:
            opts["skipped_parameter_updates"] = optimizer.skipped_parameter_updates
            after = snapshot(model, optimizer)
            opts["inf_step_changed"] = [
                key
                for part in ("params", "states")
                for key in before[part]
                if not isinstance(before[part][key], bool) and not torch.equal(before[part][key], after[part][key])
            ]
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
    return losses


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(model: torch.nn.Module, optimizer: AdamW) -> dict:
    """Every parameter and every element-wise state, whole (gathered), and the local bytes by category."""
    params = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    states, local_bytes, local_elements = {}, {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            shard = p.to_local() if isinstance(p, DTensor) else p
            local_elements += shard.numel()
            local_bytes["param"] = local_bytes.get("param", 0) + shard.numel() * shard.element_size()
            st = optimizer.state.get(p, {})
            for key, value in st.items():
                if not isinstance(value, torch.Tensor) or value.ndim == 0:
                    continue
                local = value.to_local() if isinstance(value, DTensor) else value
                category = key.removesuffix("_scale")
                local_bytes[category] = local_bytes.get(category, 0) + local.numel() * local.element_size()
                if isinstance(value, DTensor):
                    states[f"{names[p]}.{key}"] = full(value).clone()
                    if key in ("exp_avg", "exp_avg_sq") and isinstance(value, DTensor):
                        states[f"{names[p]}.{key}.placements"] = str(value.placements) == str(p.placements)
            dq = optimizer.dequantized_state(p)
            for key, value in dq.items():
                states[f"{names[p]}.{key}.float.local"] = value.clone()
    local_bytes["grad"] = local_bytes["param"]  # bf16 gradients sharded like their parameters
    return {"params": params, "states": states, "bytes": local_bytes, "elements": local_elements}


def one_run(rank: int, world: int, out: Path, opts: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    model, optimizer = build(opts, world)
    ckpt = out / "dcp"
    if opts.get("resume_from"):
        # A fresh model and optimizer continue from a DCP checkpoint written at another world size (or this one).
        source = Path(opts["resume_from"])
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(source / "dcp"))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        result["loaded"] = snapshot(model, optimizer)
        result["seed"] = optimizer.seed
        result["losses"] = train(model, optimizer, rank, world, range(opts["save_at"], STEPS), opts)
        result["final"] = snapshot(model, optimizer)
    else:
        save_at = opts.get("save_at")
        result["losses"] = train(model, optimizer, rank, world, range(save_at or STEPS), opts)
        if save_at:
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
            dcp.save(state, checkpoint_id=str(ckpt))
            result["saved"] = snapshot(model, optimizer)
            result["losses"] += train(model, optimizer, rank, world, range(save_at, STEPS), opts)
            # The same run resumed in fresh objects from the checkpoint just written.
            model2, optimizer2 = build({**opts, "seed": 99}, world)
            state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, optimizer2)}
            dcp.load(state, checkpoint_id=str(ckpt))
            set_model_state_dict(model2, state["model"])
            set_optimizer_state_dict(model2, optimizer2, state["optim"])
            result["resumed_seed"] = optimizer2.seed
            result["resumed_losses"] = train(model2, optimizer2, rank, world, range(save_at, STEPS), opts)
            result["resumed"] = snapshot(model2, optimizer2)
        result["final"] = snapshot(model, optimizer)
        result["local"] = {n: _local(p.detach()).clone() for n, p in model.named_parameters()}
        result["placements"] = str(getattr(next(model.parameters()), "placements", None))
        result["skipped_steps"] = optimizer.skipped_steps
        result["inf_step_changed"] = opts.get("inf_step_changed")
        result["skipped_parameter_updates"] = opts.get("skipped_parameter_updates")
    torch.save(result, out / f"rank{rank}.pt")


def worker(rank: int, world: int, out: Path, opts: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for run in opts.get("runs", [{}]):
            one_run(rank, world, out / run.get("name", ""), {**opts, **run})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _runs import start_ranks

    out = Path(sys.argv[1])
    opts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    world = opts.get("world", 2)
    start_ranks(worker, world, (world, out, opts))
