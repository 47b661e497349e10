"""Writes the job's progress record on a thread of its own.

The record is rank 0's step, written every couple of seconds from the agent's loop. In
the first seconds of an etcd outage each write waits out its timeout, and a loop held
for a second reads as a paused agent: the hang clock starts again (``hangs.PAUSED``) and
a worker that hangs during the outage is found seconds late. Here a write holds only
this thread; the loop hands over the newest record and goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from rendezvous.client import EtcdClient
from rendezvous.errors import MalformedRecordError, RendezvousError
from rendezvous.records import ProgressRecord

log = logging.getLogger(__name__)

# one write, as the thread will do it (``submit``'s or ``raise_to``'s)
Write = Callable[[], None]


class ProgressWriter:
    """One write at a time, the newest waiting: a record handed over while another is
    being written replaces any that waits (only the newest step matters)."""

    def __init__(self, client: EtcdClient, key: str, round_key: str, timeout: float) -> None:
        self._client = client
        self._key, self._round_key, self._timeout = key, round_key, timeout
        self._cond = threading.Condition()
        self._waiting: Write | None = None
        self._writing = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A write is under way or waits."""
        with self._cond:
            return self._writing or self._waiting is not None

    def submit(self, rec: ProgressRecord, round_rev: int, written: Callable[[], None]) -> None:
        """Write ``rec`` as soon as the write before it is done, only while the round's key
        is still at ``round_rev`` (a node that does not know yet that the job re-formed
        without it never writes its older step over the new round's); ``written`` runs
        after a write that went through."""
        self._hand_over(lambda: self._write(rec, round_rev, written))

    def raise_to(self, rec: ProgressRecord) -> None:
        """Write ``rec`` whatever the round, but only over an older step (or none): a
        raise, never a lowering. For a node whose workers' newest step is in no record
        (the job went on without them); the record's job token is kept."""
        self._hand_over(lambda: self._raise(rec))

    def _hand_over(self, write: Write) -> None:
        with self._cond:
            if self._stopped:
                return
            self._waiting = write
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="elastic-progress", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every record handed over to be written (or to fail);
        whether they were."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._writing or self._waiting), timeout)

    def stop(self) -> None:
        """No more writes; one under way finishes on its own (the thread is a daemon)."""
        with self._cond:
            self._stopped = True
            self._waiting = None
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._waiting is not None)
                if self._stopped:
                    return
                assert self._waiting is not None
                write, self._waiting = self._waiting, None
                self._writing = True
            try:
                write()
            except Exception:  # the thread outlives any one write
                log.exception("recording the job's progress failed")
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, rec: ProgressRecord, round_rev: int, written: Callable[[], None]) -> None:
        ops = self._client.ops
        try:
            current = self._client.txn(
                [ops.mod(self._round_key) == round_rev],
                [ops.put(self._key, rec.encode())],
                timeout=self._timeout,
            )
        except RendezvousError as e:
            log.debug("could not record the job's progress: %s", e)
            return
        if not current:
            log.debug("round %d is over: step %d is not the job's progress", rec.round, rec.step)
            return
        written()

    def _raise(self, rec: ProgressRecord) -> None:
        try:
            kv = self._client.get(self._key, timeout=self._timeout)
            try:
                now = ProgressRecord.decode(kv.key, kv.value) if kv is not None else None
            except MalformedRecordError:
                now = None  # junk: any record is better
            if now is not None and now.step >= rec.step:
                return
            if now is not None and now.job:
                rec = replace(rec, job=now.job)
            rev = kv.mod_revision if kv is not None else 0
            if self._client.put_if(self._key, rec.encode(), rev, timeout=self._timeout):
                log.debug("raised the job's progress to step %d", rec.step)
        except RendezvousError as e:
            log.debug("could not raise the job's progress to step %d: %s", rec.step, e)
