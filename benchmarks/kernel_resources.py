"""What the Triton AdamW kernel uses on CUDA GPUs, per specialisation, compiled ahead of time without a GPU.

Every specialisation the optimizer can launch: each rounding, Adam (L2) and AdamW (decoupled), bf16 and float32
gradients, 32- and 64-bit sizes and offsets, pointers aligned to 16 bytes (vector loads) or not; for sm_80 (A100)
and sm_90 (H100/H200). Compiled with Triton's own ``triton.compile`` and a CUDA ``GPUTarget`` (the ``ptxas`` in the
triton wheel); registers and local memory (spills) read from the cubin with the wheel's ``cuobjdump``.

    python benchmarks/kernel_resources.py            # both architectures, every specialisation
    python benchmarks/kernel_resources.py --quick    # sm_90 only
    python benchmarks/kernel_resources.py --json     # rows as JSON on stdout, no files (used by the tests)
Writes benchmarks/results/kernel_resources{,_quick}.{csv,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# The kernel module must be imported for compilation, not for the interpreter.
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lightning_pure_bf16.ops import adamw_triton  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ARCHS = (80, 90)
POINTERS = ("p_ptr", "g_ptr", "m_ptr", "v_ptr", "ms_ptr", "vs_ptr", "c_ptr")
SCALARS = (
    "beta1",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "eps",
    "weight_decay",
    "decay",
    "neg_step_size",
    "inv_bias_correction2_sqrt",
)


def _signature(grad: str, ints: str, q8m: bool = False, c8: bool = False) -> dict[str, str]:
    return {
        "p_ptr": "*bf16",
        "g_ptr": f"*{grad}",
        "m_ptr": "*i8" if q8m else "*bf16",
        "v_ptr": "*u8" if q8m else "*bf16",
        "ms_ptr": "*bf16",
        "vs_ptr": "*bf16",
        "c_ptr": "*i8" if c8 else "*bf16",
        "n_elements": ints,
        **dict.fromkeys(SCALARS, "fp32"),
        **dict.fromkeys(("key_p", "key_m", "key_v"), "i32"),
        "index_offset": ints,
    }


def _usage(cubin: bytes) -> tuple[int | None, int | None]:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    registers, local = re.search(r"REG:(\d+)", out), re.search(r"LOCAL:(\d+)", out)
    return (int(registers.group(1)) if registers else None), (int(local.group(1)) if local else None)


def _build(source: ASTSource, arch: int) -> dict:
    """Compile one specialisation for ``sm_<arch>``; what it uses."""
    options = {"num_warps": adamw_triton.NUM_WARPS, "enable_fp_fusion": False}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    registers, local = _usage(compiled.asm["cubin"])
    return {
        "registers": registers,
        "local_bytes": local,
        "fma": len(re.findall(r"\bfma\.", compiled.asm["ptx"])),
        "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v\d", compiled.asm["ptx"])),
        "cubin_bytes": len(compiled.asm["cubin"]),
    }


def compile_all(archs: tuple[int, ...]) -> list[dict]:
    """Compile every specialisation for each architecture; one row per build."""
    rows = []
    grid = itertools.product(archs, adamw_triton._ROUNDING_CODES.items(), (True, False), ("bf16", "fp32"))
    for arch, (rounding, code), decoupled, grad in grid:
        for ints, aligned in itertools.product(("i32", "i64"), (True, False)):
            constants = {
                "ROUNDING": code,
                "DECOUPLED": decoupled,
                "Q8M": False,
                "C8": False,
                "BLOCK": adamw_triton.BLOCK_SIZE,
            }
            signature = {**_signature(grad, ints), **dict.fromkeys(constants, "constexpr")}
            names = list(signature)
            # What Triton's launcher specialises on: pointers and the size divisible by 16.
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*POINTERS, "n_elements")} if aligned else {}
            source = ASTSource(fn=adamw_triton._adamw_kernel, signature=signature, constexprs=constants, attrs=attrs)
            rows.append(
                {
                    "arch": f"sm_{arch}",
                    "rounding": rounding,
                    "weight_decay": "decoupled" if decoupled else "L2",
                    "grad": grad,
                    "ints": ints,
                    "aligned": aligned,
                    **_build(source, arch),
                }
            )
    rows += compile_q8(archs)
    return rows


def compile_q8(archs: tuple[int, ...]) -> list[dict]:
    """The kernel with 8-bit states: every rounding with 8-bit moments, and Kahan's 8-bit remainder with either moment
    format; bf16 gradients, aligned pointers."""
    rows = []
    variants = [(r, True, False) for r in adamw_triton._ROUNDING_CODES] + [
        ("kahan", True, True),
        ("kahan", False, True),
    ]
    for arch, (rounding, q8m, c8), decoupled, ints in itertools.product(archs, variants, (True, False), ("i32", "i64")):
        constants = {
            "ROUNDING": adamw_triton._ROUNDING_CODES[rounding],
            "DECOUPLED": decoupled,
            "Q8M": q8m,
            "C8": c8,
            "BLOCK": adamw_triton.BLOCK_SIZE,
        }
        signature = {**_signature("bf16", ints, q8m, c8), **dict.fromkeys(constants, "constexpr")}
        names = list(signature)
        pointers = [n for n in names if n.endswith("_ptr")]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, "n_elements")}
        source = ASTSource(fn=adamw_triton._adamw_kernel, signature=signature, constexprs=constants, attrs=attrs)
        states = ("int8 moments" if q8m else "bf16 moments") + (", int8 remainder" if c8 else "")
        rows.append(
            {
                "arch": f"sm_{arch}",
                "rounding": f"{rounding} ({states})",
                "weight_decay": "decoupled" if decoupled else "L2",
                "grad": "bf16",
                "ints": ints,
                "aligned": True,
                **_build(source, arch),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sm_90 only")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON, write no files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = compile_all((90,) if args.quick else ARCHS)
    if args.json:
        print(json.dumps(rows))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from _results import write_results

    command = "python benchmarks/kernel_resources.py" + (" --quick" if args.quick else "")
    spills = sum(1 for r in rows if r["local_bytes"])
    lines = [
        f"# Triton AdamW kernel: {len(rows)} specialisations compiled ahead of time (triton {triton.__version__})",
        "",
        f"Command: `{command}`. Builds with local memory (spills): {spills}. Fused multiply-adds: "
        f"{sum(r['fma'] for r in rows)} (must be 0: the backends round every product on its own).",
        "",
        "| arch | rounding | weight decay | grad | ints | aligned | registers | local bytes | vector loads |",
        "|---|---|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arch']} | {r['rounding']} | {r['weight_decay']} | {r['grad']} | {r['ints']} | {r['aligned']} |"
            f" {r['registers']} | {r['local_bytes']} | {r['vector_loads']} |"
        )
    write_results(args.out, "kernel_resources_quick" if args.quick else "kernel_resources", rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
