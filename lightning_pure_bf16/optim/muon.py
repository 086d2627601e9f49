"""Pure-bf16 Muon (Jordan et al. 2024) with the semantics of ``torch.optim.Muon``, and AdamW for the parameters Muon
is not for, in one optimizer (as DeepSpeed's ``MuonWithAuxAdam`` and nanochat's ``MuonAdamW``: a group with
``use_muon=False`` steps by AdamW).

Muon keeps one momentum per element (``m = m + (1 - momentum) * (g - m)``, bf16 and rounded like every state), and
moves a matrix along the orthogonalized (Nesterov) momentum: five Newton-Schulz iterations in bf16 on the whole
matrix. A ZeRO-3 flat partition or an FSDP2 shard holds a run of a matrix's elements, so each matrix has an owner
rank (matrices shared out by size): the ranks send it their runs, it orthogonalizes the whole matrix and sends each
rank its run back. Memory beyond the states: at most three bf16 copies of the matrix being orthogonalized, on its
owner. The weight's write is rounded like every other algorithm's, in the fused kernels (the direction is bf16).
6 bytes per parameter on the device for Muon's matrices (bf16 weight, gradient and momentum), 8 for AdamW's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from lightning_pure_bf16.ops.algorithms import UpdateArgs
from lightning_pure_bf16.ops.rng import Buffer, next_high_word, stream_key
from lightning_pure_bf16.ops.update_torch import round_states
from lightning_pure_bf16.optim import sharded
from lightning_pure_bf16.optim.base import PureBF16Optimizer
from lightning_pure_bf16.optim.options import check_choice, check_lr, check_non_negative
from lightning_pure_bf16.optim.pieces import Piece, Pieces

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The defaults of a group with use_muon=False, as DeepSpeed's MuonWithAuxAdam sets them.
AUX_ADAMW_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-10}


class Muon(PureBF16Optimizer):
    """Muon whose bf16 matrices and momentum lose nothing to rounding on average; AdamW for groups with
    ``use_muon=False``.

    Args:
        params: parameters or parameter groups. A group's ``use_muon`` (default ``True``; or ``algorithm``,
            ``"muon"`` or ``"adamw"``) says whether its parameters are matrices stepped by Muon (``lr``,
            ``weight_decay``, ``momentum``, ``nesterov``, ``ns_coefficients``, ``eps``, ``ns_steps``,
            ``adjust_lr_fn``) or anything stepped by AdamW (``lr``,
            ``betas`` (default ``(0.9, 0.95)``), ``eps`` (default ``1e-10``), ``weight_decay``): embeddings, the
            output layer, biases and norms, which Muon is not for.
        lr: learning rate (default: ``1e-3``).
        weight_decay: decoupled weight decay coefficient (default: ``0.1``).
        momentum: the momentum's factor (default: ``0.95``).
        nesterov: orthogonalize the Nesterov momentum ``g + momentum * (m - g)`` instead of ``m`` (default:
            ``True``).
        ns_coefficients: the quintic Newton-Schulz iteration's coefficients (default: torch's).
        eps: the floor of the matrix's norm before the iteration (default: ``1e-7``).
        ns_steps: Newton-Schulz iterations, fewer than 100 (default: ``5``).
        adjust_lr_fn: ``None``/``"original"`` (the step is ``lr * sqrt(max(1, rows / cols))``) or
            ``"match_rms_adamw"`` (``lr * 0.2 * sqrt(max(rows, cols))``) (default: ``None``).
        **options: the options every optimizer of the package shares
            (:class:`~lightning_pure_bf16.optim.base.PureBF16Optimizer`); the states stay in memory, in bf16.
    """

    # Muon's momentum in slot 0 (its group keeps only it); an AdamW group keeps both moments.
    state_names = ("exp_avg", "exp_avg_sq")
    torch_state_names = ("momentum_buffer",)
    whole_parameter = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        **options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": True,
        }
        super().__init__(params, defaults, **options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and "algorithm" in param_group:
            # {"algorithm": "adamw"} says what use_muon=False says, in words.
            algorithm = param_group["algorithm"]
            check_choice(type(self).__name__, "algorithm", algorithm, ("muon", "adamw"))
            if "use_muon" in param_group and param_group["use_muon"] != (algorithm == "muon"):
                raise ValueError(
                    f"`{type(self).__name__}`: a group says algorithm={algorithm!r} and"
                    f" use_muon={param_group['use_muon']!r}; give one of them."
                )
            param_group = {
                **{k: v for k, v in param_group.items() if k != "algorithm"},
                "use_muon": algorithm == "muon",
            }
        if isinstance(param_group, dict) and not param_group.get("use_muon", True):
            param_group = {**AUX_ADAMW_DEFAULTS, **param_group}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            for p in group["params"]:
                self.check_pieces(type(self).__name__, group, self.pieces_of(p))

    @classmethod
    def check_group(cls, who: str, group: dict[str, Any]) -> None:
        check_lr(who, group["lr"])
        check_non_negative(who, "weight_decay", group["weight_decay"], "weight decay")
        if group.get("use_muon", True):
            check_non_negative(who, "momentum", group["momentum"])
            check_non_negative(who, "eps", group["eps"])
            if len(group["ns_coefficients"]) != 3:
                raise ValueError(f"`{who}(ns_coefficients={group['ns_coefficients']!r})` must be three numbers.")
            if not 0 <= int(group["ns_steps"]) < 100:
                raise ValueError(f"`{who}(ns_steps={group['ns_steps']!r})` must be in [0, 100), as torch.optim.Muon.")
            check_choice(who, "adjust_lr_fn", group["adjust_lr_fn"], (None, "original", "match_rms_adamw"))
        else:
            betas = group["betas"]
            if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
                raise ValueError(f"`{who}(betas={betas!r})`: an AdamW group's betas must be in [0, 1).")
            check_non_negative(who, "eps", group["eps"])
        super().check_group(who, group)

    def check_pieces(self, who: str, group: dict[str, Any], pieces: Pieces) -> None:
        if not group.get("use_muon", True):
            return
        for q in pieces.pieces:
            if len(q.shape) != 2:
                raise ValueError(
                    f"`{who}`: a parameter {q.name + ' ' if q.name else ''}of shape {q.shape} is in a Muon group; Muon"
                    " steps matrices only. Put it in a group with `use_muon=False` or `algorithm='adamw'` (stepped by"
                    " AdamW), as embeddings, the output layer, biases and norms usually are."
                )

    def state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self.state_names[:1] if group["use_muon"] else self.state_names

    @staticmethod
    def from_torch_state(state: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in state.items() if k != "momentum_buffer"}
        if "momentum_buffer" in state:
            out["exp_avg"] = state["momentum_buffer"]
        return {**out, "step": torch.as_tensor(state.get("step", 1 if "exp_avg" in out else 0)).to(torch.int64)}

    def update_args(
        self, group: dict[str, Any], *, step: int, keys: tuple[int, int, int], grad_scale: float
    ) -> UpdateArgs:
        """An AdamW group's step (Muon's own groups write through :meth:`write_direction`)."""
        beta1, beta2 = group["betas"]
        return UpdateArgs(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=True,
            step=step,
            rounding=group["rounding"],
            keys=keys,
            grad_scale=float(grad_scale),
        )

    @torch.no_grad()
    def update_whole(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        grad: torch.Tensor,
        backend: str,
        *,
        step: int,
        grad_scale: float,
    ) -> None:
        if not group["use_muon"]:
            if sharded.local(p).numel():
                self._write(p, group, grad, 0, backend, step=step, grad_scale=grad_scale)
            return
        pieces = self.pieces_of(p)
        state = self.state[p]
        seed, offset = self._noise(p)
        key = stream_key(seed, state["stream"], step, Buffer.EXP_AVG)
        flat_p, flat_g = sharded.local(p).reshape(-1), grad.reshape(-1)
        momentum = sharded.local(state["exp_avg"]).reshape(-1)
        lr, mu = float(group["lr"]), float(group["momentum"])
        owners = _owners(pieces)
        for q, owner in zip(pieces.pieces, owners):
            run = torch.zeros(q.span, dtype=torch.bfloat16, device=flat_p.device)  # this rank's run, padded
            for begin, end in _chunks(offset + q.offset, q.numel, self.chunk_size):
                g = flat_g[q.offset + begin : q.offset + end].to(torch.float32, copy=True)
                if grad_scale != 1.0:
                    g.mul_(grad_scale)
                stored = momentum[q.offset + begin : q.offset + end]
                m = stored.float().lerp_(g, 1.0 - mu)
                if stored.dtype != torch.bfloat16:
                    stored.copy_(m)
                else:  # the momentum's write, as every algorithm's states are written
                    index = torch.arange(end - begin, dtype=torch.int32, device=flat_p.device)
                    stored.copy_(round_states([m], group["rounding"], key, offset + q.offset + begin, index)[0])
                run[begin:end] = (g.lerp_(m, mu) if group["nesterov"] else m).bfloat16()
            runs = [run]
            del run  # _orthogonalized_run's now: a whole matrix on one rank is freed as it is orthogonalized
            direction = _orthogonalized_run(runs, q, owner, pieces, group)
            self.write_direction(
                p,
                group,
                direction[: q.numel],
                q.offset,
                step=step,
                step_size=lr * _lr_ratio(group["adjust_lr_fn"], q.shape),
                decay=lr * float(group["weight_decay"]),
                backend=backend,
            )


def muon_param_groups(module: torch.nn.Module, **adamw: Any) -> list[dict[str, Any]]:
    """The param groups of ``module`` for :class:`Muon`, by the rule its users follow (Jordan's, nanochat's,
    DeepSpeed's): every trainable matrix (two dimensions as a layer; ``ds_shape`` under ZeRO-3's partitioned init) is
    orthogonalized, except an embedding's (``nn.Embedding``, or a name with ``embed``) and the output layer's (a name
    with ``lm_head``); the rest (embeddings, the output layer, biases, norms, tensors of other ranks) goes to a group
    with ``use_muon=False`` that AdamW steps, with ``adamw``'s settings (``lr``, ``betas``...). Empty groups are left
    out. Override by building the groups yourself."""
    embeddings = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    muon, rest = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", None) or p.shape
        named_out = any(word in name.lower() for word in ("embed", "lm_head"))
        (muon if len(shape) == 2 and id(p) not in embeddings and not named_out else rest).append(p)
    groups = [{"params": muon}, {"params": rest, "use_muon": False, **adamw}]
    return [g for g in groups if g["params"]]


def newton_schulz(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization of a matrix, in bf16, as ``torch.optim.Muon`` computes it: the
    matrix (transposed to be wide) divided by its Frobenius norm (at least ``eps``), then ``steps`` iterations
    ``X = a X + (b A + c A A) X`` with ``A = X X^T``. ``matrix`` is left as it is."""
    return _newton_schulz([matrix.to(torch.bfloat16, copy=True)], coefficients, steps, eps)


