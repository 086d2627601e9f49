"""Several runs of a test script in one launch: the start-up (imports, the process group) paid once."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def start_ranks(worker: Callable[..., None], world: int, args: tuple) -> None:
    """``worker(rank, *args)`` on ``world`` ranks: spawned processes, or for one rank this process (no second
    start-up)."""
    if world == 1:
        worker(0, *args)
        return
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=args, nprocs=world, start_method="spawn")


def run_all(main: Callable[[Path, dict], None], out: Path, opts: dict) -> None:
    """``main(out, opts)``; or, where ``opts["runs"]`` lists runs (each a ``"name"`` and its options over the shared
    ones), each run one after the other in the same processes (one launch, one process group), as a user's script may
    run several fits. Each writes to OUT/<name>, its output (every rank's) to OUT/<name>/output.txt; ``"env"`` sets
    environment variables for that run only; ``"expect_error": True`` (one rank only: the others would wait) writes
    the error to the output and goes on to the next run."""
    runs = opts.pop("runs", None)
    if runs is None:
        return main(out, opts)
    for run in runs:
        run = {**opts, **run}
        run_out = out / run["name"]
        run_out.mkdir(parents=True, exist_ok=True)
        with _output_to(run_out / "output.txt"), _environment(run.get("env", {})):
            try:
                main(run_out, run)
            except Exception:
                if not run.get("expect_error"):
                    raise
                traceback.print_exc()


@contextlib.contextmanager
def _output_to(path: Path):
    """This process's stdout and stderr (file descriptors: Python's, C++'s and DeepSpeed's output alike) appended to
    ``path``; on an error, the end of it is shown on the real stderr too."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    except BaseException:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(saved[1], f"--- output of {path.parent.name}:\n{path.read_text()[-6000:]}\n".encode())
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), saved):
            os.dup2(fd, target)
            os.close(fd)


@contextlib.contextmanager
def _environment(values: dict):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
