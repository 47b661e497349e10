"""A worker's sign of life, apart from its progress: a thread that ticks in the control
block. A process frozen (SIGSTOP, a hung node) stops ticking; one whose main thread is
blocked in a collective, waiting for such a peer, keeps ticking. The agent tells the
two apart with it (``elastic.agent.hangs``), so it blames the frozen one, not its
victims. Once the script is done with ``State`` (``close()``, or the interpreter's exit,
when daemon threads freeze while torch tears down), it says nothing at all, which the
agent never judges."""

from __future__ import annotations

import atexit
import threading

from elastic.contract import ALIVE_EVERY, ControlBlock

_ticker: tuple[threading.Thread, threading.Event, ControlBlock] | None = None


def start(block: ControlBlock) -> None:
    """Tick for this process from now on (once per process, whatever the States)."""
    global _ticker
    if _ticker is not None:
        return
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            block.tick()
            done.wait(ALIVE_EVERY)

    thread = threading.Thread(target=tick, name="elastic-alive", daemon=True)
    _ticker = (thread, done, block)
    thread.start()
    atexit.register(stop)


def stop() -> None:
    """No more signs of life, and none left behind to be judged stale."""
    global _ticker
    if _ticker is None:
        return
    thread, done, block = _ticker
    _ticker = None
    done.set()
    thread.join(timeout=1.0)
    block.quiet()
