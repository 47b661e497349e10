"""The address a newcomer's workers started ahead get as their store's, until they are
placed (``lobby.py``): a listening socket that no one should reach.

A worker held by ``import elastic`` waits inside ``init_process_group`` and never
connects (it takes the round's address first). One that reached torch's own
``init_process_group`` without the hook (its script imported elastic later, or not at
all) connects here: it cannot wait for its placement, so the agent stops waiting for it
at once instead of after ``lobby.LOBBY_MAX``. Connections are kept open, unanswered, so
that such a worker waits quietly until it is stopped.
"""

from __future__ import annotations

import contextlib
import socket


class Tripwire:
    def __init__(self, addr: str) -> None:
        self._listener = socket.create_server((addr, 0))
        self._listener.setblocking(False)
        self.addr, self.port = addr, int(self._listener.getsockname()[1])
        self._caught: list[socket.socket] = []

    def tripped(self) -> bool:
        """Whether anything has connected (the connections are kept, unanswered)."""
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                return bool(self._caught)
            self._caught.append(conn)

    def reset(self) -> None:
        """Forget what connected (its workers were stopped): for the next workers."""
        for s in self._caught:
            with contextlib.suppress(OSError):
                s.close()
        self._caught = []

    def close(self) -> None:
        self.reset()
        with contextlib.suppress(OSError):
            self._listener.close()
