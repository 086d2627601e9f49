"""``client SCRIPT ARGS``: ``python SCRIPT ARGS`` run by the warm server at ``$WARM_PYTHON_SOCKET`` (server.py),
with this process's environment, directory and standard streams; exits as the script did (killed by a signal, it
kills itself with that signal). Killing this process ends the script. Any other command line (``-c``, ``-m``, flags)
is the real interpreter's. Run by ``python -S`` (the standard library only) from the executable ``client`` that
``tests/warm/__init__.py`` writes, which sets ``PYTHON``: it starts in milliseconds."""

import json
import os
import signal
import socket
import sys

if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
    os.execv(PYTHON, [PYTHON, *sys.argv[1:]])  # noqa: F821 (set by the executable that runs this file)
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(os.environ["WARM_PYTHON_SOCKET"])
request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # the connection closes: the server ends the script
status = b""
while chunk := conn.recv(64):
    status += chunk
code = int(status or b"1")
if code < 0:
    if -code != signal.SIGKILL:
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
