"""A warm Python for the test launches: imports torch, Lightning, DeepSpeed and the package once, then runs each
script it is asked to in a fork of itself, as ``python SCRIPT ARGS`` would (its own arguments, environment, working
directory and standard streams, ``__main__``, exit status and exit handlers).

The suite starts over a hundred processes; each spent about six seconds importing what every one of them imports.
What differs from a fresh interpreter: the modules above are imported already (under the environment the server
started with, which ``tests/warm/__init__.py`` requires to match in what an import reads), the hash seed is the
server's, and a script's process ends without tearing its modules down (the end of this file says why). The rank
Lightning reads from the environment at import is read again. The client is the ``python`` a script sees
(``sys.executable``), so the ranks Lightning launches from it start warm too.

Usage: ``python tests/warm/server.py SOCKET`` (listens on the Unix socket SOCKET once its imports are done; ends
when its parent does).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback

PRELOAD = ("torch", "deepspeed", "lightning", "lightning_pure_bf16", "lightning_pure_bf16.strategy")


def _serve(path: str) -> dict:
    """Accept requests until one is forked: returns that request in the child (the server never returns)."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # there, and listening
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    while True:
        if os.getppid() != parent:  # the test process ended
            for pid in children:
                _kill(pid)
            os._exit(0)
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    conn.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a client went away (killed, timed out): its script goes too
                _kill(key.data)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                selector.unregister(conn)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.sendall(str(code).encode())
                except OSError:
                    pass
                conn.close()


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _become(request: dict) -> None:
    """Turn this fork into ``python SCRIPT ARGS`` run with the request's environment and directory."""
    os.setpgid(0, 0)  # its own group: the server ends it, and whatever it started, with its client
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    sys.executable = os.environ["WARM_PYTHON_CLIENT"]
    from lightning.fabric.utilities import rank_zero

    rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0  # set at import, under the server's environment


if __name__ == "__main__":
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()
    request = _serve(sys.argv[1])
    _become(request)
    del request
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # As the interpreter ends: its threads joined, its exit handlers run, its streams flushed; the teardown of every
    # module is left out (it would copy every page this fork shares with the server, seconds of it).
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
