"""Pure-bf16 Adafactor (Shazeer and Stern 2018) with the semantics of ``torch.optim.Adafactor``: no first moment, the
second moment of a tensor of two or more dimensions factored into row and column statistics (full for one
dimension), the relative step size ``min(lr, 1/sqrt(t))`` scaled by the parameter's RMS, the update clipped to an RMS
of ``d``, decoupled weight decay.

The statistics need whole parameters: a ZeRO-3 flat partition or an FSDP2 shard holds a run of a parameter's
elements, so each rank sums its own run's squares into the rows and columns they belong to
(:class:`~lightning_pure_bf16.optim.pieces.Piece`), and the ranks add the sums up in one all-reduce per step and
tensor, then the RMS of the update in a second. The statistics are float32 (they are O(rows + columns), not
O(elements)); the weight's write is rounded like every other algorithm's. About 4 bytes per parameter on the device:
the bf16 weight and gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from lightning_pure_bf16.optim import sharded
from lightning_pure_bf16.optim.base import PureBF16Optimizer
from lightning_pure_bf16.optim.options import check_lr, check_non_negative
from lightning_pure_bf16.optim.pieces import Piece, Pieces
from lightning_pure_bf16.optim.state_dicts import STATISTICS_KEY


class Adafactor(PureBF16Optimizer):
    """Adafactor whose bf16 parameters lose nothing to rounding on average, its statistics float32.

    Args:
        params: parameters or parameter groups; groups may override ``lr``, ``beta2_decay``, ``eps``, ``d``,
            ``weight_decay`` and ``rounding``.
        lr: the largest relative step size: the step is ``min(lr, 1 / sqrt(t))`` times the parameter's RMS (at
            least ``eps[1]``) (default: ``1e-2``).
        beta2_decay: the second moment's average takes ``t ** beta2_decay`` of the new squares (default: ``-0.8``).
        eps: ``(eps1, eps2)``: the floor of the second moment's estimate (``None``: float32's machine epsilon, the
            arithmetic being float32) and of the parameter's RMS (default: ``(None, 1e-3)``).
        d: the update's RMS is clipped to this (default: ``1.0``).
        weight_decay: decoupled weight decay coefficient, multiplied by ``lr`` (default: ``0.0``).
        **options: the options every optimizer of the package shares
            (:class:`~lightning_pure_bf16.optim.base.PureBF16Optimizer`); the states stay in memory
            (``state_storage="memory"``) and there are no per-element moments to keep in 8 bits.
    """

    whole_parameter = True
    torch_state_names = ("row_var", "col_var", "variance")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        **options: Any,
    ) -> None:
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": eps, "d": d, "weight_decay": weight_decay}
        super().__init__(params, defaults, **options)

    @classmethod
    def check_group(cls, who: str, group: dict[str, Any]) -> None:
        check_lr(who, group["lr"])
        if not float(group["beta2_decay"]) <= 0.0:
            raise ValueError(f"`{who}(beta2_decay={group['beta2_decay']!r})` must be <= 0, as torch.optim.Adafactor.")
        eps = group["eps"]
        if len(eps) != 2 or (eps[0] is not None and not float(eps[0]) >= 0.0) or not float(eps[1]) >= 0.0:
            raise ValueError(f"`{who}(eps={eps!r})` must be a pair (eps1 >= 0 or None, eps2 >= 0).")
        check_non_negative(who, "d", group["d"], "the update's clipping threshold")
        check_non_negative(who, "weight_decay", group["weight_decay"], "weight decay")
        super().check_group(who, group)

    @staticmethod
    def from_torch_state(state: dict[str, Any]) -> dict[str, Any]:
        statistics = {k: state[k].detach().reshape(-1).float() for k in ("row_var", "col_var") if k in state}
        variance = state.get("variance")
        statistics["variance"] = (
            variance.detach().reshape(-1).float() if variance is not None else torch.zeros(0, dtype=torch.float32)
        )
        for key in ("row_var", "col_var"):
            statistics.setdefault(key, torch.zeros(0, dtype=torch.float32))
        return {"step": torch.as_tensor(state.get("step", 0)).to(torch.int64), STATISTICS_KEY: statistics}

    def init_states(self, params: Iterable[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        params = list(params)
        super().init_states(params)
        for p, _ in params:
            state = self.state[p]
            if STATISTICS_KEY not in state:
                rows, cols, variance = _sizes(self.pieces_of(p))
                device = sharded.local(p).device
                state[STATISTICS_KEY] = {
                    "row_var": torch.zeros(rows, dtype=torch.float32, device=device),
                    "col_var": torch.zeros(cols, dtype=torch.float32, device=device),
                    "variance": torch.zeros(variance, dtype=torch.float32, device=device),
                }

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
        pieces = self.pieces_of(p)
        stats = self.state[p][STATISTICS_KEY]
        flat_p, flat_g = sharded.local(p).reshape(-1), grad.reshape(-1)
        lr, d, decay = float(group["lr"]), float(group["d"]), float(group["lr"]) * float(group["weight_decay"])
        eps1 = torch.finfo(torch.float32).eps if group["eps"][0] is None else float(group["eps"][0])
        eps2 = float(group["eps"][1])
        places = _places(pieces)
        chunk, scale = self.chunk_size, grad_scale

        def grad_of(q: Piece, begin: int, end: int) -> torch.Tensor:
            g = flat_g[q.offset + begin : q.offset + end].to(torch.float32, copy=True)
            return g.mul_(scale) if scale != 1.0 else g

        # The parameter's squares and the gradient's row and column sums of squares, this rank's runs, then summed.
        sums = torch.zeros(
            len(pieces.pieces) + stats["row_var"].numel() + stats["col_var"].numel(), device=flat_p.device
        )
        norms, rows, cols = sums.split([len(pieces.pieces), stats["row_var"].numel(), stats["col_var"].numel()])
        for k, (q, r0, c0, _) in enumerate(places):
            for begin in range(0, q.numel, chunk):
                end = min(begin + chunk, q.numel)
                norms[k] += flat_p[q.offset + begin : q.offset + end].float().square().sum()
                if len(q.shape) >= 2:
                    g2 = grad_of(q, begin, end).square_()
                    r, c = q.indices(begin, end, flat_p.device)
                    rows[r0 : r0 + q.rows].index_add_(0, r, g2)
                    cols[c0 : c0 + q.cols].index_add_(0, c, g2)
        _all_reduce(sums, pieces)

        # The moving averages (every rank the same, from the same sums), then each element's preconditioned gradient.
        beta = float(step) ** float(group["beta2_decay"])
        row_means: list[torch.Tensor | None] = []
        for q, r0, c0, _ in places:
            if len(q.shape) < 2:
                row_means.append(None)
                continue
            row_var, col_var = stats["row_var"][r0 : r0 + q.rows], stats["col_var"][c0 : c0 + q.cols]
            row_var.lerp_(rows[r0 : r0 + q.rows].div_(q.shape[-1]), beta)
            col_var.lerp_(cols[c0 : c0 + q.cols].div_(q.shape[-2]), beta)
            row_means.append(row_var.view(-1, q.shape[-2]).mean(dim=1).clamp_(min=eps1))

        def direction(k: int, begin: int, end: int, *, average: bool) -> torch.Tensor:
            q, r0, c0, v0 = places[k]
            g = grad_of(q, begin, end)
            if row_means[k] is None:
                variance = stats["variance"][v0 + begin : v0 + end]
                if average:
                    variance.lerp_(g.square(), beta)
                estimate = variance.clamp(min=eps1 * eps1)
            else:
                r, c = q.indices(begin, end, flat_p.device)
                estimate = stats["row_var"][r0 + r].mul_(stats["col_var"][c0 + c]).div_(row_means[k][r // q.shape[-2]])
                estimate.clamp_(min=eps1 * eps1)
            return g.mul_(estimate.rsqrt_())

        updates = torch.zeros(len(places), device=flat_p.device)
        for k, (q, *_) in enumerate(places):
            for begin in range(0, q.numel, chunk):
                updates[k] += direction(k, begin, min(begin + chunk, q.numel), average=True).square().sum()
        _all_reduce(updates, pieces)

        rho = min(lr, 1.0 / math.sqrt(step))
        for k, (q, *_) in enumerate(places):
            root = math.sqrt(q.total)
            alpha = max(eps2, math.sqrt(float(norms[k])) / root) * rho
            denominator = max(1.0, math.sqrt(float(updates[k])) / (root * d)) if d > 0 else math.inf
            for begin in range(0, q.numel, chunk):
                end = min(begin + chunk, q.numel)
                u = direction(k, begin, end, average=False)
                self.write_direction(
                    p, group, u, q.offset + begin, step=step, step_size=alpha / denominator, decay=decay
                )


def _places(pieces: Pieces) -> list[tuple[Piece, int, int, int]]:
    """Each piece with where its rows, columns (matrices) or elements (vectors) start in the statistics."""
    out, rows, cols, variance = [], 0, 0, 0
    for q in pieces.pieces:
        out.append((q, rows, cols, variance))
        if len(q.shape) >= 2:
            rows, cols = rows + q.rows, cols + q.cols
        else:
            variance += q.numel
    return out


def statistics_of_pieces(
    pieces: Pieces, statistics: dict[str, torch.Tensor]
) -> list[tuple[Piece, dict[str, torch.Tensor]]]:
    """Each piece of a tensor holding ``pieces``, with its part of the tensor's float32 statistics (views): a
    matrix's whole ``row_var`` and ``col_var`` (summed over the ranks, every rank holds them whole), a vector's
    ``variance`` of the piece's own elements (``[piece.start, piece.start + piece.numel)`` of the parameter). How a
    checkpoint's statistics are read per parameter and written into another layout."""
    out = []
    for q, rows, cols, variance in _places(pieces):
        if len(q.shape) >= 2:
            part = {
                "row_var": statistics["row_var"][rows : rows + q.rows],
                "col_var": statistics["col_var"][cols : cols + q.cols],
            }
        else:
            part = {"variance": statistics["variance"][variance : variance + q.numel]}
        out.append((q, part))
    return out


def _sizes(pieces: Pieces) -> tuple[int, int, int]:
    """Elements of the row, column and vector statistics of a tensor holding ``pieces``."""
    places = _places(pieces)
    if not places:
        return 0, 0, 0
    q, rows, cols, variance = places[-1]
    if len(q.shape) >= 2:
        return rows + q.rows, cols + q.cols, variance
    return rows, cols, variance + q.numel


def _all_reduce(t: torch.Tensor, pieces: Pieces) -> None:
    if pieces.world_size() > 1:
        torch.distributed.all_reduce(t, group=pieces.group)


__all__ = ["Adafactor", "statistics_of_pieces"]
