"""The server side of ``torch.distributed.elastic.timer``'s file-based watchdog, torch-free.

With ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` torchrun serves a named pipe whose path workers
find in ``TORCHELASTIC_TIMER_FILE``; a worker's ``FileTimerClient`` writes one JSON line
per ``acquire``/``release`` (pid, scope_id, expiration_time, signal), and the server kills
a worker whose timer expires. This is the same protocol, so such scripts keep working.
Unlike torchrun, the agent does not kill itself after reaping: the worker's death is a
worker failure like any other, reported with the expired scope as its cause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

log = logging.getLogger("elastic.filetimer")

ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
FILE_ENV = "TORCHELASTIC_TIMER_FILE"


class FileTimerServer:
    """Reads timer requests from a FIFO and reaps the workers whose timers expire."""

    def __init__(self, path: str, interval: float = 0.1) -> None:
        self.path = path
        self.workers: Callable[[], list[int]] = list  # only these pids are ever killed
        self.interval = interval
        self._timers: dict[tuple[int, str], tuple[float, int]] = {}  # -> (expires, signal)
        self._expired: dict[int, str] = {}  # pid -> the scope that expired
        self._lock = threading.Lock()
        self._stop = threading.Event()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.mkfifo(path, 0o600)
        # read-write: the open never blocks and the pipe never reads EOF between writers
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, daemon=True, name="file-timer")
        self._thread.start()

    @classmethod
    def from_env(cls, environ: dict[str, str]) -> FileTimerServer | None:
        """torchrun's switch: a server when ``TORCHELASTIC_ENABLE_FILE_TIMER=1``."""
        if environ.get(ENABLE_ENV) != "1":
            return None
        path = environ.get(FILE_ENV) or os.path.join(
            tempfile.gettempdir(), f"watchdog_timer_{uuid.uuid4()}"
        )
        log.info("serving torch's file-timer watchdog at %s", path)
        return cls(path)

    def expired(self, pid: int) -> str | None:
        """The scope whose expiry killed worker ``pid``, if that is how it died."""
        with self._lock:
            return self._expired.get(pid)

    def _run(self) -> None:
        pending = b""
        while not self._stop.is_set():
            if select.select([self._fd], [], [], self.interval)[0]:
                with contextlib.suppress(BlockingIOError):
                    pending += os.read(self._fd, 1 << 16)
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._register(line)
            self._reap(time.time())

    def _register(self, line: bytes) -> None:
        try:
            req = json.loads(line)
            key = (int(req["pid"]), str(req["scope_id"]))
            expires, sig = float(req["expiration_time"]), int(req.get("signal", 0))
        except (ValueError, KeyError, TypeError):
            log.warning("file timer: ignoring a malformed request %r", line[:200])
            return
        with self._lock:
            if expires < 0:  # a release
                self._timers.pop(key, None)
            else:
                self._timers[key] = (expires, sig)

    def _reap(self, now: float) -> None:
        with self._lock:
            due = sorted(
                (expires, pid, scope, sig)
                for (pid, scope), (expires, sig) in self._timers.items()
                if expires <= now
            )
            for _, pid, scope, _ in due:
                del self._timers[(pid, scope)]
        for expires, pid, scope, sig in due:
            if sig <= 0 or pid in self._expired:
                continue  # torch's rule: no signal, no reaping
            if pid not in self.workers():
                log.warning(
                    "file timer %r of pid %d expired: not a worker here, ignored", scope, pid
                )
                continue
            log.warning(
                "worker pid %d: file timer %r expired %.1fs ago; killing it with %s",
                pid,
                scope,
                now - expires,
                _signame(sig),
            )
            with self._lock:
                self._expired[pid] = scope
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
