"""``python -m lightning_pure_bf16.consolidate CHECKPOINT OUTPUT``: one bf16 state dict from a pure-bf16 checkpoint."""

from __future__ import annotations

import argparse
import sys

from lightning_pure_bf16.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    consolidate_optimizer_state,
    save_state_dict,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pure_bf16.consolidate",
        description="Write the weights of a deepspeed_pure_bf16 checkpoint (any world size) as one bf16 state dict.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory written by Trainer(strategy='deepspeed_pure_bf16')")
    parser.add_argument("output", help="output file: .safetensors, or .pt for torch.save")
    parser.add_argument(
        "--optimizer-state",
        metavar="FILE",
        help="also write the optimizer state per parameter (keys NAME.exp_avg, NAME.exp_avg_sq, NAME.kahan_comp,"
        " NAME.step) to FILE (.safetensors or .pt)",
    )
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="read files that need code to be read (pickled objects beyond tensors and DeepSpeed's own types); only"
        " for a checkpoint whose writer you trust: it can run any command",
    )
    args = parser.parse_args(argv)
    for output in filter(None, (args.output, args.optimizer_state)):
        if not output.lower().endswith((".safetensors", ".pt", ".pth", ".bin")):
            print(f"error: Unknown output type for '{output}': use .safetensors or .pt.", file=sys.stderr)
            return 1
    try:
        state = consolidate_checkpoint(args.checkpoint, trust_checkpoint=args.trust_checkpoint)
        opt_state = None
        if args.optimizer_state:
            per_param = consolidate_optimizer_state(args.checkpoint, trust_checkpoint=args.trust_checkpoint)
            opt_state = {f"{name}.{key}": value for name, st in per_param.items() for key, value in st.items()}
        path = save_state_dict(state, args.output)
        if opt_state is not None:
            opt_path = save_state_dict(opt_state, args.optimizer_state)
            size = opt_path.stat().st_size
            print(f"wrote {opt_path}: optimizer state of {len(per_param)} parameters ({size:,} bytes)")
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    n = sum(v.numel() for v in state.values())
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in state.values()})
    print(f"wrote {path}: {len(state)} tensors, {n:,} elements ({', '.join(dtypes)}), {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
