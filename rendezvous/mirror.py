"""A watch-fed copy of one job's keys, from which immutable views are taken (view.py).

One watch stream feeds the mirror; every change wakes whoever waits on it. Nothing polls
etcd. When the stream breaks (etcd restarted, a member died) the mirror reads the job
again and watches on from there.

Two modes. *Full*: every change under the job prefix, which only the leader (the node
that writes rounds and tells members what ends them) needs. *Lean*: ``job/`` (the
round's header, ``leader``, ``notice``, ``closed``, failure reports), this node's own
bucket of the round's members and its own record: what every other node needs, in O(1)
bytes per node and round, on three watches. With N nodes, full watching at every node
would cost N events at each of N nodes; one full node and N-1 lean ones cost O(N).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from rendezvous import records
from rendezvous.client import EtcdClient
from rendezvous.errors import EtcdUnavailableError, MalformedRecordError, RendezvousError
from rendezvous.records import RoundRecord, bucket_of, buckets_for
from rendezvous.view import KV, Decoded, Glance, JobView
from rendezvous.watches import Compacted, Event, Subscription, WatchSpec, watch

log = logging.getLogger(__name__)


class JobMirror:
    """Keeps a JobView of ``prefix`` current from one watch stream."""

    def __init__(
        self, client: EtcdClient, prefix: str, own: str = "", expected_size: int = 0
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._own = own  # this node's id: its record and bucket are watched when lean
        self._expected = expected_size  # before any round: the bucket to watch is a guess
        self._cond = threading.Condition()
        self._kvs: dict[str, KV] = {}
        self._key_rev: dict[str, int] = {}  # newest revision applied per key (tombstones too)
        self._floor = 0  # the newest read's revision: older events hold nothing new
        self._decoded = Decoded()
        self._view = JobView()
        self._dirty = False
        self._version = 0
        self._revision = 0  # the mirror has seen its share of the job up to here
        self._last_join = time.monotonic()
        self._last_loss = self._last_join
        self._full = not own
        self._epoch = 0  # bumped at each change of mode: reads and events of an older one
        self._loaded_epoch = -1  # are dropped (they saw another share of the job)
        self._stream: Subscription | None = None
        self._watched_bucket = ""  # lean: the key of this node's bucket of the round
        self._reopen = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self.connected = False

    # -- lifecycle ---------------------------------------------------------------------
    def start(
        self, timeout: float | None = None, initial: tuple[int, list[KV]] | None = None
    ) -> None:
        """Read the job once (or take ``initial``: a revision and everything under the
        prefix at it), then follow it by watch. Raises if etcd is unreachable."""
        if initial is None:
            self._load(timeout)
        else:
            revision, kvs = initial
            self._load_from(revision, kvs + self._bucket(kvs, revision), self._epoch)
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def full(self) -> bool:
        """In full mode (the view may still be catching up: see ``complete``)."""
        return self._full

    @property
    def complete(self) -> bool:
        """The view holds everything: full mode, and the catch-up read is done."""
        return self._full and self._loaded_epoch == self._epoch

    def set_full(self, full: bool, wait: bool = True) -> None:
        """Switch modes; the watch thread reads the job again in the new mode. Going full
        with ``wait``, this waits (up to the request timeout) for that read: ``complete``
        says whether it came in."""
        with self._cond:
            if full == self._full:
                return
            self._full = full
            self._epoch += 1
            epoch = self._epoch
        self._reopen.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        if full and wait:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._loaded_epoch >= epoch or self._stopped.is_set(),
                    self._client.options.request_timeout,
                )

    # -- reading -----------------------------------------------------------------------
    def view(self) -> JobView:
        """The current view, built on demand: bursts of events cost one build, not many."""
        with self._cond:
            if self._dirty:
                self._view = self._decoded.view(self._revision, self._last_join, self._last_loss)
                self._dirty = False
                for problem in self._view.problems:
                    if problem not in self._warned:
                        self._warned.add(problem)
                        log.warning("ignoring %s", problem)
            return self._view

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def wait(self, version: int, timeout: float | None) -> int:
        """Block until the version moves past ``version`` or ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout)
            return self._version

    def poke(self) -> None:
        """Wake waiters without a change (a lease was lost, a deadline moved)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    # -- feeding -----------------------------------------------------------------------
    def record_own(self, kv: KV) -> None:
        """Apply a write of this process at once (a lean watch never shows it one)."""
        with self._cond:
            if kv.mod_revision > self._floor:
                self._apply_one(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)
                self._publish()

    def lean_keys(self) -> tuple[list[str], list[str]]:
        """(keys, prefixes) a lean node reads and watches (its bucket aside): its own
        record, and ``job/`` (round header, leader, notice, closed, failure reports)."""
        p = self._prefix
        return [p + records.NODES + self._own], [p + records.JOB]

    def _specs(self) -> list[WatchSpec]:
        if self._full:
            return [WatchSpec(self._prefix, prefix=True)]
        keys, prefixes = self.lean_keys()
        if self._watched_bucket:
            keys.append(self._watched_bucket)
        return [WatchSpec(k) for k in keys] + [WatchSpec(k, prefix=True) for k in prefixes]

    def _load(self, timeout: float | None = None) -> bool:
        """Read what this mode sees (at start, on a mode change, to catch up after a
        broken watch); False when the mode changed meanwhile (read again)."""
        with self._cond:
            epoch, full = self._epoch, self._full
        if full:
            return self._load_from(*self._client.get_prefix(self._prefix, timeout), epoch)
        revision, kvs = self._client.read(*self.lean_keys(), timeout=timeout)
        return self._load_from(revision, kvs + self._bucket(kvs, revision), epoch)

    def _bucket(self, kvs: list[KV], revision: int) -> list[KV]:
        """This node's bucket of the round among ``kvs`` (a lean node reads only that one),
        as of ``revision``: written in the same transaction as the round's header. From
        here on the watch brings it (see ``_apply``); before the first round, the bucket
        it would have in a round of the expected size is watched."""
        header = self._header(kvs)
        self._watched_bucket = self._bucket_key(header)
        if header is None or not self._watched_bucket:
            return []
        kv = self._client.get(self._watched_bucket, revision=revision)
        return [kv] if kv is not None else []

    def _header(self, kvs: Sequence[KV | Event]) -> RoundRecord | None:
        """The newest round header written among ``kvs`` (a read, or a batch of events),
        if readable (else the view says what is wrong with it, naming the key)."""
        key = self._prefix + records.ROUND
        for kv in reversed(kvs):
            if kv.key == key and kv.value is not None:
                with contextlib.suppress(MalformedRecordError):
                    return RoundRecord.decode(key, kv.value)
                return None
        return None

    def _bucket_key(self, header: RoundRecord | None) -> str:
        """The key of this node's bucket in ``header``'s round, or with none yet in a round
        of the expected size ("" in full mode, or with nothing to go by)."""
        size = header.size if header is not None else self._expected
        if self._full or not size:
            return ""
        return f"{self._prefix}{records.MEMBERS}{bucket_of(self._own, buckets_for(size))}"

    def _load_from(self, revision: int, kvs: list[KV], epoch: int) -> bool:
        """Make the mirror what a read of mode ``epoch`` at ``revision`` saw, keeping what
        newer events said. A key the read lacks is gone, or outside this mode's share: it
        is forgotten either way (a share read later brings it back, whatever its age)."""
        fresh = {kv.key: kv for kv in kvs}
        with self._cond:
            if epoch != self._epoch:
                return False  # read in the mode before: its share differs
            if self._loaded_epoch == epoch and revision <= self._floor:
                return True  # a newer read of this mode is in already
            if self._full and self._loaded_epoch != epoch:
                self._last_loss = time.monotonic()  # what went before, it cannot tell when
            for key in [k for k, r in self._key_rev.items() if k not in fresh and r <= revision]:
                del self._key_rev[key]
                if self._kvs.pop(key, None) is not None:
                    self._gone(key)
            for kv in fresh.values():
                self._apply_one(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)
            self._floor = revision
            self._loaded_epoch = epoch
            self._revision = max(self._revision, revision)
            self._publish()
        self.connected = True
        return True

    def _apply_one(
        self,
        key: str,
        value: bytes | None,
        create_rev: int,
        mod_rev: int,
        lease: int,
        seen: bool = False,
    ) -> None:
        """One change, unless a newer one for the same key was applied already. ``seen``:
        it came as it happened (a watch event), so a new node record is a join now; a read
        (at start, on going full) says nothing of when a node registered."""
        if mod_rev <= self._key_rev.get(key, 0):
            return
        self._key_rev[key] = mod_rev
        rel = key[len(self._prefix) :]
        old = self._kvs.get(key)
        if old is not None and (value is None or old.create_revision != create_rev):
            self._kvs.pop(key)
            self._gone(key)
        if value is None:
            return
        kv = KV(key, value, create_rev, mod_rev, lease)
        new = key not in self._kvs
        self._kvs[key] = kv
        self._decoded.put(rel, kv)
        if seen and new and rel.startswith(records.NODES):
            node = self._decoded.nodes.get(rel[len(records.NODES) :])
            if node is None or not node.record.resumes:  # one that resumes joins nothing
                self._last_join = time.monotonic()

    def _gone(self, key: str) -> None:
        """Forget what ``key`` held; a node's record going is a loss now (or a leave)."""
        rel = key[len(self._prefix) :]
        self._decoded.delete(rel)
        if rel.startswith(records.NODES):
            self._last_loss = time.monotonic()

    def _apply(self, events: list[Event], epoch: int) -> bool:
        """Apply a batch of watched events. True when a new round's header puts this lean
        node in another bucket than the one watched (its size crossed a multiple of
        ``PER_BUCKET``): read again and watch that one. Otherwise the bucket comes by the
        watch, with or soon after the header (the mirror shows the round once both are
        in), at no extra request."""
        header = self._header(events)
        moved = (
            not self._full
            and header is not None
            and self._bucket_key(header) != self._watched_bucket
        )
        if moved:  # not shown with the old bucket (this node would be missing from it):
            return True  # the read again brings the round and its new bucket together
        with self._cond:
            if epoch != self._epoch:
                return False  # watched in the mode before
            for ev in events:
                self._revision = max(self._revision, ev.mod_revision)
                if ev.mod_revision > self._floor:
                    self._apply_one(
                        ev.key, ev.value, ev.create_revision, ev.mod_revision, ev.lease, seen=True
                    )
            self._publish()
        return moved

    def _publish(self) -> None:
        self._dirty = True
        self._version += 1
        self._cond.notify_all()

    def _run(self) -> None:
        backoff = 0.1
        stale = False  # after a break, read everything again before watching on
        while not self._stopped.is_set():
            try:
                self._reopen.clear()
                if stale or self._loaded_epoch != self._epoch:
                    if not self._load(timeout=2.0):
                        continue  # the mode changed during the read
                    stale = False
                    self.poke()
                with self._cond:
                    epoch, specs, start = self._epoch, self._specs(), self._revision + 1
                    if self._loaded_epoch != epoch:
                        continue  # the mode changed since the read
                self._stream = watch(self._client, specs, start)
                if self._stopped.is_set() or self._reopen.is_set():
                    self._stream.cancel()
                for events in self._stream:
                    self.connected = True
                    backoff = 0.1
                    if self._apply(events, epoch):
                        self._stream.cancel()  # its bucket moved: read again, watch that one
                        stale = True
                        break
                if self._stopped.is_set():
                    return
                if self._reopen.is_set() or stale:
                    continue  # the mode or the bucket changed: watch again, differently
                raise EtcdUnavailableError("watch stream ended")
            except Compacted:
                log.info("etcd compacted the job's history; reading it again")
                stale = True
            except RendezvousError as e:
                if self._stopped.is_set():
                    return
                if self.connected:
                    log.debug("watch on %s interrupted: %s", self._prefix, e)
                self.connected = False
                stale = True
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 1.0)
            except Exception:  # the watch thread must never die silently
                log.exception("watch on %s failed; retrying", self._prefix)
                stale = True
                self._stopped.wait(1.0)


