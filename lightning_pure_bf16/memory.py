"""Model-state memory accounting, measured from live ZeRO-3 buffers or FSDP2 shards, and the measured peak beside it
(used by the strategies, tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from lightning_pure_bf16._internals import (
    zero3_grad_partition_buffer,
    zero3_inner_optimizer,
    zero3_master_partitions,
    zero3_param_partitions,
)
from lightning_pure_bf16.optim import is_scale_key, scale_key
from lightning_pure_bf16.optim.sharded import local

CATEGORIES = (
    "param",
    "grad",
    "master",
    "exp_avg",
    "exp_avg_sq",
    "momentum_buffer",
    "kahan_comp",
    "statistics",
    "other_state",
)

# Model-state bytes per trainable parameter under ZeRO-3, by category, for the configurations the project compares.
# benchmarks/memory.py measures every one of them from live buffers; tests/test_plan.py checks the two agree.
MODEL_STATE_BYTES: dict[str, dict[str, float]] = {
    "pure_bf16_stochastic": {"param": 2, "grad": 2, "exp_avg": 2, "exp_avg_sq": 2},
    "pure_bf16_kahan": {"param": 2, "grad": 2, "exp_avg": 2, "exp_avg_sq": 2, "kahan_comp": 2},
    # moments="int8": one byte per element plus a bf16 scale per ops.quant.QBLOCK (128) elements.
    "pure_bf16_int8": {"param": 2, "grad": 2, "exp_avg": 1 + 2 / 128, "exp_avg_sq": 1 + 2 / 128},
    "pure_bf16_int8_kahan": {
        "param": 2,
        "grad": 2,
        "exp_avg": 1 + 2 / 128,
        "exp_avg_sq": 1 + 2 / 128,
        "kahan_comp": 1,
    },
    # gradient_release=True: no gradient partition (each partition is applied as its gradient is reduce-scattered).
    "pure_bf16_release": {"param": 2, "exp_avg": 2, "exp_avg_sq": 2},
    "pure_bf16_kahan_release": {"param": 2, "exp_avg": 2, "exp_avg_sq": 2, "kahan_comp": 2},
    "pure_bf16_int8_release": {"param": 2, "exp_avg": 1 + 2 / 128, "exp_avg_sq": 1 + 2 / 128},
    "pure_bf16_int8_kahan_release": {"param": 2, "exp_avg": 1 + 2 / 128, "exp_avg_sq": 1 + 2 / 128, "kahan_comp": 1},
    # The other algorithms: Lion's one moment, SGD's momentum buffer (none without momentum).
    "pure_bf16_lion": {"param": 2, "grad": 2, "exp_avg": 2},
    "pure_bf16_lion_kahan": {"param": 2, "grad": 2, "exp_avg": 2, "kahan_comp": 2},
    "pure_bf16_lion_int8": {"param": 2, "grad": 2, "exp_avg": 1 + 2 / 128},
    "pure_bf16_lion_release": {"param": 2, "exp_avg": 2},
    "pure_bf16_lion_int8_release": {"param": 2, "exp_avg": 1 + 2 / 128},
    "pure_bf16_sgd_momentum": {"param": 2, "grad": 2, "momentum_buffer": 2},
    "pure_bf16_sgd_momentum_int8_release": {"param": 2, "momentum_buffer": 1 + 2 / 128},
    "pure_bf16_sgd": {"param": 2, "grad": 2},
    # Adafactor: float32 row and column statistics (O(rows + columns), under 0.1 B/param at a width of 256; not
    # listed), Kahan's remainder; Muon: its momentum on the matrices (AdamW's two moments on the rest).
    "pure_bf16_adafactor": {"param": 2, "grad": 2},
    "pure_bf16_adafactor_kahan": {"param": 2, "grad": 2, "kahan_comp": 2},
    "pure_bf16_muon": {"param": 2, "grad": 2, "exp_avg": 2},
    # bf16_master_weights_and_grads + bf16_optimizer_states: a second bf16 copy as master.
    "deepspeed_bf16_master": {"param": 2, "grad": 2, "master": 2, "exp_avg": 2, "exp_avg_sq": 2},
    # DeepSpeed's bf16 default: fp32 master weights and fp32 moments.
    "deepspeed_bf16_mixed": {"param": 2, "grad": 2, "master": 4, "exp_avg": 4, "exp_avg_sq": 4},
    # state_storage="mmap": the moments (and the Kahan buffer) are in files, see STATE_FILE_BYTES.
    "pure_bf16_mmap": {"param": 2, "grad": 2},
    "pure_bf16_kahan_mmap": {"param": 2, "grad": 2},
    # state_storage="mmap" with gradient_release=True: the bf16 weights alone (each gradient partition applied, with
    # its states streamed from the files, as it is reduce-scattered).
    "pure_bf16_mmap_release": {"param": 2},
    "pure_bf16_kahan_mmap_release": {"param": 2},
    "pure_bf16_int8_mmap_release": {"param": 2},
    "pure_bf16_int8_kahan_mmap_release": {"param": 2},
}
# Bytes per trainable parameter in the memory-mapped state files (on disk, streamed through every step: read once,
# written once).
STATE_FILE_BYTES: dict[str, float] = {
    "pure_bf16_mmap": 4,
    "pure_bf16_kahan_mmap": 6,
    "pure_bf16_mmap_release": 4,
    "pure_bf16_kahan_mmap_release": 6,
    "pure_bf16_int8_mmap_release": 2 * (1 + 2 / 128),
    "pure_bf16_int8_kahan_mmap_release": 2 * (1 + 2 / 128) + 1,
}
# A frozen parameter has no gradient, master or moments: only its bf16 partition.
FROZEN_BYTES = 2


def state_category(key: str) -> str:
    """The category of the optimizer state entry ``key``: itself, but an 8-bit state's block scales belong to the
    state."""
    return key.removesuffix(scale_key("")) if is_scale_key(key) else key


def state_tensors(state: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(category, tensor)`` for every tensor of one parameter's optimizer state but its counters: the per-element
    states, their block scales, and an algorithm's statistics (Adafactor's rows and columns, ``statistics``)."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from ((key, t) for t in value.values() if isinstance(t, torch.Tensor))
        elif isinstance(value, torch.Tensor) and value.ndim > 0:
            yield state_category(key), value


def bytes_per_param(config: str) -> float:
    """Model-state bytes per trainable parameter held in memory by one of :data:`MODEL_STATE_BYTES`' configurations
    (state files excluded)."""
    return sum(MODEL_STATE_BYTES[config].values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_file_backed(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a memory-mapped file (``state_storage="mmap"``) rather than in device or host memory."""
    return t.untyped_storage().filename is not None


