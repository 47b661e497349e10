"""A node's etcd lease, kept alive in the background.

The lease is the node's liveness: its record is attached to it, so a node that crashes,
freezes or is cut off vanishes from etcd within the TTL, and one that leaves revokes
it and vanishes at once. The keeper distinguishes "etcd is unreachable" (keep going:
the lease may well be alive, and etcd extends every lease when it comes back) from
"etcd says the lease is gone" (the others have moved on: fence).

Every lease of one ``EtcdClient`` is kept alive by one thread over one LeaseKeepAlive
stream, as etcd's Go client does: a keep-alive is one message on it, answered by the
lease's id. One agent holds one lease, so this changes nothing for it; a process that
simulates many nodes (the scale benchmark) costs one thread and one stream, not three
threads and a stream per node.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import grpc
from etcd3 import etcdrpc

from rendezvous.client import EtcdClient, KeepAliveStream
from rendezvous.errors import RendezvousError

log = logging.getLogger(__name__)

RETRY = 0.5  # seconds between keep-alives while etcd does not answer


class LeaseKeeper:
    """One lease: granted here, kept alive by its client's ``KeepAlives``."""

    def __init__(
        self,
        client: EtcdClient,
        ttl: int,
        interval: float,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self.ttl = ttl
        self.interval = interval
        self.on_change = on_change
        self.lease_id = 0
        self.lost = False
        self.last_ok = 0.0
        self.next_at = 0.0  # monotonic time of the next keep-alive
        self.was_reachable = True
        self.last_heard = 0.0  # monotonic time etcd last answered for this lease
        self.back_at = 0.0  # ... after it had not for a while (see ``quiet``)

    @property
    def quiet(self) -> float:
        """Seconds without an answer that are more than a late keep-alive: etcd is away
        (or this node is cut off), and whole TTLs of it may drop every lease."""
        return max(self.ttl / 2, self.interval * 1.25)

    def _silent_at(self, now: float) -> bool:
        """etcd has not answered for longer than ``quiet`` (once it has answered at all)."""
        return bool(self.last_heard) and now - self.last_heard > self.quiet

    def _heard(self, now: float) -> None:
        if self._silent_at(now):
            self.back_at = now
        self.last_heard = now

    def came_back(self, now: float) -> None:
        """etcd answers again after an outage this node saw before it held a lease (as it
        registered): the grace of ``outage_until`` runs from ``now``."""
        self.back_at = now

    def outage_until(self, now: float) -> float:
        """Until when a node that vanished from etcd may be coming back (0: no outage
        lately): while etcd does not answer this node, and a TTL after it does again,
        since an outage that dropped another node's lease may well have dropped them all."""
        if self._silent_at(now):
            return now + self.ttl
        return self.back_at + self.ttl if self.back_at else 0.0

    def grant(self, timeout: float | None = None) -> int:
        self.lease_id = self._client.grant(self.ttl, timeout)
        self.lost = False
        self.last_ok = self.next_at = time.monotonic()
        self._heard(self.last_ok)
        self.next_at += self.interval
        self.was_reachable = True
        self._client.shared(KeepAlives).add(self)
        return self.lease_id

    def reachable(self, now: float) -> bool:
        """False once no keep-alive has succeeded for a whole TTL."""
        return now - self.last_ok < self.ttl

    def answered(self, lease_id: int, ttl: int, now: float) -> bool:
        """etcd answered a keep-alive of ``lease_id`` with ``ttl`` left (<= 0: gone).
        True when the waiters should look again (the lease is lost, or etcd is back)."""
        self._heard(now)
        if lease_id != self.lease_id or self.lost:
            return False  # an answer for the lease before a re-registration
        if ttl <= 0:
            self.lost = True
            log.warning("etcd says this node's lease %x is gone", lease_id)
            return True
        self.last_ok = now
        if self.was_reachable:
            return False
        self.was_reachable = True
        log.info("etcd reachable again; lease %x still alive", lease_id)
        return True

    def unreachable_now(self, now: float, why: str) -> bool:
        """True when this is the moment the lease turned unreachable (tell the waiters)."""
        if not self.was_reachable or self.reachable(now) or not self.lease_id or self.lost:
            return False
        self.was_reachable = False
        log.warning("etcd unreachable for %ss; workers keep running: %s", self.ttl, why)
        return True

    def revoke(self, timeout: float = 2.0) -> None:
        """Drop the lease now: the node's record disappears for everyone at once."""
        lease_id, self.lease_id = self.lease_id, 0
        if lease_id and not self.lost:  # a lost lease is gone already
            try:
                self._client.revoke(lease_id, timeout=timeout)
            except RendezvousError as e:  # one gone already is no error (client.revoke)
                log.warning(
                    "could not revoke lease %x (it expires in %ss): %s", lease_id, self.ttl, e
                )

    def stop(self) -> None:
        self._client.shared(KeepAlives).remove(self)


class KeepAlives:
    """The keep-alive thread of one client: sends each lease's keep-alive when due on the
    shared stream, matches answers by lease id, and reopens the stream when it breaks or
    an answer is overdue (the first keep-alive after a break goes through the client's
    retrying call, which replaces a broken channel, e.g. after an etcd restart)."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._keepers: dict[int, LeaseKeeper] = {}  # by id(): a keeper's lease id changes
        self._thread: threading.Thread | None = None
        self._inbox: queue.Queue = queue.Queue()  # (stream or None, answer / error / wake)
        self._stream: KeepAliveStream | None = None
        self._pending: dict[int, float] = {}  # lease id -> when its keep-alive was sent
        self._heard = 0.0  # when the stream last brought an answer
        self._error = "no answer"

    def add(self, keeper: LeaseKeeper) -> None:
        with self._lock:
            self._keepers[id(keeper)] = keeper
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd-lease", daemon=True)
                self._thread.start()
        self._inbox.put((None, None))

    def remove(self, keeper: LeaseKeeper) -> None:
        with self._lock:
            self._keepers.pop(id(keeper), None)
            thread = self._thread if not self._keepers else None
        self._inbox.put((None, None))
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._lock:
                keepers = list(self._keepers.values())
                if not keepers:
                    self._thread = None
                    self._close()
                    return
            now = time.monotonic()
            changed = [k for k in keepers if k.unreachable_now(now, self._error)]
            live = [k for k in keepers if k.lease_id and not k.lost]
            due = []
            if any(k.next_at <= now for k in live):
                # those due within half an interval go along: the leases of a process come
                # into step, and one wake-up a round keeps them all (no more requests)
                due = [k for k in live if k.next_at <= now + k.interval / 2]
            try:
                if due:
                    changed += self._send(due, now)
                for k in changed:
                    k.on_change()
                self._receive({k.lease_id: k for k in keepers if k.lease_id and not k.lost})
            except Exception:  # the leases' only thread: it must never die silently
                log.exception("keeping the leases alive failed; retrying")
                self._close()
                time.sleep(RETRY)

    def _send(self, due: list[LeaseKeeper], now: float) -> list[LeaseKeeper]:
        """Send the due keep-alives; returns the keepers whose waiters should look again
        (answered on the way: the first keep-alive on a new stream)."""
        changed = []
        if self._stream is None:
            first = due.pop(0)
            lease_id = first.lease_id  # the keeper may get a new lease meanwhile
            try:
                ttl = self._client.refresh(lease_id, timeout=first.interval)
                self._stream = self._client.keep_alive(self._inbox)
            except RendezvousError as e:
                self._error = str(e)
                for k in [first, *due]:
                    k.next_at = now + min(k.interval, RETRY)
                return []
            first.next_at = now + first.interval
            if first.answered(lease_id, ttl, time.monotonic()):
                changed.append(first)
        for k in due:
            self._pending[k.lease_id] = now
            k.next_at = now + k.interval
            self._stream.send(k.lease_id)
        return changed

    def _receive(self, kept: dict[int, LeaseKeeper]) -> None:
        """Take answers until the next keep-alive is due, one is overdue, or a keeper
        came or went."""
        for lease_id in [lid for lid in self._pending if lid not in kept]:
            del self._pending[lease_id]  # revoked or lost meanwhile
        while True:
            now = time.monotonic()
            due = [k.next_at for k in kept.values()]
            due += [sent + kept[lid].interval for lid, sent in self._pending.items()]
            until = min(due, default=now + 1.0)
            if until <= now:
                break
            try:
                stream, got = self._inbox.get(timeout=until - now)
            except queue.Empty:
                break
            if stream is None:
                return  # a keeper came or went
            if stream is not self._stream:
                continue  # from a stream closed before
            if isinstance(got, etcdrpc.LeaseKeepAliveResponse):
                self._heard = time.monotonic()
                self._pending.pop(got.ID, None)
                k = kept.get(got.ID)
                if k is not None and k.answered(got.ID, int(got.TTL), time.monotonic()):
                    k.on_change()
            else:
                why = got.details() if isinstance(got, grpc.RpcError) else "the stream ended"
                self._broken(why)
        # an answer is overdue, and nothing came since it was asked for: the stream is
        # dead (a slow one, answering others, is not: its process may just be busy)
        now = time.monotonic()
        late = [
            lid
            for lid, sent in self._pending.items()
            if now - sent >= kept[lid].interval and self._heard < sent
        ]
        if late:
            self._broken(f"no answer to a keep-alive in {kept[late[0]].interval:g}s")

    def _broken(self, why: str) -> None:
        self._error = f"etcd unreachable at {self._client.options.describe()}: {why}"
        log.debug("keep-alive stream closed: %s", self._error)
        self._close()

    def _close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._pending.clear()
