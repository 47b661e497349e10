"""``--start-method forkserver``: workers forked from a process that has imported torch.

A fresh interpreter spends most of a worker's start in ``import torch`` (about two
seconds on a small machine), and every restart and resize pays it on the recovery path.
The fork server pays it once per node: it imports torch, then forks one child per worker
and runs the script in it (``zygote.py``). The child is the worker: its own session,
stdio from the agent's pipes, SIGKILL when the fork server dies, which dies with the agent.

The difference from ``spawn`` (a fresh ``python -u script.py``, torchrun's way and the
default): the script runs in an interpreter where torch is already imported, so settings
a script makes in the environment *before* importing torch, for libraries that read them
at import time (OMP_NUM_THREADS, TORCH_LOGS...), come too late. Set those in the agent's
environment instead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from elastic.agent.helper import Helper


class ForkedWorker:
    """What WorkerGroup needs of a Popen, for a worker the fork server forked."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = None  # set by the caller when it piped them
        self.stderr: IO[bytes] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            self._server.wait_change(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ForkServer:
    """The per-node fork server, started at once so torch imports while the job forms."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._helper = Helper("elastic.agent.zygote", env)
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._pids: list[int] = []
        self._gone = False
        self._ready = False  # torch is imported: a fork is a fork, not an import
        self._lock = threading.Lock()  # one spawn at a time: replies come in order
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self._helper.receive()
            except OSError:
                msg = None
            with self._cond:
                if msg is None:
                    self._gone = True
                    self._pids.append(-1)  # wake spawners: the server is gone
                    self._cond.notify_all()
                    return
                if "ready" in msg:
                    self._ready = True
                elif "pid" in msg:
                    self._pids.append(msg["pid"])
                else:
                    self._exits[msg["exited"]] = msg["status"]
                self._cond.notify_all()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the server has imported torch (or is gone); True if it is ready."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._gone, timeout)
            return self._ready

    def spawn(
        self,
        target: str,
        args: Sequence[str],
        module: bool,
        env: Mapping[str, str],
        stdio: tuple[int, int, int],
        cwd: str | None = None,
    ) -> ForkedWorker:
        request = json.dumps(
            {
                "target": target,
                "args": list(args),
                "module": module,
                "env": dict(env),
                "cwd": cwd or os.getcwd(),
            }
        ).encode()
        with self._lock:
            socket.send_fds(self._helper.sock, [request], list(stdio))
            with self._cond:
                self._cond.wait_for(lambda: self._pids, timeout=60)
                pid = self._pids.pop(0) if self._pids else -1
        if pid < 0:
            raise RuntimeError("the fork server is gone (see the agent's log for why)")
        return ForkedWorker(self, pid)

    def status(self, pid: int) -> int | None:
        """``pid``'s exit status; once the server is gone (its children die with it: a
        parent-death signal), a worker no longer running counts as killed."""
        with self._cond:
            code = self._exits.get(pid)
            if code is not None or not self._gone:
                return code
        if _running(pid):
            return None
        with self._cond:
            return self._exits.setdefault(pid, -int(signal.SIGKILL))

    def wait_change(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait(timeout)

    def close(self) -> None:
        self._helper.close()
