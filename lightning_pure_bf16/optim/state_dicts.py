"""The optimizer's state dicts and the conversions between state formats: what :meth:`AdamW.state_dict` writes and
:meth:`AdamW.load_state_dict` reads (torch.optim's moments converted, states in files filled, 8-bit codes kept or
encoded, DTensor states' per-element block scales), and states written range by range
(:meth:`AdamW.load_state_range`, what a re-partitioning load calls).

Functions of the optimizer, which keeps the state; this module keeps none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from lightning_pure_bf16._log import rank_zero_info
from lightning_pure_bf16.ops import quant
from lightning_pure_bf16.ops.rng import Buffer, random_bits, stream_key
from lightning_pure_bf16.optim import sharded
from lightning_pure_bf16.optim.options import UNSUPPORTED_TORCH_OPTIONS

if TYPE_CHECKING:
    from lightning_pure_bf16.optim.adamw import AdamW

# State entries with one element per parameter element (what ``state_storage`` decides the place of).
BUFFER_KEYS = ("exp_avg", "exp_avg_sq", "kahan_comp")
# The block scales of 8-bit moments (one bf16 per ops.quant.QBLOCK elements).
SCALE_KEYS = ("exp_avg_scale", "exp_avg_sq_scale")
# Every state tensor that state_storage decides the place of.
STORED_KEYS = (*BUFFER_KEYS, *SCALE_KEYS)
EXTRA_KEY = "pure_bf16"


@torch.no_grad()
def load_state_range(optimizer: AdamW, p: torch.Tensor, start: int, values: dict[str, torch.Tensor]) -> None:
    """Write elements ``[start, start + n)`` of the state buffers of ``p`` (a plain tensor whose state exists,
    :meth:`AdamW.init_state`) from ``values``, keyed as the buffers (``exp_avg``, ``exp_avg_sq``, ``kahan_comp``), each
    1-D of ``n`` elements in any format; what it reads is one range, what it writes goes straight into the
    buffers (memory or files), so a checkpoint of any size loads in pieces:

    - floats (bf16, float32): a bf16 buffer takes them rounded to nearest; 8-bit moments encode them in their own
      blocks of this range; an 8-bit remainder encodes them against the weight ``p`` holds now. Encodings draw the
      noise of the tensor's stream at step 0, as :meth:`AdamW.load_state_dict` does, whatever the range.
    - 8-bit moment codes with ``exp_avg_scale``/``exp_avg_sq_scale`` one per element (float32, the scale each code
      was written under; NaN where none: its code 0): re-blocked (:func:`ops.quant.reblock`), a block whose codes
      share a scale kept bit for bit.
    - an 8-bit remainder's codes: copied (its unit is its weight's spacing, the same for the same weight).

    A range of 8-bit moments starts on a block (a multiple of ``QBLOCK`` elements) and ends on one or at the end.
    """
    state = optimizer.state[p]
    seed, offset = optimizer._noise(p)
    n = next(v.numel() for k, v in values.items() if k in BUFFER_KEYS)

    def bits(buffer: Buffer) -> torch.Tensor:  # drawn only for what is encoded
        index = torch.arange(n, dtype=torch.int32, device=p.device)
        return random_bits(stream_key(seed, state["stream"], 0, buffer), offset + start, index)

    for key in BUFFER_KEYS:
        if key not in values:
            continue
        value, target = values[key].reshape(-1).to(p.device), state[key].view(-1)
        weight = p.detach().reshape(-1).narrow(0, start, n)
        if key == "kahan_comp" and target.is_floating_point() != value.is_floating_point():
            if value.is_floating_point():
                value = quant.encode_residual(value.float(), weight, bits(Buffer.PARAM))
            else:
                value = quant.decode_residual(value, weight)
        if target.is_floating_point() or key == "kahan_comp":
            if not value.is_floating_point() and key != "kahan_comp":  # 8-bit codes into a bf16 buffer
                unit = torch.ones(quant.scale_blocks(n), dtype=torch.bfloat16, device=p.device)
                decode = quant.decode_v if key == "exp_avg_sq" else quant.decode_m
                value = decode(value, unit) * values[f"{key}_scale"].reshape(-1).to(p.device).nan_to_num(nan=0.0)
            target.narrow(0, start, n).copy_(value)
        else:
            if start % quant.QBLOCK or (n % quant.QBLOCK and start + n != target.numel()):
                raise ValueError(
                    f"load_state_range: 8-bit moments are written in whole blocks of {quant.QBLOCK} elements; the"
                    f" range [{start}, {start + n}) of {target.numel()} does not start and end on one."
                )
            second = key == "exp_avg_sq"
            buffer = Buffer.EXP_AVG_SQ if second else Buffer.EXP_AVG
            if value.is_floating_point():
                value = value.float()
                scales = quant.block_scales(value)
                codes = (quant.encode_v if second else quant.encode_m)(value, scales, bits(buffer))
            else:
                own = values[f"{key}_scale"].reshape(-1).to(p.device)
                codes, scales = quant.reblock(value, own, second=second, bits=bits(buffer))
            target.narrow(0, start, n).copy_(codes)
            state[f"{key}_scale"].narrow(0, start // quant.QBLOCK, scales.numel()).copy_(scales)


@torch.no_grad()
def dequantized(optimizer: AdamW, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """:meth:`AdamW.dequantized_state`."""
    stored = optimizer.state.get(p, {})
    out: dict[str, torch.Tensor] = {}
    if "exp_avg" not in stored:
        return out
    state = {k: sharded.local(v) if isinstance(v, torch.Tensor) else v for k, v in stored.items()}
    p = sharded.local(p)
    if state["exp_avg"].dtype == torch.int8:
        out["exp_avg"] = quant.decode_m(state["exp_avg"].reshape(-1), state["exp_avg_scale"])
        out["exp_avg_sq"] = quant.decode_v(state["exp_avg_sq"].reshape(-1), state["exp_avg_sq_scale"])
    else:
        out["exp_avg"] = state["exp_avg"].float()
        out["exp_avg_sq"] = state["exp_avg_sq"].float()
    if "kahan_comp" in state:
        comp = state["kahan_comp"]
        if comp.dtype == torch.int8:
            out["kahan_comp"] = quant.decode_residual(comp.reshape(-1), p.detach().reshape(-1))
        else:
            out["kahan_comp"] = comp.float()
    return {k: v.reshape(p.shape) for k, v in out.items()}


def state_dict(optimizer: AdamW) -> dict[str, Any]:
    """:meth:`AdamW.state_dict` (see there)."""
    optimizer._storage.check_kept(type(optimizer).__name__, "save")
    optimizer.wait_for_state_writes()
    sd = Optimizer.state_dict(optimizer)
    sd["state"] = {index: optimizer._storage.saveable(st) for index, st in sd["state"].items()}
    sd[EXTRA_KEY] = {
        "seed": optimizer.seed,
        "skipped_steps": optimizer.skipped_steps,
        "next_stream": optimizer._next_stream,
    }
    if sharded.dtensors(p for g in optimizer.param_groups for p in g["params"]):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        sd["state"] = {index: _per_element_scales(params[index], st) for index, st in sd["state"].items()}
        for group in sd["param_groups"]:
            group[EXTRA_KEY] = dict(sd[EXTRA_KEY])
    return sd


def load_state_dict(optimizer: AdamW, state_dict: dict[str, Any]) -> None:
    """:meth:`AdamW.load_state_dict` (see there)."""
    optimizer.wait_for_state_writes()  # a write still running must not land over the loaded states
    loaded: dict[str, Any] = {}

    # Runs after the user's pre-hooks (it is registered last), on the state dict they leave.
    def unpack(_: Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        sd = dict(sd)
        extra = sd.pop(EXTRA_KEY, None)
        groups = sd.get("param_groups")
        if isinstance(groups, list) and any(isinstance(g, dict) and EXTRA_KEY in g for g in groups):
            # Saved with DTensor parameters (and perhaps through torch.distributed.checkpoint, which keeps only
            # the state and the groups).
            in_groups = [g.get(EXTRA_KEY) for g in groups if isinstance(g, dict)]
            sd["param_groups"] = [
                {k: v for k, v in g.items() if k != EXTRA_KEY} if isinstance(g, dict) else g for g in groups
            ]
            extra = extra if extra is not None else in_groups[0]
        if extra is None:
            sd = _from_torch_state_dict(optimizer, sd)
        loaded["extra"] = extra
        loaded["dtypes"] = _check_saved_formats(optimizer, sd)
        loaded["buffers"] = optimizer._storage.take_saved(optimizer, sd)
        return sd

    # Runs before the user's post-hooks (it is prepended).
    def restore(_: Optimizer) -> None:
        extra = loaded["extra"]
        if extra is not None:
            optimizer.seed = int(extra["seed"])
            optimizer.skipped_steps = int(extra["skipped_steps"])
            optimizer._next_stream = int(extra["next_stream"])
        for state in optimizer.state.values():
            if "step" in state:
                # torch may cast or move "step"; keep it an exact int64 CPU counter.
                state["step"] = torch.as_tensor(state["step"]).detach().to("cpu", torch.int64).reshape(())
                if "stream" not in state:  # loaded from torch.optim
                    state["stream"] = optimizer._next_stream
                    optimizer._next_stream += 1
        _restore_formats(optimizer, loaded["dtypes"])
        optimizer._storage.put_saved(optimizer, loaded["buffers"])

    pre = optimizer.register_load_state_dict_pre_hook(unpack)
    post = optimizer.register_load_state_dict_post_hook(restore, prepend=True)
    try:
        Optimizer.load_state_dict(optimizer, state_dict)
    finally:
        pre.remove()
        post.remove()


def _from_torch_state_dict(optimizer: AdamW, sd: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim.AdamW``/``Adam`` state dict made loadable: this optimizer's group options with the saved
    hyperparameters (checked first, before anything changes)."""
    name = type(optimizer).__name__
    saved_groups = sd.get("param_groups")
    states = sd.get("state")
    if not isinstance(saved_groups, list) or not isinstance(states, dict):
        raise KeyError(f"{name}.load_state_dict: this is not an optimizer state dict (no 'state' and 'param_groups').")
    keys = {k for st in states.values() for k in st}
    if not keys <= {"step", "exp_avg", "exp_avg_sq"} or any(
        g.get(option, off) != off for g in saved_groups for option, off in UNSUPPORTED_TORCH_OPTIONS.items()
    ):
        raise KeyError(
            f"{name}.load_state_dict: this state dict has no {EXTRA_KEY!r} entry and is not a plain"
            f" torch.optim.AdamW/Adam one (state keys {sorted(keys)}; amsgrad, maximize, capturable and"
            " differentiable must be off), so it cannot be converted."
        )
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    groups = []
    for ours, saved in zip(optimizer.param_groups, saved_groups):
        decoupled = saved.get("decoupled_weight_decay", ours["decoupled_weight_decay"])
        if decoupled != ours["decoupled_weight_decay"] and saved.get("weight_decay", 0.0) != 0.0:
            kind = "decoupled (AdamW)" if decoupled else "L2 (Adam)"
            raise ValueError(
                f"{name}.load_state_dict: the saved optimizer used {kind} weight decay, this one does not. Load"
                f" it into lightning_pure_bf16.{'AdamW' if decoupled else 'Adam'} instead."
            )
        group = {k: v for k, v in ours.items() if k not in ("params", "param_names")}
        group.update({k: saved[k] for k in ("lr", "betas", "eps", "weight_decay") if k in saved})
        group.update({k: saved[k] for k in ("params", "param_names") if k in saved})
        if "initial_lr" in saved:  # set by an LR scheduler
            group["initial_lr"] = saved["initial_lr"]
        groups.append(group)
    rank_zero_info(
        f"{name}.load_state_dict: converted a torch.optim state dict ({len(states)} tensor(s) with moments):"
        f" moments rounded to the parameters' dtype, rounding seed {optimizer.seed},"
        f" rounding={optimizer.param_groups[0]['rounding']!r}."
    )
    return {**sd, "param_groups": groups}


