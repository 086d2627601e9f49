"""The fused CPU loops of the pure-bf16 update: one pass over p, g and the states (and the Kahan buffer) per tensor,
and a one-pass check of bf16 gradients for inf/NaN. Adam has loops of its own, vectorized by hand; the other
algorithms of the family (``csrc/algorithms.h``) run in one generic loop (``csrc/elementwise.cpp``).

C++ in ``ops/csrc/`` (shipped with the package), compiled on first use with ``torch.utils.cpp_extension.load`` (a C++
compiler and ninja are needed; without them the optimizer falls back to the chunked PyTorch path, with a warning).
It performs exactly the PyTorch
path's float32 operations in the same order, with fused multiply-add contraction off, and draws the same random bits
(``ops.rng``), so the two give identical results bit for bit. bf16 parameters and gradients only.

The loops run in explicit AVX-512 or AVX2 vector code where the build targets them (one template, two sets of
instructions; for 8-bit states, whole blocks of 128 elements) and in portable loops the compiler vectorizes elsewhere;
``use_vector_loops(False)`` switches the vector code off (tests). Both decide the stochastic rounding of the exact sum
``p + update`` from the float32 sum's discarded bits plus the random bits, and hand the rare elements whose decision
the sum's rounding error could change (within 2**17 of a carry: one in 2**14) to the exact computation, so the bits
stay the PyTorch path's. The 8-bit vector loop divides by 127 and 255 (the codes' levels) and by the Kahan
remainder's power-of-two unit without the divider, with the division's results (every level is checked against the
division by the tests).
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

from lightning_pure_bf16.ops import rng
from lightning_pure_bf16.ops.algorithms import ROUNDING_CODES, Algorithm, Args, hyper_scalars

_extension: Any = None
_failure: str | None = None


# The C++ sources (package data), one translation unit for the loops and one for the Python bindings.
CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("update_cpu.cpp", "elementwise.cpp", "bindings.cpp")


def hash_defines() -> list[str]:
    """The hash's constants, the rounding codes and the algorithm codes as compiler defines: ``ops/rng.py`` and
    ``ops/algorithms.py`` are their one source; the C++ names them only."""
    defines = {
        "MIX_MUL1": f"{rng.MIX_MUL1:#x}u",
        "MIX_MUL2": f"{rng.MIX_MUL2:#x}u",
        "MIX_SHIFT1": str(rng.MIX_SHIFT1),
        "MIX_SHIFT2": str(rng.MIX_SHIFT2),
        "MIX_SHIFT3": str(rng.MIX_SHIFT3),
        **{f"ROUNDING_{name.upper()}": str(code) for name, code in ROUNDING_CODES.items()},
        **{f"ALGORITHM_{a.name}": str(int(a)) for a in Algorithm},
    }
    return [f"-D{k}={v}" for k, v in defines.items()]


# How long a process waits for another one's build of the loop (a build takes one to three minutes) before it gives up
# with a warning and uses the PyTorch path.
BUILD_WAIT_S = float(os.environ.get("LIGHTNING_PURE_BF16_BUILD_WAIT_S", "900"))


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built and cached: a directory of this package's own under torch's extension
    root (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), one per Python environment and torch
    version, so that two environments never share (or wait on) one build."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    environment = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / "lightning_pure_bf16" / f"{python}_torch{torch.__version__}_{environment}" / name


def _load_under_lock(name: str, **options: Any) -> Any:
    """torch's ``load`` under a lock the kernel releases when its holder dies.

    torch's own build lock is a file that a killed build leaves behind, and every later load of the same name then
    waits on it forever. Every build of this loop goes through ``<build directory>.lock`` (an ``flock``, held only by
    a live process), so a ``lock`` file found in the build directory while it is held was left by a build that died:
    it is removed, and the build resumes (ninja redoes what was cut off)."""
    from torch.utils.cpp_extension import load

    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(f"{directory}.lock", timeout=BUILD_WAIT_S):
            (directory / "lock").unlink(missing_ok=True)
            return load(name=name, build_directory=str(directory), **options)
    except Timeout:
        raise TimeoutError(
            f"another process has been building the loop in {directory} for over {BUILD_WAIT_S:.0f} s (set"
            " LIGHTNING_PURE_BF16_BUILD_WAIT_S to wait longer)"
        ) from None


def fused_cpu_available() -> bool:
    """Whether the fused CPU loop compiled (it is compiled on the first call; a failure is reported once)."""
    global _extension, _failure
    if _extension is None and _failure is None:
        # Vector instructions of the CPU torch itself dispatches to; part of the name, so each build is cached apart.
        # FMA too: ATen reports AVX2 only for CPUs that also have FMA3, and every AVX-512 CPU has it (the 8-bit vector
        # loop uses explicit fused multiply-adds; the compiler still contracts nothing by itself).
        # No fused multiply-add contraction: every product is rounded, as in the PyTorch path. The random bits belong
        # to each element's index, so any split over threads writes the same bytes.
        capability = torch.backends.cpu.get_cpu_capability()
        arch = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]}.get(
            capability, []
        )
        flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", *arch]
        # With OpenMP, as torch itself is built, at::parallel_for splits the loop over torch's threads (without it,
        # ATen's inline parallel_for runs serially in an extension); a compiler without OpenMP builds the serial loop.
        for suffix, openmp in (("", ["-fopenmp"]), ("_serial", [])):
            try:
                _extension = _load_under_lock(
                    f"lightning_pure_bf16_update_cpu_v26_{capability.lower()}{suffix}",
                    sources=[str(CSRC / name) for name in _SOURCES],
                    extra_include_paths=[str(CSRC)],
                    extra_cflags=[*flags, *hash_defines(), *openmp],
                    extra_ldflags=openmp,
                    verbose=False,
                )
                break
            except Exception as err:  # noqa: BLE001 - any build failure means: try the next, then the PyTorch path
                _failure = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else err}"
        if _extension is not None:
            _failure = None
        else:
            warnings.warn(
                f"lightning_pure_bf16: the fused CPU optimizer loop did not compile ({_failure}); using the slower"
                " PyTorch path. It needs a C++ compiler and ninja (`pip install ninja`).",
                RuntimeWarning,
                stacklevel=3,
            )
    return _extension is not None


def can_use_fused_cpu(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether a parameter and its gradient suit the fused CPU loop: bf16 on the CPU, contiguous (the optimizer's own
    state buffers are created so)."""
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous() for t in (param, grad))