def zero3_model_state_report(zero_optimizer: Any, module: torch.nn.Module | None = None) -> dict[str, float]:
    """Bytes per parameter of this rank's partition, by category, read from a ZeRO-3 optimizer's buffers.

    ``param`` is the bf16 parameter partition, ``grad`` ZeRO-3's persistent gradient partition buffer, ``master``
    the master partition when it is a separate copy (0 when it is the parameter partition itself), then every tensor
    of the inner optimizer's state that has one element per parameter and is held in memory; state in memory-mapped
    files (``state_storage="mmap"``) is reported as ``state_files``, outside ``total``. Parameters ZeRO-3 keeps
    gathered on every rank (below ``stage3_param_persistence_threshold``) and fixed-size communication buckets are not
    model state and are not counted here; :func:`reachable_tensors` finds them.

    Frozen parameters (``requires_grad=False``) are not the optimizer's: with ``module`` given, their partitions on
    this rank are counted apart (``frozen``, 2 B/param: the bf16 partition, no gradient or state) and beside the
    trainable ones in ``whole_model``.

    Returns:
        One entry per name in :data:`CATEGORIES` plus ``"total"`` (bytes per trainable parameter in memory),
        ``"state_files"`` (bytes/param in files), ``"params_on_rank"`` (trainable elements), ``"frozen"`` (bytes per
        frozen parameter), ``"frozen_params_on_rank"`` and ``"whole_model"`` (bytes per parameter over trainable and
        frozen together; ``total`` when nothing is frozen).
    """
    params = zero3_param_partitions(zero_optimizer)
    n = sum(t.numel() for t in params)
    param_ptrs = {t.data_ptr() for t in params}
    nbytes = dict.fromkeys(CATEGORIES, 0)
    nbytes["param"] = sum(_nbytes(t) for t in params)
    grad_buffer = zero3_grad_partition_buffer(zero_optimizer)
    nbytes["grad"] = _nbytes(grad_buffer) if grad_buffer is not None else 0
    nbytes["master"] = sum(
        _nbytes(t) for t in zero3_master_partitions(zero_optimizer) if t.data_ptr() not in param_ptrs
    )
    in_files = 0
    for state in zero3_inner_optimizer(zero_optimizer).state.values():
        for category, value in state_tensors(state):
            if is_file_backed(value):
                in_files += _nbytes(value)
            else:
                nbytes[category if category in nbytes else "other_state"] += _nbytes(value)
    frozen = [p.ds_tensor for p in (module.parameters() if module is not None else ()) if not p.requires_grad]
    return _per_parameter(nbytes, n, in_files, frozen)


