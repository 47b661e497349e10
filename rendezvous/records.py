"""The etcd key layout of one job and its JSON records.

Values are JSON, never pickle: whoever can write a key must not be able to run code in
an agent. Anything under the job's prefix that does not decode to the expected shape
raises ``MalformedRecordError`` naming the key.

    <prefix>/<run_id>/nodes/<node_id>              NodeRecord, attached to the node's lease
    <prefix>/<run_id>/gone/<node_id>               GoneRecord: a node that left on
                                                   purpose, on a short lease of its own
    <prefix>/<run_id>/arriving/<node_id>           empty: a newcomer whose workers start
                                                   before it registers, on a lease of its
                                                   own (``rendezvous.arrival``)
    <prefix>/<run_id>/members/<bucket>             the round's members whose id hashes to
                                                   that bucket (``bucket_of``)
    <prefix>/<run_id>/job/round                    RoundRecord without its members (those
                                                   are in the buckets, written with it),
                                                   by transaction only
    <prefix>/<run_id>/job/leader                   LeaderRecord: the node that writes
                                                   rounds, on its lease
    <prefix>/<run_id>/job/notice                   NoticeRecord: the leader's word on what
                                                   ends the running round
    <prefix>/<run_id>/job/failures/<round>/<node>  a node's worker failures in that round
    <prefix>/<run_id>/job/closed                   ClosedRecord: the job is over
    <prefix>/<run_id>/job/progress                 ProgressRecord: the newest step the
                                                   job committed, as its rank-0 node last
                                                   said (no lease: it outlives them all)

Everything every node needs is under ``job/``, so a node other than the leader watches
three things: ``job/``, its own record and its bucket of the round.

Why the round is split: a node needs the round's header and its own place in it, not the
whole membership. Each reads the header and one bucket of at most ``PER_BUCKET`` members,
so the bytes etcd sends for a round grow with N, not N squared, and no value nears etcd's
request limit (10,000 members: 120 buckets of 84 in one transaction, about 0.5 MB).
"""

from __future__ import annotations

import enum
import json
import math
import signal
import zlib
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any, TypeVar

from rendezvous.errors import MalformedRecordError

NODES = "nodes/"
GONE = "gone/"
ARRIVING = "arriving/"
MEMBERS = "members/"
JOB = "job/"  # what every node watches: one range, one watch
ROUND = JOB + "round"
LEADER = JOB + "leader"
NOTICE = JOB + "notice"
FAILURES = JOB + "failures/"
CLOSED = JOB + "closed"
PROGRESS = JOB + "progress"

PER_BUCKET = 64  # members per bucket, up to MAX_BUCKETS buckets
MAX_BUCKETS = 120  # a round's puts and deletes stay within etcd's --max-txn-ops (128)
NAMES = 32  # node names a round or notice lists in full (the counts are always exact)

E = TypeVar("E", bound=enum.Enum)


class NodeState(enum.Enum):
    """What a node says of itself in its record.

    WAITING -> LEAVING (it got SIGTERM/SIGINT, or its job ended): the others drain for
    a resize, and it never becomes a member of a new round.
    """

    WAITING = "waiting"
    LEAVING = "leaving"


class JobOutcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class RoundCause(enum.Enum):
    """Why a round was formed (the first cause that applies, in this order)."""

    START = "start"  # the job's first round
    LOST = "lost"  # a member vanished without a word (crash, freeze, partition)
    FAILURE = "failure"  # a member's workers failed: one restart charged
    LEFT = "left"  # a member left on purpose
    RESIZE = "resize"  # nodes joined, or members stopped to let them in


