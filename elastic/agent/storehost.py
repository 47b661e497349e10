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
import select
import threading

from elastic.agent.helper import Helper


class StoreError(RuntimeError):
    """The store could not be hosted on the round's port."""


class StoreHost:
    """The helper process and the one store it hosts at a time."""

    def __init__(self, start_timeout: float = 120.0) -> None:
        self._timeout = start_timeout
        self._lock = threading.Lock()
        self._helper: Helper | None = None
        self._hosting = False
        self._ready = False

    def warm(self) -> None:
        """Start the helper, if it is not running: its ``import torch`` begins now."""
        with self._lock:
            self._start()

    def _start(self) -> Helper:
        if self._helper is None:
            self._helper = Helper("elastic.agent.store_server")
        return self._helper

    @property
    def ready(self) -> bool:
        """The helper runs and has imported torch: hosting a store takes milliseconds."""
        with self._lock:
            helper = self._helper
            waiting = helper is not None and not self._ready
            if waiting and helper and select.select([helper.sock], [], [], 0)[0]:
                self._await_ready(helper)
            return self._ready

    def host_round(self, addr: str, port: int) -> None:
        """Host a fresh store on ``port`` (the previous one goes). Waits for the helper's
        ``import torch`` if it is still under way."""
        with self._lock:
            helper = self._start()
            if not self._ready:
                self._await_ready(helper)
            reply = self._ask(helper, {"host": addr, "port": port})
        if "error" in reply:
            raise StoreError(f"cannot host the round's store on port {port}: {reply['error']}")
        self._hosting = True

    def drop_round(self) -> None:
        """The round is over: its store goes (stale workers have nothing to reach)."""
        helper = self._helper
        if not self._hosting or helper is None:
            return
        self._hosting = False
        with self._lock, contextlib.suppress(OSError):
            helper.send({"drop": True})

    def _await_ready(self, helper: Helper) -> None:
        if "ready" not in self._receive(helper):
            raise StoreError("the store helper did not say it was ready")
        self._ready = True

    def _ask(self, helper: Helper, msg: dict[str, object]) -> dict[str, object]:
        try:
            helper.send(msg)
        except OSError as e:
            raise StoreError(f"the store helper is gone ({e})") from None
        return self._receive(helper)

    def _receive(self, helper: Helper) -> dict[str, object]:
        try:
            reply = helper.receive(self._timeout)
        except OSError as e:
            raise StoreError(f"the store helper is gone ({e})") from None
        if reply is None:
            raise StoreError(f"the store helper exited with {helper.exit_code}")
        return reply

    def close(self) -> None:
        if self._helper is not None:
            self._helper.close()
