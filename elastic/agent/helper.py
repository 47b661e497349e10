"""A helper process of the agent: the work that needs torch, which the agent never imports.

Two helpers exist: the round's store (``storehost``/``store_server``) and the fork server
(``forkserver``/``zygote``). Each runs as ``python -m MODULE FD``, FD one end of a Unix
``SOCK_SEQPACKET`` socket pair (one JSON message per packet, file descriptors alongside
where needed), in its own session (a terminal's Ctrl-C reaches only the agent, which
stops it in order) and with a parent-death signal (it never outlives the agent). Its
first message says ``{"ready": true}``: its imports are done. It ends when the agent
closes its end (``close``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from elastic.agent.procs import die_with_parent


class Helper:
    """The agent's side of one helper process."""

    def __init__(self, module: str, env: Mapping[str, str] | None = None) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches only the agent
            preexec_fn=die_with_parent(),
        )
        theirs.close()

    def send(self, msg: dict[str, Any]) -> None:
        """One message (raises OSError once the helper is gone)."""
        self.sock.send(json.dumps(msg).encode())

    def receive(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; None once the helper is gone (raises TimeoutError)."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        finally:
            self.sock.settimeout(None)
        if not data:
            return None
        msg: dict[str, Any] = json.loads(data)
        return msg

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll()

    def close(self, wait: float = 0.2) -> None:
        """Close our end (the helper ends: it reads the end of the stream), then reap it,
        killing it after ``wait`` seconds: it holds nothing to save, and a torch
        interpreter's own exit takes about a second, which a Ctrl-C should not wait for.
        A shutdown, not just a close: a thread of ours blocked in ``recv`` on this socket
        keeps it open until something wakes it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the helper's side -----------------------------------------------------------------------------
def agent_socket() -> socket.socket:
    """In the helper: its end of the pair (``python -m MODULE FD``)."""
    return socket.socket(fileno=int(sys.argv[1]))


def say_ready(sock: socket.socket) -> None:
    """In the helper: its imports are done."""
    sock.send(json.dumps({"ready": True}).encode())
