"""A live, watch-fed copy of one job's keys, and the immutable views taken of it.

One watch stream feeds the mirror; every change wakes whoever waits on it. Nothing polls
etcd. When the stream breaks (etcd restarted, a member died) the mirror reads the job
again and watches on from there.

Two modes. *Full*: every change under the job prefix, as a running member (it must see
arrivals, departures, failures) or the round's writer needs. *Lean*: only departures
(etcd's NOPUT filter), the round and ``closed``, which is all a node waiting for someone
else to write the round needs. With N nodes forming a round, full watching costs N
events at each of N nodes; lean watching costs next to nothing at the N-1 that wait.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from rendezvous import records
from rendezvous.client import KV, Compacted, EtcdClient, Event, WatchSpec, WatchStream
from rendezvous.errors import EtcdUnavailableError, MalformedRecordError, RendezvousError
from rendezvous.records import (
    ClosedRecord,
    FailureRecord,
    GoneRecord,
    Member,
    NodeRecord,
    NodeState,
    RoundRecord,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveNode:
    record: NodeRecord
    rev: int  # create revision: join order, and the incarnation
    lease: int = 0


@dataclass(frozen=True)
class JobView:
    """The job as of one etcd revision. Malformed round/closed values raise on access."""

    revision: int = 0
    nodes: dict[str, LiveNode] = field(default_factory=dict)
    gone: dict[str, GoneRecord] = field(default_factory=dict)
    round_record: RoundRecord | None = None
    round_mod_revision: int = 0
    round_error: str | None = None
    closed_record: ClosedRecord | None = None
    closed_error: str | None = None
    failures: dict[int, dict[str, FailureRecord]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    last_join: float = 0.0  # monotonic time this process saw the newest node register

    @property
    def round(self) -> RoundRecord | None:
        if self.round_error:
            raise MalformedRecordError(self.round_error)
        return self.round_record

    @property
    def closed(self) -> ClosedRecord | None:
        if self.closed_error:
            raise MalformedRecordError(self.closed_error)
        return self.closed_record

    def is_live(self, m: Member) -> bool:
        node = self.nodes.get(m.id)
        return node is not None and node.rev == m.rev

    def was_leaving(self, m: Member) -> bool:
        """``m`` left on purpose (its tombstone names this incarnation)."""
        gone = self.gone.get(m.id)
        return gone is not None and gone.rev == m.rev


class _Decoded:
    """The job's records, decoded once per change and updated event by event."""

    def __init__(self) -> None:
        self.nodes: dict[str, LiveNode] = {}
        self.gone: dict[str, GoneRecord] = {}
        self.round: RoundRecord | None = None
        self.round_rev = 0
        self.round_err: str | None = None
        self.closed: ClosedRecord | None = None
        self.closed_err: str | None = None
        self.failures: dict[int, dict[str, FailureRecord]] = {}
        self.problems: dict[str, str] = {}  # rel key -> why it was ignored

    def put(self, rel: str, kv: KV) -> None:
        self.delete(rel)
        try:
            if rel.startswith(records.NODES):
                rec = NodeRecord.decode(kv.key, kv.value)
                self.nodes[rec.id] = LiveNode(rec, kv.create_revision, kv.lease)
            elif rel.startswith(records.GONE):
                self.gone[rel[len(records.GONE) :]] = GoneRecord.decode(kv.key, kv.value)
            elif rel == records.ROUND:
                self.round_rev = kv.mod_revision
                self.round = RoundRecord.decode(kv.key, kv.value)
            elif rel == records.CLOSED:
                self.closed = ClosedRecord.decode(kv.key, kv.value)
            elif rel.startswith(records.FAILURES):
                f = FailureRecord.decode(kv.key, kv.value)
                if rel != f"{records.FAILURES}{f.round}/{f.node}":
                    raise MalformedRecordError(
                        f"malformed value at etcd key {kv.key}: "
                        "round or node does not match the key"
                    )
                self.failures.setdefault(f.round, {})[f.node] = f
        except MalformedRecordError as e:
            if rel == records.ROUND:
                self.round_err = str(e)
            elif rel == records.CLOSED:
                self.closed_err = str(e)
            else:
                self.problems[rel] = str(e)

    def delete(self, rel: str) -> None:
        """Forget what ``rel`` held (the key layout says what it was)."""
        self.problems.pop(rel, None)
        if rel.startswith(records.NODES):
            self.nodes.pop(rel[len(records.NODES) :], None)
        elif rel.startswith(records.GONE):
            self.gone.pop(rel[len(records.GONE) :], None)
        elif rel.startswith(records.FAILURES):
            number, _, node = rel[len(records.FAILURES) :].partition("/")
            if number.isdigit():
                self.failures.get(int(number), {}).pop(node, None)
        elif rel == records.ROUND:
            self.round, self.round_rev, self.round_err = None, 0, None
        elif rel == records.CLOSED:
            self.closed, self.closed_err = None, None

    def leaving(self, rel: str) -> bool:
        node = self.nodes.get(rel[len(records.NODES) :]) if rel.startswith(records.NODES) else None
        return node is not None and node.record.state is NodeState.LEAVING

    def view(self, revision: int, last_join: float) -> JobView:
        return JobView(
            revision,
            dict(self.nodes),
            dict(self.gone),
            self.round,
            self.round_rev,
            self.round_err,
            self.closed,
            self.closed_err,
            {n: dict(f) for n, f in self.failures.items() if f},
            tuple(self.problems.values()),
            last_join,
        )


