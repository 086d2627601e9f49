"""Optimizer step time with states in memory-mapped files, against in-memory states and the disk's own bandwidth.

One flat bf16 parameter (a ZeRO-3 partition) on the device, its moments (and Kahan buffer) in files under
``--state-dir``. Three cases for the files:

- hot: the files are in the page cache (a host with RAM to spare): the cost is the extra copies of the streaming;
- cold: before each step the files are written back and dropped from the page cache (``madvise``/``fsync``/
  ``posix_fadvise``, untimed), so every read comes from the disk; the writes go to the page cache;
- cold + sync: as cold, and the step ends with ``fsync`` of the files, so the writes reach the disk too.

The disk's sequential bandwidth is measured on the same directory first (overwriting a preallocated file, with
``fsync``; reading after dropping the file from the page cache, with ``read()`` and by copying out of a mapping).
The bound of a cold step is (bytes read) / (read bandwidth); of a cold + sync step, plus (bytes written) / (write
bandwidth). The page-cache residency of the files before each step is checked with ``mincore`` and reported.

    python benchmarks/mmap_states.py --state-dir /local/nvme/tmp   # 2**26 elements
    python benchmarks/mmap_states.py --quick                         # 2**23 elements, state dir in the temp dir
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import write_results

from lightning_pure_bf16 import AdamW
from lightning_pure_bf16.optim.mmap_states import filesystem_type

RESULTS = Path(__file__).parent / "results"
_LIBC = ctypes.CDLL(None, use_errno=True)
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def disk_bandwidth(directory: Path, nbytes: int) -> tuple[float, float, float]:
    """Sequential bandwidth of the disk under ``directory`` in GB/s: reading a file not in the page cache with large
    ``read()`` calls, reading it by copying 8 MiB pieces out of a mapping of it (what the streaming does), and
    overwriting a preallocated file with ``fsync`` (what a state file sees)."""
    block = os.urandom(1 << 20) * 16  # 16 MiB of incompressible data
    path = directory / "pure_bf16_bandwidth_probe.bin"

    def drop() -> None:
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    try:
        with open(path, "wb", buffering=0) as f:
            os.posix_fallocate(f.fileno(), 0, nbytes)
            for _ in range(nbytes // len(block)):
                f.write(block)
            os.fsync(f.fileno())
        start = time.perf_counter()
        with open(path, "r+b", buffering=0) as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            os.fsync(f.fileno())
        write = _gbps(nbytes, time.perf_counter() - start)
        drop()
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(len(block)):
                pass
        read = _gbps(nbytes, time.perf_counter() - start)
        drop()
        piece = 1 << 22
        staging = torch.empty(piece, dtype=torch.bfloat16)
        mapped = torch.from_file(os.fspath(path), shared=False, size=nbytes // 2, dtype=torch.bfloat16)
        start = time.perf_counter()
        for s in range(0, mapped.numel(), piece):
            staging[: min(piece, mapped.numel() - s)].copy_(mapped[s : s + piece])
        mapped_read = _gbps(nbytes, time.perf_counter() - start)
        del mapped
    finally:
        path.unlink(missing_ok=True)
    return read, mapped_read, write


def _state_files(opt: AdamW) -> list[tuple[str, int, int]]:
    """(path, mapping address, bytes) of every state file."""
    out = {}
    for state in opt.state.values():
        t = state["exp_avg"]
        storage = t.untyped_storage()
        out[storage.filename] = (storage.filename, storage.data_ptr(), storage.nbytes())
    return list(out.values())


def evict(opt: AdamW) -> None:
    """Write the state files back and drop them from this process's mapping and from the page cache."""
    for path, address, nbytes in _state_files(opt):
        # Unmapped pages of a shared file mapping keep their data in the page cache (and, after fsync, on disk).
        if _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise failed")
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sync_files(opt: AdamW) -> None:
    for path, _, _ in _state_files(opt):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def resident_fraction(opt: AdamW) -> float:
    """Fraction of the state files' pages in the page cache (``mincore`` on a private read mapping)."""
    resident = total = 0
    for path, _, nbytes in _state_files(opt):
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
        try:
            pages = (nbytes + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            buf = ctypes.c_char.from_buffer(mm)
            if _LIBC.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(nbytes), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            del buf
            resident += sum(v & 1 for v in vec)
            total += pages
        finally:
            mm.close()
    return resident / max(total, 1)


def time_steps(
    opt: AdamW, param: torch.Tensor, repeats: int, *, cold: bool = False, sync: bool = False, slices: int = 0
):
    """Median milliseconds of ``opt.step()`` (plus the files' ``fsync`` with ``sync``), and the mean page-cache
    residency of the state files before the steps (``None`` for in-memory states).

    Args:
        cold: write back and drop the state files from the page cache before each step (untimed).
        sync: end each timed step with ``fsync`` of the state files.
        slices: apply each step as this many slices of the tensor, the last first, as gradient release applies a
            partition's parameters while the backward brings their gradients (``AdamW.update_slice``; 0: one
            ``step()``).
    """
    device = param.device
    if slices:
        group = opt.param_groups[0]
        opt.init_states([(param, group)])
        grad = param.grad
        cuts = [param.numel() * i // slices // 128 * 128 for i in range(slices)] + [param.numel()]

        def step() -> None:
            # Last slice first, as the backward reaches a partition's parameters in the reverse of their order.
            for lo, hi in reversed(list(zip(cuts, cuts[1:]))):
                opt.update_slice(param, group, grad[lo:hi], lo)
            opt.advance_step(param)

        opt.step = step  # type: ignore[method-assign]
    opt.step()  # first step: allocation, compilation
    times, residency = [], []
    for _ in range(repeats):
        if cold:
            evict(opt)
        if opt.state_storage == "mmap":
            residency.append(resident_fraction(opt))
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        if sync:
            sync_files(opt)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3, (sum(residency) / len(residency) if residency else None)


RELEASE_SLICES = 64  # a partition of 2**26 elements as 64 parameters of 2**20


def measure(rounding: str, n: int, device: torch.device, state_dir: str, repeats: int) -> dict[str, tuple]:
    """Step time (ms) and residency of each case for one rounding mode."""
    g = torch.Generator().manual_seed(0)
    init = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(device)
    grad = (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16).to(device)
    results = {}
    files = {"state_storage": "mmap", "state_dir": state_dir}
    for case, storage, cold, sync, slices in (
        ("in memory", {}, False, False, 0),
        ("mmap, hot", files, False, False, 0),
        ("mmap, cold", files, True, False, 0),
        ("mmap, cold + sync", files, True, True, 0),
        # Gradient release: the partition applied as 64 slices, its states in memory or streamed from the files.
        ("release, in memory", {}, False, False, RELEASE_SLICES),
        ("release, mmap, hot", files, False, False, RELEASE_SLICES),
        ("release, mmap, cold", files, True, False, RELEASE_SLICES),
    ):
        p = init.clone().requires_grad_()
        p.grad = grad.clone()
        opt = AdamW([p], lr=1e-4, rounding=rounding, seed=0, **storage)
        results[case] = time_steps(opt, p, repeats, cold=cold, sync=sync, slices=slices)
        opt.close()
        print(f"{rounding:10s} {case:18s} {results[case][0]:9.1f} ms", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2**23 elements, 3 repeats")
    parser.add_argument("--state-dir", type=Path, default=None, help="default: the system's temp dir")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, run nothing")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    n = 1 << (23 if args.quick else 26)
    repeats = 3 if args.quick else 5
    probe_bytes = (256 if args.quick else 1024) * 1024**2
    root = args.state_dir or Path(tempfile.gettempdir())
    fs = filesystem_type(root) or "unknown"
    out_dir = args.out or (RESULTS / "gpu" if device.type == "cuda" else RESULTS)
    if args.dry_run:
        print(f"dry run: {n:,} elements on {device}, {repeats} repeats, state files under {root} ({fs})")
        return 0

    with tempfile.TemporaryDirectory(dir=root, prefix="pure_bf16_bench-") as tmp:
        read_bw, mapped_bw, write_bw = disk_bandwidth(Path(tmp), probe_bytes)
        print(
            f"disk under {root} ({fs}): read {read_bw:.2f} GB/s (through a mapping {mapped_bw:.2f}), write"
            f" {write_bw:.2f} GB/s",
            file=sys.stderr,
        )
        rows = []
        for rounding in ("stochastic", "kahan"):
            state_bytes = n * 2 * (3 if rounding == "kahan" else 2)
            results = measure(rounding, n, device, tmp, repeats)
            memory = {
                case: results["release, in memory" if case.startswith("release") else "in memory"][0]
                for case in results
            }
            read_bound = state_bytes / (read_bw * 1e9) * 1e3
            bounds = {
                "mmap, cold": read_bound,
                "mmap, cold + sync": read_bound + state_bytes / (write_bw * 1e9) * 1e3,
                "release, mmap, cold": read_bound,
            }
            for case, (ms, res) in results.items():
                bound = bounds.get(case)
                rows.append(
                    {
                        "rounding": rounding,
                        "case": case,
                        "elements": n,
                        "state_bytes": state_bytes,
                        "step_ms": round(ms, 2),
                        "vs_in_memory": round(ms / memory[case], 2),  # release rows: vs release in memory
                        "disk_bound_ms": round(bound, 2) if bound is not None else "",
                        "vs_disk_bound": round(ms / bound, 2) if bound is not None else "",
                        "resident_before_step": round(res, 3) if res is not None else "",
                        "read_gbps": round(read_bw, 2),
                        "mapped_read_gbps": round(mapped_bw, 2),
                        "write_gbps": round(write_bw, 2),
                    }
                )

    stem = "mmap_states_quick" if args.quick else "mmap_states"
    command = "python benchmarks/mmap_states.py" + (" --quick" if args.quick else "")
    if args.state_dir:
        command += f" --state-dir {args.state_dir}"
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"# Optimizer step with states in memory-mapped files: {n:,} bf16 elements on {device_name}",
        "",
        f"Command: `{command}`. State files on {fs}; the disk's measured sequential bandwidth there: read"
        f" {read_bw:.2f} GB/s ({mapped_bw:.2f} GB/s copying out of a mapping of the file, as the streaming does),"
        f" write {write_bw:.2f} GB/s ({probe_bytes // 1024**2} MiB, overwrite + fsync, reads after dropping the file"
        " from the page cache). Median of the timed steps. Residency: fraction of the files' pages in"
        " the page cache just before the step (mincore). Disk bound: bytes read / read bandwidth (cold), plus bytes"
        " written / write bandwidth (cold + sync). Release rows: the step applied as"
        f" {RELEASE_SLICES} slices, the last first (``AdamW.update_slice``, as gradient release applies a partition's"
        " parameters in the backward's order), against release with the states in memory.",
        "",
        "| rounding | states | step ms | vs in memory | disk bound ms | vs disk bound | resident before step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        bound = f"{r['disk_bound_ms']:.1f}" if r["disk_bound_ms"] != "" else ""
        ratio = f"{r['vs_disk_bound']:.2f}x" if r["vs_disk_bound"] != "" else ""
        res = f"{r['resident_before_step']:.0%}" if r["resident_before_step"] != "" else ""
        lines.append(
            f"| {r['rounding']} | {r['case']} | {r['step_ms']:.1f} | {r['vs_in_memory']:.2f}x | {bound} | {ratio} |"
            f" {res} |"
        )
    write_results(out_dir, stem, rows, lines, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
