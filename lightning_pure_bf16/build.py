"""Compile the fused CPU optimizer loop ahead of time: ``python -m lightning_pure_bf16.build``.

The loop is compiled once per machine with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are needed) and
cached under torch's extension directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), in a
directory of its own per Python environment; afterwards
every process loads it in about a second. Run this once on a new machine or image, for example while building a
container, so the first training run does not wait for the compiler.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    import lightning_pure_bf16.ops.update_cpu as update_cpu

    start = time.perf_counter()
    ok = update_cpu.fused_cpu_available()
    elapsed = time.perf_counter() - start
    if not ok:
        print(
            f"lightning_pure_bf16: the fused CPU optimizer loop did not compile: {update_cpu._failure}", file=sys.stderr
        )
        return 1
    where = update_cpu.build_directory(update_cpu._extension.__name__)
    print(f"lightning_pure_bf16: fused CPU optimizer loop ready ({elapsed:.2f} s), cached in {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
