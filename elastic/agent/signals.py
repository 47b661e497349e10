"""The agent's signal handling, out of the signal handler.

Python runs a signal handler in the main thread between two bytecodes, wherever that
thread is, even inside another handler. A handler that takes a lock can therefore wait
forever on a lock its own thread holds: two SIGINTs back to back (``timeout -s INT``
sends one to the agent and one to its process group; an impatient Ctrl-C twice) had the
second handler wait in ``Event.set`` for the lock the first one held, and the agent hung
with its workers training. So the handler only writes the signal's number to a pipe,
which takes no lock in Python; a thread of its own reads it and hands it on, where a
lock is safe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def relayed(signals: tuple[int, ...], handler: Callable[[int], None]) -> Iterator[None]:
    """While inside, each of ``signals`` is handed to ``handler`` on a relay thread, in
    the order they came; the previous handlers are back afterwards."""
    read, write = os.pipe()
    os.set_blocking(write, False)

    def note(signum: int, _frame: object) -> None:
        with contextlib.suppress(BlockingIOError):  # 64 KiB of signals unread: one more lost
            os.write(write, bytes([signum]))

    def relay() -> None:
        while data := os.read(read, 64):
            for signum in data:
                handler(signum)

    thread = threading.Thread(target=relay, name="signal-relay", daemon=True)
    thread.start()
    previous = {s: signal.signal(s, note) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        os.close(write)  # the relay reads what is left, then the end
        thread.join(timeout=5.0)
        if not thread.is_alive():  # else a handler still runs: its end stays open
            os.close(read)
