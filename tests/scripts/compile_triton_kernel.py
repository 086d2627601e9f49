"""Compile the Triton AdamW kernel ahead of time for CUDA GPUs, without a GPU, and print what each build uses as JSON.

Runs in its own process: the kernel module must be imported with TRITON_INTERPRET unset (the test session interprets).
Uses Triton's own compile API with a CUDA ``GPUTarget`` and the ``ptxas``/``cuobjdump`` that ship in the triton wheel.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lightning_pure_bf16.ops import adamw_triton  # noqa: E402

SCALARS = ["beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "weight_decay", "decay", "neg_step_size"]
SIGNATURE = {
    **{name: "*bf16" for name in ("p_ptr", "g_ptr", "m_ptr", "v_ptr", "c_ptr")},
    "n_elements": "i64",
    **{name: "fp32" for name in [*SCALARS, "inv_bias_correction2_sqrt"]},
    **{name: "i32" for name in ("key_p", "key_m", "key_v")},
    "index_offset": "i64",
}


def main() -> None:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    builds = []
    for arch in map(int, sys.argv[1:]):
        for rounding, code in adamw_triton._ROUNDING_CODES.items():
            for decoupled in (True, False):
                constants = {"ROUNDING": code, "DECOUPLED": decoupled, "BLOCK": adamw_triton.BLOCK_SIZE}
                source = ASTSource(
                    fn=adamw_triton._adamw_kernel,
                    signature={**SIGNATURE, **dict.fromkeys(constants, "constexpr")},
                    constexprs=constants,
                )
                options = {"num_warps": adamw_triton.NUM_WARPS, "enable_fp_fusion": False}
                compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
                usage = ""
                if cuobjdump.exists():
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(compiled.asm["cubin"])
                        f.flush()
                        usage = subprocess.run(
                            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
                        ).stdout
                local = re.search(r"LOCAL:(\d+)", usage)
                registers = re.search(r"REG:(\d+)", usage)
                builds.append(
                    {
                        "arch": arch,
                        "rounding": rounding,
                        "decoupled": decoupled,
                        "cubin_bytes": len(compiled.asm["cubin"]),
                        "fma": len(re.findall(r"\bfma\.", compiled.asm["ptx"])),
                        "local_bytes": int(local.group(1)) if local else None,
                        "registers": int(registers.group(1)) if registers else None,
                    }
                )
    print(json.dumps(builds))


if __name__ == "__main__":
    main()
