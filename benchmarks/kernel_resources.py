"""What the Triton update kernel uses on CUDA GPUs, per specialisation, compiled ahead of time without a GPU.

Every specialisation the optimizer can launch for AdamW: each rounding, Adam (L2) and AdamW (decoupled), bf16 and
float32 gradients, 32- and 64-bit sizes and offsets, aligned (pointers and size multiples of 16 bytes: vector loads;
an index offset that is a multiple of 8) or not; for sm_80 (A100) and sm_90 (H100/H200); and the other algorithms of
the family (Lion, SGD with momentum, SGD without) as the strategies launch them, with bf16 and 8-bit states. Compiled
with Triton's own ``triton.compile`` and a CUDA ``GPUTarget`` (the ``ptxas`` in the triton wheel); registers and local
memory (spills) read from the cubin with the wheel's ``cuobjdump``, and the SASS instructions it disassembles counted
per element (the kernel has no loop: each thread runs its elements unrolled, so the instructions of one pass over the
kernel, less ``NOP`` padding and the closing self-branch, divided by the elements per thread), and those a thread
executes on the common path (``executed_instructions``: the listing also holds the slow paths of the correctly rounded
division and square root). For the default configurations the report sets the time the executed instructions take at
a device's issue rate beside the time the kernel's bytes take at its memory bandwidth: the larger bounds the step.

    python benchmarks/kernel_resources.py            # both architectures, every specialisation
    python benchmarks/kernel_resources.py --quick    # sm_90 only
    python benchmarks/kernel_resources.py --json     # rows as JSON on stdout, no files
    python benchmarks/kernel_resources.py --quick --corners --json   # what the suite checks (below)
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

from lightning_pure_bf16.ops import update_triton  # noqa: E402
from lightning_pure_bf16.ops.algorithms import ROUNDING_CODES, Algorithm  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ARCHS = (80, 90)
ELEMENTS_PER_THREAD = update_triton.BLOCK_SIZE // (32 * update_triton.NUM_WARPS)
# Devices of sm_90: streaming multiprocessors, the clock (GHz) and the memory bandwidth (TB/s); an SM issues one
# warp instruction per clock on each of its 4 schedulers. SMs and bandwidths as NVIDIA states them for the SXM parts
# (132 SMs; 3.35 and 4.8 TB/s). The clock is an assumption, a sustained 1.755 GHz under load (at which an H100 issues
# 124 instructions per element in the time its memory moves 14 bytes); --clock-ghz sets another.
DEVICES = {"H100 SXM": (132, 1.755, 3.35), "H200 SXM": (132, 1.755, 4.8)}
POINTERS = ("p_ptr", "g_ptr", "m_ptr", "v_ptr", "ms_ptr", "vs_ptr", "c_ptr")
SCALARS = (*(f"h{i}" for i in range(9)), "grad_scale")


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
        **dict.fromkeys(("word_p", "word_m", "word_v"), "i32"),
        "index_offset": ints,
    }


def _usage(cubin: bytes) -> tuple[int | None, int | None, int | None, int | None]:
    """Registers, local memory bytes, SASS instructions and those one thread executes (``None`` each where the wheel
    has no ``cuobjdump``)."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return None, None, None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
    registers, local = re.search(r"REG:(\d+)", out), re.search(r"LOCAL:(\d+)", out)
    return (
        (int(registers.group(1)) if registers else None),
        (int(local.group(1)) if local else None),
        sass_instructions(sass),
        executed_instructions(sass),
    )


def _listing(sass: str) -> list[tuple[str, str, str, str]]:
    """The instructions of a ``cuobjdump -sass`` listing: (address, predicate, opcode, operands) each."""
    return re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_.]*)([^;]*);", sass)


def sass_instructions(sass: str) -> int:
    """The instructions of a ``cuobjdump -sass`` listing, less ``NOP`` padding and the self-branch after ``EXIT``."""
    body = [opcode for _, _, opcode, _ in _listing(sass) if not opcode.startswith("NOP")]
    while body and body[-1].startswith("BRA"):
        body.pop()
    return len(body)