class JobMirror:
    """Keeps a JobView of ``prefix`` current from one watch stream."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._cond = threading.Condition()
        self._kvs: dict[str, KV] = {}
        self._key_rev: dict[str, int] = {}  # newest revision applied per key (tombstones too)
        self._decoded = _Decoded()
        self._view = JobView()
        self._dirty = False
        self._version = 0
        self._major = 0
        self._revision = 0
        self._last_join = time.monotonic()
        self._full = True
        self._catching_up = False
        self._stream: WatchStream | None = None
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
            self._load_from(*initial)
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
        return self._full and not self._catching_up

    def set_full(self, full: bool, wait: bool = True) -> None:
        """Switch modes. Going full reads the job again: here when ``wait`` (the view is
        complete on return), else in the watch thread (``complete`` says when)."""
        if full == self._full:
            return
        with self._cond:
            self._full = full
            self._catching_up = full and not wait
        self._reopen.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        if full and wait:
            self._load()

    # -- reading -----------------------------------------------------------------------
    def view(self) -> JobView:
        """The current view, built on demand: bursts of events cost one build, not many."""
        with self._cond:
            if self._dirty:
                self._view = self._decoded.view(self._revision, self._last_join)
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

    @property
    def major_version(self) -> int:
        """Counts only changes that can end a wait for someone else's round: the round,
        closed, a node leaving or gone. Arrivals and 'done' updates do not count."""
        with self._cond:
            return self._major

    def wait(self, version: int, timeout: float | None, major: bool = False) -> int:
        """Block until the (major) version moves past ``version`` or ``timeout``."""
        with self._cond:
            if major:
                self._cond.wait_for(lambda: self._major != version, timeout)
                return self._major
            self._cond.wait_for(lambda: self._version != version, timeout)
            return self._version

    def poke(self) -> None:
        """Wake waiters without a change (a lease was lost, a deadline moved)."""
        with self._cond:
            self._version += 1
            self._major += 1
            self._cond.notify_all()

    # -- feeding -----------------------------------------------------------------------
    def record_own(self, kv: KV) -> None:
        """Apply a write of this process at once (a lean watch never shows it one)."""
        with self._cond:
            self._apply_one(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)
            self._publish()

    def _specs(self) -> list[WatchSpec]:
        if self._full:
            return [WatchSpec(self._prefix, prefix=True)]
        return [
            WatchSpec(self._prefix, prefix=True, no_put=True),
            WatchSpec(self._prefix + records.ROUND),
            WatchSpec(self._prefix + records.CLOSED),
        ]

    def _load(self, timeout: float | None = None) -> None:
        """Read everything (at start, going full, and to catch up after a broken watch)."""
        self._load_from(*self._client.get_prefix(self._prefix, timeout))

    def _load_from(self, revision: int, kvs: list[KV]) -> None:
        fresh = {kv.key: kv for kv in kvs}
        with self._cond:
            for key in [k for k in self._kvs if k not in fresh]:
                self._apply_one(key, None, 0, revision, 0)
            for kv in fresh.values():
                self._apply_one(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)
            self._revision = max(self._revision, revision)
            self._publish()
        self.connected = True

    def _apply_one(
        self, key: str, value: bytes | None, create_rev: int, mod_rev: int, lease: int
    ) -> None:
        """One change, unless a newer one for the same key was applied already."""
        if mod_rev <= self._key_rev.get(key, 0):
            return
        self._key_rev[key] = mod_rev
        self._revision = max(self._revision, mod_rev)
        rel = key[len(self._prefix) :]
        old = self._kvs.get(key)
        if old is not None and (value is None or old.create_revision != create_rev):
            self._kvs.pop(key)
            self._major += 1
            self._decoded.delete(rel)
        if value is None:
            return
        kv = KV(key, value, create_rev, mod_rev, lease)
        if rel.startswith(records.NODES) and key not in self._kvs and self._version:
            self._last_join = time.monotonic()
        self._kvs[key] = kv
        self._decoded.put(rel, kv)
        if rel in (records.ROUND, records.CLOSED) or self._decoded.leaving(rel):
            self._major += 1

    def _apply(self, events: list[Event]) -> None:
        with self._cond:
            for ev in events:
                self._apply_one(ev.key, ev.value, ev.create_revision, ev.mod_revision, ev.lease)
            self._publish()

    def _publish(self) -> None:
        self._dirty = True
        self._version += 1
        self._cond.notify_all()

    def _run(self) -> None:
        backoff = 0.1
        stale = False  # after a break, read everything again before watching on
        while not self._stopped.is_set():
            try:
                if stale or self._catching_up:
                    self._load(timeout=2.0)
                    stale = self._catching_up = False
                    self.poke()
                self._reopen.clear()
                self._stream = self._client.watch(self._specs(), self._revision + 1)
                if self._stopped.is_set() or self._reopen.is_set():
                    self._stream.cancel()
                for events in self._stream:
                    self.connected = True
                    backoff = 0.1
                    self._apply(events)
                if self._stopped.is_set():
                    return
                if self._reopen.is_set():
                    continue  # the mode changed: watch again, differently
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


def read_view(client: EtcdClient, prefix: str) -> JobView:
    """The job as it is now, read once (no watch): for ``elastic-run status``."""
    decoded = _Decoded()
    revision, kvs = client.get_prefix(prefix)
    for kv in kvs:
        decoded.put(kv.key[len(prefix) :], kv)
    return decoded.view(revision, 0.0)
