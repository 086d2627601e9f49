"""Test launches through a warm Python (``server.py``): ``command(argv, env)`` turns ``[sys.executable, SCRIPT, ...]``
into the same run by a server that has torch, Lightning, DeepSpeed and the package imported already; any other command
is left as it is. One server per pytest process and per value of the environment variables that change what an import
does; ``WARM_PYTHON=0`` in the environment runs every launch cold."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
# What a server's imports depend on: a launch with other values gets a server of its own.
IMPORT_ENV = (
    "PYTHONPATH",
    "PYTHONWARNINGS",
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "TRITON_INTERPRET",
    "DS_ACCELERATOR",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)
_servers: dict[tuple, tuple[subprocess.Popen, str, str] | None] = {}


def command(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` and ``env`` for ``subprocess``: a script run by ``sys.executable`` goes through a warm server."""
    if os.environ.get("WARM_PYTHON") == "0" or len(argv) < 2 or argv[0] != sys.executable:
        return argv, env
    if not argv[1].endswith(".py"):
        return argv, env
    key = tuple(env.get(name) for name in IMPORT_ENV)
    if key not in _servers:
        _servers[key] = _start(env)
    if _servers[key] is None:
        return argv, env
    _, sock, client = _servers[key]
    return [client, *argv[1:]], {**env, "WARM_PYTHON_SOCKET": sock, "WARM_PYTHON_CLIENT": client}


def _start(env: dict[str, str]) -> tuple[subprocess.Popen, str, str] | None:
    """A server for ``env``'s imports, or ``None`` where a Unix socket path would be too long (cold launches)."""
    where = Path(tempfile.mkdtemp(prefix="warm_python_"))
    if len(str(where / "socket").encode()) > 100:  # sun_path holds 108 bytes
        where.rmdir()
        return None
    client = where / "client"
    client.write_text(
        f"#!{sys.executable} -S\nPYTHON = {sys.executable!r}\nexec(open({str(HERE / 'client.py')!r}).read())\n"
    )
    client.chmod(0o755)
    sock = str(where / "socket")
    server_env = {k: v for k, v in env.items() if not k.startswith(("MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    with open(where / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(HERE / "server.py"), sock], env=server_env, stdout=log, stderr=log)
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    atexit.register(proc.kill)  # runs first
    while not os.path.exists(sock):  # bound once its imports are done
        if proc.poll() is not None:
            raise RuntimeError(f"the warm server did not start: {(where / 'server.log').read_text()[-3000:]}")
        time.sleep(0.05)
    return proc, sock, str(client)
