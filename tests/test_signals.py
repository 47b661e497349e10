"""The agent's signals reach it through a relay thread, never a lock in the handler."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from harness import ROOT

CHILD = textwrap.dedent(
    """
    import os, signal, threading
    from elastic.agent.signals import relayed

    lock = threading.Lock()  # what the handler takes, as Agent.on_signal's Event.set does
    got = []
    both = threading.Event()

    def handler(signum):
        with lock:
            got.append(signum)
        if len(got) == 2:
            both.set()

    before = signal.getsignal(signal.SIGUSR1)
    with relayed((signal.SIGUSR1, signal.SIGUSR2), handler):
        with lock:  # the main thread holds it as the signals come, twice in a row
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
            sum(range(1000))  # bytecodes: a Python handler runs here
        assert both.wait(10), got
    assert got == [signal.SIGUSR1, signal.SIGUSR2], got
    assert signal.getsignal(signal.SIGUSR1) is before
    print("ok")
    """
)


def test_signals_while_the_main_thread_holds_the_handlers_lock_are_handed_on() -> None:
    """Two SIGINTs back to back hung the agent for good: the second handler ran inside
    the first, in ``Event.set``, and waited for the lock the first held."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
