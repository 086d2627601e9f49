"""Durable writes shared by every writer of the package (checkpoints, re-partitioning, exports): when one of these
returns, the data and the names are on the disk."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike, *, recursive: bool = True) -> None:
    """fsync every file and directory under ``directory`` (and ``directory`` itself): their data and their names are
    on the disk when this returns."""
    directory = Path(directory)
    if recursive:
        for root, _, files in os.walk(directory, topdown=False):
            for name in files:
                fsync_path(Path(root) / name)
            fsync_path(Path(root))
    else:
        fsync_path(directory)


@contextlib.contextmanager
def replaced_atomically(path: str | os.PathLike) -> Iterator[Path]:
    """Write a file that replaces ``path`` whole or not at all: yields ``PATH.part`` to write; when the block ends
    without an error its data is fsynced, it is moved over ``path`` and the directory is fsynced (a crash leaves the
    old file or the new one, never a mix); on an error the partial file is removed and ``path`` is untouched.

    Example::

        with replaced_atomically(directory / "latest") as part:
            part.write_text(tag)
    """
    path = Path(path)
    part = path.with_name(path.name + ".part")
    try:
        yield part
        fsync_path(part)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, path)
    fsync_path(path.absolute().parent)


__all__ = ["fsync_path", "fsync_tree", "replaced_atomically"]