def executed_instructions(sass: str) -> int:
    """The instructions one thread executes on the common path of a ``cuobjdump -sass`` listing: from the start to the
    unconditional ``EXIT``, every element in range, and no division or square root taking its slow path.

    The listing holds more than runs: the correctly rounded division and square root branch around a call of a
    slow-path subroutine (denormal, infinite or huge operands), and those subroutines follow the ``EXIT``. The walk
    follows unconditional branches, takes a conditional branch where the code it skips calls a subroutine, and falls
    through every other one (a predicated ``EXIT`` of threads past the end included).
    """
    rows = _listing(sass)
    at = {int(address, 16): i for i, (address, _, _, _) in enumerate(rows)}
    count, i = 0, 0
    for _ in range(len(rows)):
        _, predicate, opcode, operands = rows[i]
        if opcode.startswith("NOP"):
            i += 1
            continue
        count += 1
        if opcode == "EXIT" and not predicate:
            return count
        if opcode.startswith("BRA"):
            target = at[int(re.search(r"0x([0-9a-f]+)", operands).group(1), 16)]
            j = i + 1
            while j < len(rows) and not rows[j][2].startswith(("BRA", "BSYNC", "EXIT", "CALL")):
                j += 1
            if not predicate or (j < len(rows) and rows[j][2].startswith("CALL")):
                i = target
                continue
        i += 1
    raise ValueError("no path to EXIT in the listing (a loop?)")


def bytes_per_element(grad: str, rounding: str, states: int = 2) -> float:
    """What one element of the update reads and writes: the weight (bf16, both ways), the gradient (read), each of
    ``states`` states (bf16 both ways, or int8 with a bf16 scale per 128 elements), Kahan's remainder (bf16 or int8,
    both ways)."""
    moments = states * (2 * 1 + 2 * 2 / 128) if "int8 moments" in rounding else states * 2 * 2
    remainder = 0 if not rounding.startswith("kahan") else (2 if "int8 remainder" in rounding else 4)
    return 4 + (2 if grad == "bf16" else 4) + moments + remainder


def predicted(
    per_element: float, nbytes: float, device: str, numel: int = 2**24, clock_ghz: float | None = None
) -> tuple[float, float]:
    """(milliseconds at the issue rate, milliseconds at the memory bandwidth) of one update of ``numel`` elements."""
    sms, ghz, tbps = DEVICES[device]
    ghz = clock_ghz or ghz
    issue = numel * per_element / 32 / (sms * 4 * ghz * 1e9)
    return issue * 1e3, numel * nbytes / (tbps * 1e12) * 1e3


def _build(source: ASTSource, arch: int) -> dict:
    """Compile one specialisation for ``sm_<arch>``; what it uses."""
    options = {"num_warps": update_triton.NUM_WARPS, "enable_fp_fusion": False}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    registers, local, sass, executed = _usage(compiled.asm["cubin"])
    return {
        "registers": registers,
        "local_bytes": local,
        "sass": sass,
        "sass_per_element": None if sass is None else round(sass / ELEMENTS_PER_THREAD, 1),
        "executed_per_element": None if executed is None else round(executed / ELEMENTS_PER_THREAD, 1),
        "fma": len(re.findall(r"\bfma\.", compiled.asm["ptx"])),
        "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v\d", compiled.asm["ptx"])),
        "cubin_bytes": len(compiled.asm["cubin"]),
    }


# What the strategies launch (AdamW, bf16 gradient, 32-bit sizes, aligned pointers), and its opposite in every option at
# once (Adam with L2, float32 gradient, 64-bit sizes, unaligned): the most registers any specialisation needs.
LAUNCHED = (True, "bf16", "i32", True)
WIDEST = (False, "fp32", "i64", False)


def compile_all(archs: tuple[int, ...], corners: bool = False) -> list[dict]:
    """Compile every specialisation for each architecture; one row per build. ``corners``: of each state format, only
    the launched configuration and the widest (:data:`LAUNCHED`, :data:`WIDEST`)."""
    rows = []
    grid = itertools.product(archs, ROUNDING_CODES.items(), (True, False), ("bf16", "fp32"))
    for arch, (rounding, code), decoupled, grad in grid:
        for ints, aligned in itertools.product(("i32", "i64"), (True, False)):
            if corners and (decoupled, grad, ints, aligned) not in (LAUNCHED, WIDEST):
                continue
            constants = {
                **_algorithm(Algorithm.ADAM, 2, int(decoupled)),
                "ROUNDING": code,
                "Q8M": False,
                "C8": False,
                # The launcher's INDEX8 (an index offset that is a multiple of 8) goes with the aligned builds.
                "INDEX8": aligned,
                "SCALE_G": False,  # no clipping factor to fold in (or a factor of 1): no product
                "BLOCK": update_triton.BLOCK_SIZE,
            }
            signature = {**_signature(grad, ints), **dict.fromkeys(constants, "constexpr")}
            names = list(signature)
            # What Triton's launcher specialises on: pointers and the size divisible by 16.
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*POINTERS, "n_elements")} if aligned else {}
            source = ASTSource(fn=update_triton._update_kernel, signature=signature, constexprs=constants, attrs=attrs)
            rows.append(
                {
                    "arch": f"sm_{arch}",
                    "algorithm": "adamw",
                    "rounding": rounding,
                    "weight_decay": "decoupled" if decoupled else "L2",
                    "grad": grad,
                    "ints": ints,
                    "aligned": aligned,
                    **_build(source, arch),
                }
            )
    rows += compile_q8(archs, corners)
    rows += compile_family(archs)
    return rows


