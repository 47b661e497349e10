"""The round's store as a re-forming worker uses it: every wait in short polls that an
abandon ends.

torch's own rendezvous waits inside C++ until the store's timeout (30 minutes for gloo
by default): for a peer's key that a lost member never writes, and, while the store's
host is gone, in a connect loop of its own. No socket cut wakes either. So a live worker
connects itself, quietly and in short tries, and forms its group over this store, whose
waits look for an abandon between polls. Its keys are those torch's env:// rendezvous
uses (``PrefixStore("default_pg", ...)``), so fresh workers that form the same round
through the script's ``init_process_group()`` meet the re-forming ones.
"""

from __future__ import annotations

import datetime
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

POLL = 0.002  # the first pause between polls; it doubles up to LONGEST
LONGEST = 0.05
TRY = 0.25  # seconds of one try to connect: an abandon is looked for between tries


T = TypeVar("T")


class Abandoned(RuntimeError):
    """The round was given up while this worker waited in its store."""


def _abortable(make: Callable[[], T], check_abandoned: Callable[[], None]) -> T:
    """``make()`` in a thread of its own, while this one looks for an abandon: torch's
    TCPStore client, once its connection is reset (the host died as it was validated),
    sleeps and retries inside its constructor, past the timeout it was given (0.65 s and
    more here), holding no lock of Python's. Abandoned, the thread is left to finish,
    and whatever it made is dropped with it."""
    done: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    def run() -> None:
        try:
            done.put((True, make()))
        except BaseException as e:  # raised again in the caller
            done.put((False, e))

    threading.Thread(target=run, name="elastic-store-connect", daemon=True).start()
    pause = POLL
    while True:
        check_abandoned()
        try:
            ok, value = done.get(timeout=pause)
        except queue.Empty:
            pause = min(pause * 2, LONGEST)
            continue
        if ok:
            return value  # type: ignore[no-any-return]
        raise value


class AbortableStore(dist.Store):
    """A store whose waits end when ``check_abandoned()`` raises (pybind's trampoline
    names: ``getNumKeys``, ``deleteKey``; the instance must outlive the group)."""

    def __init__(
        self,
        inner: dist.TCPStore,
        check_abandoned: Callable[[], None],
        limit: datetime.timedelta,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.check_abandoned = check_abandoned
        self.limit = limit  # the longest wait (the group's timeout)
        self.lost = False  # its host went: it is asked nothing more

    def _until(self, keys: list[str]) -> None:
        """Wait for ``keys`` up to the group's own timeout, whatever the caller asked: the
        group forms with a short one (``Group.form``), which bounds gloo's wait for a
        peer's connection, not this wait for a peer's start-up. Once the store's host
        went (a call failed: torch's client never connects again, and logs each failed
        call with its stack), it only waits for the abandon that follows."""
        limit = self.limit.total_seconds()
        deadline, pause = time.monotonic() + limit, POLL
        while True:
            self.check_abandoned()
            try:
                if not self.lost and self.inner.check(keys):
                    return
            except RuntimeError:  # the store's host went: the agent will say what follows
                self.lost = True
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"timed out after {limit:.0f}s waiting for {keys}")
            time.sleep(pause)
            pause = min(pause * 2, LONGEST)

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._until([key])
        return self.inner.get(key)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._until(keys)

    def getNumKeys(self) -> int:  # the trampoline's name
        return self.inner.num_keys()

    def deleteKey(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def clone(self) -> AbortableStore:
        return self


def connect(
    addr: str,
    port: int,
    rank: int,
    world: int,
    hosted_by_agent: bool,
    check_abandoned: Callable[[], None],
    timeout: datetime.timedelta,
) -> AbortableStore:
    """The round's store, in tries of ``TRY`` seconds with a look for an abandon between
    them and during each (torch logs every refused connect of its own loop: a plain
    socket tries first)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        check_abandoned()
        try:
            if hosted_by_agent:
                socket.create_connection((addr, port), timeout=TRY).close()
            inner = _abortable(
                lambda: dist.TCPStore(
                    addr,
                    port,
                    world,
                    is_master=rank == 0 and not hosted_by_agent,
                    timeout=datetime.timedelta(seconds=TRY),
                    wait_for_workers=False,
                ),
                check_abandoned,
            )
            inner.set_timeout(timeout)
            return AbortableStore(inner, check_abandoned, timeout)
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(LONGEST)
