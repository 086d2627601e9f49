"""``python -m lightning_pure_bf16.consolidate CHECKPOINT OUTPUT``: a pure-bf16 checkpoint's weights for the tools
downstream, streamed a tensor at a time.

``OUTPUT`` a directory: Hugging Face's sharded safetensors layout (``model-0000K-of-0000N.safetensors``,
``model.safetensors.index.json``, ``--config``'s ``config.json``), which transformers' ``from_pretrained``, vLLM and
the Hub read. ``OUTPUT`` a ``.safetensors`` file: one file, also streamed. ``.pt``: one ``torch.save`` file (the
whole model in memory: ``torch.save`` writes a dict).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

from lightning_pure_bf16 import _log
from lightning_pure_bf16.checkpoint import (
    CheckpointError,
    assemble,
    export_optimizer_state,
    export_pretrained,
    save_state_dict,
    weight_sources,
    write_file_atomically,
)
from lightning_pure_bf16.shards import DEFAULT_MAX_SHARD_SIZE, check_new_directory, map_keys, parse_size, read_config

_FILE_TYPES = (".safetensors", ".pt", ".pth", ".bin")


def _kind(output: str) -> str | None:
    """``"safetensors"``, ``"pt"``, ``"dir"``, or None for a name that looks like a file of another type."""
    suffix = Path(output).suffix.lower()
    if output.endswith(("/", "\\")) or Path(output).is_dir():
        return "dir"
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in _FILE_TYPES:
        return "pt"
    if re.fullmatch(r"\.[a-z]{1,5}", suffix):  # w.txt, weights.json: a file's name, of a type not written
        return None
    return "dir"


def _key_map(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--key-map {pair!r}: give OLD=NEW (for example --key-map model.= to drop 'model.').")
        old, new = pair.split("=", 1)
        if not old:
            raise ValueError(f"--key-map {pair!r}: the prefix to replace is empty.")
        out[old] = new
    return out


def main(argv: list[str] | None = None) -> int:
    """The command; the library's messages (``logging``, logger ``lightning_pure_bf16``) printed with its own."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = _log.log.level
    _log.log.removeHandler(_log.console)
    _log.log.addHandler(handler)
    _log.log.setLevel(logging.INFO)
    try:
        return _run(argv)
    finally:
        _log.log.removeHandler(handler)
        _log.log.addHandler(_log.console)
        _log.log.setLevel(level)


def _run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pure_bf16.consolidate",
        description="Write the weights of a deepspeed_pure_bf16 checkpoint (any world size) in bf16, streamed: into a"
        " directory in Hugging Face's sharded safetensors layout, or into one .safetensors or .pt file.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory written by Trainer(strategy='deepspeed_pure_bf16')")
    parser.add_argument(
        "output",
        help="a new directory (Hugging Face's layout; end the name with '/' if it has a dot), or a .safetensors or"
        " .pt file",
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest shard of a directory output, as transformers reads it (default {DEFAULT_MAX_SHARD_SIZE};"
        " 500MB, 256MiB, or bytes)",
    )
    parser.add_argument(
        "--config", metavar="PATH", help="the model's config.json (or its directory), copied beside the shards"
    )
    parser.add_argument(
        "--key-map",
        metavar="OLD=NEW",
        action="append",
        default=[],
        help="rename keys starting with OLD to start with NEW (repeatable; first match wins): --key-map model.="
        " drops a LightningModule's 'model.' prefix",
    )
    parser.add_argument(
        "--optimizer-state",
        metavar="PATH",
        help="also write the optimizer state per parameter (keys NAME.exp_avg, NAME.exp_avg_sq, NAME.kahan_comp,"
        " NAME.step) to PATH: a .safetensors file or a new directory of shards",
    )
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="read files that need code to be read (pickled objects beyond tensors and DeepSpeed's own types); only"
        " for a checkpoint whose writer you trust: it can run any command",
    )
    args = parser.parse_args(argv)
    kind = _kind(args.output)
    opt_kind = _kind(args.optimizer_state) if args.optimizer_state else "dir"
    # Every argument is checked before anything is read or written.
    try:
        if kind is None or opt_kind is None or opt_kind == "pt":
            bad = args.output if kind is None else args.optimizer_state
            raise ValueError(
                f"Unknown output type for '{bad}': use .safetensors or .pt for one file (.safetensors for the"
                " optimizer state), or a directory for Hugging Face's sharded layout (end it with '/' if its name"
                " has a dot)."
            )
        if kind != "dir" and args.config:
            raise ValueError("--config goes with a directory output (Hugging Face's layout), not a single file.")
        key_map = _key_map(args.key_map)
        parse_size(args.max_shard_size)
        read_config(args.config)
        for target, target_kind in ((args.output, kind), (args.optimizer_state, opt_kind)):
            if target and target_kind == "dir":
                check_new_directory(Path(target))
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        if kind == "dir":
            shards = export_pretrained(
                args.checkpoint,
                args.output,
                max_shard_size=args.max_shard_size,
                config=args.config,
                key_map=key_map,
                trust_checkpoint=args.trust_checkpoint,
            )
            sources = [s for members in shards.values() for s in members]
            where = f"{args.output} ({len(shards)} safetensors file{'s' if len(shards) > 1 else ''})"
        else:
            sources = map_keys(weight_sources(args.checkpoint, trust_checkpoint=args.trust_checkpoint), key_map)
            if kind == "safetensors":
                write_file_atomically(sources, args.output)
            else:
                save_state_dict(assemble(sources), args.output)
            where = f"{args.output} ({Path(args.output).stat().st_size:,} bytes)"
        if args.optimizer_state:
            opt = export_optimizer_state(
                args.checkpoint,
                args.optimizer_state,
                max_shard_size=args.max_shard_size,
                key_map=key_map,
                trust_checkpoint=args.trust_checkpoint,
            )
            count = sum(len(m) for m in opt.values())
            print(f"wrote {args.optimizer_state}: optimizer state, {count} tensors")
    except (CheckpointError, ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    n = sum(s.numel for s in sources)
    dtypes = sorted({str(s.dtype).replace("torch.", "") for s in sources})
    print(f"wrote {where}: {len(sources)} tensors, {n:,} elements ({', '.join(dtypes)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
