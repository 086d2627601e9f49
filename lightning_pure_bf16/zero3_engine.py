"""A DeepSpeed engine in pure bf16, the same for every front end: its process group's teardown, its construction (the
master partitions aliased to the bf16 ones), what is set up on a new engine (states allocated, the step's patches,
gradient release, the gather policy, the memory report) and what is kept for it (:class:`EngineHandle`)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import shutil
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from lightning_pure_bf16 import _internals, collectives, gather
from lightning_pure_bf16._log import rank_zero_info, rank_zero_warn
from lightning_pure_bf16.memory import PeakMeter, format_peak, format_report, peak_report, zero3_model_state_report
from lightning_pure_bf16.optim import PureBF16Optimizer, pieces
from lightning_pure_bf16.presets import PureBF16Settings
from lightning_pure_bf16.release import GradientRelease


@contextlib.contextmanager
def process_group_destroyed_at_exit() -> Iterator[None]:
    """Around a front end's process-group setup: a default process group created inside is destroyed at interpreter
    exit, while Python is still whole; one that existed before (the user's) is left alone.

    Without it the group lives until the interpreter's own teardown, where gloo's worker threads may still hold work
    objects: a finished fit can then end in ``terminate called without an active exception`` (SIGABRT, exit 134),
    rarely and more often under load (benchmarks/exit_stress.py counts it; pytorch/pytorch#190489). Lightning
    registers the same for NCCL groups it creates itself, but the DeepSpeed strategies create theirs through DeepSpeed.
    The group is not destroyed at ``teardown``: a second fit in the same process reuses it (DeepSpeed keeps handles to
    it).
    """
    existed = torch.distributed.is_available() and torch.distributed.is_initialized()
    yield
    if not existed and torch.distributed.is_available() and torch.distributed.is_initialized():
        destroy_process_group_at_exit()


_DESTROY_REGISTERED: list[bool] = []


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit if it is still alive then (ranks leaving together), once
    per process. For the integrations, whose group another library created (the HF ``TrainingArguments``,
    Accelerate's state) and nobody destroys: the abort :func:`process_group_destroyed_at_exit` describes happened to a
    finished HF Trainer run. A group destroyed before exit is not touched."""
    if not _DESTROY_REGISTERED:
        _DESTROY_REGISTERED.append(True)
        atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if not torch.distributed.is_initialized():
        return
    if torch.distributed.get_backend() == "gloo":
        # Leave together, as far as a short wait allows: a rank that tears its connections down while another still
        # uses them can abort that one. A rank that never comes (it crashed) costs this wait, not a hang.
        with contextlib.suppress(RuntimeError):
            torch.distributed.monitored_barrier(timeout=timedelta(seconds=30))
    torch.distributed.destroy_process_group()


def device_rank(root_device: torch.device, local_rank: int) -> int:
    """The device rank DeepSpeed wants: the device index, or the local rank for CPU devices (which have none)."""
    return root_device.index if root_device.index is not None else local_rank


@contextlib.contextmanager
def zero3_construction(gradient_release: bool) -> Iterator[None]:
    """Around ``deepspeed.initialize``, for every front end: ZeRO-3's master partitions aliased to the bf16 parameter
    partitions (without the gradient buffers release never uses), and DeepSpeed's collectives in bounded pieces under
    gloo before (ZeRO-3's construction gathers every parameter once, to hook its gradient) and after (where
    ``deepspeed.initialize`` set up DeepSpeed's communication backend itself)."""
    collectives.bounded_gloo_collectives()
    with _internals.alias_bf16_master_partitions(gradient_release=gradient_release):
        yield
    collectives.bounded_gloo_collectives()


def initialize_engine(
    config: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Any,
    lr_scheduler: Any,
    rank: int,
    settings: PureBF16Settings | None = None,
) -> tuple[Any, Any, Any]:
    """``deepspeed.initialize`` with ZeRO-3's master partitions aliased to the bf16 parameter partitions, after the
    final config is checked against the front end's ``settings``."""
    import deepspeed

    if settings is not None:
        settings.check_engine_config(config)

    model_parameters = filter(lambda p: p.requires_grad, model.parameters())
    with zero3_construction(gradient_release=settings is not None and settings.gradient_release):
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            args=argparse.Namespace(device_rank=rank),
            config=config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
    return engine, ds_optimizer, ds_scheduler


def inner_optimizer(engine: Any) -> PureBF16Optimizer:
    """The pure-bf16 optimizer inside DeepSpeed's ZeRO-3 optimizer (holds the moments and counters)."""
    return _internals.zero3_inner_optimizer(engine.optimizer)


def memory_report(engine: Any) -> dict[str, float]:
    """Model-state bytes per parameter on this rank, by category, from the live ZeRO-3 buffers
    (:func:`lightning_pure_bf16.memory.zero3_model_state_report`)."""
    return zero3_model_state_report(engine.optimizer, engine.module)


def init_zero3_optimizer_state(zero_optimizer: Any) -> None:
    """Allocate the pure-bf16 optimizer's state for every ZeRO-3 sub-group now, in sub-group order.

    That is the order of the first step, so nothing changes but the time of allocation: the memory report at setup
    is the steady state, and a shortage of memory shows at setup instead of at the first step.
    """
    optimizer = _internals.zero3_inner_optimizer(zero_optimizer)
    if optimizer.whole_parameter:
        describe_zero3_partitions(zero_optimizer, optimizer)
    optimizer.init_states(
        (flat, optimizer.param_groups[group]) for flat, group in _internals.zero3_sub_groups(zero_optimizer)
    )


def describe_zero3_partitions(zero_optimizer: Any, optimizer: PureBF16Optimizer) -> None:
    """Tell an optimizer whose update needs whole parameters (Adafactor, Muon) which run of which parameter each
    flat partition of this rank holds, and over which process group the other runs are.

    Raises:
        ValueError: a parameter its group's algorithm cannot step (Muon: not a matrix), naming it.
    """
    group = _internals.zero3_data_parallel_group(zero_optimizer)
    rank = torch.distributed.get_rank(group)
    for sub, shapes in zip(_internals.zero3_layout(zero_optimizer), _internals.zero3_param_shapes(zero_optimizer)):
        described = [(name, shape, numel, span) for (name, numel, span), shape in zip(sub.params, shapes)]
        optimizer.set_pieces(sub.flat, pieces.zero3(described, rank, group), optimizer.param_groups[sub.group])


def after_engine_setup(
    engine: Any,
    strategy_name: str,
    device: torch.device,
    *,
    gradient_release: bool = False,
    gather_cache: str = "auto",
) -> EngineHandle:
    """Set a new engine up for pure bf16 and return what the package keeps for it (:class:`EngineHandle`, also
    ``engine.pure_bf16``): every sub-group's optimizer state allocated now (a shortage shows at setup), the step
    given views of the gradient partition instead of copies, its clip factor applied inside the update (no pass of
    its own) and a gradient norm read in one pass, gradient release if asked (which frees the gradient partition),
    the next layer gathered ahead with ``gather_cache="next"`` (and, with ``"auto"``, where the first step leaves
    room for it), and the memory per parameter logged."""
    optimizer = inner_optimizer(engine)
    if gradient_release and optimizer.whole_parameter:
        raise ValueError(
            f"`{strategy_name}(gradient_release=True)` updates each parameter's partition as its gradient arrives,"
            f" but {type(optimizer).__name__}'s update needs every rank's part of a parameter first (its statistics"
            " or its orthogonalization). Turn gradient release off for this optimizer."
        )
    init_zero3_optimizer_state(engine.optimizer)
    _internals.reduce_full_buckets_at_once(engine.optimizer)
    if gather_cache == "next":
        gather.prefetch_next_module(engine.optimizer)
    release = None
    if gradient_release:
        # ZeRO-3's step then updates nothing: the step's gradient views and norm are not installed (they would keep
        # a reference to the gradient partition that release frees).
        release = GradientRelease(engine.optimizer, strategy_name)
    else:
        _internals.view_sub_group_gradients(engine.optimizer)
        _internals.fold_gradient_scale(engine.optimizer)
        collectives.gradient_norm_in_one_pass(engine.optimizer)
    report = memory_report(engine)
    rank_zero_info(f"{strategy_name}: model state per parameter on each rank: " + format_report(report))
    if optimizer.state_storage == "mmap":
        used = report["state_files"] * report["params_on_rank"] / 1024**3
        free = shutil.disk_usage(optimizer.state_dir).free / 1024**3
        rank_zero_info(
            f"{strategy_name}: optimizer states in memory-mapped files, {used:.2f} GiB in {optimizer.state_dir} on"
            f" rank 0 ({free:.1f} GiB left on that disk); each rank has its own directory there."
        )
    meter = PeakMeter(device)
    gather_policy = gather.NextLayerIfItFits(engine, meter, strategy_name) if gather_cache == "auto" else None
    handle = EngineHandle(engine, strategy_name, meter, release, gather_policy)
    meter.reset()
    return handle


class EngineHandle:
    """What this package keeps for one DeepSpeed engine, made by :func:`after_engine_setup` and held the same way by
    every front end (``engine.pure_bf16``): the gradient release, the gather policy, the peak meter, and the one wrap
    of ZeRO-3's step, after which the gather policy decides (once) and a step ZeRO-3 skipped on an inf/NaN gradient is
    counted in the pure-bf16 optimizer and reported.

    Attributes:
        release: the gradient release installed on the engine, or ``None``.
        gather: ``gather_cache="auto"``'s policy, or ``None``.
        meter: the peak memory since setup.
    """

    def __init__(
        self,
        engine: Any,
        strategy_name: str,
        meter: PeakMeter,
        release: GradientRelease | None,
        policy: gather.NextLayerIfItFits | None,
    ) -> None:
        self.engine, self.strategy_name, self.meter = engine, strategy_name, meter
        self.release, self.gather = release, policy
        if policy is not None:
            policy.install()
        zero_optimizer = engine.optimizer
        step = zero_optimizer.step  # gradient release's bookkeeping step, where release replaced it

        def step_and_account(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            self._after_step()
            return out

        zero_optimizer.step = step_and_account
        self.optimizer.overflow = False  # DeepSpeed's ZeRO flag for a skipped step, read by Accelerate
        engine.pure_bf16 = self

    @property
    def optimizer(self) -> PureBF16Optimizer:
        """The pure-bf16 optimizer inside ZeRO-3's."""
        return inner_optimizer(self.engine)

    def _after_step(self) -> None:
        if self.gather is not None:
            self.gather.after_step()
        skipped = _internals.zero3_step_skipped(self.engine.optimizer)
        optimizer = self.optimizer
        optimizer.overflow = skipped
        if skipped:
            optimizer.record_skipped_step()
            rank_zero_warn(
                f"{self.strategy_name}: a gradient was inf/NaN, the step was skipped on every rank"
                f" ({optimizer.skipped_steps} skipped so far)."
            )

    def memory_report(self) -> dict[str, float]:
        """Model-state bytes per parameter on this rank (see :func:`memory_report`)."""
        return memory_report(self.engine)

    def peak_memory(self) -> dict[str, Any] | None:
        """The peak memory of this rank since setup beside its model state
        (:func:`lightning_pure_bf16.memory.peak_report`); ``None`` where no peak can be measured."""
        return peak_report(self.meter, memory_report(self.engine))

    def log_peak_memory(self) -> None:
        """The end-of-fit line: rank 0's measured peak beside its model state."""
        rank_zero_info(f"{self.strategy_name}: memory of rank 0 during the fit: " + format_peak(self.peak_memory()))


def engine_handle(engine: Any) -> EngineHandle | None:
    """What the package keeps for ``engine`` (:class:`EngineHandle`), or ``None`` for an engine it did not set up."""
    handle = getattr(engine, "pure_bf16", None)
    return handle if isinstance(handle, EngineHandle) else None


def gradient_release(engine: Any) -> GradientRelease | None:
    """The gradient release installed on this engine, if any."""
    handle = engine_handle(engine)
    return handle.release if handle is not None else None


__all__ = [
    "EngineHandle",
    "after_engine_setup",
    "describe_zero3_partitions",
    "destroy_process_group_at_exit",
    "device_rank",
    "engine_handle",
    "gradient_release",
    "init_zero3_optimizer_state",
    "initialize_engine",
    "inner_optimizer",
    "memory_report",
    "process_group_destroyed_at_exit",
    "zero3_construction",
]
