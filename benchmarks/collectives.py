"""ZeRO-3's gradient reduce-scatter under gloo: gloo's own ``reduce_scatter_tensor`` beside this package's
(``collectives.reduce_scatter_by_exchange``: one all-to-all and a local sum), on CPU ranks of this machine.

Each size is a bf16 gradient bucket of that many elements on every rank (5M: ZeRO-3's bucket on the CPU in this
package), each rank left with its share of the sum; every call starts after a barrier (no skew between the ranks),
the figure is the median over the repeats of rank 0's time. Also checked: the two give the same bits (on 2 ranks; on
more the exchange sums in float32 and rounds once).

    python benchmarks/collectives.py             # 5M and 2^25 elements, 2 ranks, 9 repeats
    python benchmarks/collectives.py --quick     # 4,096 and 65,536 elements, 3 repeats
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _rank(rank: int, world: int, port: int, sizes: list[int], repeats: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from lightning_pure_bf16 import collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the cores shared, as the training ranks do
    exchange = collectives.reduce_scatter_by_exchange(dist.reduce_scatter_tensor)
    rows = []
    for size in sizes:
        g = torch.Generator().manual_seed(rank)
        bucket = torch.randn(size // world * world, generator=g).bfloat16()
        ours, theirs = (torch.empty(size // world, dtype=torch.bfloat16) for _ in range(2))
        times: dict[str, list[float]] = {"gloo": [], "exchange": []}
        for _ in range(repeats):
            for name, call, out in (("gloo", dist.reduce_scatter_tensor, theirs), ("exchange", exchange, ours)):
                dist.barrier()
                start = time.perf_counter()
                call(out, bucket)
                times[name].append(time.perf_counter() - start)
        rows.append(
            {
                "bucket_elements": bucket.numel(),
                "ranks": world,
                "gloo_ms": round(statistics.median(times["gloo"]) * 1e3, 3),
                "exchange_ms": round(statistics.median(times["exchange"]) * 1e3, 3),
                "same_bits": bool(torch.equal(ours.view(torch.int16), theirs.view(torch.int16))),
            }
        )
        rows[-1]["speedup"] = round(rows[-1]["gloo_ms"] / rows[-1]["exchange_ms"], 2)
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4,096 and 65,536 elements, 3 repeats")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error(f"--ranks {args.ranks}: a reduce-scatter needs at least 2 ranks")
    sizes = [4096, 65536] if args.quick else [5_000_000, 1 << 25]
    repeats = 3 if args.quick else args.repeats
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp
    from _results import write_results

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.pt"
        mp.start_processes(
            _rank, args=(args.ranks, port, sizes, repeats, rows_file), nprocs=args.ranks, start_method="spawn"
        )
        rows = torch.load(rows_file)
    command = "python benchmarks/collectives.py" + " ".join(["", *(argv if argv is not None else sys.argv[1:])])
    markdown = [
        f"# ZeRO-3's gradient reduce-scatter under gloo: {args.ranks} CPU ranks",
        "",
        f"Command: `{command}`. A bf16 bucket per rank, each call after a barrier; medians of {repeats} calls on"
        " rank 0. gloo: `torch.distributed.reduce_scatter_tensor`; exchange: this package's"
        " `collectives.reduce_scatter_by_exchange` (one `all_to_all_single` and a local sum), which ZeRO-3 calls"
        " under gloo.",
        "",
        "| bucket elements | gloo ms | exchange ms | speed-up | same bits |",
        "|---:|---:|---:|---:|---|",
        *(
            f"| {r['bucket_elements']:,} | {r['gloo_ms']:.2f} | {r['exchange_ms']:.2f} | {r['speedup']:.2f}x |"
            f" {'yes' if r['same_bits'] else 'no (float32 sum, rounded once)'} |"
            for r in rows
        ),
    ]
    write_results(args.out, "collectives_quick" if args.quick else "collectives", rows, markdown, command)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(main())
