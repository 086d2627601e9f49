"""fsync primitives shared by checkpoints and re-partitioning: when one of these returns, the data and the names
are on the disk."""

from __future__ import annotations

import os
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


__all__ = ["fsync_path", "fsync_tree"]