def _algorithm(algorithm: Algorithm, states: int, variant: int) -> dict[str, int]:
    """The kernel's compile-time choice of arithmetic (its constexprs in their order)."""
    return {"ALGORITHM": int(algorithm), "STATES": states, "VARIANT": variant}


# The other algorithms as the strategies launch them: their usual variant (Lion and SGD with weight decay, SGD with
# Nesterov momentum), bf16 gradient, 32-bit sizes, aligned, each rounding with bf16 states and stochastic rounding
# with 8-bit ones.
FAMILY = {
    "lion": (Algorithm.LION, 1, 1),
    "sgd_momentum": (Algorithm.SGD, 1, 3),
    "sgd": (Algorithm.SGD, 0, 1),
    "muon_write": (Algorithm.DIRECTION, 0, 1),  # Muon's orthogonalized momentum written, with decoupled decay
}


def compile_family(archs: tuple[int, ...]) -> list[dict]:
    """The kernel for Lion, SGD (with and without momentum) and Muon's write, as launched; one row per build."""
    rows = []
    formats = [(rounding, False) for rounding in ROUNDING_CODES] + [("stochastic", True)]
    for arch, name, (rounding, q8m) in itertools.product(archs, FAMILY, formats):
        algorithm, states, variant = FAMILY[name]
        if q8m and not states:
            continue
        constants = {
            **_algorithm(algorithm, states, variant),
            "ROUNDING": ROUNDING_CODES[rounding],
            "Q8M": q8m,
            "C8": False,
            "INDEX8": True,
            "SCALE_G": False,
            "BLOCK": update_triton.BLOCK_SIZE,
        }
        signature = {**_signature("bf16", "i32", q8m), **dict.fromkeys(constants, "constexpr")}
        names = list(signature)
        pointers = [n for n in names if n.endswith("_ptr")]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, "n_elements")}
        source = ASTSource(fn=update_triton._update_kernel, signature=signature, constexprs=constants, attrs=attrs)
        rows.append(
            {
                "arch": f"sm_{arch}",
                "algorithm": name,
                "rounding": f"{rounding} (int8 moments)" if q8m else rounding,
                "weight_decay": "L2" if algorithm is Algorithm.SGD else "decoupled",
                "grad": "bf16",
                "ints": "i32",
                "aligned": True,
                "states": states,
                **_build(source, arch),
            }
        )
    return rows


