"""Optimizer states in memory-mapped files, and the update that streams them through in chunks.

With ``state_storage="mmap"`` the moments (and the Kahan buffer) of each parameter tensor live in one file under the
user's state directory, mapped into the process with ``torch.from_file``. The device holds only the parameter and its
gradient. On CUDA each step streams the states through two chunk-sized pinned staging slots: while the update kernel
works on one chunk, a reader thread copies the next chunk out of the mapping (the disk read) and a writer thread
copies the previous result back (the disk write goes through the page cache); the host-to-device and device-to-host
copies run on their own stream. On the CPU the update works on the mapping itself, chunk by chunk, while a reader
thread brings the next chunk's pages into memory, writable, with ``MADV_POPULATE_WRITE`` (no slots, no copies). The
kernel gets each chunk's index in the whole tensor, so the random bits, and therefore the results, are those of the
in-memory optimizer, bit for bit.

Files are created at full size with ``posix_fallocate`` after checking the free space, so a full disk is an error at
allocation rather than a crash at a later write; before every step each file's size and identity are checked, so a
truncated or replaced file is an error rather than a ``SIGBUS`` or silently wrong moments.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_pure_bf16._log import rank_zero_warn

# Elements per streamed chunk: 4 Mi elements = 8 MiB per bf16 buffer, large enough that each disk request and
# host-device copy is efficient, small enough that two slots of three buffers stay under 50 MiB.
DEFAULT_STATE_CHUNK = 1 << 22
# Files are named after the rank (or the process) and the tensor's stream id; one directory per optimizer.
_DIR_PREFIX = "pure_bf16_states-"
# Free space kept beyond the files themselves, for the filesystem's own metadata.
_SPACE_MARGIN = 64 * 1024**2


class StateStorageError(OSError):
    """An optimizer state file or its directory is unusable (missing, read-only, full, truncated or replaced)."""


def check_state_dir(state_dir: str | os.PathLike, *, who: str) -> Path:
    """Check that ``state_dir`` exists, is a directory and accepts new files; return it as an absolute path.

    Args:
        state_dir: the directory the caller wants its state files in.
        who: the call quoted in error messages, e.g. ``"AdamW(state_storage='mmap', state_dir=...)"``.

    Raises:
        StateStorageError: saying what is wrong and what to do.
    """
    path = Path(state_dir).expanduser().absolute()
    if not path.exists():
        raise StateStorageError(
            errno.ENOENT,
            f"`{who}`: the state directory '{path}' does not exist. Create it (on a local NVMe disk) or pass another.",
        )
    if not path.is_dir():
        raise StateStorageError(errno.ENOTDIR, f"`{who}`: '{path}' is not a directory.")
    try:
        # A real probe: permission bits do not show a read-only mount, and root passes every permission check.
        with tempfile.TemporaryFile(dir=path, prefix=".pure_bf16_probe-"):
            pass
    except OSError as err:
        raise StateStorageError(
            err.errno or errno.EACCES,
            f"`{who}`: cannot create files in the state directory '{path}' ({err.strerror or err}). Pass a"
            " writable directory.",
        ) from err
    return path


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the filesystem holding ``path`` (``"ext4"``, ``"tmpfs"``...) from ``/proc/self/mounts``, if known."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return None
    target = os.path.realpath(path)
    best, kind = "", None
    for _, mount_point, fs_type in mounts:
        mount_point = mount_point.replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, fs_type
    return kind


@dataclass
class _StateFile:
    path: Path
    nbytes: int
    inode: int
    buffers: list[torch.Tensor]  # flat views of the mapping, one per state buffer


def _layout(specs: Sequence[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of buffers laid out one after the other, each aligned to its element size, and the total size."""
    offsets, end = [], 0
    for numel, dtype in specs:
        start = -(-end // dtype.itemsize) * dtype.itemsize
        offsets.append(start)
        end = start + numel * dtype.itemsize
    return offsets, end


class MmapStateStore:
    """The state files of one optimizer: one file per parameter tensor, in a directory of its own.

    Args:
        state_dir: an existing, writable directory (checked by :func:`check_state_dir`).
        who: the call quoted in error messages.
    """

    def __init__(self, state_dir: str | os.PathLike, *, who: str) -> None:
        self.root = Path(state_dir)
        self.who = who
        self.pid = os.getpid()
        self.label = f"{socket.gethostname()}-pid{self.pid}"
        self.directory: Path | None = None
        self.files: dict[int, _StateFile] = {}

    def allocate(
        self, requests: Sequence[tuple[int, Sequence[tuple[int, torch.dtype]]]]
    ) -> dict[int, list[torch.Tensor]]:
        """Create and map the files of several tensors at once, all or none.

        Args:
            requests: ``(stream id, [(elements, dtype) per buffer])`` per tensor; one file per tensor holds its
                buffers one after the other, each aligned to its element size.

        Returns:
            Per stream id, the flat zero-filled buffers (CPU tensors backed by the file).

        Raises:
            StateStorageError: when the disk has too little free space (checked for all files before any is created)
                or a file cannot be created; files created by this call are removed again.
        """
        if not requests:
            return {}
        needed = sum(_layout(specs)[1] for _, specs in requests)
        free = shutil.disk_usage(self.root).free
        if needed + _SPACE_MARGIN > free:
            raise StateStorageError(
                errno.ENOSPC,
                f"`{self.who}`: the optimizer states need {_size(needed)} in '{self.root}', which has {_size(free)}"
                f" free. Free space (leftover '{_DIR_PREFIX}*' directories of crashed runs can be deleted) or pass"
                " another `state_dir`.",
            )
        if self.directory is None:
            _warn_left_behind(self.root, self.who)
            self.directory = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{self.label}-", dir=self.root))
        created: list[int] = []
        try:
            for stream, specs in requests:
                self.files[stream] = self._create(stream, specs)
                created.append(stream)
        except BaseException:
            for stream in created:
                self._remove(self.files.pop(stream))
            raise
        return {stream: self.files[stream].buffers for stream in created}

    def _create(self, stream: int, specs: Sequence[tuple[int, torch.dtype]]) -> _StateFile:
        assert self.directory is not None
        path = self.directory / f"t{stream:05d}.bin"
        offsets, nbytes = _layout(specs)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as err:
            raise StateStorageError(
                err.errno, f"`{self.who}`: cannot create the state file '{path}': {err.strerror}."
            ) from err
        try:
            if nbytes:
                # Reserve every block now: writes through the mapping can then never run out of space.
                os.posix_fallocate(fd, 0, nbytes)
            inode = os.fstat(fd).st_ino
        except OSError as err:
            os.close(fd)
            path.unlink(missing_ok=True)
            reason = "the disk is full" if err.errno == errno.ENOSPC else err.strerror
            raise StateStorageError(
                err.errno,
                f"`{self.who}`: cannot reserve {_size(nbytes)} for the state file '{path}': {reason}. Free space or"
                " pass another `state_dir`.",
            ) from err
        os.close(fd)
        raw = (
            torch.from_file(os.fspath(path), shared=True, size=nbytes, dtype=torch.uint8)
            if nbytes
            else torch.zeros(0, dtype=torch.uint8)
        )
        buffers = [
            raw[offset : offset + numel * dtype.itemsize].view(dtype) for offset, (numel, dtype) in zip(offsets, specs)
        ]
        return _StateFile(path, nbytes, inode, buffers)

    def verify(self, stream: int) -> None:
        """Check that the file of ``stream`` still has its size and identity (one ``stat``).

        Raises:
            StateStorageError: when it was removed, truncated, grown or replaced since it was created.
        """
        f = self.files[stream]
        try:
            st = os.stat(f.path)
        except FileNotFoundError as err:
            raise StateStorageError(
                errno.ENOENT,
                f"The optimizer state file '{f.path}' was removed while training; its moments cannot be trusted."
                " Keep other programs out of the state directory and resume from the last checkpoint.",
            ) from err
        if st.st_size != f.nbytes or st.st_ino != f.inode:
            what = "replaced" if st.st_ino != f.inode else f"resized to {st.st_size} bytes (expected {f.nbytes})"
            raise StateStorageError(
                errno.EIO,
                f"The optimizer state file '{f.path}' was {what} while training; its moments cannot be trusted."
                " Keep other programs out of the state directory and resume from the last checkpoint.",
            )

    def release_all(self) -> None:
        """Remove every file but keep the directory (the states are about to be replaced)."""
        for f in self.files.values():
            self._remove(f)
        self.files.clear()

    def close(self) -> None:
        """Remove every file and the directory (idempotent). Mappings still referenced stay valid until released.

        Only in the process that created them: a forked child (a DataLoader worker) exiting must not remove its
        parent's states.
        """
        if os.getpid() != self.pid:
            return
        self.release_all()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    @staticmethod
    def _remove(f: _StateFile) -> None:
        f.path.unlink(missing_ok=True)
        f.buffers = []


def left_behind(root: str | os.PathLike) -> list[Path]:
    """The state directories under ``root`` that a run on this host left when it ended without closing them (killed,
    say, in the middle of a backward): named by a process id that is no longer running. Their states are of no use to a
    resume (a checkpoint holds its own copy)."""
    host = re.escape(socket.gethostname())
    found = []
    for path in sorted(Path(root).glob(f"{_DIR_PREFIX}*")):
        match = re.match(rf"^{re.escape(_DIR_PREFIX)}{host}-pid(\d+)-", path.name)
        if match and path.is_dir() and not _running(int(match.group(1))):
            found.append(path)
    return found


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True


def _warn_left_behind(root: Path, who: str) -> None:
    stale = left_behind(root)
    if stale:
        held = sum(f.stat().st_size for d in stale for f in d.iterdir() if f.is_file())
        names = ", ".join(f"'{d}'" for d in stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        rank_zero_warn(  # every rank sees the same directories
            f"`{who}`: {len(stale)} state director{'y' if len(stale) == 1 else 'ies'} of a run that ended without"
            f" closing (killed?) hold {_size(held)} in '{root}': {names}. A checkpoint holds its own copy of the"
            " states; delete them to free the space."
        )


def _size(nbytes: int) -> str:
    if nbytes < 1024**2:
        return f"{nbytes} bytes"
    if nbytes < 1024**3:
        return f"{nbytes / 1024**2:.1f} MiB"
    return f"{nbytes / 1024**3:.2f} GiB"


# ------------------------------------------------------------------------------------------------ streamed update
UpdateFn = Callable[..., None]


_LINUX = sys.platform.startswith("linux")
_MADV_WILLNEED = 3
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PAGE = mmap.PAGESIZE
_libc: Any = None
_populate_write = _LINUX  # cleared when the kernel does not know MADV_POPULATE_WRITE


def _madvise(t: torch.Tensor, advice: int) -> int:
    """``madvise`` over the pages of a CPU tensor's memory; returns 0 or the errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = t.data_ptr() - t.data_ptr() % _PAGE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    return 0 if _libc.madvise(start, length, advice) == 0 else ctypes.get_errno()


def prefault(t: torch.Tensor) -> None:
    """Bring a piece of a state file's mapping into memory, writable, before the update touches it.

    ``MADV_POPULATE_WRITE`` reads the pages from the disk where needed and maps them writable in one call, so the
    update then runs at memory speed instead of taking a page fault (and a write-protect fault) every few pages. A
    page that cannot be read (the file was truncated, an I/O error) is an error here instead of a ``SIGBUS`` in the
    update. Kernels before 5.14: readahead only (``MADV_WILLNEED``).

    Raises:
        StateStorageError: the pages could not be read.
    """
    global _populate_write
    if not _LINUX or t.numel() == 0:
        return
    if _populate_write:
        # (No MADV_WILLNEED first: measured, it made cold reads 2-2.5x slower than the page faults' own readahead.)
        err = _madvise(t, _MADV_POPULATE_WRITE)
        if err == errno.EINVAL:
            _populate_write = False
        elif err:
            raise StateStorageError(
                err,
                f"an optimizer state file could not be read into memory ({os.strerror(err)}): its disk failed or the"
                " file was truncated while in use. The optimizer states of this run are lost; resume from the last"
                " checkpoint.",
            )
        else:
            return
    _madvise(t, _MADV_WILLNEED)


def read_ahead(pieces: Sequence[torch.Tensor]) -> None:
    """Ask the kernel to read ``pieces`` of the state files' mappings in the background (``MADV_WILLNEED``), for an
    update expected to need them next; returns at once. A page that cannot be read is reported by the update."""
    if _LINUX:
        for piece in pieces:
            if piece.numel():
                _madvise(piece, _MADV_WILLNEED)


class StateStreamer:
    """Two staging slots and the reader/writer threads that stream state chunks between the files and the device.

    On the CPU the update works on the mapping itself, chunk by chunk, while a reader thread brings the next chunk's
    pages into memory (:func:`prefault`): no staging slots, no copies. Elsewhere (CUDA) each chunk is read into a
    pinned slot, copied to the device on a stream of its own, updated, copied back and written to the file by a
    writer thread. With ``defer_writes``, :meth:`update` returns once its last chunk is queued, before that chunk is
    written back: under gradient release the backward of the layers that follow runs meanwhile. The next
    :meth:`update` (which reuses the slots) and :meth:`wait_for_writes` wait for those writes.

    Args:
        device: where the parameters and the update kernel are.
        specs: per state buffer, its dtype and how many parameter elements share one of its elements (1 for a
            moment, 128 for the block scales of 8-bit moments).
        chunk: parameter elements per chunk (a multiple of every divisor).
        staged: stage the chunks through the slots on the CPU too (the CUDA path's pipeline without a GPU).
    """

    def __init__(
        self, device: torch.device, specs: Sequence[tuple[torch.dtype, int]], chunk: int, staged: bool = False
    ) -> None:
        if any(chunk % divisor for _, divisor in specs):
            raise ValueError(f"the chunk ({chunk}) must be a multiple of every divisor of {list(specs)}")
        self.device = device
        self.chunk = chunk
        self.divisors = [divisor for _, divisor in specs]
        cuda = device.type == "cuda"
        self.in_place = device.type == "cpu" and not staged
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="pure_bf16_state_read")
        self.writer: ThreadPoolExecutor | None = None
        # The write-backs the last update left running (the slot pipeline).
        self._pending: list[Future] = []
        if self.in_place:
            self.host = self.dev = []
            self.copy_stream = None
            return
        # Pinned host slots: host-device copies run asynchronously, at full bus speed.
        self.host = [
            [torch.empty(chunk // divisor, dtype=dtype, pin_memory=cuda) for dtype, divisor in specs] for _ in range(2)
        ]
        self.dev = (
            [[torch.empty(chunk // divisor, dtype=dtype, device=device) for dtype, divisor in specs] for _ in range(2)]
            if cuda
            else self.host
        )
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="pure_bf16_state_write")

    def wait_for_writes(self) -> None:
        """Return once every chunk an :meth:`update` computed is written back to its file (raises what a write
        raised). The files are then complete: before they are read, copied or replaced."""
        pending, self._pending = self._pending, []
        try:
            for future in pending:
                future.result()
        finally:
            for future in pending:  # after an error, the others still finish before the slots are reused
                future.exception()

    def close(self) -> None:
        self.wait_for_writes()
        self.reader.shutdown(wait=True)
        if self.writer is not None:
            self.writer.shutdown(wait=True)
        if self.copy_stream is not None:
            # No copy may still use the slots when their memory goes back to the allocator.
            self.copy_stream.synchronize()

    def update(
        self,
        update: UpdateFn,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: Sequence[torch.Tensor],
        forward: Callable[[list[torch.Tensor]], tuple[Any, ...]],
        index_base: int = 0,
        defer_writes: bool = False,
    ) -> None:
        """Run ``update`` over ``param`` chunk by chunk with the matching chunks of the file-backed ``states``.

        Args:
            update: called as ``update(param_chunk, grad_chunk, *forward(state_chunks), index_offset=start)``.
            param: the flat parameter (contiguous, on ``device``), or a slice of one.
            grad: the flat gradient, same length.
            states: flat file-backed CPU buffers, one element per ``divisor`` parameter elements each (sliced as
                ``param`` is: a slice starts on a multiple of every divisor).
            forward: maps the device-side state chunks to the kernel's state arguments (inserts ``None`` for an
                absent Kahan buffer).
            index_base: the index of ``param``'s first element in the tensor it is a slice of, so that the random
                bits of every element are the whole tensor's (default: 0).
            defer_writes: return before the last chunks are written back (the slot pipeline; see the class).
        """
        n = param.numel()
        starts = list(range(0, n, self.chunk))
        if not starts:
            return

        def span(i: int) -> tuple[int, int]:
            return starts[i], min(starts[i] + self.chunk, n)

        def spans(i: int) -> list[tuple[int, int]]:
            s, e = span(i)
            return [(s // d, -(-e // d)) for d in self.divisors]

        if index_base:
            inner = update

            def update(*args: Any, index_offset: int) -> None:
                inner(*args, index_offset=index_base + index_offset)

        if self.in_place:
            self._update_in_place(update, param, grad, states, forward, len(starts), span, spans)
            return

        def load(i: int, slot: int) -> None:
            for buf, src, (s, e) in zip(self.host[slot], states, spans(i)):
                buf[: e - s].copy_(src[s:e])  # reads the file (page faults) outside the GIL

        def store(i: int, slot: int, done: torch.cuda.Event | None) -> None:
            if done is not None:
                done.synchronize()
            for dst, buf, (s, e) in zip(states, self.host[slot], spans(i)):
                dst[s:e].copy_(buf[: e - s])

        self.wait_for_writes()  # the previous update's last chunks still use the slots
        reads: dict[int, Future] = {0: self.reader.submit(load, 0, 0)}
        writes: dict[int, Future] = {}
        compute = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        try:
            for i in range(len(starts)):
                slot = i % 2
                reads.pop(i).result()
                if i + 1 < len(starts):
                    # The next chunk goes into the other slot once that slot's previous result is written back.
                    if i - 1 in writes:
                        writes.pop(i - 1).result()
                    reads[i + 1] = self.reader.submit(load, i + 1, 1 - slot)
                s, e = span(i)
                dev = [b[: hi - lo] for b, (lo, hi) in zip(self.dev[slot], spans(i))]
                done = None
                if self.copy_stream is not None:
                    assert compute is not None
                    with torch.cuda.stream(self.copy_stream):
                        for d, h in zip(dev, self.host[slot]):
                            d.copy_(h[: d.numel()], non_blocking=True)
                    compute.wait_stream(self.copy_stream)
                update(param[s:e], grad[s:e], *forward(dev), index_offset=s)
                if self.copy_stream is not None:
                    self.copy_stream.wait_stream(compute)
                    with torch.cuda.stream(self.copy_stream):
                        for h, d in zip(self.host[slot], dev):
                            h[: d.numel()].copy_(d, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(self.copy_stream)
                assert self.writer is not None  # the slot pipeline has its writer thread
                writes[i] = self.writer.submit(store, i, slot, done)
            # With defer_writes the last chunks are written back while the caller goes on (wait_for_writes, or the
            # next update).
            self._pending = [writes.pop(i) for i in sorted(writes)]
            if not defer_writes:
                self.wait_for_writes()
        finally:
            # On an error, let the threads finish what they started before the slots are reused or freed.
            for f in [*reads.values(), *writes.values()]:
                f.cancel() or f.exception()

    def _update_in_place(
        self,
        update: UpdateFn,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: Sequence[torch.Tensor],
        forward: Callable[[list[torch.Tensor]], tuple[Any, ...]],
        count: int,
        span: Callable[[int], tuple[int, int]],
        spans: Callable[[int], list[tuple[int, int]]],
    ) -> None:
        """The CPU: each chunk updated in the mapping, the next one brought into memory meanwhile."""

        def pieces(i: int) -> list[torch.Tensor]:
            return [t[lo:hi] for t, (lo, hi) in zip(states, spans(i))]

        # The next chunk's pages are brought in while this one is updated. (Measured on one disk: two reader threads or
        # two chunks ahead were no faster, 2**26 elements cold.)
        loads: dict[int, list[Future]] = {}

        def submit(i: int) -> None:
            if i < count and i not in loads:
                loads[i] = [self.reader.submit(prefault, t) for t in pieces(i)]

        try:
            for i in range(count):
                submit(i)
                submit(i + 1)
                for f in loads.pop(i):
                    f.result()
                s, e = span(i)
                update(param[s:e], grad[s:e], *forward(pieces(i)), index_offset=s)
        finally:
            for futures in loads.values():
                for f in futures:
                    f.cancel() or f.exception()


__all__ = [
    "DEFAULT_STATE_CHUNK",
    "left_behind",
    "read_ahead",
    "MmapStateStore",
    "StateStorageError",
    "StateStreamer",
    "check_state_dir",
    "filesystem_type",
]
