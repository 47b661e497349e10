"""A worker's sign of life, apart from its progress: a thread that ticks in the control
block. A process frozen (SIGSTOP, a hung node) stops ticking; one whose main thread is
blocked in a collective, waiting for such a peer, keeps ticking. The agent tells the
two apart with it (``elastic.agent.hangs``), so it blames the frozen one, not its
victims."""

from __future__ import annotations

import threading

from elastic.contract import ALIVE_EVERY, ControlBlock

_started = False


def start(block: ControlBlock) -> None:
    """Tick for this process from now on (once per process, whatever the States)."""
    global _started
    if _started:
        return
    _started = True

    def tick() -> None:
        while True:
            block.tick()
            threading.Event().wait(ALIVE_EVERY)

    threading.Thread(target=tick, name="elastic-alive", daemon=True).start()
