"""The round's TCPStore, hosted for the rank-0 agent as torchrun's c10d backend does.

Workers find it at MASTER_ADDR:MASTER_PORT with TORCHELASTIC_USE_AGENT_STORE=True, the
same environment torchrun gives them. Each round gets a store on a fresh port, dropped
when the round ends, so a stale worker of an older round has nothing to connect to.

A TCPStore needs torch, and the agent never imports torch (it stays small, and its own
start does not compete with its workers' ``import torch`` for the cores). So the store
lives in a helper process (``store_server``); hosting a round's store is then one message
away. The helper costs an ``import torch`` (about 2 s of CPU, a few hundred MB), so only
an agent that may host starts it (``warm``): the leader, which writes the first round and
holds its rank 0, and the nodes of group rank 0 and 1 of each round (rank 1 becomes rank
0 when rank 0 goes). It says when its import is done (``ready``): until then, the rank-0
agent starts its new workers first, so that their ``import torch`` and the helper's
overlap. The helper has its own session (a terminal's Ctrl-C reaches only the agent) and
dies with the agent.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
import threading

from elastic.agent.procs import die_with_parent


class StoreError(RuntimeError):
    """The store could not be hosted on the round's port."""


class StoreHost:
    """The helper process and the one store it hosts at a time."""

    def __init__(self, start_timeout: float = 120.0) -> None:
        self._timeout = start_timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._hosting = False
        self._ready = False

    def warm(self) -> None:
        """Start the helper, if it is not running: its ``import torch`` begins now."""
        with self._lock:
            self._start()

    def _start(self) -> socket.socket:
        if self._sock is None:
            self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "elastic.agent.store_server", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
            theirs.close()
        return self._sock

    @property
    def ready(self) -> bool:
        """The helper runs and has imported torch: hosting a store takes milliseconds."""
        with self._lock:
            sock = self._sock
            if sock is not None and not self._ready and select.select([sock], [], [], 0)[0]:
                self._await_ready(sock)
            return self._ready

    def host_round(self, addr: str, port: int) -> None:
        """Host a fresh store on ``port`` (the previous one goes). Waits for the helper's
        ``import torch`` if it is still under way."""
        with self._lock:
            sock = self._start()
            if not self._ready:
                self._await_ready(sock)
            reply = self._ask(sock, {"host": addr, "port": port})
        if "error" in reply:
            raise StoreError(f"cannot host the round's store on port {port}: {reply['error']}")
        self._hosting = True

    def drop_round(self) -> None:
        """The round is over: its store goes (stale workers have nothing to reach)."""
        sock = self._sock
        if not self._hosting or sock is None:
            return
        self._hosting = False
        with self._lock, contextlib.suppress(OSError):
            sock.send(json.dumps({"drop": True}).encode())

    def _await_ready(self, sock: socket.socket) -> None:
        if "ready" not in self._receive(sock):
            raise StoreError("the store helper did not say it was ready")
        self._ready = True

    def _ask(self, sock: socket.socket, msg: dict[str, object]) -> dict[str, object]:
        try:
            sock.send(json.dumps(msg).encode())
        except OSError as e:
            raise StoreError(f"the store helper is gone ({e})") from None
        return self._receive(sock)

    def _receive(self, sock: socket.socket) -> dict[str, object]:
        try:
            sock.settimeout(self._timeout)
            data = sock.recv(1 << 16)
        except OSError as e:
            raise StoreError(f"the store helper is gone ({e})") from None
        finally:
            sock.settimeout(None)
        if not data:
            code = self._proc.poll() if self._proc is not None else None
            raise StoreError(f"the store helper exited with {code}")
        reply: dict[str, object] = json.loads(data)
        return reply

    def close(self) -> None:
        if self._sock is None or self._proc is None:
            return
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
