"""One agent's handover: told to leave, it may train on until a node joining holds the
job's newest state (``handover.hands_over`` decides, from what the agent knows of the
state it holds). This owns what that wait holds: the signal held back, and the timer
that brings it back at ``--handover-timeout``. An agent tries it once."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from elastic.agent.handover import Holding, hands_over

log = logging.getLogger("elastic.agent")


class Handover:
    """``expired``: what the timer calls with the signal held back (the agent's own
    signal handler: the loop leaves wherever it is)."""

    def __init__(self, timeout: float, expired: Callable[[int], None]) -> None:
        self.timeout = timeout
        self._expired = expired
        self._held: tuple[int, threading.Timer] | None = None
        self._tried = False

    @property
    def active(self) -> bool:
        """It trains on with a signal held back."""
        return self._held is not None

    def consider(self, sig: int | None, holding: Callable[[], Holding]) -> tuple[bool, int | None]:
        """Told to leave by ``sig`` (or handing over already, ``sig`` then a second signal
        or None): (whether it trains on, the signal it leaves with otherwise). A second
        signal, the bound, or the state handed over end the wait: it leaves as the first
        signal asked."""
        held = self._held
        if held is not None and sig is not None:  # again, or the bound passed
            self.end()
            return False, held[0]
        if held is None and (self._tried or self.timeout <= 0):
            return False, sig
        keep, why = hands_over(held is not None, holding())
        if held is None:
            self._tried = True
            if not keep:
                log.debug("no handover: %s", why)
                return False, sig
            first = sig or signal.SIGTERM
            timer = threading.Timer(self.timeout, self._timed_out)
            timer.daemon = True
            self._held = (first, timer)
            timer.start()
            log.warning(
                "received %s: %s (at most %gs; signal again to leave now)",
                signal.Signals(first).name,
                why,
                self.timeout,
            )
            return True, None
        if keep:
            return True, None
        log.info("%s: leaving the job now", why)
        self.end()
        return False, held[0]

    def end(self) -> None:
        if self._held is not None:
            self._held[1].cancel()
            self._held = None

    def _timed_out(self) -> None:
        """The timer's end: the signal comes back, wherever the agent's loop is."""
        held = self._held
        if held is not None:
            log.warning(
                "the newest state was not handed over within %gs: leaving the job", self.timeout
            )
            self._expired(held[0])