def glance(client: EtcdClient, prefix: str, timeout: float | None = None) -> Glance:
    """The job's own keys, its leader's record and how many nodes are registered, read
    once (three small reads, whatever the job's size, each within ``timeout``: default
    the client's connect timeout); whatever is malformed reads as absent."""
    decoded = Decoded()
    _, kvs = client.read([], [prefix + records.JOB], timeout=timeout)
    for kv in kvs:
        decoded.put(kv.key[len(prefix) :], kv)
    leader = decoded.leader_record()
    node = None
    if leader is not None:
        _, found = client.read([prefix + records.NODES + leader.id], [], timeout=timeout)
        for kv in found:
            decoded.put(kv.key[len(prefix) :], kv)
        present = decoded.nodes.get(leader.id)
        node = present.record if present is not None and present.rev == leader.rev else None
    closed = decoded.closed is not None
    count = client.count(prefix + records.NODES, timeout=timeout)
    return Glance(decoded.round, closed, node, decoded.progress, count)


def read_view(client: EtcdClient, prefix: str) -> JobView:
    """The job as it is now, read once (no watch): for ``elastic-run status``."""
    decoded = Decoded()
    revision, kvs = client.get_prefix(prefix)
    for kv in kvs:
        decoded.put(kv.key[len(prefix) :], kv)
    return decoded.view(revision, 0.0)
