"""Saves the checkpoint SOURCE over TARGET with the package's save protocol and dies at one instant of it, as a kill
would: no clean-up, no exception handlers (``os._exit``). One process, no DeepSpeed: the writer copies SOURCE's files
one by one as DeepSpeed's ranks would write them.

    python tests/scripts/crash_save.py TARGET SOURCE INSTANT      (or in_a_child(TARGET, SOURCE, INSTANT) from a test)

INSTANT: ``file:N`` after the N-th file is written; ``replace:N`` just before the N-th rename of the protocol (1: the
manifest into place, 2: the previous checkpoint aside, 3: the new one into place); ``rmtree:1`` just before the
previous checkpoint is deleted; ``none``: no crash.
"""

import os
import shutil
import sys
from pathlib import Path

from lightning_pure_bf16 import checkpoint


def save_and_die(target: Path, source: Path, instant: str) -> None:
    """The save of SOURCE over TARGET, ended by ``os._exit(9)`` at ``instant`` (or returning, for ``none``)."""
    kind, _, n = instant.partition(":")
    calls = {"file": 0, "replace": 0, "rmtree": 0}

    def counted(name, original):
        def call(*args, **kwargs):
            calls[name] += 1
            if kind == name and calls[name] == int(n):
                os._exit(9)
            return original(*args, **kwargs)

        return call

    os.replace = counted("replace", os.replace)
    shutil.rmtree = counted("rmtree", shutil.rmtree)

    def write(staged: Path) -> None:
        for f in sorted(p for p in source.rglob("*") if p.is_file() and p.name != checkpoint.MANIFEST):
            dest = staged / f.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
            calls["file"] += 1
            if kind == "file" and calls["file"] == int(n):
                os._exit(9)

    checkpoint.save_staged(target, write, world_size=2, is_global_zero=True, barrier=lambda _: None)


def in_a_child(target: Path, source: Path, instant: str) -> int:
    """:func:`save_and_die` in a forked child of this process (its imports shared, its patches its own); returns
    the child's exit status: 9 when it died at the instant, 0 when the save finished, 1 when it raised."""
    pid = os.fork()
    if pid == 0:
        try:
            save_and_die(target, source, instant)
        except BaseException:  # noqa: BLE001 - reported through the exit status
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    save_and_die(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