def compile_q8(archs: tuple[int, ...], corners: bool = False) -> list[dict]:
    """The kernel with 8-bit states: every rounding with 8-bit moments, and Kahan's 8-bit remainder with either moment
    format; bf16 gradients, aligned pointers (``corners``: AdamW with 32-bit sizes and Adam with 64-bit ones only)."""
    rows = []
    variants = [(r, True, False) for r in ROUNDING_CODES] + [
        ("kahan", True, True),
        ("kahan", False, True),
    ]
    for arch, (rounding, q8m, c8), decoupled, ints in itertools.product(archs, variants, (True, False), ("i32", "i64")):
        if corners and (decoupled, ints) not in ((LAUNCHED[0], LAUNCHED[2]), (WIDEST[0], WIDEST[2])):
            continue
        constants = {
            **_algorithm(Algorithm.ADAM, 2, int(decoupled)),
            "ROUNDING": ROUNDING_CODES[rounding],
            "Q8M": q8m,
            "C8": c8,
            "INDEX8": True,  # 8-bit moments' offsets are multiples of QBLOCK
            "SCALE_G": False,
            "BLOCK": update_triton.BLOCK_SIZE,
        }
        signature = {**_signature("bf16", ints, q8m, c8), **dict.fromkeys(constants, "constexpr")}
        names = list(signature)
        pointers = [n for n in names if n.endswith("_ptr")]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, "n_elements")}
        source = ASTSource(fn=update_triton._update_kernel, signature=signature, constexprs=constants, attrs=attrs)
        states = ("int8 moments" if q8m else "bf16 moments") + (", int8 remainder" if c8 else "")
        rows.append(
            {
                "arch": f"sm_{arch}",
                "algorithm": "adamw",
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
    parser.add_argument("--corners", action="store_true", help="per state format, the launched and the widest build")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--clock-ghz", type=float, default=None, help="the SM clock of the prediction (default 1.755)")
    args = parser.parse_args(argv)
    rows = compile_all((90,) if args.quick else ARCHS, corners=args.corners)
    for r in rows:
        if r["executed_per_element"] is not None:
            nbytes = bytes_per_element(r["grad"], r["rounding"], r.get("states", 2))
            times = {d: predicted(r["executed_per_element"], nbytes, d, clock_ghz=args.clock_ghz) for d in DEVICES}
            r["bound"] = {d: "memory" if memory >= issue else "issue" for d, (issue, memory) in times.items()}
    if args.json:
        print(json.dumps(rows))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from _results import write_results

    command = "python benchmarks/kernel_resources.py" + (" --quick" if args.quick else "")
    command += f" --clock-ghz {args.clock_ghz:g}" if args.clock_ghz else ""
    spills = sum(1 for r in rows if r["local_bytes"])
    lines = [
        f"# Triton update kernel: {len(rows)} specialisations compiled ahead of time (triton {triton.__version__})",
        "",
        f"Command: `{command}`. Builds with local memory (spills): {spills}. Fused multiply-adds: "
        f"{sum(r['fma'] for r in rows)} (must be 0: the backends round every product on its own). SASS instructions"
        f" per element: the kernel's instructions (no loop; NOP padding left out) over the {ELEMENTS_PER_THREAD}"
        " elements each thread updates, counted two ways: all of the listing, and those a thread executes on the"
        " common path (every element in range, no division or square root on its slow path: the listing also holds"
        " those slow paths' calls and subroutines, which run only for denormal, infinite or huge operands).",
        "",
        "## The default configurations on sm_90: instructions against bytes",
        "",
        "AdamW (decoupled weight decay), bf16 gradient, 32-bit sizes, aligned (pointers, size, index offset): what the"
        " strategies launch. The"
        " time of one update of 2^24 elements at the issue rate, for the instructions executed (132 SMs x 4 warp"
        f" instructions per clock at {args.clock_ghz or 1.755} GHz, an assumed sustained clock; `DEVICES` in the"
        " script), beside the time its bytes take at the memory bandwidth (H100 SXM 3.35 TB/s, H200 SXM 4.8 TB/s, as"
        " NVIDIA states them); the larger bounds the kernel.",
        "",
        "| rounding | SASS / element | executed / element | bytes / element | H100: issue ms | H100: memory ms"
        " | H100 bound | H200: issue ms | H200: memory ms | H200 bound |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        default = (r["arch"], r["algorithm"], r["weight_decay"], r["grad"], r["ints"], r["aligned"]) == (
            "sm_90",
            "adamw",
            "decoupled",
            "bf16",
            "i32",
            True,
        )
        if not default or r["executed_per_element"] is None:
            continue
        nbytes = bytes_per_element(r["grad"], r["rounding"])
        cells = []
        for device in DEVICES:
            issue, memory = predicted(r["executed_per_element"], nbytes, device, clock_ghz=args.clock_ghz)
            cells.append(f"{issue:.3f} | {memory:.3f} | {'memory' if memory >= issue else '**issue**'}")
        lines.append(
            f"| {r['rounding']} | {r['sass_per_element']} | {r['executed_per_element']} | {nbytes:g} | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "## The other algorithms of the family on sm_90, as launched",
        "",
        "Lion with weight decay, SGD with Nesterov momentum and weight decay, SGD without momentum (no state); bf16"
        " gradient, 32-bit sizes, aligned; the same prediction as above.",
        "",
        "| algorithm | rounding | SASS / element | executed / element | bytes / element | H100 bound | H200 bound |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if r["arch"] != "sm_90" or r["algorithm"] == "adamw" or r["executed_per_element"] is None:
            continue
        nbytes = bytes_per_element(r["grad"], r["rounding"], r["states"])
        lines.append(
            f"| {r['algorithm']} | {r['rounding']} | {r['sass_per_element']} | {r['executed_per_element']} |"
            f" {nbytes:g} | {r['bound']['H100 SXM']} | {r['bound']['H200 SXM']} |"
        )
    lines += [
        "",
        "## Every specialisation",
        "",
        "| arch | algorithm | rounding | weight decay | grad | ints | aligned | registers | local bytes | vector loads"
        " | SASS / element | executed / element |",
        "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arch']} | {r['algorithm']} | {r['rounding']} | {r['weight_decay']} | {r['grad']} | {r['ints']} |"
            f" {r['aligned']} |"
            f" {r['registers']} | {r['local_bytes']} | {r['vector_loads']} | {r['sass_per_element']} |"
            f" {r['executed_per_element']} |"
        )
    write_results(args.out, "kernel_resources_quick" if args.quick else "kernel_resources", rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
