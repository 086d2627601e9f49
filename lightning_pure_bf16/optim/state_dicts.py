"""The optimizer's state dicts and the conversions between state formats: what
:meth:`PureBF16Optimizer.state_dict` writes and :meth:`PureBF16Optimizer.load_state_dict` reads (torch.optim's states
converted, states in files filled, 8-bit codes kept or encoded, DTensor states' per-element block scales), and states
written range by range (:meth:`PureBF16Optimizer.load_state_range`, what a re-partitioning load calls).

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
    from lightning_pure_bf16.optim.base import PureBF16Optimizer

# A tensor's state: "step" (an int64 counter), "stream" (its noise stream, an int), the algorithm's per-element
# states (PureBF16Optimizer.state_names), the Kahan remainder, and the 8-bit states' block scales (one bf16 per
# ops.quant.QBLOCK elements, under the state's name plus this suffix). Every tensor but "step" is a buffer
# state_storage places.
KAHAN_KEY = "kahan_comp"
# Float32 statistics an algorithm keeps beside its per-element states (Adafactor's rows and columns): a dict of
# tensors under this key, not per element, not placed by state_storage, loaded as saved (never cast to the
# parameter's dtype).
STATISTICS_KEY = "statistics"
_SCALE_SUFFIX = "_scale"
EXTRA_KEY = "pure_bf16"


def scale_key(key: str) -> str:
    """The key of the block scales of the 8-bit state ``key``."""
    return key + _SCALE_SUFFIX


def is_scale_key(key: str) -> bool:
    """Whether ``key`` names block scales."""
    return key.endswith(_SCALE_SUFFIX)


def stored_keys(state: dict[str, Any]) -> list[str]:
    """The buffers of one tensor's state (what ``state_storage`` decides the place of): every tensor but the step."""
    return [k for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)]


def _decode(codes: torch.Tensor, scales: torch.Tensor, slot: int) -> torch.Tensor:
    return quant.decode_states(codes, scales, slot)