def _newton_schulz(
    holder: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """:func:`newton_schulz` of the bf16 matrix ``holder`` holds, which it takes out and divides in place (as
    ``torch.optim.Muon`` divides its gradient's bf16 copy): given the only reference, the matrix is freed at the first
    iteration, so at most three matrices are alive at once (the iterate, ``A`` or ``b A + c A A``, and the next
    iterate; ``A`` is square in the smaller dimension)."""
    a, b, c = coefficients
    x = holder.pop()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        del gram
        x = torch.addmm(x, update, x, beta=a)
        del update
    return x.T if tall else x


def _orthogonalized_run(
    runs: list[torch.Tensor], q: Piece, owner: int, pieces: Pieces, group: dict[str, Any]
) -> torch.Tensor:
    """This rank's run of the orthogonalized matrix whose run ``runs`` holds (``q.span`` elements, bf16; taken out, so
    that a whole matrix on one rank is freed as it is orthogonalized): the owner
    gathers every rank's run into one buffer, orthogonalizes it in place of that buffer, and scatters the runs back.
    Above the model state the owner holds at most three copies of the matrix at once (:func:`_newton_schulz`), the
    other ranks a run."""
    world = pieces.world_size()

    def orthogonalize(holder: list[torch.Tensor]) -> torch.Tensor:
        flat = holder.pop()
        n = flat.numel()
        holder.append(flat[: q.total].view(q.shape))
        del flat
        matrix = _newton_schulz(holder, group["ns_coefficients"], int(group["ns_steps"]), group["eps"])
        out = matrix.new_zeros(n)  # the padding of the last rank's run stays zero
        out[: q.total].view(q.shape).copy_(matrix)
        return out

    if world == 1:
        return orthogonalize(runs)
    run = runs.pop()
    dist = torch.distributed
    rank, source = pieces.rank(), dist.get_global_rank(pieces.group, owner)
    holder = [torch.empty(world * run.numel(), dtype=run.dtype, device=run.device)] if rank == owner else []
    dist.gather(run, list(holder[0].chunk(world)) if holder else None, dst=source, group=pieces.group)
    pieces_back = list(orthogonalize(holder).chunk(world)) if holder else None
    out = torch.empty_like(run)
    dist.scatter(out, pieces_back, src=source, group=pieces.group)
    return out


def _owners(pieces: Pieces) -> list[int]:
    """The rank that orthogonalizes each matrix: the largest first, each to the rank with the fewest elements so far
    (the same answer on every rank)."""
    world = pieces.world_size()
    load = [0] * world
    owners = [0] * len(pieces.pieces)
    for k in sorted(range(len(pieces.pieces)), key=lambda k: (-pieces.pieces[k].total, k)):
        owners[k] = min(range(world), key=lambda r: (load[r], r))
        load[owners[k]] += pieces.pieces[k].total
    return owners


def _chunks(index_offset: int, n: int, chunk: int) -> Iterable[tuple[int, int]]:
    """``[begin, end)`` chunks of ``n`` elements whose random bits take one block key each (none crosses a multiple of
    2**32 of the index)."""
    begin = 0
    while begin < n:
        end = min(begin + chunk, n, next_high_word(index_offset + begin) - index_offset)
        yield begin, end
        begin = end


def _lr_ratio(adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


__all__ = ["AUX_ADAMW_DEFAULTS", "NS_COEFFICIENTS", "Muon", "muon_param_groups", "newton_schulz"]