def any_nonfinite_cpu(grad: torch.Tensor) -> bool:
    """Whether a contiguous bf16 CPU tensor holds an inf or NaN (one pass; the fused loop must be available)."""
    return grad.numel() > 0 and bool(_extension.any_nonfinite_bf16(grad))


def update_cpu_(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: Sequence[torch.Tensor],
    kahan_comp: torch.Tensor | None,
    args: Args,
    *,
    scales: Sequence[torch.Tensor | None] = (),
    index_offset: int = 0,
) -> None:
    """One step of ``args.algorithm`` in place, one pass; same contract and bits as
    :func:`~lightning_pure_bf16.ops.update_torch.update_torch_` (bf16, CPU), 8-bit states included.

    ``index_offset``: index of the first element in the whole tensor when the buffers are one piece of it.
    """
    if param.numel() == 0:
        return
    rounding = ROUNDING_CODES[args.rounding]
    comp = kahan_comp if kahan_comp is not None else param  # the loops ignore the placeholders of absent buffers
    q8 = any(sc is not None for sc in scales)
    if args.algorithm is not Algorithm.ADAM:
        state, scale = (states[0], scales[0] if q8 else param) if states else (param, param)
        hyper = hyper_scalars(args)
        _extension.update_elementwise(
            int(args.algorithm),
            len(states),
            args.variant,
            rounding,
            param,
            grad,
            state,
            scale,
            comp,
            list(hyper[:-1]),
            hyper[-1],
            args.keys[0],
            args.keys[1],
            index_offset,
        )
        return
    step = (rounding, args.decoupled, *args.scalars, *args.keys, index_offset)
    exp_avg, exp_avg_sq = states
    if q8 or comp.dtype == torch.int8:
        m_scale, v_scale = scales if q8 else (param, param)
        _extension.adamw_update_q8(param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, comp, *step)
    else:
        _extension.adamw_update_bf16(param, grad, exp_avg, exp_avg_sq, comp, *step)


__all__ = ["any_nonfinite_cpu", "can_use_fused_cpu", "fused_cpu_available", "update_cpu_"]
