"""``python -m lightning_pure_bf16.consolidate CHECKPOINT OUTPUT``: one bf16 state dict from a pure-bf16 checkpoint."""

from __future__ import annotations

import argparse
import sys

from lightning_pure_bf16.checkpoint import CheckpointError, consolidate_checkpoint, save_state_dict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pure_bf16.consolidate",
        description="Write the weights of a deepspeed_pure_bf16 checkpoint (any world size) as one bf16 state dict.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory written by Trainer(strategy='deepspeed_pure_bf16')")
    parser.add_argument("output", help="output file: .safetensors, or .pt for torch.save")
    args = parser.parse_args(argv)
    try:
        state = consolidate_checkpoint(args.checkpoint)
        path = save_state_dict(state, args.output)
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    n = sum(v.numel() for v in state.values())
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in state.values()})
    print(f"wrote {path}: {len(state)} tensors, {n:,} elements ({', '.join(dtypes)}), {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