@torch.no_grad()
def load_state_range(
    optimizer: PureBF16Optimizer, p: torch.Tensor, start: int, values: dict[str, torch.Tensor]
) -> None:
    """Write elements ``[start, start + n)`` of the state buffers of ``p`` (a plain tensor whose state exists,
    :meth:`PureBF16Optimizer.init_state`) from ``values``, keyed as the buffers (the algorithm's states, AdamW's
    ``exp_avg`` and ``exp_avg_sq``, and ``kahan_comp``), each 1-D of ``n`` elements in any format; what it reads is one
    range, what it writes goes straight into the buffers (memory or files), so a checkpoint of any size loads in
    pieces:

    - floats (bf16, float32): a bf16 buffer takes them rounded to nearest; 8-bit moments encode them in their own
      blocks of this range; an 8-bit remainder encodes them against the weight ``p`` holds now. Encodings draw the
      noise of the tensor's stream at step 0, as :meth:`PureBF16Optimizer.load_state_dict` does, whatever the range.
    - 8-bit moment codes with ``exp_avg_scale``/``exp_avg_sq_scale`` one per element (float32, the scale each code
      was written under; NaN where none: its code 0): re-blocked (:func:`ops.quant.reblock`), a block whose codes
      share a scale kept bit for bit.
    - an 8-bit remainder's codes: copied (its unit is its weight's spacing, the same for the same weight).

    A range of 8-bit moments starts on a block (a multiple of ``QBLOCK`` elements) and ends on one or at the end.
    """
    state = optimizer.state[p]
    seed, offset = optimizer._noise(p)
    n = next(v.numel() for k, v in values.items() if not is_scale_key(k))

    def bits(buffer: Buffer) -> torch.Tensor:  # drawn only for what is encoded
        index = torch.arange(n, dtype=torch.int32, device=p.device)
        return random_bits(stream_key(seed, state["stream"], 0, buffer), offset + start, index)

    for key in (*optimizer.state_names, KAHAN_KEY):
        if key not in values or key not in state:
            continue
        value, target = values[key].reshape(-1).to(p.device), state[key].view(-1)
        weight = p.detach().reshape(-1).narrow(0, start, n)
        if key == KAHAN_KEY:
            if target.is_floating_point() != value.is_floating_point():
                if value.is_floating_point():
                    value = quant.encode_residual(value.float(), weight, bits(Buffer.PARAM))
                else:
                    value = quant.decode_residual(value, weight)
            target.narrow(0, start, n).copy_(value)
            continue
        slot = optimizer.state_names.index(key)
        if target.is_floating_point():
            if not value.is_floating_point():  # 8-bit codes into a bf16 buffer
                unit = torch.ones(quant.scale_blocks(n), dtype=torch.bfloat16, device=p.device)
                value = _decode(value, unit, slot) * values[scale_key(key)].reshape(-1).to(p.device).nan_to_num(nan=0.0)
            target.narrow(0, start, n).copy_(value)
            continue
        if start % quant.QBLOCK or (n % quant.QBLOCK and start + n != target.numel()):
            raise ValueError(
                f"load_state_range: 8-bit states are written in whole blocks of {quant.QBLOCK} elements; the"
                f" range [{start}, {start + n}) of {target.numel()} does not start and end on one."
            )
        buffer = Buffer.EXP_AVG_SQ if slot else Buffer.EXP_AVG
        if value.is_floating_point():
            value = value.float()
            scales = quant.block_scales(value)
            codes = quant.encode_states(value, scales, bits(buffer), slot)
        else:
            own = values[scale_key(key)].reshape(-1).to(p.device)
            codes, scales = quant.reblock(value, own, second=bool(slot), bits=bits(buffer))
        target.narrow(0, start, n).copy_(codes)
        state[scale_key(key)].narrow(0, start // quant.QBLOCK, scales.numel()).copy_(scales)


@torch.no_grad()
def dequantized(optimizer: PureBF16Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """:meth:`PureBF16Optimizer.dequantized_state`."""
    stored = optimizer.state.get(p, {})
    out: dict[str, torch.Tensor] = {}
    state = {k: sharded.local(v) if isinstance(v, torch.Tensor) else v for k, v in stored.items()}
    p = sharded.local(p)
    for slot, key in enumerate(optimizer.state_names):
        if key in state:
            value = state[key]
            out[key] = (
                value.float() if value.is_floating_point() else _decode(value.reshape(-1), state[scale_key(key)], slot)
            )
    if KAHAN_KEY in state:
        comp = state[KAHAN_KEY]
        if comp.dtype == torch.int8:
            out[KAHAN_KEY] = quant.decode_residual(comp.reshape(-1), p.detach().reshape(-1))
        else:
            out[KAHAN_KEY] = comp.float()
    return {k: v.reshape(p.shape) for k, v in out.items()}


def state_dict(optimizer: PureBF16Optimizer) -> dict[str, Any]:
    """:meth:`PureBF16Optimizer.state_dict` (see there)."""
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


def load_state_dict(optimizer: PureBF16Optimizer, state_dict: dict[str, Any]) -> None:
    """:meth:`PureBF16Optimizer.load_state_dict` (see there)."""
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
        loaded["statistics"] = _take_statistics(sd)
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
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for index, statistics in loaded["statistics"].items():
            device = sharded.local(params[index]).device
            optimizer.state[params[index]][STATISTICS_KEY] = {
                k: v.to(device, torch.float32, copy=True) for k, v in statistics.items()
            }
        optimizer._storage.put_saved(optimizer, loaded["buffers"])

    pre = optimizer.register_load_state_dict_pre_hook(unpack)
    post = optimizer.register_load_state_dict_post_hook(restore, prepend=True)
    try:
        Optimizer.load_state_dict(optimizer, state_dict)
    finally:
        pre.remove()
        post.remove()


def _take_statistics(sd: dict[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
    """The float32 statistics of every saved tensor's state, taken out of ``sd`` (torch's loader would cast them to
    the parameter's dtype), by the tensor's position among the optimizer's parameters."""
    saved_ids = [i for g in sd.get("param_groups", []) for i in g["params"]]
    position = {index: n for n, index in enumerate(saved_ids)}
    out = {}
    states = dict(sd.get("state", {}))
    for index, st in states.items():
        if isinstance(st, dict) and STATISTICS_KEY in st:
            st = dict(st)
            out[position[index]] = st.pop(STATISTICS_KEY)
            states[index] = st
    sd["state"] = states
    return out


def _from_torch_state_dict(optimizer: PureBF16Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict of the torch.optim optimizer of the same algorithm (``torch.optim.AdamW``/``Adam`` for
    :class:`AdamW`/:class:`Adam`, ``torch.optim.SGD`` for :class:`SGD`) made loadable: this optimizer's group options
    with the saved hyperparameters (checked first, before anything changes), each tensor's state as this optimizer
    keeps it (``from_torch_state``)."""
    name = type(optimizer).__name__
    saved_groups = sd.get("param_groups")
    states = sd.get("state")
    if not isinstance(saved_groups, list) or not isinstance(states, dict):
        raise KeyError(f"{name}.load_state_dict: this is not an optimizer state dict (no 'state' and 'param_groups').")
    keys = {k for st in states.values() for k in st}
    torch_names = optimizer.torch_state_names or optimizer.state_names
    if not keys <= {"step", *torch_names} or any(
        g.get(option, off) != off for g in saved_groups for option, off in UNSUPPORTED_TORCH_OPTIONS.items()
    ):
        raise KeyError(
            f"{name}.load_state_dict: this state dict has no {EXTRA_KEY!r} entry and is not a plain torch.optim one"
            f" of the same algorithm (state keys {sorted(keys)}, expected among"
            f" {sorted({'step', *torch_names})}; amsgrad, maximize, capturable and differentiable must be"
            " off), so it cannot be converted."
        )
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    groups = []
    for ours, saved in zip(optimizer.param_groups, saved_groups):
        decoupled = saved.get("decoupled_weight_decay", ours.get("decoupled_weight_decay"))
        if decoupled != ours.get("decoupled_weight_decay") and saved.get("weight_decay", 0.0) != 0.0:
            kind = "decoupled (AdamW)" if decoupled else "L2 (Adam)"
            raise ValueError(
                f"{name}.load_state_dict: the saved optimizer used {kind} weight decay, this one does not. Load"
                f" it into lightning_pure_bf16.{'AdamW' if decoupled else 'Adam'} instead."
            )
        group = {k: v for k, v in ours.items() if k not in ("params", "param_names")}
        # The algorithm's hyperparameters as saved; this optimizer's own options (rounding) stay.
        group.update(
            {k: saved[k] for k in optimizer.defaults if k in saved and k not in ("rounding", "decoupled_weight_decay")}
        )
        group.update({k: saved[k] for k in ("params", "param_names") if k in saved})
        if "initial_lr" in saved:  # set by an LR scheduler
            group["initial_lr"] = saved["initial_lr"]
        groups.append(group)
    rank_zero_info(
        f"{name}.load_state_dict: converted a torch.optim state dict ({len(states)} tensor(s) with moments):"
        f" moments rounded to the parameters' dtype, rounding seed {optimizer.seed},"
        f" rounding={optimizer.param_groups[0]['rounding']!r}."
    )
    states = {index: optimizer.from_torch_state(st) for index, st in states.items()}
    return {**sd, "state": states, "param_groups": groups}


def _check_saved_formats(
    optimizer: PureBF16Optimizer, sd: dict[str, Any]
) -> list[tuple[torch.Tensor, dict[str, torch.dtype]]]:
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
        saved_int8 = any(dtypes.get(k) in (torch.int8, torch.uint8) for k in optimizer.state_names)
        if saved_int8 and not optimizer.int8_states(p):
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


def _restore_formats(optimizer: PureBF16Optimizer, saved: list[tuple[torch.Tensor, dict[str, torch.dtype]]]) -> None:
    for p, dtypes in saved:
        state = optimizer.state.get(p)
        if not state:
            continue
        for key, dtype in dtypes.items():
            if key in state and state[key].dtype != dtype and not dtype.is_floating_point:
                state[key] = state[key].to(dtype)
        if sharded.is_dtensor(p):
            _compact_scales(optimizer, p, state)
        present = {k: state[k] for k in stored_keys(state)}
        state.update(encode_float_buffers(optimizer, p, state["stream"], present))


def _compact_scales(optimizer: PureBF16Optimizer, p: torch.Tensor, state: dict[str, Any]) -> None:
    """8-bit moments of a DTensor parameter loaded from :meth:`state_dict`, where each block scale is saved once per
    element (so DCP can reshard it like the parameter): back to one scale per block of this rank's shard. Saved at
    the same sharding, every block's elements carry one scale and the codes stay as they were, bit for bit; saved
    at another, the moments are decoded with each element's own scale and encoded again in this rank's blocks."""
    per_element = {k: state[k] for k in stored_keys(state) if is_scale_key(k) and sharded.is_dtensor(state[k])}
    if not per_element:
        return
    n = sharded.local(p).numel()
    scales = {k: sharded.local(v).reshape(-1).to(torch.bfloat16) for k, v in per_element.items()}
    compact = {k: v[:: quant.QBLOCK].clone() for k, v in scales.items()}
    if all(torch.equal(compact[k].repeat_interleave(quant.QBLOCK)[:n], scales[k]) for k in scales):
        state.update(compact)
        return
    for slot, key in enumerate(optimizer.state_names):
        if scale_key(key) not in scales:
            continue
        codes = sharded.local(state[key]).reshape(-1)
        unit = torch.ones(quant.scale_blocks(n), dtype=torch.bfloat16, device=codes.device)
        values = _decode(codes, unit, slot) * scales[scale_key(key)].float()
        # Floats, encoded in this rank's blocks by encode_float_buffers.
        state[key] = sharded.like(values.view(sharded.local(p).shape), p)
        del state[scale_key(key)]


def encode_float_buffers(
    optimizer: PureBF16Optimizer, p: torch.Tensor, stream: int, buffers: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Moments or a remainder saved as floats (bf16, float32, torch.optim), for this optimizer's 8-bit formats:
    encoded once, with noise of the tensor's own stream at step 0 (never an update step). Others unchanged."""
    seed, offset = optimizer._noise(p)
    param, dtensor, p = p, sharded.is_dtensor(p), sharded.local(p)
    out = {k: sharded.local(v) for k, v in buffers.items()}
    step_keys = [stream_key(seed, stream, 0, b) for b in Buffer]
    idx = torch.arange(p.numel(), dtype=torch.int32, device=p.device)
    changed = set()
    if optimizer.int8_states(p):
        for slot, key in enumerate(optimizer.state_names):
            if key not in out or not out[key].is_floating_point():
                continue
            value = out.pop(key).float().reshape(-1).to(p.device)
            out[scale_key(key)] = scales = quant.block_scales(value)
            bits = random_bits(step_keys[1 + slot], offset, idx)
            out[key] = quant.encode_states(value, scales, bits, slot).view(p.shape)
            changed.add(key)
    comp = out.get(KAHAN_KEY)
    if comp is not None and optimizer.compensation == "int8" and comp.is_floating_point():
        c = comp.float().reshape(-1).to(p.device)
        codes = quant.encode_residual(c, p.detach().reshape(-1), random_bits(step_keys[0], offset, idx))
        out[KAHAN_KEY] = codes.view(p.shape)
        changed.add(KAHAN_KEY)
    if not dtensor:
        return out
    # A DTensor parameter's element-wise buffers stay DTensors sharded like it; its block scales are this rank's.
    return {
        k: v if is_scale_key(k) else buffers[k] if k not in changed else sharded.like(v, param) for k, v in out.items()
    }


def check_saved_buffers(
    optimizer: PureBF16Optimizer, state_dict: dict[str, Any]
) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
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
        buffers = {k: st[k] for k in stored_keys(st)}
        for key, value in buffers.items():
            numel, dtype = optimizer.buffer_spec(p, key)
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
    like the DTensor ``p`` (see :meth:`PureBF16Optimizer.state_dict`); other states unchanged."""
    scale_keys = [k for k in stored_keys(state) if is_scale_key(k)]
    if not sharded.is_dtensor(p) or not scale_keys:
        return state
    shard = sharded.local(p)
    out = dict(state)
    for key in scale_keys:
        per_element = state[key].repeat_interleave(quant.QBLOCK)[: shard.numel()].view(shard.shape)
        out[key] = sharded.like(per_element, p)
    return out


__all__ = [
    "EXTRA_KEY",
    "KAHAN_KEY",
    "STATISTICS_KEY",
    "check_saved_buffers",
    "dequantized",
    "encode_float_buffers",
    "is_scale_key",
    "load_state_dict",
    "load_state_range",
    "saveable",
    "scale_key",
    "state_dict",
    "stored_keys",
]