def _per_parameter(nbytes: dict[str, int], n: int, in_files: int, frozen: list[torch.Tensor]) -> dict[str, float]:
    """The report of :func:`zero3_model_state_report` from bytes by category over ``n`` trainable elements, bytes in
    state files, and the frozen parameters' tensors on this rank."""
    report = {k: v / max(n, 1) for k, v in nbytes.items()}
    report["total"] = sum(report.values())
    report["state_files"] = in_files / max(n, 1)
    report["params_on_rank"] = float(n)
    frozen_n = sum(t.numel() for t in frozen)
    frozen_bytes = sum(_nbytes(t) for t in frozen)
    report["frozen"] = frozen_bytes / frozen_n if frozen_n else 0.0
    report["frozen_params_on_rank"] = float(frozen_n)
    report["whole_model"] = (report["total"] * n + frozen_bytes) / max(n + frozen_n, 1)
    return report


def sharded_model_state_report(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module | None = None, *, gradients_released: bool = False
) -> dict[str, float]:
    """Bytes per parameter of this rank's shards, by category, for an optimizer over DTensor parameters (FSDP2's
    ``fully_shard``, tensor parallelism) or plain ones: the same keys as :func:`zero3_model_state_report`.

    ``param`` is every trainable parameter's local shard, ``grad`` its gradient's local shard where one exists (after a
    backward, before ``zero_grad``), else the parameter's element size (FSDP2 reduce-scatters into the parameter's
    dtype unless a ``MixedPrecisionPolicy`` asks otherwise), then every state tensor with one element per parameter
    element (its local shard) and the 8-bit block scales with their moment. Frozen parameters of ``module`` are
    counted apart (``frozen``) and in ``whole_model``. With ``gradients_released`` (each gradient freed once its
    parameter is updated) no gradient shard is counted.
    """
    nbytes = dict.fromkeys(CATEGORIES, 0)
    n = 0
    trainable = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            trainable.add(id(p))
            shard = local(p)
            n += shard.numel()
            nbytes["param"] += _nbytes(shard)
            grad = local(p.grad) if p.grad is not None else None
            if grad is not None:
                nbytes["grad"] += _nbytes(grad)
            elif not gradients_released:
                nbytes["grad"] += shard.numel() * shard.element_size()
            for category, value in state_tensors(optimizer.state.get(p, {})):
                nbytes[category if category in nbytes else "other_state"] += _nbytes(local(value))
    frozen = [local(p) for p in (module.parameters() if module is not None else ()) if id(p) not in trainable]
    return _per_parameter(nbytes, n, 0, frozen)


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMeter:
    """The peak memory of this process since :meth:`reset`, beside the memory at that moment.

    On CUDA it is the caching allocator's peak (``torch.cuda.max_memory_allocated``); on the CPU the resident set's
    high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``), which counts everything the process holds.
    Where the high-water mark cannot be reset (not Linux), :meth:`read` returns ``None``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.at_reset: int | None = None

    @property
    def source(self) -> str:
        return "torch.cuda.max_memory_allocated" if self.device.type == "cuda" else "resident set (VmHWM)"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.at_reset = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        except OSError:
            self.at_reset = None
            return
        self.at_reset = _proc_status_bytes("VmRSS")

    def read(self) -> tuple[int, int] | None:
        """``(peak bytes, bytes at the reset)``, or ``None`` where there is no resettable peak."""
        if self.at_reset is None:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), self.at_reset
        peak = _proc_status_bytes("VmHWM")
        return (peak, self.at_reset) if peak is not None else None

    def headroom(self) -> tuple[int, int] | None:
        """``(bytes this process can still take now, bytes its peak since the reset held above what it holds now)``,
        or ``None`` where there is no resettable peak.

        On CUDA the first is the device's free memory plus what the caching allocator reserved and does not use; on
        the CPU the machine's available memory (``psutil.virtual_memory().available``), which the processes of one
        machine share.
        """
        measured = self.read()
        if measured is None:
            return None
        peak = measured[0]
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            now = torch.cuda.memory_allocated(self.device)
            return free + torch.cuda.memory_reserved(self.device) - now, max(peak - now, 0)
        import psutil  # a dependency of DeepSpeed

        now = _proc_status_bytes("VmRSS")
        if now is None:
            return None
        return psutil.virtual_memory().available, max(peak - now, 0)


def peak_report(meter: PeakMeter, model_state: dict[str, float]) -> dict[str, Any] | None:
    """The measured peak beside model state: ``peak_gib``, ``at_setup_gib`` (the memory when the states had been
    allocated), ``above_setup_per_param`` (what the steps added at their peak, in bytes per parameter of this rank's
    partition), ``model_state_per_param`` and ``source``; ``None`` where nothing was measured."""
    measured = meter.read()
    if measured is None:
        return None
    peak, at_setup = measured
    n = max(model_state["params_on_rank"], 1.0)
    return {
        "source": meter.source,
        "peak_gib": peak / 1024**3,
        "at_setup_gib": at_setup / 1024**3,
        "above_setup_per_param": max(peak - at_setup, 0) / n,
        "model_state_per_param": model_state["total"],
        "params_on_rank": n,
    }


# Below this much model state on a rank, what a step adds above setup is mostly fixed costs (buckets, the process's own
# allocations), and a figure per parameter of the partition would mislead (a small model shows hundreds of bytes).
PER_PARAM_MIN_STATE_GIB = 1.0


def format_peak(peak: dict[str, Any] | None) -> str:
    """One line for the end of a fit."""
    if peak is None:
        return "no peak measured here (the CPU's resident high-water mark cannot be reset on this system)"
    line = (
        f"{peak['peak_gib']:.2f} GiB at the peak ({peak['source']}), {peak['peak_gib'] - peak['at_setup_gib']:.2f} GiB"
        " above the memory at setup (activations, gathered layers, communication buckets and the step's temporaries)"
    )
    params = peak.get("params_on_rank", 0.0)
    if peak["model_state_per_param"] * params / 1024**3 < PER_PARAM_MIN_STATE_GIB:
        return line + f"; at {params:,.0f} parameters on this rank fixed costs dominate, so no figure per parameter"
    return (
        line + f": {peak['above_setup_per_param']:.2f} B per parameter of this rank's partition on top of"
        f" {peak['model_state_per_param']:.2f} B/param of model state"
    )


def format_report(report: dict[str, float]) -> str:
    """One line: ``8.00 B/param (param 2.00, grad 2.00, ...) over N elements``."""
    parts = [f"{k} {report[k]:.2f}" for k in CATEGORIES if report.get(k)]
    line = f"{report['total']:.2f} B/param ({', '.join(parts)}) over {int(report['params_on_rank']):,}"
    frozen = int(report.get("frozen_params_on_rank", 0))
    line += " trainable elements" if frozen else " elements"
    if report.get("state_files"):
        line += f", plus {report['state_files']:.2f} B/param of optimizer state in memory-mapped files"
    if frozen:
        total = frozen + int(report["params_on_rank"])
        line += (
            f"; frozen: {report['frozen']:.2f} B/param over {frozen:,} elements; whole model:"
            f" {report['whole_model']:.2f} B/param over {total:,} elements"
        )
    return line


__all__ = [
    "state_category",
    "CATEGORIES",
    "state_tensors",
    "FROZEN_BYTES",
    "MODEL_STATE_BYTES",
    "STATE_FILE_BYTES",
    "PeakMeter",
    "bytes_per_param",
    "format_peak",
    "format_report",
    "is_file_backed",
    "peak_report",
    "zero3_model_state_report",
]
