"""``python -m lightning_pure_bf16.export_universal CHECKPOINT OUTPUT``: a checkpoint in DeepSpeed's universal layout.

DeepSpeed's engine loads the result at any world size with ``"checkpoint": {"load_universal": true}``.
"""

from __future__ import annotations

import argparse
import sys

from lightning_pure_bf16.checkpoint import CheckpointError, export_universal_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pure_bf16.export_universal",
        description="Write a deepspeed_pure_bf16 (or DeepSpeed ZeRO-3) checkpoint in DeepSpeed's universal layout.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory (any world size)")
    parser.add_argument("output", help="output directory; the checkpoint goes into OUTPUT/universal")
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="read files that need code to be read (pickled objects beyond tensors and DeepSpeed's own types); only"
        " for a checkpoint whose writer you trust: it can run any command",
    )
    args = parser.parse_args(argv)
    try:
        written = export_universal_checkpoint(args.checkpoint, args.output, trust_checkpoint=args.trust_checkpoint)
    except (CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    params = sum(1 for p in (written / "zero").iterdir() if p.is_dir())
    print(f'wrote {written}: {params} parameters; load with DeepSpeed\'s "checkpoint": {{"load_universal": true}}')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
