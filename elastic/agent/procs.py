"""Child processes that never outlive their parent, and stopping whole process groups."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable
from typing import IO, Protocol

_PR_SET_PDEATHSIG = 1
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies.

    The kernel delivers the signal when the *thread* that forked the child exits, so
    callers spawn from a long-lived thread. The ``getppid`` check closes the window in
    which the parent died before ``prctl`` took effect.
    """
    parent = os.getpid()

    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class Process(Protocol):
    """What a worker process offers: a Popen, or a fork server's ``ForkedWorker``."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def signal_group(proc: Process, sig: int) -> None:
    """Send ``sig`` to the process group led by ``proc`` (its DataLoader workers too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def stop_group(procs: list[Process], grace: float, sig: int = signal.SIGTERM) -> None:
    """Ask ``procs`` (each leading its own group) to stop; SIGKILL what is left after ``grace``."""
    live = [p for p in procs if p.poll() is None]
    if grace > 0:
        for p in live:
            signal_group(p, sig)
        deadline = time.monotonic() + grace
        while live and time.monotonic() < deadline:
            time.sleep(0.02)
            live = [p for p in live if p.poll() is None]
    for p in procs:
        # the leader may be gone while its children still run in the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait()
