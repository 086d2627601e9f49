"""What every pure-bf16 optimizer of the family shares: the step and its checks, the inf/NaN skip, the rounding noise,
the state formats (bf16 or 8-bit), where the states live (memory or files), gradient release's slices, copies and
state dicts. An algorithm is a thin subclass (:mod:`~lightning_pure_bf16.optim.adamw`, ``lion``, ``sgd``) that
declares its states, checks its hyperparameters and turns a param group into the step's scalars
(``ops.algorithms``); it touches nothing of the rest.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_pure_bf16.ops import quant
from lightning_pure_bf16.ops.algorithms import ROUNDING_MODES, Args, DirectionArgs
from lightning_pure_bf16.ops.rng import Buffer, draw_seed, stream_key
from lightning_pure_bf16.ops.update_cpu import fused_cpu_available
from lightning_pure_bf16.ops.update_torch import DEFAULT_CHUNK
from lightning_pure_bf16.optim import functional, sharded, state_dicts, storage
from lightning_pure_bf16.optim.mmap_states import DEFAULT_STATE_CHUNK
from lightning_pure_bf16.optim.options import (
    OptimizerOptions,
    check_choice,
    check_power_of_two,
    check_torch_arguments,
)
from lightning_pure_bf16.optim.pieces import Pieces
from lightning_pure_bf16.optim.pieces import of_tensor as pieces_of_tensor

Rounding = Literal["stochastic", "kahan", "nearest"]
Backend = Literal["auto", "triton", "cpu", "torch"]
StateStorage = Literal["memory", "mmap"]


class _StepArgument:
    """A former one-step attribute that is now an argument of :meth:`PureBF16Optimizer.step`: reading or setting it
    says so (setting it used to apply it to the next step; now it would silently do nothing)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        raise AttributeError(self._message(obj))

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(self._message(obj))

    def _message(self, obj: Any) -> str:
        return (
            f"`{type(obj).__name__}.{self.name}` is an argument of the step now, for the one step it describes: call"
            f" `optimizer.step({self.name}=...)` instead of setting the attribute."
        )


# Attributes a copy or an unpickled optimizer keeps, besides torch's defaults, state and param groups.
_COPIED_ATTRIBUTES = (
    "seed",
    "backend",
    "chunk_size",
    "skipped_steps",
    "skipped_parameter_updates",
    "check_nonfinite",
    "state_storage",
    "state_chunk_size",
    "moments",
    "compensation",
    "_next_stream",
    "_closed",
    "_storage",
)


