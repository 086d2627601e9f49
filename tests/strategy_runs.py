"""Runs tests/scripts/*.py as processes of their own (Lightning launches the other ranks), started warm
(``tests/warm``), and loads what they wrote."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import torch

from tests import warm

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT_S = 300


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a launch binds it seconds later (after its imports), and
    a port the kernel hands out (gloo's connections, any client socket) could be taken in between; one below that
    range is only ever taken by a bind that names it. Each pytest-xdist worker draws from its own range, so two
    workers' launches cannot pick the same port."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    span = 2000
    low = 10_000 + (worker % 8) * span
    if low + span > _ephemeral_low():  # a machine whose ephemeral range starts low: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = random.randrange(span)
    for i in range(span):
        port = low + (start + i) % span
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + span - 1}")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"))}
    env.update({"PYTHONWARNINGS": "ignore", "MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1"}, **extra)
    return env


def run_script(script: str, out: Path, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    command, env = warm.command([sys.executable, str(SCRIPTS / script), str(out), *args], _env(**env))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def fit(out: Path, check: bool = True, **opts: object) -> subprocess.CompletedProcess:
    return run_script("fit_mlp.py", out, json.dumps(opts), check=check)


def fit_runs(
    out: Path, runs: list[dict], env: dict[str, str] | None = None, script: str = "fit_mlp.py", **shared: object
) -> Path:
    """Several fits in one launch (one process group; see scripts/_runs.py): ``runs`` each with a ``"name"`` and its
    options over ``shared``. Each writes OUT/<name>/rank{R}.pt and OUT/<name>/output.txt."""
    run_script(script, out, json.dumps({**shared, "runs": runs}), **(env or {}))
    return out


def output(out: Path) -> str:
    return (out / "output.txt").read_text()


def fit_nodes(out: Path, num_nodes: int, **opts: object) -> None:
    """One fit over ``num_nodes`` simulated nodes on this machine, launched as a cluster launches them: the same
    command once per node with its ``NODE_RANK`` and one master address (Lightning launches each node's other ranks)."""
    args, env = warm.command(
        [sys.executable, str(SCRIPTS / "fit_mlp.py"), str(out), json.dumps({**opts, "num_nodes": num_nodes})], _env()
    )
    procs = [
        subprocess.Popen(args, env={**env, "NODE_RANK": str(node)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for node in range(num_nodes)
    ]
    logs = [p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace") for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise AssertionError("a node failed:\n" + "\n".join(f"node {i}:\n{log[-3000:]}" for i, log in enumerate(logs)))


def load_ranks(out: Path, world_size: int = 2) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def assert_same_partitions(a: dict, b: dict, keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "kahan_comp")) -> None:
    """Two launched fits' results for one rank hold the same bits in every element of every flat parameter partition
    and of every per-element state in ``keys`` that ``a`` holds (the padding ZeRO-3 leaves uninitialised aside), and
    the same step counts. The one bit-for-bit comparison of the tests that resume, convert or repeat a fit."""
    for x, y, real in zip(a["flat_params"], b["flat_params"], a["real_masks"], strict=True):
        assert torch.equal(x[real], y[real])
    for sa, sb, real in zip(a["state"].values(), b["state"].values(), a["real_masks"], strict=True):
        if "step" in sa:
            assert torch.equal(sa["step"], sb["step"])
        for key in (k for k in keys if k in sa):
            assert torch.equal(sa[key][real], sb[key][real]), key


def state_buffers(result: dict) -> list[tuple[str, torch.dtype, int]]:
    """The model-state buffers among every tensor a launched fit found reachable from DeepSpeed's ZeRO-3 optimizer
    (``result["zero_buffers"]``: name, dtype, bytes, in a state file), by storage: scalars (step counters, the norm,
    the overflow flag), the fixed-size reduce bucket and buffers in memory-mapped state files left out."""
    return [(n, d, b) for n, d, b, f in result["zero_buffers"] if b > 16 and ".ipg_buckets." not in n and not f]
