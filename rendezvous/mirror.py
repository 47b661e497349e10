"""A live, watch-fed copy of one job's keys, and the immutable views taken of it.

One watch stream over the job prefix feeds the mirror; every change wakes whoever waits
on it. Nothing polls etcd. When the stream breaks (etcd restarted, a member died) the
mirror resumes from the last revision it saw, or re-reads everything if etcd compacted
that history away.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from rendezvous import records
from rendezvous.client import KV, Compacted, EtcdClient, Event, WatchStream
from rendezvous.errors import EtcdUnavailableError, MalformedRecordError, RendezvousError
from rendezvous.records import ClosedRecord, FailureRecord, Member, NodeRecord, RoundRecord

log = logging.getLogger(__name__)

_DEPARTED_KEEP = 256


@dataclass(frozen=True)
class LiveNode:
    record: NodeRecord
    rev: int  # create revision: join order, and the incarnation


@dataclass(frozen=True)
class JobView:
    """The job as of one etcd revision. Malformed round/closed values raise on access."""

    revision: int = 0
    nodes: dict[str, LiveNode] = field(default_factory=dict)
    departed: dict[str, LiveNode] = field(default_factory=dict)
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
        gone = self.departed.get(m.id)
        return gone is not None and gone.rev == m.rev and gone.record.state == "leaving"

    @classmethod
    def build(cls, revision: int, kvs: dict[str, KV], departed: dict[str, LiveNode],
              last_join: float, cache: dict[str, tuple[int, object]] | None = None) -> JobView:
        """Decode every record (reusing ``cache`` entries whose mod revision still holds)."""
        cache = {} if cache is None else cache
        nodes: dict[str, LiveNode] = {}
        failures: dict[int, dict[str, FailureRecord]] = {}
        problems: list[str] = []
        rnd = closed = None
        round_rev = 0
        round_err = closed_err = None
        for rel in [k for k in cache if k not in kvs]:
            del cache[rel]
        for rel, kv in kvs.items():
            hit = cache.get(rel)
            if hit is not None and hit[0] == kv.mod_revision:
                value = hit[1]
            else:
                value = _decode(rel, kv)
                cache[rel] = (kv.mod_revision, value)
            if isinstance(value, MalformedRecordError):
                if rel == records.ROUND:
                    round_rev, round_err = kv.mod_revision, str(value)
                elif rel == records.CLOSED:
                    closed_err = str(value)
                else:
                    problems.append(str(value))
            elif isinstance(value, NodeRecord):
                nodes[value.id] = LiveNode(value, kv.create_revision)
            elif isinstance(value, RoundRecord):
                rnd, round_rev = value, kv.mod_revision
            elif isinstance(value, ClosedRecord):
                closed = value
            elif isinstance(value, FailureRecord):
                failures.setdefault(value.round, {})[value.node] = value
        return cls(revision, nodes, dict(departed), rnd, round_rev, round_err, closed,
                   closed_err, failures, tuple(problems), last_join)


def _decode(rel: str, kv: KV) -> object:
    """The record at ``rel``, the MalformedRecordError it raised, or None if not ours."""
    try:
        if rel.startswith(records.NODES):
            return NodeRecord.decode(kv.key, kv.value)
        if rel == records.ROUND:
            return RoundRecord.decode(kv.key, kv.value)
        if rel == records.CLOSED:
            return ClosedRecord.decode(kv.key, kv.value)
        if rel.startswith(records.FAILURES):
            return FailureRecord.decode(kv.key, kv.value)
    except MalformedRecordError as e:
        return e
    return None


class JobMirror:
    """Keeps a JobView of ``prefix`` current from one watch stream."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._cond = threading.Condition()
        self._kvs: dict[str, KV] = {}
        self._departed: dict[str, LiveNode] = {}
        self._view = JobView()
        self._dirty = False
        self._decoded: dict[str, tuple[int, object]] = {}  # rel key -> (mod rev, record)
        self._version = 0
        self._revision = 0
        self._last_join = time.monotonic()
        self._stream: WatchStream | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self.connected = False

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> None:
        """Read the job once (raises if etcd is unreachable), then follow it by watch."""
        self._load(timeout)
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- reading -----------------------------------------------------------------------
    def view(self) -> JobView:
        """The current view, built on demand: bursts of events cost one build, not many."""
        with self._cond:
            if self._dirty:
                self._view = JobView.build(self._revision, self._kvs, self._departed,
                                           self._last_join, self._decoded)
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
        """Block until the view changes past ``version`` or ``timeout``; returns the version."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout)
            return self._version

    def poke(self) -> None:
        """Wake waiters without a change (a lease was lost, a deadline moved)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    # -- feeding -----------------------------------------------------------------------
    def _rel(self, key: str) -> str:
        return key[len(self._prefix):]

    def _load(self, timeout: float | None = None) -> None:
        revision, kvs = self._client.get_prefix(self._prefix, timeout)
        with self._cond:
            old = {(k, kv.create_revision) for k, kv in self._kvs.items()
                   if k.startswith(records.NODES)}
            self._kvs = {self._rel(kv.key): kv for kv in kvs}
            new = {(k, kv.create_revision) for k, kv in self._kvs.items()
                   if k.startswith(records.NODES)}
            if new - old and self._version:
                self._last_join = time.monotonic()
            for rel, _ in old - new:
                self._note_departed(rel)
            self._revision = revision
            self._publish()
        self.connected = True

    def _note_departed(self, rel: str) -> None:
        node_id = rel[len(records.NODES):]
        kv = self._kvs.get(rel)
        decoded = self._decoded.get(rel)
        gone = None
        if kv is not None and decoded is not None and isinstance(decoded[1], NodeRecord):
            gone = LiveNode(decoded[1], kv.create_revision)
        if gone is not None:
            self._departed[node_id] = gone
            while len(self._departed) > _DEPARTED_KEEP:
                self._departed.pop(next(iter(self._departed)))

    def _apply(self, events: list[Event]) -> None:
        with self._cond:
            for ev in events:
                rel = self._rel(ev.key)
                if ev.value is None:
                    if rel.startswith(records.NODES):
                        self._note_departed(rel)
                    self._kvs.pop(rel, None)
                else:
                    if rel.startswith(records.NODES) and ev.create_revision == ev.mod_revision:
                        self._last_join = time.monotonic()
                    self._kvs[rel] = KV(ev.key, ev.value, ev.create_revision, ev.mod_revision,
                                        ev.lease)
                self._revision = max(self._revision, ev.mod_revision)
            self._publish()

    def _publish(self) -> None:
        self._dirty = True
        self._version += 1
        self._cond.notify_all()

    def _run(self) -> None:
        backoff = 0.1
        stale = False  # after any break, read everything again before watching on
        while not self._stopped.is_set():
            try:
                if stale:
                    self._load(timeout=2.0)
                    stale = False
                self._stream = self._client.watch_prefix(self._prefix, self._revision + 1)
                if self._stopped.is_set():
                    self._stream.cancel()
                for _, events in self._stream:
                    self.connected = True
                    backoff = 0.1
                    if events:
                        self._apply(events)
                if self._stopped.is_set():
                    return
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
