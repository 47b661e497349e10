"""The job as one etcd revision shows it: its records decoded into an immutable view.

Pure: no gRPC, no etcd client. The mirror (``mirror.py``) feeds ``Decoded`` from its watch
and takes views of it; the rules (``rules.py``) and ``elastic-run status`` read views.
A node whose lease is alive is *present* (its record exists); a member of the round that
is no longer present is gone (left, or lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rendezvous import records
from rendezvous.errors import MalformedRecordError
from rendezvous.records import (
    ClosedRecord,
    FailureRecord,
    GoneRecord,
    LeaderRecord,
    Member,
    NodeRecord,
    NoticeRecord,
    ProgressRecord,
    RoundRecord,
    decode_bucket,
)


@dataclass(frozen=True)
class KV:
    """One etcd key as read or watched: its value, revisions and lease."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class PresentNode:
    record: NodeRecord
    rev: int  # the incarnation, and join order: the create revision (or what it resumes)
    lease: int = 0


@dataclass(frozen=True)
class JobView:
    """The job as of one etcd revision. Malformed values are named in ``problems``."""

    revision: int = 0
    nodes: dict[str, PresentNode] = field(default_factory=dict)
    gone: dict[str, GoneRecord] = field(default_factory=dict)
    round_record: RoundRecord | None = None
    round_mod_revision: int = 0  # of whatever the key holds: a write over it is guarded by it
    closed_record: ClosedRecord | None = None
    closed_junk: KV | None = None  # a value no agent wrote at the closed key: not closed
    failures: dict[int, dict[str, FailureRecord]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    last_join: float = 0.0  # monotonic time this process saw the newest node register
    leader: LeaderRecord | None = None  # None also when the key holds no live leader's
    leader_kv: KV | None = None  # whatever the key holds, for guarded writes (and claims)
    notice: NoticeRecord | None = None
    progress: ProgressRecord | None = None
    # monotonic time this process saw a node's record go, or began to see the whole job
    # (a read says nothing of when a record went)
    last_loss: float = 0.0
    # the newest round number any key here names (the header, a bucket): the next is
    # above it, even where a value no leader wrote hides the header (``rules.next_number``)
    newest_round: int = 0

    @property
    def round(self) -> RoundRecord | None:
        return self.round_record

    @property
    def closed(self) -> ClosedRecord | None:
        return self.closed_record


@dataclass(frozen=True)
class Glance:
    """What a node reads of a job before it registers (see ``elastic.agent.lobby``): the
    round's header (its members aside), whether the job is over, the leader's record,
    and the job's recorded progress."""

    round: RoundRecord | None = None
    closed: bool = False
    leader: NodeRecord | None = None
    progress: ProgressRecord | None = None
    present: int = -1  # nodes registered (-1: not counted)


class Decoded:
    """The job's records, decoded once per change and updated event by event."""

    def __init__(self) -> None:
        self.nodes: dict[str, PresentNode] = {}
        self.gone: dict[str, GoneRecord] = {}
        self.round: RoundRecord | None = None  # the header
        self.round_rev = 0
        self.buckets: dict[int, tuple[int, list[Member]]] = {}
        self.shown: RoundRecord | None = None  # the newest round whose members are here
        self.shown_rev = 0
        self.leader: KV | None = None
        self.notice: NoticeRecord | None = None
        self.closed: ClosedRecord | None = None
        self.closed_junk: KV | None = None
        self.progress: ProgressRecord | None = None
        self.failures: dict[int, dict[str, FailureRecord]] = {}
        self.problems: dict[str, str] = {}  # rel key -> why it was ignored

    def put(self, rel: str, kv: KV) -> None:
        """Take in the value at ``rel``; one that is malformed is named in ``problems``
        and read as absent, but for the round's header: a value no leader wrote over it
        leaves the last good header in place (the round goes on; the next is written
        over the value, guarded by its revision)."""
        header = self.round
        self.delete(rel)
        try:
            if rel.startswith(records.NODES):
                why = NodeRecord.foreign(kv.key, kv.value, kv.lease)
                if why is not None:  # its node, if alive, writes its record again
                    raise MalformedRecordError(why)
                rec = NodeRecord.decode(kv.key, kv.value)
                if not 0 <= rec.resumes < kv.create_revision:
                    raise MalformedRecordError(
                        f"malformed etcd key {kv.key}: it resumes incarnation {rec.resumes}, "
                        f"not one before its own ({kv.create_revision})"
                    )
                self.nodes[rec.id] = PresentNode(rec, rec.resumes or kv.create_revision, kv.lease)
            elif rel.startswith(records.GONE):
                self.gone[rel[len(records.GONE) :]] = GoneRecord.decode(kv.key, kv.value)
            elif rel == records.ROUND:
                self.round_rev = kv.mod_revision
                self.round = RoundRecord.decode(kv.key, kv.value)
            elif rel.startswith(records.MEMBERS):
                bucket = rel[len(records.MEMBERS) :]
                if not bucket.isdigit():
                    raise MalformedRecordError(f"malformed etcd key {kv.key}: not a bucket")
                self.buckets[int(bucket)] = decode_bucket(kv.key, kv.value)
            elif rel == records.LEADER:
                self.leader = kv  # kept even if foreign: a claim replaces it over its revision
                LeaderRecord.decode(kv.key, kv.value)
                if not kv.lease:
                    raise MalformedRecordError(
                        f"the leader record at etcd key {kv.key} is on no lease: "
                        "not a live leader's (every elastic-run leader holds it on its lease)"
                    )
            elif rel == records.NOTICE:
                self.notice = NoticeRecord.decode(kv.key, kv.value)
            elif rel == records.CLOSED:
                self.closed = ClosedRecord.decode(kv.key, kv.value)
            elif rel == records.PROGRESS:
                self.progress = ProgressRecord.decode(kv.key, kv.value)
            elif rel.startswith(records.FAILURES):
                f = FailureRecord.decode(kv.key, kv.value)
                if rel != f"{records.FAILURES}{f.round}/{f.node}":
                    raise MalformedRecordError(
                        f"malformed value at etcd key {kv.key}: "
                        "round or node does not match the key"
                    )
                self.failures.setdefault(f.round, {})[f.node] = f
        except MalformedRecordError as e:
            self.problems[rel] = str(e)
            if rel == records.ROUND:
                self.round, self.round_rev = header, kv.mod_revision
            elif rel == records.CLOSED:  # the leader removes it: a close is written over none
                self.closed_junk = kv

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
            self.round, self.round_rev = None, 0
        elif rel.startswith(records.MEMBERS):
            bucket = rel[len(records.MEMBERS) :]
            if bucket.isdigit():
                self.buckets.pop(int(bucket), None)
        elif rel == records.LEADER:
            self.leader = None
        elif rel == records.NOTICE:
            self.notice = None
        elif rel == records.CLOSED:
            self.closed, self.closed_junk = None, None
        elif rel == records.PROGRESS:
            self.progress = None

    def assembled(self) -> tuple[RoundRecord | None, int]:
        """The round with the members its buckets here hold, or, while this node's bucket
        of a newer round is still on its way, the newest round it has whole."""
        header = self.round
        if header is None:
            return None, self.round_rev  # a value no leader wrote, if any
        members = [
            m
            for b, (number, ms) in self.buckets.items()
            if number == header.number and b < header.buckets
            for m in ms
        ]
        fetched = {b for b, (number, _) in self.buckets.items() if number == header.number}
        if fetched:
            self.shown, self.shown_rev = header.with_members(members), self.round_rev
        return self.shown, self.shown_rev

    def leader_record(self) -> LeaderRecord | None:
        """The leader, if the key holds a live leader's record (see ``put``)."""
        kv = self.leader
        if kv is None or records.LEADER in self.problems:
            return None
        return LeaderRecord.decode(kv.key, kv.value, kv.create_revision)

    def view(self, revision: int, last_join: float, last_loss: float = 0.0) -> JobView:
        shown, shown_rev = self.assembled()
        named = [r.number for r in (self.round, shown) if r]
        newest = max([*named, *(n for n, _ in self.buckets.values()), 0])
        return JobView(
            revision,
            dict(self.nodes),
            dict(self.gone),
            shown,
            shown_rev,
            self.closed,
            self.closed_junk,
            {n: dict(f) for n, f in self.failures.items() if f},
            tuple(self.problems.values()),
            last_join,
            self.leader_record(),
            self.leader,
            self.notice,
            self.progress,
            last_loss,
            newest,
        )
