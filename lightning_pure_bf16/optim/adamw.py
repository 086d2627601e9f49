"""Pure-bf16 Adam and AdamW: bf16 parameters and moments, stochastic rounding or Kahan compensation on every write.

The optimizer owns state, hyperparameters and dispatch; the arithmetic lives in ``ops`` (one fused Triton kernel for
CUDA tensors, a chunked PyTorch path everywhere else), which draw identical random bits from ``ops.rng``.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_pure_bf16.ops import quant
from lightning_pure_bf16.ops.adamw_cpu import (
    any_nonfinite_cpu,
    can_use_fused_cpu,
    fused_cpu_available,
)
from lightning_pure_bf16.ops.adamw_torch import (
    DEFAULT_CHUNK,
    UpdateArgs,
)
from lightning_pure_bf16.ops.rng import draw_seed, rank_seed
from lightning_pure_bf16.optim import functional, sharded, state_dicts
from lightning_pure_bf16.optim.mmap_states import (
    DEFAULT_STATE_CHUNK,
    MmapStateStore,
    StateStreamer,
    check_state_dir,
    read_ahead,
)
from lightning_pure_bf16.optim.options import (
    BACKENDS,
    UNSUPPORTED_TORCH_OPTIONS,
    OptimizerOptions,
    check_choice,
    check_seed,
    unsupported_torch_options,
)
from lightning_pure_bf16.optim.state_dicts import BUFFER_KEYS as _BUFFER_KEYS
from lightning_pure_bf16.optim.state_dicts import SCALE_KEYS as _SCALE_KEYS
from lightning_pure_bf16.optim.state_dicts import STORED_KEYS as _STORED_KEYS

Rounding = Literal["stochastic", "kahan", "nearest"]
Backend = Literal["auto", "triton", "cpu", "torch"]
StateStorage = Literal["memory", "mmap"]

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
)


class AdamW(Optimizer):
    """AdamW whose bf16 parameters and moments lose nothing to rounding on average.

    Every buffer the size of the parameter has the parameter's dtype: with bf16 parameters the optimizer state is
    4 bytes per parameter (6 with Kahan). All arithmetic is fp32, each buffer is read and written once per step, and
    decoupled weight decay is part of the same rounded write. float32 parameters get plain float32 AdamW.

    Args:
        params: parameters or parameter groups; groups may override ``lr``, ``betas``, ``eps``, ``weight_decay`` and
            ``rounding``.
        lr: learning rate (default: ``1e-3``).
        betas: coefficients of the moment averages (default: ``(0.9, 0.999)``).
        eps: added to the denominator (default: ``1e-8``).
        weight_decay: decoupled weight decay coefficient (default: ``1e-2``).
        rounding: how bf16 values are written (default: ``"stochastic"``). ``"stochastic"`` rounds the parameter and
            both moments stochastically; ``"kahan"`` keeps the part of the parameter update lost to rounding in a bf16
            compensation buffer (+2 bytes/param) and rounds the moments stochastically; ``"nearest"`` rounds
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
        state_storage: where the moments (and the Kahan buffer) live: ``"memory"``, next to the parameter, or
            ``"mmap"``, in one memory-mapped file per parameter tensor under ``state_dir``, streamed through the
            update in chunks (same results bit for bit; the device holds 4 bytes/param less) (default: ``"memory"``).
        state_dir: an existing, writable directory for the state files, ideally on a local NVMe disk; required with
            ``state_storage="mmap"``. Each optimizer makes its own subdirectory, removed by :meth:`close` (default:
            ``None``).
        state_chunk_size: elements per streamed chunk with ``state_storage="mmap"``, a power of two (default:
            ``2**22``).
        moments: the format of both moments of bf16 parameters: ``"bf16"`` (2 bytes each) or ``"int8"`` (1 byte
            each plus a bf16 scale per 128 elements, :mod:`lightning_pure_bf16.ops.quant`; every 8-bit write is
            stochastically rounded): 6 bytes/param of model state instead of 8 (default: ``"bf16"``). float32
            parameters keep float32 moments.
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

    _decoupled_default = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
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
        for option in unsupported:
            if option not in UNSUPPORTED_TORCH_OPTIONS:
                raise TypeError(f"{name}() got an unexpected keyword argument {option!r}.")
        for option, value in unsupported_torch_options(unsupported).items():
            raise ValueError(
                f"`{name}({option}={value!r})` is not supported by the pure-bf16 optimizer. Remove `{option}` or"
                " use a torch.optim optimizer with fp32 master weights."
            )
        if foreach or fused:
            flag = "foreach" if foreach else "fused"
            raise ValueError(
                f"`{name}({flag}=True)` selects a torch.optim implementation; the pure-bf16 optimizer picks its own."
                " Use `backend='triton'` or `backend='torch'` instead."
            )
        check_choice(name, "backend", backend, BACKENDS)
        if chunk_size <= 0 or chunk_size & (chunk_size - 1):
            raise ValueError(f"`chunk_size` must be a positive power of two, got {chunk_size}.")
        check_seed(name, seed)
        if backend == "triton" and not functional.triton_available():
            functional.update_function("triton")  # says what is missing
        functional.check_hyperparameters(name, lr, betas, eps, weight_decay, rounding)
        OptimizerOptions(
            rounding=rounding,
            backend=backend,
            state_storage=state_storage,
            state_dir=None if state_dir is None else os.fspath(state_dir),
            moments=moments,
            compensation=compensation,
        ).check(name)
        if state_chunk_size < 1024 or state_chunk_size & (state_chunk_size - 1):
            raise ValueError(f"`state_chunk_size` must be a power of two >= 1024, got {state_chunk_size}.")
        self.state_storage = state_storage
        self.state_chunk_size = state_chunk_size
        self.moments = moments
        self.compensation = compensation
        self._store: MmapStateStore | None = None
        self._streamers: dict[tuple[torch.device, torch.dtype, int], StateStreamer] = {}
        self._closed = False
        if state_storage == "mmap":
            who = f"{name}(state_storage='mmap', state_dir={os.fspath(state_dir)!r})"  # type: ignore[arg-type]
            self._store = MmapStateStore(check_state_dir(state_dir, who=who), who=who)  # type: ignore[arg-type]
            # Files are removed when the optimizer is closed, garbage-collected, or the interpreter exits.
            self._finalizer = weakref.finalize(self, _close_storage, self._store, self._streamers)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "rounding": rounding,
            "decoupled_weight_decay": self._decoupled_default,
        }
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
        super().__init__(params, defaults)
        for hook in list(_construction_hooks.values()):
            hook(self)
        if backend in ("auto", "cpu") and any(
            p.device.type == "cpu" and p.dtype == torch.bfloat16 for g in self.param_groups for p in g["params"]
        ):
            # Compiled (or loaded from torch's extension cache) now, not inside the first step.
            fused_cpu_available()

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
                self._check_tensor_kind(p)
            if isinstance(p, torch.Tensor) and p.dtype not in (torch.bfloat16, torch.float32):
                raise TypeError(
                    f"{type(self).__name__} supports bfloat16 and float32 parameters, got a {p.dtype} parameter of"
                    f" shape {tuple(p.shape)}. Convert the model with `model.to(torch.bfloat16)`."
                )
        merged = {**self.defaults, **param_group}
        functional.check_hyperparameters(
            type(self).__name__,
            merged["lr"],
            merged["betas"],
            merged["eps"],
            merged["weight_decay"],
            merged["rounding"],
        )
        # torch checks the rest (sets, non-tensors, names on some parameters only, a parameter in two groups).
        super().add_param_group(param_group)
        self._given_params.update(id(p) for p in self.param_groups[-1]["params"])

    def _check_tensor_kind(self, p: torch.Tensor) -> None:
        name = type(self).__name__
        if not sharded.is_dtensor(p):
            functional.refuse_subclass(name, p, "a parameter")
            return
        why = sharded.unsupported_placement(p)
        if why is not None:
            raise TypeError(f"{name}: a DTensor parameter of shape {tuple(p.shape)} cannot be trained: {why}.")
        if self.state_storage == "mmap":
            raise ValueError(
                f"`{name}(state_storage='mmap')` keeps whole tensors' states in files; a DTensor parameter of shape"
                f" {tuple(p.shape)} (FSDP2, tensor parallelism) has only a shard on this rank. Use"
                " `state_storage='memory'` with sharded parameters."
            )
        functional.refuse_subclass(name, sharded.local(p), "the local shard of a DTensor parameter")

    @property
    def state_dir(self) -> str | None:
        """The directory holding this optimizer's state files (its own subdirectory of ``state_dir``), if any."""
        if self._store is None:
            return None
        return os.fspath(self._store.directory or self._store.root)

    def set_storage_label(self, label: str) -> None:
        """Name the state files' directory after ``label`` (a rank, say) instead of host and pid; before any state
        exists. Does nothing with in-memory states."""
        if self._store is not None:
            self._store.label = label

    def wait_for_state_writes(self) -> None:
        """Return once every state chunk an update computed is back in its file (``state_storage="mmap"`` on CUDA,
        where :meth:`update_slice` returns while its last chunks are still being written back; see
        :class:`~lightning_pure_bf16.optim.mmap_states.StateStreamer`). :meth:`state_dict`, :meth:`load_state_dict`
        and gradient release's end of step call it; does nothing otherwise."""
        for streamer in self._streamers.values():
            streamer.wait_for_writes()

    def close(self) -> None:
        """Remove the state files (``state_storage="mmap"``) and stop the streaming threads; idempotent.

        The optimizer cannot step afterwards. With in-memory states it only marks the optimizer closed.
        """
        if self._store is not None:
            self._finalizer()
            for state in self.state.values():
                for key in _STORED_KEYS:
                    state.pop(key, None)
        self._closed = True

    @torch.no_grad()
    def nonfinite_grads(self) -> torch.Tensor:
        """A 0-dim float32 tensor: 1.0 if any gradient of this optimizer holds inf or NaN, else 0.0 (one reduction)."""
        found = [
            self._nonfinite(sharded.local(p.grad))
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if any(f is True for f in found):
            return torch.ones((), dtype=torch.float32)
        flags = [f.to(torch.float32) for f in found if isinstance(f, torch.Tensor)]
        if not flags:
            return torch.zeros((), dtype=torch.float32)
        devices = {f.device for f in flags}
        if len(devices) > 1:
            flags = [f.cpu() for f in flags]
        return torch.cat(flags).amax()

    def _nonfinite(self, t: torch.Tensor) -> bool | torch.Tensor:
        """Whether ``t`` holds inf or NaN: a bool from the fused CPU loop's read-only pass (torch's isfinite on bf16 CPU
        tensors costs more than the update itself), else a 1-element bool tensor on ``t``'s device (no sync)."""
        if self.backend in ("auto", "cpu") and can_use_fused_cpu(t, t) and fused_cpu_available():
            return any_nonfinite_cpu(t)
        return torch.logical_not(torch.isfinite(t).all()).reshape(1)

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
            return torch.as_tensor(self._nonfinite(sharded.local(p.grad)), dtype=torch.float32).reshape(())

        updated = self._apply([(p, group)], flag, agree_over=[p] if sharded.is_dtensor(p) else [])
        if not updated:
            self.skipped_parameter_updates += 1
        return updated

    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step; skipped entirely (no buffer or counter changes) when any gradient is inf/NaN.

        Under ``torch.compile`` the step runs eagerly (it is one fused kernel per tensor already), so it draws the
        same rounding noise as without compiling.
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        # One inf/NaN on any rank skips the step on every rank, as under ZeRO-3; every rank steps, so every rank takes
        # part in the agreement.
        if not self._apply(params, self.nonfinite_grads, agree_over=self._sharded_params()):
            self.record_skipped_step()
        return loss

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"This {type(self).__name__} was closed (its state files are removed); it cannot step.")

    def _apply(
        self,
        params: list[tuple[torch.Tensor, dict[str, Any]]],
        nonfinite: Callable[[], torch.Tensor],
        *,
        agree_over: list[torch.Tensor],
    ) -> bool:
        """The update path of :meth:`step` and :meth:`step_parameter`: every tensor checked and its backend chosen
        before anything changes, the inf/NaN decision (``nonfinite()``, reduced by :attr:`nonfinite_reduce` or agreed
        over the DTensors ``agree_over`` across ranks), the state files made and checked, then each tensor updated.
        Returns whether the tensors were updated (False: a gradient was inf/NaN and nothing changed)."""
        name = type(self).__name__
        plan = [
            (p, group, functional.resolve_backend(self.backend, *self._local_pair(p), name=name)) for p, group in params
        ]
        self._refuse_float32_masters(plan)
        if self.check_nonfinite:
            flag = nonfinite()
            if self.nonfinite_reduce is not None:
                flag = self.nonfinite_reduce(flag)
            elif agree_over and torch.distributed.is_initialized():
                flag = sharded.agree_any(flag, agree_over)
            if bool(flag.item()):
                return False
        if self._store is not None:
            # All files of this step exist (created together, after one free-space check) and are intact before
            # any buffer changes.
            self.init_states([(p, group) for p, group, _ in plan])
            for p, _, _ in plan:
                self._store.verify(self.state[p]["stream"])
        for p, group, backend in plan:
            self._update(p, group, backend)
        return True

    def _group_of(self, p: torch.Tensor) -> dict[str, Any] | None:
        """The group holding ``p``, from an index rebuilt when the groups change (one lookup per hook call, not a scan
        of every parameter): ``add_param_group`` appends a group, ``load_state_dict`` replaces the list."""
        groups = self.param_groups
        indexed = getattr(self, "_indexed_groups", None)
        if indexed is None or indexed[0] is not groups or indexed[1] != len(groups):
            index = {id(q): g for g in groups for q in g["params"]}
            self._indexed_groups = indexed = (groups, len(groups), index)
        return indexed[2].get(id(p))

    def _sharded_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if sharded.is_dtensor(p)]

    def _local_pair(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors the update writes and reads: a DTensor parameter's local shard and its gradient's."""
        if not sharded.is_dtensor(p):
            return p, p.grad
        sharded.check_grad(type(self).__name__, p, p.grad)
        return sharded.local(p), sharded.local(p.grad)

    def _noise(self, p: torch.Tensor) -> tuple[int, int]:
        """The seed and the index of the first element that ``p``'s update draws its random bits with: the
        optimizer's seed and 0 for a plain tensor; for a DTensor's shard, its elements' indices in the whole tensor
        (or a seed of the shard's own, see :mod:`lightning_pure_bf16.optim.sharded`)."""
        if not sharded.is_dtensor(p):
            return self.seed, 0
        where = sharded.layout(p, block=quant.QBLOCK if self._int8_moments(p) else 1)
        return (self.seed if where.shard is None else rank_seed(self.seed, where.shard)), where.index_offset

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
        pending: list[tuple[torch.Tensor, dict[str, Any], list[str]]] = []
        for p, group in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.int64)
                # The stream id decorrelates the rounding noise of different tensors; fixed at first use and saved.
                state["stream"] = self._next_stream
                self._next_stream += 1
            keys = [k for k in self._buffer_keys(p, group) if k not in state]
            if keys:
                pending.append((p, group, keys))
        if self._store is None:
            for p, _, keys in pending:
                for key in keys:
                    self.state[p][key] = self._new_buffer(p, key)
            return
        for p, _, keys in pending:
            if self.state[p]["stream"] in self._store.files:
                raise RuntimeError(
                    f"{type(self).__name__}(state_storage='mmap'): a parameter needs the state buffers {keys} added to"
                    " its existing state file (its group's `rounding` changed to 'kahan' after its first step); that"
                    " is not supported. Set the rounding before the first step."
                )
        requests = [
            (self.state[p]["stream"], [self._buffer_spec(p, k) for k in self._buffer_keys(p, g)]) for p, g, _ in pending
        ]
        created = self._store.allocate(requests)
        for p, group, _ in pending:
            buffers = created[self.state[p]["stream"]]
            for key, flat in zip(self._buffer_keys(p, group), buffers):
                self.state[p][key] = flat if key in _SCALE_KEYS else flat.view(p.shape)

    def _buffer_keys(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[str, ...]:
        keys: tuple[str, ...] = _BUFFER_KEYS[:2]
        if self._int8_moments(p):
            keys += _SCALE_KEYS
        if group["rounding"] == "kahan" and p.dtype == torch.bfloat16:
            keys += _BUFFER_KEYS[2:]
        return keys

    def _int8_moments(self, p: torch.Tensor) -> bool:
        return self.moments == "int8" and p.dtype == torch.bfloat16

    def _buffer_spec(self, p: torch.Tensor, key: str) -> tuple[int, torch.dtype]:
        """Elements and dtype of the state buffer ``key`` of ``p`` (of its local shard, for a DTensor)."""
        if key in _SCALE_KEYS:
            # Scale blocks start at the shard's first element: a block never spans two ranks.
            return quant.scale_blocks(sharded.local(p).numel()), torch.bfloat16
        dtype = p.dtype
        if self._int8_moments(p) and key in _BUFFER_KEYS[:2]:
            dtype = torch.int8 if key == "exp_avg" else torch.uint8
        elif key == "kahan_comp" and self.compensation == "int8":
            dtype = torch.int8
        return sharded.local(p).numel(), dtype

    def _new_buffer(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """A zero buffer; for a DTensor parameter, a DTensor sharded like it (its block scales: this rank's, plain)."""
        numel, dtype = self._buffer_spec(p, key)
        shard = sharded.local(p)
        shape = (numel,) if key in _SCALE_KEYS else shard.shape
        buffer = torch.zeros(shape, dtype=dtype, device=shard.device)
        return sharded.like(buffer, p) if sharded.is_dtensor(p) and key not in _SCALE_KEYS else buffer

    @torch.no_grad()
    def dequantized_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The moments (and Kahan remainder) of ``p`` as float32 tensors of its shape, whatever their format (of this
        rank's shard's shape, for a DTensor parameter).

        For inspection, tests and conversion; an empty dict before ``p``'s state exists.
        """
        stored = self.state.get(p, {})
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

    @torch.no_grad()
    def load_state_range(self, p: torch.Tensor, start: int, values: dict[str, torch.Tensor]) -> None:
        """Write elements ``[start, start + n)`` of the state buffers of ``p`` (a plain tensor whose state exists,
        :meth:`init_state`) from ``values``, keyed as the buffers (``exp_avg``, ``exp_avg_sq``, ``kahan_comp``), each
        1-D of ``n`` elements in any format; what it reads is one range, what it writes goes straight into the
        buffers (memory or files), so a checkpoint of any size loads in pieces:

        - floats (bf16, float32): a bf16 buffer takes them rounded to nearest; 8-bit moments encode them in their own
          blocks of this range; an 8-bit remainder encodes them against the weight ``p`` holds now. Encodings draw the
          noise of the tensor's stream at step 0, as :meth:`load_state_dict` does, whatever the range.
        - 8-bit moment codes with ``exp_avg_scale``/``exp_avg_sq_scale`` one per element (float32, the scale each code
          was written under; NaN where none: its code 0): re-blocked (:func:`ops.quant.reblock`), a block whose codes
          share a scale kept bit for bit.
        - an 8-bit remainder's codes: copied (its unit is its weight's spacing, the same for the same weight).

        A range of 8-bit moments starts on a block (a multiple of ``QBLOCK`` elements) and ends on one or at the end.
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
        if sharded.is_dtensor(p):
            raise TypeError(f"{name}.update_slice: slices of ZeRO-3 partitions only; this is a DTensor, use `step`.")
        state = self.state.get(p, {})
        if "exp_avg" not in state:
            raise RuntimeError(f"{name}.update_slice: the tensor has no state yet; call `init_states` first.")
        end = start + grad.numel()
        if start < 0 or end > p.numel():
            raise ValueError(f"{name}.update_slice: elements [{start}, {end}) are outside a tensor of {p.numel()}.")
        if self._int8_moments(p) and (start % quant.QBLOCK or (end % quant.QBLOCK and end != p.numel())):
            raise ValueError(
                f"{name}.update_slice: with 8-bit moments a slice covers whole blocks of {quant.QBLOCK} elements;"
                f" [{start}, {end}) of {p.numel()} does not."
            )
        if end == start:
            return
        args = self._step_args(group, state, int(state["step"].item()) + 1)
        flat = p.view(-1)[start:end]
        grad = grad.reshape(-1)
        pieces = {k: state[k].view(-1)[start:end] for k in _BUFFER_KEYS if k in state}
        blocks = slice(start // quant.QBLOCK, -(-end // quant.QBLOCK))
        scales = {k: state[k][blocks] for k in _SCALE_KEYS if k in state}
        kahan_comp = pieces.get("kahan_comp") if group["rounding"] == "kahan" else None
        backend = functional.resolve_backend(self.backend, flat, grad, name=type(self).__name__)
        update = functional.update_function(backend, self.chunk_size)
        if self._store is not None:
            # The backward reaches a partition's parameters in the reverse of their order, and the kernel's readahead
            # follows a file forward: the states just before this slice are asked for now (asynchronously), to be read
            # from the disk while this slice is updated.
            ahead = max(0, start - (end - start))
            read_ahead([state[k].view(-1)[ahead:start] for k in _BUFFER_KEYS if k in state])
            sliced = {**pieces, **scales}
            self._update_streamed(
                update, flat, grad, sliced, kahan_comp is not None, args, index_base=start, defer_writes=True
            )
            return
        update(flat, grad, pieces["exp_avg"], pieces["exp_avg_sq"], kahan_comp, args, index_offset=start, **scales)

    def advance_step(self, p: torch.Tensor) -> None:
        """Count one completed step of ``p`` whose slices :meth:`update_slice` applied."""
        self.state[p]["step"] += 1

    @torch.no_grad()
    def nonfinite(self, tensors: list[torch.Tensor]) -> list[bool]:
        """For each tensor, whether it holds inf or NaN (one read each; one device synchronization in all)."""
        found = [self._nonfinite(t) for t in tensors]
        flags = [f for f in found if isinstance(f, torch.Tensor)]
        if flags:
            rest = iter(torch.cat([f.cpu() for f in flags] if len({f.device for f in flags}) > 1 else flags).tolist())
            found = [next(rest) if isinstance(f, torch.Tensor) else f for f in found]
        return [bool(f) for f in found]

    def _step_args(
        self, group: dict[str, Any], state: dict[str, Any], step: int, seed: int | None = None
    ) -> UpdateArgs:
        seed = self.seed if seed is None else seed
        return functional.update_args(**_hyperparameters(group), step=step, seed=seed, stream=state["stream"])

    def _update(self, p: torch.Tensor, group: dict[str, Any], backend: str) -> None:
        state = self.init_state(p, group)
        state["step"] += 1
        step = int(state["step"].item())
        if self._store is not None:  # plain tensors only (DTensors are refused with state files)
            kahan = group["rounding"] == "kahan" and "kahan_comp" in state
            args = self._step_args(group, state, step)
            self._update_streamed(functional.update_function(backend, self.chunk_size), p, p.grad, state, kahan, args)
            return
        seed, offset = self._noise(p)
        shard, grad = self._local_pair(p)
        if not shard.numel():  # FSDP2 leaves the last ranks' shards of a short tensor empty
            return
        buffers = {k: sharded.local(v) for k, v in state.items() if k in _STORED_KEYS}
        functional.adamw(
            shard,
            grad,
            buffers.pop("exp_avg"),
            buffers.pop("exp_avg_sq"),
            step=step,
            **_hyperparameters(group),
            **buffers,
            seed=seed,
            stream=state["stream"],
            index_offset=offset,
            backend=backend,
            chunk_size=self.chunk_size,
        )

    def _update_streamed(
        self,
        update: Callable[..., None],
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        kahan: bool,
        args: UpdateArgs,
        index_base: int = 0,
        defer_writes: bool = False,
    ) -> None:
        keys = ["exp_avg", "exp_avg_sq", *(["kahan_comp"] if kahan else []), *(k for k in _SCALE_KEYS if k in state)]
        states = [state[k].view(-1) for k in keys]
        specs = tuple((t.dtype, quant.QBLOCK if k in _SCALE_KEYS else 1) for k, t in zip(keys, states))
        key = (p.device, specs)
        streamer = self._streamers.get(key)
        # Slots as large as the largest tensor seen (a power of two), at most state_chunk_size: small models do not
        # pay for 8 MiB slots. 8-bit moments stream whole scale blocks.
        chunk = min(self.state_chunk_size, 1 << max(p.numel() - 1, 1).bit_length())
        if any(k in _SCALE_KEYS for k in keys):
            chunk = max(chunk, quant.QBLOCK)
        if streamer is None or streamer.chunk < chunk:
            if streamer is not None:
                streamer.close()
            streamer = self._streamers[key] = StateStreamer(p.device, specs, chunk)
        p_flat = p.view(-1) if p.is_contiguous() else p.contiguous().view(-1)
        g_flat = grad.reshape(-1)
        scale_at = {k: i for i, k in enumerate(keys) if k in _SCALE_KEYS}

        def forward(chunks: list[torch.Tensor]) -> tuple[Any, ...]:
            scales = {k: chunks[i] for k, i in scale_at.items()}
            return chunks[0], chunks[1], chunks[2] if kahan else None, args, scales

        def call(param_chunk, grad_chunk, m, v, c, step_args, scales, index_offset):  # noqa: ANN001, ANN202
            update(param_chunk, grad_chunk, m, v, c, step_args, index_offset=index_offset, **scales)

        streamer.update(call, p_flat, g_flat, states, forward, index_base, defer_writes)
        if not p.is_contiguous():
            p.copy_(p_flat.view(p.shape))

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy``, ``pickle`` and ``torch.save(optimizer)`` keep: torch's state plus the seed, the
        counters and the options, so a copy continues bit for bit like the original. ``nonfinite_reduce`` is left out
        (like torch's hooks: it is bound to a process group); a copy checks its own gradients until it is set again.
        With ``state_storage="mmap"`` the moments travel as tensors and the copy writes them to state files of its
        own (under the same ``state_dir``); the original's files are never touched."""
        if self._store is not None and self._closed:
            raise RuntimeError(
                f"This {type(self).__name__} was closed and its state files removed: there are no moments to copy."
            )
        state = super().__getstate__()
        state.update({k: getattr(self, k) for k in _COPIED_ATTRIBUTES})
        if self._store is not None:
            state["_state_root"] = os.fspath(self._store.root)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "seed" not in state:
            # torch's load_state_dict sets the state and param groups through __setstate__: not a copy.
            super().__setstate__(state)
            return
        state = dict(state)
        root = state.pop("_state_root", None)
        state.setdefault("skipped_parameter_updates", 0)
        super().__setstate__(state)
        self._given_params = {id(p) for group in self.param_groups for p in group["params"]}  # the copy's own
        self.nonfinite_reduce = None
        self._streamers = {}
        self._store = None
        if root is None:
            return
        # The copied moments are plain tensors now; they move into files of this copy's own.
        who = f"{type(self).__name__}(state_storage='mmap', state_dir={root!r}) (a copy)"
        self._store = MmapStateStore(check_state_dir(root, who=who), who=who)
        self._finalizer = weakref.finalize(self, _close_storage, self._store, self._streamers)
        saved = {p: {k: st.pop(k) for k in _STORED_KEYS if k in st} for p, st in self.state.items()}
        state_dicts.load_buffers_into_files(self, saved)

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
_construction_hooks: OrderedDict[int, Callable[[AdamW], None]] = OrderedDict()  # RemovableHandle refers to it weakly


def register_construction_hook(hook: Callable[[AdamW], None]) -> RemovableHandle:
    """Call ``hook(optimizer)`` for every :class:`AdamW` (and :class:`Adam`) built from now on, after its parameter
    groups are set and before its first step. Returns a handle whose ``remove()`` stops the calls."""
    handle = RemovableHandle(_construction_hooks)
    _construction_hooks[handle.id] = hook
    return handle


def _close_storage(store: MmapStateStore, streamers: dict[Any, StateStreamer]) -> None:
    for streamer in streamers.values():
        streamer.close()
    streamers.clear()
    store.close()


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """What :func:`functional.adamw` takes of a param group."""
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "rounding")}


class Adam(AdamW):
    """Adam with L2 weight decay added to the gradient (``torch.optim.Adam`` semantics), pure bf16.

    Same arguments as :class:`AdamW`, except ``weight_decay`` defaults to ``0`` and is coupled unless
    ``decoupled_weight_decay=True``.
    """

    _decoupled_default = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        **kwargs: Any,
    ) -> None:
        self._decoupled_default = decoupled_weight_decay
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)


__all__ = ["Adam", "AdamW", "register_construction_hook"]