class PureBF16Optimizer(Optimizer):
    """The base of the pure-bf16 optimizers: bf16 parameters and states that lose nothing to rounding on average.

    Every buffer the size of the parameter has the parameter's dtype (or the 8-bit state format); all arithmetic is
    fp32, each buffer is read and written once per step by one fused kernel, and the weight's write is rounded as
    ``rounding`` says. float32 parameters get the plain float32 algorithm. Subclasses: :class:`AdamW`, :class:`Adam`,
    :class:`Lion`, :class:`SGD`.

    Options shared by every algorithm (keyword-only):

    Args:
        rounding: how bf16 values are written (default: ``"stochastic"``). ``"stochastic"`` rounds the parameter and
            every state stochastically; ``"kahan"`` keeps the part of the parameter update lost to rounding in a
            compensation buffer (+2 bytes/param) and rounds the states stochastically; ``"nearest"`` rounds
            everything to nearest-even, as other pure-bf16 optimizers do (small updates vanish).
        seed: seed of the counter-based rounding noise, saved in ``state_dict()`` (default: ``None``: drawn from
            torch's default generator, one 64-bit draw, as any torch random op would: the same ``torch.manual_seed``
            before building gives the same noise, in one process or two, and optimizers built one after the other
            draw different noise). Two optimizers given the same explicit seed draw the same noise for their n-th
            tensors.
        backend: ``"triton"`` (one fused kernel per tensor, CUDA), ``"cpu"`` (one fused C++ loop per tensor, CPU,
            compiled once per machine when the first optimizer with bf16 CPU parameters is made, or ahead of time by
            ``python -m lightning_pure_bf16.build``), ``"torch"`` (chunked PyTorch, any device) or ``"auto"``: Triton
            for CUDA tensors when it imports, the fused loop for CPU tensors when it compiles, else PyTorch (default:
            ``"auto"``). All give the same results bit for bit on the CPU; float32 parameters always take the PyTorch
            path.
        chunk_size: elements per chunk of the PyTorch path, a power of two (default: ``2**18``).
        state_storage: where the states (and the Kahan buffer) live: ``"memory"``, next to the parameter, or
            ``"mmap"``, in one memory-mapped file per parameter tensor under ``state_dir``, streamed through the
            update in chunks (same results bit for bit; the device holds only the weights) (default: ``"memory"``).
        state_dir: an existing, writable directory for the state files, ideally on a local NVMe disk; required with
            ``state_storage="mmap"``. Each optimizer makes its own subdirectory, removed by :meth:`close` (default:
            ``None``).
        state_chunk_size: elements per streamed chunk with ``state_storage="mmap"``, a power of two (default:
            ``2**22``).
        moments: the format of the per-element states of bf16 parameters (Adam's two moments, Lion's and SGD's
            momentum): ``"bf16"`` (2 bytes each) or ``"int8"`` (1 byte each plus a bf16 scale per 128 elements,
            :mod:`lightning_pure_bf16.ops.quant`; every 8-bit write is stochastically rounded) (default: ``"bf16"``).
            float32 parameters keep float32 states.
        compensation: the format of the Kahan buffer: ``"bf16"`` or ``"int8"`` (the remainder in units of 1/256 of
            the weight's bf16 spacing, stochastically rounded): 1 byte/param instead of 2 (default: ``"bf16"``).

    Attributes:
        skipped_steps: steps skipped because a gradient was inf/NaN (saved in ``state_dict()``).
        skipped_parameter_updates: updates of one parameter by :meth:`step_parameter` skipped because its gradient was
            inf/NaN.
        check_nonfinite: whether :meth:`step` checks gradients itself (default: ``True``). A distributed caller that
            makes the decision for all ranks sets it to ``False`` and uses :meth:`nonfinite_grads` and
            :meth:`record_skipped_step`.
        nonfinite_reduce: optional function applied to the local non-finite flag before deciding (for example an
            all-reduce with ``MAX``), so every rank skips together.
    """

    # What an algorithm declares: the names of its per-element states, in slot order (slot 0 signed, slot 1
    # non-negative: their 8-bit codes differ), and how it reads a param group.
    state_names: tuple[str, ...] = ()
    # Whether the update of an element needs the whole parameter (Adafactor's statistics, Muon's orthogonalization):
    # such an algorithm steps whole tensors only (no slices for gradient release) and reads what a tensor holds of
    # the parameters from set_pieces.
    whole_parameter = False
    # The per-tensor state keys of the torch.optim optimizer of the same algorithm, whose state dicts load
    # (from_torch_state converts each tensor's state); empty: the same as state_names.
    torch_state_names: tuple[str, ...] = ()
    grad_scale = _StepArgument()
    grads_finite = _StepArgument()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        rounding: Rounding = "stochastic",
        seed: int | None = None,
        backend: Backend = "auto",
        chunk_size: int = DEFAULT_CHUNK,
        state_storage: StateStorage = "memory",
        state_dir: str | os.PathLike | None = None,
        state_chunk_size: int = DEFAULT_STATE_CHUNK,
        moments: str = "bf16",
        compensation: str = "bf16",
        foreach: bool | None = None,
        fused: bool | None = None,
        **unsupported: Any,
    ) -> None:
        name = type(self).__name__
        check_torch_arguments(name, unsupported, foreach=foreach, fused=fused)
        for option, given, kept in (("state_storage", state_storage, "memory"), ("moments", moments, "bf16")):
            if self.whole_parameter and given != kept:
                raise ValueError(
                    f"`{name}({option}={given!r})` is not available: {name}'s update needs whole parameters, and"
                    f" its states stay in memory, in bf16 (Adafactor keeps none per element). Leave `{option}` at"
                    f" {kept!r}."
                )
        check_power_of_two(name, "chunk_size", chunk_size)
        if backend == "triton" and not functional.triton_available():
            functional.update_function("triton")  # says what is missing
        defaults = {**defaults, "rounding": rounding}
        self.check_group(name, defaults)
        OptimizerOptions(
            rounding=rounding,
            seed=seed,
            backend=backend,
            state_storage=state_storage,
            state_dir=None if state_dir is None else os.fspath(state_dir),
            moments=moments,
            compensation=compensation,
        ).check(name)
        check_power_of_two(name, "state_chunk_size", state_chunk_size, minimum=1024)
        self.state_storage = state_storage
        self.state_chunk_size = state_chunk_size
        self.moments = moments
        self.compensation = compensation
        self._closed = False
        self._storage = storage.make(state_storage, state_dir, state_chunk_size, name=name)
        self.seed = draw_seed() if seed is None else seed
        self.backend = backend
        self.chunk_size = chunk_size
        self.skipped_steps = 0
        self.skipped_parameter_updates = 0
        self.check_nonfinite = True
        self.nonfinite_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._next_stream = 0
        # The parameters this optimizer was given (ids): a float32 tensor stepped in their place is a wrapper's master.
        self._given_params: set[int] = set()
        self._pieces: dict[int, Pieces] = {}
        super().__init__(params, defaults)
        for hook in list(_construction_hooks.values()):
            hook(self)
        if backend in ("auto", "cpu") and any(
            p.device.type == "cpu" and p.dtype == torch.bfloat16 for g in self.param_groups for p in g["params"]
        ):
            # Compiled (or loaded from torch's extension cache) now, not inside the first step.
            fused_cpu_available()

    @classmethod
    def check_group(cls, who: str, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the first bad hyperparameter of ``group`` (its options merged over the
        defaults), before anything is built. An algorithm checks its own and calls this for the rounding."""
        check_choice(who, "rounding", group["rounding"], ROUNDING_MODES)

    def state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The per-element states a parameter of ``group`` keeps, in slot order (default: all of
        :attr:`state_names`; SGD without momentum keeps none)."""
        return self.state_names

    @staticmethod
    def from_torch_state(state: dict[str, Any]) -> dict[str, Any]:
        """One tensor's state from the torch.optim optimizer of the same algorithm, as this optimizer keeps it (its
        states are converted to the parameter's formats afterwards): a state without a step count starts at 0."""
        return state if "step" in state else {**state, "step": torch.tensor(0)}

    def update_args(self, group: dict[str, Any], *, step: int, keys: tuple[int, int, int], grad_scale: float) -> Args:
        """The scalars of one step of a parameter of ``group`` (``ops.algorithms``)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as ``torch.optim``: parameters, a generator of them, or ``(name, parameter)`` pairs) after
        checking its hyperparameters and that its parameters are bf16 or float32."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):
            # Listed once, here, and stored back as torch does: a generator read by the checks below would otherwise
            # reach torch empty, and the group would silently train nothing.
            params = param_group["params"] = list(params)
        elif isinstance(params, torch.Tensor):
            params = [params]
        for p in params:
            p = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # a named parameter
            if isinstance(p, torch.Tensor):
                functional.check_param(type(self).__name__, p)
                self._storage.check_param(type(self).__name__, p)
        self.check_group(type(self).__name__, {**self.defaults, **param_group})
        # torch checks the rest (sets, non-tensors, names on some parameters only, a parameter in two groups).
        super().add_param_group(param_group)
        self._given_params.update(id(p) for p in self.param_groups[-1]["params"])

    def set_pieces(self, p: torch.Tensor, pieces: Pieces, group: dict[str, Any] | None = None) -> None:
        """Say what the tensor ``p`` holds of the model's parameters (a ZeRO-3 flat partition holds a run of each
        parameter of its sub-group; :mod:`~lightning_pure_bf16.optim.pieces`), before its state exists; ``group`` is
        its param group when it is not in one now. Only the algorithms whose update needs whole parameters
        (:attr:`whole_parameter`) read it; a plain tensor or DTensor describes itself.

        Raises:
            ValueError: the pieces do not fit in ``p``, or the algorithm cannot step one of them.
        """
        end = max((q.offset + q.span for q in pieces.pieces), default=0)
        if end > sharded.local(p).numel() or any(
            q.numel > q.span or q.start + q.numel > q.total for q in pieces.pieces
        ):
            raise ValueError(
                f"{type(self).__name__}.set_pieces: pieces ending at element {end} do not fit in a tensor of"
                f" {sharded.local(p).numel()} elements, or a piece is longer than its parameter."
            )
        group = group if group is not None else self._group_of(p)
        if group is not None:
            self.check_pieces(type(self).__name__, group, pieces)
        self._pieces[id(p)] = pieces

    def pieces_of(self, p: torch.Tensor) -> Pieces:
        """What ``p`` holds of the model's parameters: as :meth:`set_pieces` said, else all of itself."""
        found = self._pieces.get(id(p))
        return found if found is not None else pieces_of_tensor(p)

    def check_pieces(self, who: str, group: dict[str, Any], pieces: Pieces) -> None:
        """Raise ``ValueError`` if a parameter of ``group`` described by ``pieces`` cannot be stepped (Muon: a
        parameter that is not a matrix); by default every piece can."""

    @property
    def state_dir(self) -> str | None:
        """The directory holding this optimizer's state files (its own subdirectory of ``state_dir``), if any."""
        return self._storage.directory

    def set_storage_label(self, label: str) -> None:
        """Name the state files' directory after ``label`` (a rank, say) instead of host and pid; before any state
        exists. Does nothing with in-memory states."""
        self._storage.set_label(label)

    def wait_for_state_writes(self) -> None:
        """Return once every state chunk an update computed is back in its file (``state_storage="mmap"`` on CUDA,
        where :meth:`update_slice` returns while its last chunks are still being written back; see
        :class:`~lightning_pure_bf16.optim.mmap_states.StateStreamer`). :meth:`state_dict`, :meth:`load_state_dict`
        and gradient release's end of step call it; does nothing otherwise."""
        self._storage.wait_for_writes()

    def close(self) -> None:
        """Remove the state files (``state_storage="mmap"``) and stop the streaming threads; idempotent.

        The optimizer cannot step afterwards. With in-memory states it only marks the optimizer closed.
        """
        self._storage.close(self.state.values())
        self._closed = True

    @torch.no_grad()
    def nonfinite_grads(self) -> torch.Tensor:
        """A 0-dim float32 tensor: 1.0 if any gradient of this optimizer holds inf or NaN, else 0.0 (one reduction)."""
        grads = [sharded.local(p.grad) for group in self.param_groups for p in group["params"] if p.grad is not None]
        return functional.any_nonfinite(grads, self.backend)

    def record_skipped_step(self) -> None:
        """Count a step that a caller skipped because of non-finite gradients (nothing else changes)."""
        self.skipped_steps += 1

    @torch.compiler.disable
    @torch.no_grad()
    def step_parameter(self, p: torch.Tensor) -> bool:
        """Apply the next step to the one parameter ``p`` now, from its gradient (gradient release: a hook called as
        soon as the gradient exists, such as the post-accumulate-grad hook FSDP2 calls after its reduce-scatter).

        The update is the one :meth:`step` would apply to ``p``, bit for bit (its random bits belong to its elements).
        An inf/NaN gradient leaves ``p`` and its states as they are (for a DTensor, on every rank: the decision is
        all-reduced, so every rank must call this for the same parameters in the same order, as FSDP2's hooks are);
        :attr:`skipped_parameter_updates` counts it. The caller frees the gradient.

        Returns:
            Whether ``p`` was updated.
        """
        self._check_open()
        group = self._group_of(p)
        if group is None:
            raise ValueError(f"{type(self).__name__}.step_parameter: the tensor is not a parameter of this optimizer.")
        if p.grad is None:
            return False

        def flag() -> torch.Tensor:
            return functional.any_nonfinite([sharded.local(p.grad)], self.backend)

        updated = self._apply([(p, group)], flag, agree_over=sharded.dtensors([p]))
        if not updated:
            self.skipped_parameter_updates += 1
        return updated

    @torch.compiler.disable
    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0, grads_finite: bool = False
    ) -> float | None:
        """One optimizer step; skipped entirely (no buffer or counter changes) when any gradient is inf/NaN.

        Under ``torch.compile`` the step runs eagerly (it is one fused kernel per tensor already), so it draws the
        same rounding noise as without compiling.

        Args:
            closure: re-evaluates the model and returns the loss, as in ``torch.optim``; called before the update.
            grad_scale: a factor every gradient element is multiplied by, in float32, inside the update's one pass
                (default: ``1.0``, no product): for a caller that clips by the global norm itself, in place of a
                pass of its own over the gradients. The strategies pass the clip factor here. A finite number > 0.
            grads_finite: the caller has established, on every rank, that every gradient is finite (a finite
                global norm over them, say): the step skips its own inf/NaN check, a pass over the gradients and a
                host synchronization (default: ``False``).
        """
        self._check_open()
        functional.check_grad_scale(f"`{type(self).__name__}.step(grad_scale=...)`", grad_scale)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        # One inf/NaN on any rank skips the step on every rank, as under ZeRO-3; every rank steps, so every rank
        # takes part in the agreement, over all its DTensor parameters (with a gradient or not), unless the caller
        # established on every rank that the gradients are finite (grads_finite).
        every = sharded.dtensors(q for g in self.param_groups for q in g["params"])
        nonfinite = None if grads_finite else self.nonfinite_grads
        if not self._apply(params, nonfinite, agree_over=every, grad_scale=float(grad_scale)):
            self.record_skipped_step()
        return loss

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"This {type(self).__name__} was closed (its state files are removed); it cannot step.")

    def _apply(
        self,
        params: list[tuple[torch.Tensor, dict[str, Any]]],
        nonfinite: Callable[[], torch.Tensor] | None,
        *,
        agree_over: list[torch.Tensor],
        grad_scale: float = 1.0,
    ) -> bool:
        """The update path of :meth:`step` and :meth:`step_parameter`: every tensor checked and its backend chosen
        before anything changes, the inf/NaN decision (``nonfinite()``, reduced by :attr:`nonfinite_reduce` or agreed
        over the DTensors ``agree_over`` across ranks), the state files made and checked, then each tensor updated.
        Returns whether the tensors were updated (False: a gradient was inf/NaN and nothing changed)."""
        name = type(self).__name__
        plan = [
            (p, group, functional.resolve_backend(self.backend, *sharded.local_pair(name, p), name=name))
            for p, group in params
        ]
        self._refuse_float32_masters(plan)
        if self.whole_parameter:
            for p, group, _ in plan:
                self.check_pieces(name, group, self.pieces_of(p))
        if self.check_nonfinite and nonfinite is not None:
            flag = nonfinite()
            if self.nonfinite_reduce is not None:
                flag = self.nonfinite_reduce(flag)
            elif agree_over and torch.distributed.is_initialized():
                flag = sharded.agree_any(flag, agree_over)
            if bool(flag.item()):
                return False
        # All states of this step exist (files: created together, after one free-space check) and are intact before
        # any buffer changes.
        self.init_states([(p, group) for p, group, _ in plan])
        self._storage.verify(self.state[p] for p, _, _ in plan)
        for p, group, backend in plan:
            state = self.state[p]
            state["step"] += 1
            shard, grad = sharded.local_pair(name, p)
            if self.whole_parameter:  # every rank takes part in the collectives, an empty shard included
                self.update_whole(p, group, grad, backend, step=int(state["step"].item()), grad_scale=grad_scale)
            elif shard.numel():  # FSDP2 leaves the last ranks' shards of a short tensor empty
                self._write(p, group, grad, 0, backend, step=int(state["step"].item()), grad_scale=grad_scale)
        return True

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
        """One step of a tensor whose update needs whole parameters (:attr:`whole_parameter`): ``grad`` is the
        gradient of ``p``'s local elements, to be multiplied by ``grad_scale`` in float32, :meth:`pieces_of` says
        which parameters they belong to. Writes through :meth:`write_direction` or :meth:`_write`."""
        raise NotImplementedError

    def write_direction(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        direction: torch.Tensor,
        start: int,
        *,
        step: int,
        step_size: float,
        decay: float,
        backend: str = "torch",
    ) -> None:
        """Move elements ``[start, start + direction.numel())`` of ``p``'s local tensor by ``-step_size * direction
        - decay * p``, one rounded write with the noise and Kahan remainder the elementwise algorithms use
        (``ops.algorithms.DirectionArgs``): the write of the whole-parameter algorithms. ``backend`` (resolved: the
        step's) writes a bf16 direction of a bf16 tensor (Muon's) with the fused kernels, the same bits as the PyTorch
        path, which writes every other (Adafactor's float32 direction)."""
        state = self.state[p]
        seed, offset = self._noise(p)
        args = DirectionArgs(
            step_size=step_size,
            decay=decay,
            step=step,
            rounding=group["rounding"],
            keys=tuple(stream_key(seed, state["stream"], step, b) for b in Buffer),  # type: ignore[arg-type]
        )
        end = start + direction.numel()
        kahan = group["rounding"] == "kahan" and p.dtype == torch.bfloat16
        fused = p.dtype == direction.dtype == torch.bfloat16 and backend != "torch"
        functional.update_function(backend if fused else "torch", self.chunk_size)(
            sharded.local(p).view(-1)[start:end],
            direction,
            [],
            sharded.local(state[state_dicts.KAHAN_KEY]).view(-1)[start:end] if kahan else None,
            args,
            index_offset=offset + start,
        )

    def _group_of(self, p: torch.Tensor) -> dict[str, Any] | None:
        """The group holding ``p``, from an index rebuilt when the groups change (one lookup per hook call, not a scan
        of every parameter): ``add_param_group`` appends a group, ``load_state_dict`` replaces the list."""
        groups = self.param_groups
        indexed = getattr(self, "_indexed_groups", None)
        if indexed is None or indexed[0] is not groups or indexed[1] != len(groups):
            index = {id(q): g for g in groups for q in g["params"]}
            self._indexed_groups = indexed = (groups, len(groups), index)
        return indexed[2].get(id(p))

    def _noise(self, p: torch.Tensor) -> tuple[int, int]:
        """The seed and the index of the first element that ``p``'s update draws its random bits with
        (:func:`~lightning_pure_bf16.optim.sharded.noise`)."""
        return sharded.noise(p, self.seed, block=quant.QBLOCK if self.int8_states(p) else 1)

    def _refuse_float32_masters(self, plan: list[tuple[torch.Tensor, dict[str, Any], str]]) -> None:
        """A float32 tensor put in the param groups in place of the parameters this optimizer was given is a wrapper's
        float32 master copy (DeepSpeed's ZeRO and bf16 optimizers make one under bf16 mixed precision): the run
        would keep float32 masters and moments, 16 bytes/param under the name of pure bf16. Refused."""
        wide = [p for p, _, _ in plan if p.dtype == torch.float32 and id(p) not in self._given_params]
        if wide:
            numel = sum(p.numel() for p in wide)
            raise RuntimeError(
                f"{type(self).__name__} was handed {len(wide)} float32 tensor(s) ({numel:,} elements) in place of its"
                " parameters: float32 master weights made by a wrapper (DeepSpeed's ZeRO or bf16 optimizer under"
                " bf16 mixed precision), which would train with float32 masters and moments, 16 bytes/param instead"
                " of 8. Let this package set DeepSpeed up: `Trainer(strategy='deepspeed_pure_bf16')` (Lightning),"
                " `lightning_pure_bf16.deepspeed.initialize` (plain DeepSpeed),"
                " `lightning_pure_bf16.integrations.transformers.PureBF16Trainer` (Hugging Face Trainer) or"
                " `lightning_pure_bf16.integrations.accelerate.PureBF16Accelerator` (Accelerate)."
            )

    def init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Allocate the state of ``p`` (a parameter of ``group``) now instead of at its first step.

        Callers that own the parameters (the ZeRO-3 strategy) use it so that memory is allocated, reported and, if
        short, fails at setup rather than at the first step. Idempotent.
        """
        self.init_states([(p, group)])
        return self.state[p]

    def init_states(self, params: Iterable[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """:meth:`init_state` for several parameters; with ``state_storage="mmap"`` their files are created together,
        after one check that the disk has room for all of them (all or none). Idempotent."""
        pending: list[tuple[torch.Tensor, dict[str, Any], list[tuple[str, int, torch.dtype]]]] = []
        for p, group in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.int64)
                # The stream id decorrelates the rounding noise of different tensors; fixed at first use and saved.
                state["stream"] = self._next_stream
                self._next_stream += 1
            specs = [(k, *self.buffer_spec(p, k)) for k in self._buffer_keys(p, group) if k not in state]
            if specs:
                pending.append((p, state, specs))
        self._storage.allocate(type(self).__name__, pending)

    def _buffer_keys(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[str, ...]:
        keys = self.state_keys(group)
        if self.int8_states(p):
            keys += tuple(state_dicts.scale_key(k) for k in keys)
        if group["rounding"] == "kahan" and p.dtype == torch.bfloat16:
            keys += (state_dicts.KAHAN_KEY,)
        return keys

    def int8_states(self, p: torch.Tensor) -> bool:
        """Whether the per-element states of ``p`` are 8-bit codes (``moments="int8"`` and a bf16 parameter)."""
        return self.moments == "int8" and p.dtype == torch.bfloat16

    def buffer_spec(self, p: torch.Tensor, key: str) -> tuple[int, torch.dtype]:
        """Elements and dtype of the state buffer ``key`` of ``p`` (of its local shard, for a DTensor)."""
        n = sharded.local(p).numel()
        if state_dicts.is_scale_key(key):
            # Scale blocks start at the shard's first element: a block never spans two ranks.
            return quant.scale_blocks(n), torch.bfloat16
        if key == state_dicts.KAHAN_KEY:
            return n, torch.int8 if self.compensation == "int8" and p.dtype == torch.bfloat16 else p.dtype
        if self.int8_states(p):
            return n, torch.uint8 if self.state_names.index(key) else torch.int8
        return n, p.dtype

    @torch.no_grad()
    def dequantized_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The moments (and Kahan remainder) of ``p`` as float32 tensors of its shape, whatever their format (of this
        rank's shard's shape, for a DTensor parameter).

        For inspection, tests and conversion; an empty dict before ``p``'s state exists.
        """
        return state_dicts.dequantized(self, p)

    def set_step(self, p: torch.Tensor, step: int) -> None:
        """Set the step count of ``p``'s state (which exists, :meth:`init_state`): what a checkpoint loaded piece by
        piece (:meth:`load_state_range`) saved."""
        state = self.state.get(p, {})
        if "step" not in state:
            raise RuntimeError(
                f"{type(self).__name__}.set_step: the tensor has no state yet; call `init_states` first."
            )
        state["step"] = torch.tensor(int(step), dtype=torch.int64)

    @torch.no_grad()
    def load_state_range(self, p: torch.Tensor, start: int, values: dict[str, torch.Tensor]) -> None:
        """Write elements ``[start, start + n)`` of the state buffers of ``p`` (a plain tensor whose state exists,
        :meth:`init_state`) from ``values``, keyed as the buffers, each 1-D of ``n`` elements in any format (floats,
        8-bit codes with their per-element scales): straight into the buffers, memory or files, so a checkpoint of any
        size loads in pieces. See :func:`lightning_pure_bf16.optim.state_dicts.load_state_range`.
        """
        state_dicts.load_state_range(self, p, start, values)

    @torch.no_grad()
    def update_slice(self, p: torch.Tensor, group: dict[str, Any], grad: torch.Tensor, start: int) -> None:
        """Apply elements ``[start, start + grad.numel())`` of the next step of the flat tensor ``p`` now, with
        ``grad`` as their gradient (gradient release: each parameter's slice of a ZeRO-3 partition is updated as soon
        as its gradient exists).

        The step counter is not advanced: the slices of one step all take step ``state["step"] + 1`` and give the
        bits of the whole update (the random bits belong to the element's index in ``p``); call
        :meth:`advance_step` once the step is complete. ``p``'s state must exist (:meth:`init_states`). With states
        in files the slice's states stream as the whole tensor's do (on the CPU updated in the mapping, on a GPU
        through the staging slots, the last chunks written back after this returns: :meth:`wait_for_state_writes`
        before the files are read). With 8-bit moments the slice covers whole scale blocks: ``start`` is a multiple
        of ``QBLOCK`` and the slice ends at one or at the end of ``p``.

        Raises:
            RuntimeError: no state yet.
            ValueError: a slice outside ``p``, or one that cuts an 8-bit scale block.
            StateStorageError: a state file that cannot be read or written (naming it).
        """
        name = type(self).__name__
        sharded.refuse_dtensor(f"{name}.update_slice", p, "slices of ZeRO-3 partitions only; use `step`")
        if self.whole_parameter:
            raise ValueError(
                f"{name}.update_slice: {name}'s update needs each parameter's whole gradient (its statistics or its"
                " orthogonalization), so it cannot update slices as gradients arrive. Turn gradient release off."
            )
        state = self.state.get(p, {})
        if "step" not in state:
            raise RuntimeError(f"{name}.update_slice: the tensor has no state yet; call `init_states` first.")
        end = start + grad.numel()
        if start < 0 or end > p.numel():
            raise ValueError(f"{name}.update_slice: elements [{start}, {end}) are outside a tensor of {p.numel()}.")
        if self.int8_states(p) and (start % quant.QBLOCK or (end % quant.QBLOCK and end != p.numel())):
            raise ValueError(
                f"{name}.update_slice: with 8-bit moments a slice covers whole blocks of {quant.QBLOCK} elements;"
                f" [{start}, {end}) of {p.numel()} does not."
            )
        if end > start:
            backend = functional.resolve_backend(self.backend, p.view(-1)[start:end], grad.reshape(-1), name=name)
            self._write(p, group, grad, start, backend, step=int(state["step"].item()) + 1, defer_writes=True)

    def advance_step(self, p: torch.Tensor) -> None:
        """Count one completed step of ``p`` whose slices :meth:`update_slice` applied."""
        self.state[p]["step"] += 1

    @torch.no_grad()
    def nonfinite(self, tensors: list[torch.Tensor]) -> list[bool]:
        """For each tensor, whether it holds inf or NaN (one read each; one device synchronization in all)."""
        return functional.nonfinite(tensors, self.backend)

    def _write(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        grad: torch.Tensor,
        start: int,
        backend: str,
        *,
        step: int,
        grad_scale: float = 1.0,
        defer_writes: bool = False,
    ) -> None:
        """The one update path: elements ``[start, start + grad.numel())`` of ``p`` (of its local shard, for a DTensor)
        at step ``step`` from their gradient ``grad``, through the state storage (``defer_writes``: see
        :meth:`update_slice`)."""
        state = self.state[p]
        seed, offset = self._noise(p)
        names = self.state_keys(group)
        args = self.update_args(
            group,
            step=step,
            keys=tuple(stream_key(seed, state["stream"], step, b) for b in Buffer),  # type: ignore[arg-type]
            grad_scale=grad_scale,
        )
        update = functional.update_function(backend, self.chunk_size)
        kahan = group["rounding"] == "kahan" and p.dtype == torch.bfloat16

        def run(param: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], index_offset: int) -> None:
            update(
                param,
                grad,
                [states[k] for k in names],
                states[state_dicts.KAHAN_KEY] if kahan else None,
                args,
                scales=[states.get(state_dicts.scale_key(k)) for k in names],
                index_offset=index_offset,
            )

        # A remainder kept from an earlier rounding="kahan" is neither read nor written under another rounding.
        keys = [k for k in self._buffer_keys(p, group) if k in state]
        self._storage.update(
            run,
            sharded.local(p),
            grad,
            {k: sharded.local(state[k]) for k in keys},
            start=start,
            index_offset=offset + start,
            defer_writes=defer_writes,
        )

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy``, ``pickle`` and ``torch.save(optimizer)`` keep: torch's state plus the seed, the
        counters and the options, so a copy continues bit for bit like the original. ``nonfinite_reduce`` is left out
        (like torch's hooks: it is bound to a process group); a copy checks its own gradients until it is set again.
        With ``state_storage="mmap"`` the moments travel as tensors and the copy writes them to state files of its
        own (under the same ``state_dir``); the original's files are never touched."""
        state = super().__getstate__()
        state.update({k: getattr(self, k) for k in _COPIED_ATTRIBUTES})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "seed" not in state:
            # torch's load_state_dict sets the state and param groups through __setstate__: not a copy.
            super().__setstate__(state)
            return
        state = {"skipped_parameter_updates": 0, "_storage": storage.InMemory(), **state}
        super().__setstate__(state)
        self._given_params = {id(p) for group in self.param_groups for p in group["params"]}  # the copy's own
        self._pieces = {}  # a ZeRO-3 partition's description belongs to the engine that set it
        self.nonfinite_reduce = None
        self._storage.adopt_copy(self)

    def state_dict(self) -> dict[str, Any]:
        """The torch state dict plus the rounding seed, the stream counter and the skipped-step count.

        With DTensor parameters (FSDP2, tensor parallelism) every state tensor with one element per parameter element
        is a DTensor sharded like its parameter, so ``torch.distributed.checkpoint`` saves and reshards it; the 8-bit
        moments' block scales are given once per element for that (only in the state dict: in memory a block of 128
        elements has one), and the seed and counters are repeated in every parameter group, which
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keeps (it drops other top-level keys)."""
        return state_dicts.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`; restores the seed, so the run continues bit for bit.

        States saved with either ``state_storage`` load into either: with ``"mmap"`` the saved moments are copied
        into fresh state files (checked against the parameters first) instead of being moved to the device. A state
        dict of ``torch.optim.AdamW``/``Adam`` loads too: its moments are rounded to the parameters' dtype, each
        tensor gets a fresh noise stream, and this optimizer's seed and ``rounding`` stay.

        Load-state-dict pre-hooks see the whole state dict; post-hooks see the restored seed and counters.
        """
        state_dicts.load_state_dict(self, state_dict)


# Called with every optimizer of this package once it is built (register_construction_hook): the layers above watch
# what a host does with it, and this layer knows nothing of any host.
_construction_hooks: OrderedDict[int, Callable[[PureBF16Optimizer], None]] = OrderedDict()  # weakly referred to


def register_construction_hook(hook: Callable[[PureBF16Optimizer], None]) -> RemovableHandle:
    """Call ``hook(optimizer)`` for every optimizer of this package built from now on, after its parameter groups
    are set and before its first step. Returns a handle whose ``remove()`` stops the calls."""
    handle = RemovableHandle(_construction_hooks)
    _construction_hooks[handle.id] = hook
    return handle


__all__ = ["PureBF16Optimizer", "register_construction_hook"]
