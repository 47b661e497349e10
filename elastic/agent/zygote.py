"""The fork server's own process (``--start-method forkserver``): import torch once, then
fork a worker per request and run its script in the child, as ``python script.py`` would.

Runs as ``python -m elastic.agent.zygote FD``; FD is a Unix SOCK_SEQPACKET socket to the agent.
A request is one message, JSON, with three file descriptors attached (the worker's
stdin, stdout, stderr); replies are messages too: ``{"pid": N}`` for each fork,
``{"exited": N, "status": S}`` when a worker ends (S as Popen.returncode: negative for a
signal), and ``{"ready": true}`` once, first, when the imports are done (the agent joins
the job only then: a node that joins a running job pauses it until its workers start).
Nothing here runs threads: children are forked from a single-threaded process.
"""

from __future__ import annotations

import ctypes
import gc
import io
import json
import os
import runpy
import signal
import socket
import sys
import traceback

import elastic
from elastic.agent.helper import agent_socket, say_ready
from elastic.contract import LOBBY_ENV

_PR_SET_PDEATHSIG = 1


def _run_child(req: dict, fds: list[int], parent: int) -> None:
    """In the forked child: become the worker, run its script, exit like python does."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "prctl"):
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # as python -u: output as it comes
    os.environ.clear()
    os.environ.update(req["env"])
    if os.environ.get(LOBBY_ENV):  # what a spawned one's sitecustomize does (placed.py)
        from elastic.worker import placed  # the worker's side: in the child alone

        placed.watch()
    os.chdir(req["cwd"])
    # imported here before the worker's environment was; by this process, not the script
    elastic.watch_the_first_group(imported=False)
    code = 0
    try:
        if req["module"]:
            sys.argv = [req["target"], *req["args"]]
            runpy.run_module(req["target"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [req["target"], *req["args"]]
            sys.path[0] = os.path.dirname(os.path.abspath(req["target"]))
            runpy.run_path(req["target"], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _status(raw: int) -> int:
    if os.WIFSIGNALED(raw):
        return -os.WTERMSIG(raw)
    return os.WEXITSTATUS(raw)


def serve(sock: socket.socket) -> None:
    import torch  # the point of this process: the import every worker shares
    import torch._dynamo
    import torch.distributed  # noqa: F401

    gc.freeze()  # what every child shares: its collections and its exit never walk it,
    # and they leave its pages shared (Python's advice for a process that forks)
    me = os.getpid()
    children: set[int] = set()

    def send(msg: dict) -> None:
        sock.send(json.dumps(msg).encode())

    say_ready(sock)
    while True:
        while children:  # report exits first, so they arrive even with no request
            pid, raw = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send({"exited": pid, "status": _status(raw)})
        sock.settimeout(0.05 if children else None)
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        except TimeoutError:
            continue
        if not data:
            return  # the agent closed us, or is gone
        pid = os.fork()
        if pid == 0:
            sock.close()
            _run_child(json.loads(data), list(fds), me)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        send({"pid": pid})


if __name__ == "__main__":
    serve(agent_socket())