def _load(key: str, raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        preview = raw[:40]
        raise MalformedRecordError(
            f"malformed value at etcd key {key}: not JSON (starts with {preview!r}); "
            "it was not written by elastic-run"
        ) from None
    if not isinstance(value, dict):
        raise MalformedRecordError(
            f"malformed value at etcd key {key}: expected a JSON object, got {type(value).__name__}"
        )
    return value


def _bad(key: str, why: str) -> MalformedRecordError:
    return MalformedRecordError(f"malformed value at etcd key {key}: {why}")


def _field(key: str, obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in obj:
        raise _bad(key, f"missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _bad(key, f"field {name!r} has the wrong type ({type(value).__name__})")
    return value


def _text(key: str, obj: dict[str, Any], name: str) -> str:
    """An optional text field: absent is empty, anything but text is malformed."""
    value = obj.get(name, "")
    if not isinstance(value, str):
        raise _bad(key, f"field {name!r} has the wrong type ({type(value).__name__})")
    return value


def _int(obj: dict[str, Any], name: str, default: int = 0) -> int:
    """An optional whole-number field; anything else counts as absent."""
    value = obj.get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _enum(key: str, kind: type[E], text: object) -> E:
    try:
        return kind(text)
    except ValueError:
        allowed = ", ".join(repr(e.value) for e in kind)
        raise _bad(key, f"{kind.__name__} {text!r} (expected one of {allowed})") from None


def _number(obj: dict[str, Any], name: str) -> float:
    """An optional number field; anything else counts as absent (0)."""
    value = obj.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _names(value: object) -> tuple[str, ...]:
    return tuple(map(str, value)) if isinstance(value, list | tuple) else ()


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, default=_plain).encode()


def _shallow(record: Any) -> dict[str, Any]:
    """A record's fields as a dict, as they are (``asdict`` deep-copies every value: a
    tenth of a millisecond per record, at every registration and round)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _plain(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON")


HUNG = "hung: "  # begins the message of a worker its agent found hung (and killed)


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that failed, as its agent saw it."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int  # negative: killed by that signal
    time: float
    message: str = ""
    traceback: str = ""
    error_file: str = ""  # "" when the script has no @record (no file was written)
    consequence: bool = False  # it failed because a peer vanished (a collective's error)

    @property
    def hung(self) -> bool:
        """Its agent found it hung: a failure of its own, whatever the signal."""
        return self.message.startswith(HUNG)

    @property
    def how(self) -> str:
        if self.exitcode < 0:
            try:
                return f"signal {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"signal {-self.exitcode}"
        return f"exit code {self.exitcode}"

    def plain(self) -> dict[str, Any]:
        return _shallow(self)

    @classmethod
    def from_plain(cls, key: str, obj: object) -> WorkerFailure:
        if not isinstance(obj, dict):
            raise _bad(key, "a failure is not a JSON object")
        return cls(
            rank=_field(key, obj, "rank", int),
            local_rank=_field(key, obj, "local_rank", int),
            pid=_field(key, obj, "pid", int),
            exitcode=_field(key, obj, "exitcode", int),
            time=float(_field(key, obj, "time", (int, float))),
            message=_text(key, obj, "message"),
            traceback=_text(key, obj, "traceback"),
            error_file=_text(key, obj, "error_file"),
            consequence=obj.get("consequence") is True,
        )


@dataclass(frozen=True)
class FailureReport:
    """What a node reports when its workers fail: one line, its host, and each failed
    worker (causes before consequences). As a root cause (the round's or the closed
    job's) it also names the node and when it reported."""

    summary: str
    host: str = ""
    failures: tuple[WorkerFailure, ...] = ()
    node: str = ""
    time: float = 0.0

    def plain(self) -> dict[str, Any]:
        obj = _shallow(self)
        obj["failures"] = [f.plain() for f in self.failures]
        return obj

    @classmethod
    def from_plain(cls, key: str, obj: object) -> FailureReport:
        """Validated: a value of the wrong shape raises, naming the key."""
        if not isinstance(obj, dict):
            raise _bad(key, "a failure report is not a JSON object")
        failures = obj.get("failures", [])
        if not isinstance(failures, list):
            raise _bad(key, "field 'failures' is not a list")
        when = obj.get("time", 0.0)
        if isinstance(when, bool) or not isinstance(when, int | float):
            raise _bad(key, "field 'time' is not a number")
        return cls(
            summary=_text(key, obj, "summary"),
            host=_text(key, obj, "host"),
            failures=tuple(WorkerFailure.from_plain(key, f) for f in failures),
            node=_text(key, obj, "node"),
            time=float(when),
        )

    @classmethod
    def lenient(cls, key: str, obj: object) -> FailureReport | None:
        """A root cause carried by another record: absent is None, unreadable is said so
        (the record around it stays readable)."""
        if not obj:
            return None
        try:
            return cls.from_plain(key, obj)
        except MalformedRecordError as e:
            return cls(summary=f"(the root cause is unreadable: {e})")


@dataclass(frozen=True)
class NodeRecord:
    """What the others need to know about a node. ``done`` is the newest round it left."""

    id: str
    addr: str
    nproc: int
    host: str = ""
    pid: int = 0
    version: str = ""
    done: int = 0
    state: NodeState = NodeState.WAITING
    probe: int = 0  # TCP port that refuses connections once this agent is gone
    metrics: int = 0  # the agent's /metrics port, for people and scrapers (0: none)
    min_nodes: int = 0  # the job's --nnodes as this node was started with (0: unknown)
    max_nodes: int = 0
    rank: int = -1  # the group rank it asks for (torchrun's --node-rank); -1: none
    # the job's workers re-form in place (State.run: this node's did): a newcomer's can wait
    # ahead of its joining (the leader's record is read)
    in_place: bool = False
    # the incarnation it carries on (0: none): etcd dropped its lease in an outage while no
    # round formed without it, so it came back as it was (``Session.resume``)
    resumes: int = 0
    # leading, the nodes the next round waits for (``rules.holders_away``): one out of the
    # job for now (``lobby.step_out``) comes back at once when it reads its name here
    awaits: tuple[str, ...] = ()

    def encode(self) -> bytes:
        obj = _shallow(self)
        obj["awaits"] = list(self.awaits[:NAMES])
        return dumps(obj)

    @classmethod
    def decode(cls, key: str, raw: bytes) -> NodeRecord:
        obj = _load(key, raw)
        rec = cls(
            id=_field(key, obj, "id", str),
            addr=_field(key, obj, "addr", str),
            nproc=_field(key, obj, "nproc", int),
            host=str(obj.get("host", "")),
            pid=_int(obj, "pid"),
            version=str(obj.get("version", "")),
            done=_field(key, obj, "done", int),
            state=_enum(key, NodeState, obj.get("state", NodeState.WAITING.value)),
            probe=_int(obj, "probe"),
            metrics=_int(obj, "metrics"),
            min_nodes=_int(obj, "min_nodes"),
            max_nodes=_int(obj, "max_nodes"),
            rank=_int(obj, "rank", -1),
            in_place=obj.get("in_place") is True,
            resumes=_int(obj, "resumes"),
            awaits=_names(obj.get("awaits")),
        )
        if rec.nproc < 1:
            raise _bad(key, "nproc must be >= 1")
        if key.rsplit("/", 1)[-1] != rec.id:
            raise _bad(key, f"id {rec.id!r} does not match the key")
        return rec

    @classmethod
    def foreign(cls, key: str, raw: bytes, lease: int) -> str | None:
        """Why the value at a node's key is no agent's record (every agent writes a
        NodeRecord there, on its lease); None where it may be one."""
        if not lease:
            return (
                f"a value on no lease at etcd key {key}: no node's record (every "
                "elastic-run node holds its record on its lease)"
            )
        try:
            cls.decode(key, raw)
        except MalformedRecordError as e:
            return str(e)
        return None


@dataclass(frozen=True)
class GoneRecord:
    """A node that left on purpose (``rev`` names the incarnation). It outlives the node's
    own lease briefly, so that even a one-shot reader (``elastic-run status``) can tell a
    departure from a loss."""

    rev: int
    host: str = ""
    at: float = 0.0
    # it left for now (its own worker failed: ``lobby.step_out``) and joins again, its
    # snapshots kept: what it trained may be the job's newest state (``rules.plan``)
    back: bool = False

    def encode(self) -> bytes:
        return dumps(_shallow(self))

    @classmethod
    def decode(cls, key: str, raw: bytes) -> GoneRecord:
        obj = _load(key, raw)
        return cls(
            rev=_field(key, obj, "rev", int),
            host=str(obj.get("host", "")),
            at=_number(obj, "at"),
            back=obj.get("back") is True,
        )


@dataclass(frozen=True)
class Member:
    """A node as a round saw it. ``rev`` (its record's create revision) tells incarnations
    apart: a node that lost its lease and registered again is a new member. ``rank`` (its
    group rank) and ``base`` (its first worker's global rank) are set by the round.
    ``probe``: its agent's probe port (0: unknown), so that whoever leads can prove it dead
    once its record is gone (``Lead.probe_round``). ``since``: the round this incarnation
    joined in (-1: unknown, a round written before members had it), so that a round can
    tell a member that received the job's state from one that never did
    (``rules.holders_away``)."""

    id: str
    rev: int
    addr: str
    nproc: int
    rank: int = -1
    base: int = -1
    probe: int = 0
    since: int = -1


def bucket_of(node_id: str, buckets: int) -> int:
    """The bucket that holds ``node_id``'s entry in a round of ``buckets`` buckets."""
    return zlib.crc32(node_id.encode()) % buckets


def buckets_for(size: int) -> int:
    return min(MAX_BUCKETS, max(1, math.ceil(size / PER_BUCKET)))


@dataclass(frozen=True)
class RoundRecord:
    """A round. ``members`` is all of them where the node reads the whole job (the leader,
    ``elastic-run status``) and only its own bucket elsewhere: ``complete`` says which.
    ``size`` and ``world_size`` are the round's, whatever ``members`` holds."""

    number: int
    members: tuple[Member, ...]
    master_addr: str
    master_port: int
    store_port: int
    restarts: int = 0
    cause: RoundCause = RoundCause.START
    joined: tuple[str, ...] = ()  # at most NAMES of each; the counts are exact
    left: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    root_cause: FailureReport | None = None
    formed_at: float = 0.0
    size: int = -1  # members in the round (-1: all of them are in ``members``)
    world: int = -1  # workers in the round
    counts: tuple[int, int, int] = (-1, -1, -1)  # joined, left, lost

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.size < 0:  # a new round, all of it: ranks in member order
            base, ranked = 0, []
            for i, m in enumerate(self.members):
                ranked.append(replace(m, rank=i, base=base))
                base += m.nproc
            set_(self, "members", tuple(ranked))
            set_(self, "size", len(self.members))
        if self.world < 0:
            set_(self, "world", sum(m.nproc for m in self.members))
        if min(self.counts) < 0:
            set_(self, "counts", (len(self.joined), len(self.left), len(self.lost)))
        for name in ("joined", "left", "lost"):
            set_(self, name, tuple(getattr(self, name))[:NAMES])

    @property
    def world_size(self) -> int:
        return self.world

    def member(self, node_id: str, rev: int | None = None) -> Member | None:
        """``node_id`` (incarnation ``rev``, if given) among ``members``, if there. Asked
        once per node at every plan: a scan each time made planning O(N^2)."""
        m = self._by_id.get(node_id)
        return m if m is not None and rev in (None, m.rev) else None

    @cached_property
    def _by_id(self) -> dict[str, Member]:
        return {m.id: m for m in self.members}

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size

    @property
    def buckets(self) -> int:
        return buckets_for(self.size)

    def rank_of(self, node_id: str) -> int:
        m = self.member(node_id)
        return m.rank if m is not None else -1

    def encode(self) -> bytes:
        """The header: everything but the members (see ``encode_buckets``)."""
        obj = _shallow(self)
        del obj["members"]
        obj["root_cause"] = self.root_cause.plain() if self.root_cause else {}
        return dumps(obj)

    def encode_buckets(self) -> dict[int, bytes]:
        """The members, bucket by bucket: each entry ``[id, rev, addr, nproc, rank, base,
        probe, since]``."""
        assert self.complete, "only a complete round can be written"
        parts: dict[int, list[list[Any]]] = {b: [] for b in range(self.buckets)}
        for m in self.members:
            parts[bucket_of(m.id, self.buckets)].append(
                [m.id, m.rev, m.addr, m.nproc, m.rank, m.base, m.probe, m.since]
            )
        return {b: dumps({"round": self.number, "members": p}) for b, p in parts.items()}

    @classmethod
    def decode(cls, key: str, raw: bytes) -> RoundRecord:
        """The header alone (``members`` empty until ``with_members``)."""
        obj = _load(key, raw)
        size = _field(key, obj, "size", int)
        world = _field(key, obj, "world", int)
        counts = obj.get("counts")
        if size < 1 or world < size:
            raise _bad(key, f"size {size} and world {world} do not make a round")
        if not (
            isinstance(counts, list)
            and len(counts) == 3
            and all(isinstance(c, int) and c >= 0 for c in counts)
        ):
            raise _bad(key, "field 'counts' must be three whole numbers")
        return cls(
            number=_field(key, obj, "number", int),
            members=(),
            master_addr=_field(key, obj, "master_addr", str),
            master_port=_field(key, obj, "master_port", int),
            store_port=_field(key, obj, "store_port", int),
            restarts=_field(key, obj, "restarts", int),
            cause=_enum(key, RoundCause, obj.get("cause", RoundCause.START.value)),
            joined=_names(obj.get("joined")),
            left=_names(obj.get("left")),
            lost=_names(obj.get("lost")),
            root_cause=FailureReport.lenient(key, obj.get("root_cause")),
            formed_at=_number(obj, "formed_at"),
            size=size,
            world=world,
            counts=(counts[0], counts[1], counts[2]),
        )

    def with_members(self, members: list[Member]) -> RoundRecord:
        return replace(self, members=tuple(sorted(members, key=lambda m: m.rank)))


def decode_bucket(key: str, raw: bytes) -> tuple[int, list[Member]]:
    """(round number, members) of one bucket of a round."""
    obj = _load(key, raw)
    number = _field(key, obj, "round", int)
    members = []
    for i, e in enumerate(_field(key, obj, "members", list)):
        # type() is, not isinstance: a bool is no number here (and this runs per member)
        if (
            type(e) is not list
            or len(e) not in (6, 7, 8)  # written before members had a probe port, a since
            or type(e[0]) is not str
            or type(e[1]) is not int
            or type(e[2]) is not str
            or any(type(x) is not int for x in e[3:])
        ):
            raise _bad(key, f"member {i} is not [id, rev, addr, nproc, rank, base, probe, since]")
        members.append(Member(*e))
    return number, members


class RoundEnd(enum.Enum):
    """What ends a node's current round. ``urgent`` ones leave its workers' round broken:
    stop them now. The others let them save at their next step and stop (drain)."""

    JOB_SUCCEEDED = "job succeeded"  # another node closed the job as succeeded
    # ... in a round without this node (it was away): its workers are stale
    JOB_DONE_WITHOUT = "job succeeded without this node"
    JOB_FAILED = "job failed"  # closed as failed (restart budget spent)
    FENCED = "fenced"  # etcd dropped this node: the job went on without it
    LAPSED = "lapsed"  # etcd dropped this node's lease, but no round formed without it
    SUPERSEDED = "superseded"  # a newer round that includes this node formed
    LOST = "lost"  # a member vanished without a word
    PEER_FAILED = "peer failed"  # a member's workers failed
    LEFT = "left"  # a member left before this node drained
    LEAVING = "leaving"  # a member is about to leave
    STOPPING = "stopping"  # a member stopped its workers for this round
    WAITING = "waiting"  # a node waits to join and the round has room

    @property
    def urgent(self) -> bool:
        return self not in (RoundEnd.LEAVING, RoundEnd.STOPPING, RoundEnd.WAITING)


@dataclass(frozen=True)
class LeaderRecord:
    """The node that reads the whole job and writes its rounds, held on that node's lease:
    the first candidate of the next round (its rank 0), so that it can pick a free port
    on its own host. ``rev`` 0: the node claimed the post in the transaction that
    registered it, whose revision it does not know yet; its record and this key were
    created together, so the key's create revision is its incarnation."""

    id: str
    rev: int
    addr: str
    probe: int = 0

    def encode(self) -> bytes:
        return dumps(_shallow(self))

    @classmethod
    def decode(cls, key: str, raw: bytes, create_revision: int = 0) -> LeaderRecord:
        obj = _load(key, raw)
        return cls(
            id=_field(key, obj, "id", str),
            rev=_field(key, obj, "rev", int) or create_revision,
            addr=_field(key, obj, "addr", str),
            probe=_int(obj, "probe"),
        )


@dataclass(frozen=True)
class NoticeRecord:
    """The leader's word to the members of ``round`` that it ends: what the others could
    only see by reading every node's record."""

    round: int
    end: RoundEnd
    detail: str
    nodes: tuple[str, ...] = ()

    def encode(self) -> bytes:
        obj = _shallow(self)
        obj["nodes"] = list(self.nodes[:NAMES])
        return dumps(obj)

    @classmethod
    def decode(cls, key: str, raw: bytes) -> NoticeRecord:
        obj = _load(key, raw)
        return cls(
            round=_field(key, obj, "round", int),
            end=_enum(key, RoundEnd, _field(key, obj, "end", str)),
            detail=str(obj.get("detail", "")),
            nodes=_names(obj.get("nodes")),
        )


@dataclass(frozen=True)
class ProgressRecord:
    """The newest step the job committed, as the rank-0 node of ``round`` last said: a
    round that later resumes from an older step says how many it trains again, even
    when no node that trained them is left."""

    step: int
    node: str
    round: int
    at: float = 0.0
    # this run of the job, drawn by its first writer and carried by the next: a node's
    # snapshot left in shared memory belongs to it only if taken under the same (a job
    # started again under the same id, on an etcd that forgot the first, is another)
    job: str = ""
    # its writer's last word (it left the job): no step of the job is newer. Otherwise
    # the writer may have committed an interval's steps more before it was lost
    final: bool = False

    def encode(self) -> bytes:
        return dumps(_shallow(self))

    @classmethod
    def decode(cls, key: str, raw: bytes) -> ProgressRecord:
        obj = _load(key, raw)
        step = _field(key, obj, "step", int)
        if step < 0:
            raise _bad(key, f"step {step} is negative")
        return cls(
            step=step,
            node=_text(key, obj, "node"),
            round=_field(key, obj, "round", int),
            at=_number(obj, "at"),
            job=_text(key, obj, "job"),
            final=obj.get("final") is True,
        )


@dataclass(frozen=True)
class ClosedRecord:
    state: JobOutcome
    reason: str = ""
    by: str = ""
    round: int = 0
    at: float = 0.0
    root_cause: FailureReport | None = None

    def encode(self) -> bytes:
        obj = _shallow(self)
        obj["root_cause"] = self.root_cause.plain() if self.root_cause else {}
        return dumps(obj)

    @classmethod
    def decode(cls, key: str, raw: bytes) -> ClosedRecord:
        obj = _load(key, raw)
        return cls(
            state=_enum(key, JobOutcome, _field(key, obj, "state", str)),
            reason=str(obj.get("reason", "")),
            by=str(obj.get("by", "")),
            round=_int(obj, "round"),
            at=_number(obj, "at"),
            root_cause=FailureReport.lenient(key, obj.get("root_cause")),
        )


@dataclass(frozen=True)
class FailureRecord:
    """A node's report that its workers failed in ``round``."""

    node: str
    round: int
    time: float
    report: FailureReport

    def encode(self) -> bytes:
        obj = {"node": self.node, "round": self.round, "time": self.time}
        return dumps({**obj, "detail": self.report.plain()})

    @classmethod
    def decode(cls, key: str, raw: bytes) -> FailureRecord:
        obj = _load(key, raw)
        return cls(
            node=_field(key, obj, "node", str),
            round=_field(key, obj, "round", int),
            time=float(_field(key, obj, "time", (int, float))),
            report=FailureReport.from_plain(key, obj.get("detail") or {"summary": ""}),
        )

    def root_cause(self) -> FailureReport:
        """This report as a root cause: it names the node and when it reported."""
        return replace(self.report, node=self.node, time=self.time)