def _check_saved_formats(optimizer: AdamW, sd: dict[str, Any]) -> list[tuple[torch.Tensor, dict[str, torch.dtype]]]:
    """Per parameter, the dtypes of its saved state tensors, after checking they suit this optimizer's formats
    (before anything changes). torch's loader casts every state tensor to the parameter's dtype; the 8-bit codes
    are cast back after it (their values are small integers, exact in bf16)."""
    name = type(optimizer).__name__
    saved_ids = [i for g in sd.get("param_groups", []) for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = []
    for index, p in zip(saved_ids, params):
        st = sd.get("state", {}).get(index, {})
        dtypes = {k: v.dtype for k, v in st.items() if isinstance(v, torch.Tensor)}
        saved_int8 = dtypes.get("exp_avg") == torch.int8
        if saved_int8 and not optimizer._int8_moments(p):
            raise ValueError(
                f"{name}.load_state_dict: the state dict holds 8-bit moments (saved with moments='int8'), this"
                f" optimizer keeps moments={optimizer.moments!r}. Create it with `moments='int8'`."
            )
        if dtypes.get("kahan_comp") == torch.int8 and optimizer.compensation != "int8":
            raise ValueError(
                f"{name}.load_state_dict: the state dict holds an 8-bit Kahan buffer (compensation='int8'), this"
                f" optimizer keeps compensation={optimizer.compensation!r}. Create it with `compensation='int8'`."
            )
        out.append((p, dtypes))
    return out


def _restore_formats(optimizer: AdamW, saved: list[tuple[torch.Tensor, dict[str, torch.dtype]]]) -> None:
    for p, dtypes in saved:
        state = optimizer.state.get(p)
        if not state:
            continue
        for key, dtype in dtypes.items():
            if key in state and state[key].dtype != dtype and not dtype.is_floating_point:
                state[key] = state[key].to(dtype)
        if sharded.is_dtensor(p):
            _compact_scales(optimizer, p, state)
        present = {k: state[k] for k in STORED_KEYS if k in state}
        state.update(encode_float_buffers(optimizer, p, state["stream"], present))


def _compact_scales(optimizer: AdamW, p: torch.Tensor, state: dict[str, Any]) -> None:
    """8-bit moments of a DTensor parameter loaded from :meth:`state_dict`, where each block scale is saved once per
    element (so DCP can reshard it like the parameter): back to one scale per block of this rank's shard. Saved at
    the same sharding, every block's elements carry one scale and the codes stay as they were, bit for bit; saved
    at another, the moments are decoded with each element's own scale and encoded again in this rank's blocks."""
    per_element = {k: state[k] for k in SCALE_KEYS if sharded.is_dtensor(state.get(k))}
    if not per_element:
        return
    n = sharded.local(p).numel()
    scales = {k: sharded.local(v).reshape(-1).to(torch.bfloat16) for k, v in per_element.items()}
    compact = {k: v[:: quant.QBLOCK].clone() for k, v in scales.items()}
    if all(torch.equal(compact[k].repeat_interleave(quant.QBLOCK)[:n], scales[k]) for k in scales):
        state.update(compact)
        return
    for key, decode in (("exp_avg", quant.decode_m), ("exp_avg_sq", quant.decode_v)):
        codes = sharded.local(state[key]).reshape(-1)
        unit = torch.ones(quant.scale_blocks(n), dtype=torch.bfloat16, device=codes.device)
        values = decode(codes, unit) * scales[f"{key}_scale"].float()
        # Floats, encoded in this rank's blocks by encode_float_buffers.
        state[key] = sharded.like(values.view(sharded.local(p).shape), p)
        del state[f"{key}_scale"]


def encode_float_buffers(
    optimizer: AdamW, p: torch.Tensor, stream: int, buffers: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Moments or a remainder saved as floats (bf16, float32, torch.optim), for this optimizer's 8-bit formats:
    encoded once, with noise of the tensor's own stream at step 0 (never an update step). Others unchanged."""
    seed, offset = optimizer._noise(p)
    param, dtensor, p = p, sharded.is_dtensor(p), sharded.local(p)
    out = {k: sharded.local(v) for k, v in buffers.items()}
    step_keys = [stream_key(seed, stream, 0, b) for b in Buffer]
    idx = torch.arange(p.numel(), dtype=torch.int32, device=p.device)
    changed = set()
    if optimizer._int8_moments(p) and "exp_avg" in out and out["exp_avg"].is_floating_point():
        m = out.pop("exp_avg").float().reshape(-1).to(p.device)
        v = out.pop("exp_avg_sq").float().reshape(-1).to(p.device)
        m_scale, v_scale = quant.block_scales(m), quant.block_scales(v)
        out["exp_avg"] = quant.encode_m(m, m_scale, random_bits(step_keys[1], offset, idx)).view(p.shape)
        out["exp_avg_sq"] = quant.encode_v(v, v_scale, random_bits(step_keys[2], offset, idx)).view(p.shape)
        out["exp_avg_scale"], out["exp_avg_sq_scale"] = m_scale, v_scale
        changed |= {"exp_avg", "exp_avg_sq"}
    comp = out.get("kahan_comp")
    if comp is not None and optimizer.compensation == "int8" and comp.is_floating_point():
        c = comp.float().reshape(-1).to(p.device)
        codes = quant.encode_residual(c, p.detach().reshape(-1), random_bits(step_keys[0], offset, idx))
        out["kahan_comp"] = codes.view(p.shape)
        changed.add("kahan_comp")
    if not dtensor:
        return out
    # A DTensor parameter's element-wise buffers stay DTensors sharded like it; its block scales are this rank's.
    return {
        k: v if k in SCALE_KEYS else buffers[k] if k not in changed else sharded.like(v, param) for k, v in out.items()
    }


def check_saved_buffers(optimizer: AdamW, state_dict: dict[str, Any]) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """The saved moments per parameter, after checking each matches its parameter (before anything changes)."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(saved_ids) != len(params):
        raise ValueError(
            f"The state dict holds {len(saved_ids)} parameters, this optimizer {len(params)}; it was saved for"
            " another model."
        )
    by_id = dict(zip(saved_ids, params))
    out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for index, st in state_dict["state"].items():
        p = by_id[index]
        buffers = {k: v for k, v in st.items() if k in STORED_KEYS}
        for key, value in buffers.items():
            numel, dtype = optimizer._buffer_spec(p, key)
            if not isinstance(value, torch.Tensor) or value.numel() != numel:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"The saved {key!r} of parameter {index} has shape {got}, the parameter {tuple(p.shape)}; the"
                    " state dict was saved for another model or partitioning."
                )
            if not value.dtype.is_floating_point and dtype.is_floating_point:
                raise ValueError(
                    f"The saved {key!r} of parameter {index} is {value.dtype} (8-bit), this optimizer's state files"
                    f" hold {dtype}: create it with the saved `moments`/`compensation`, or load the state dict into"
                    " an optimizer with in-memory states of the saved format and save it again."
                )
        out[p] = buffers
    return out


def saveable(state: dict[str, Any]) -> dict[str, Any]:
    """One tensor's state with its buffers ``torch.save`` can write: the buffers of one state file share its storage,
    and torch refuses views of one storage as different dtypes (8-bit codes, bf16 scales), so all but the first dtype
    are copied out of the file."""
    first: dict[int, torch.dtype] = {}
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.ndim:
            ptr = value.untyped_storage().data_ptr()
            if first.setdefault(ptr, value.dtype) != value.dtype:
                value = value.clone()
        out[key] = value
    return out


def _per_element_scales(p: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
    """One tensor's state with its 8-bit block scales repeated for every element of its shard, as a DTensor sharded
    like the DTensor ``p`` (see :meth:`AdamW.state_dict`); other states unchanged."""
    if not sharded.is_dtensor(p) or not any(k in state for k in SCALE_KEYS):
        return state
    shard = sharded.local(p)
    out = dict(state)
    for key in SCALE_KEYS:
        if key in state:
            per_element = state[key].repeat_interleave(quant.QBLOCK)[: shard.numel()].view(shard.shape)
            out[key] = sharded.like(per_element, p)
    return out


__all__ = [
    "BUFFER_KEYS",
    "EXTRA_KEY",
    "SCALE_KEYS",
    "STORED_KEYS",
    "check_saved_buffers",
    "dequantized",
    "encode_float_buffers",
    "load_state_dict",
    "load_state_range",
    "saveable",
    "state_dict",
]
