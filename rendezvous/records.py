"""The etcd key layout of one job and its JSON records.

Values are JSON, never pickle: whoever can write a key must not be able to run code in
an agent. Anything under the job's prefix that does not decode to the expected shape
raises ``MalformedRecordError`` naming the key.

    <prefix>/<run_id>/nodes/<node_id>          NodeRecord, attached to the node's lease
    <prefix>/<run_id>/gone/<node_id>           GoneRecord: a node that left on purpose,
                                               on a short lease of its own
    <prefix>/<run_id>/round                    RoundRecord, written by transaction only
    <prefix>/<run_id>/failures/<round>/<node>  a node's worker failures in that round
    <prefix>/<run_id>/closed                   ClosedRecord: the job is over
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from rendezvous.errors import MalformedRecordError

NODES = "nodes/"
GONE = "gone/"
ROUND = "round"
FAILURES = "failures/"
CLOSED = "closed"

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


def _names(value: object) -> tuple[str, ...]:
    return tuple(map(str, value)) if isinstance(value, list | tuple) else ()


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, default=_plain).encode()


def _plain(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON")


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

    def encode(self) -> bytes:
        return dumps(asdict(self))

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
        )
        if rec.nproc < 1:
            raise _bad(key, "nproc must be >= 1")
        if key.rsplit("/", 1)[-1] != rec.id:
            raise _bad(key, f"id {rec.id!r} does not match the key")
        return rec


@dataclass(frozen=True)
class GoneRecord:
    """A node that left on purpose (``rev`` names the incarnation). It outlives the node's
    own lease briefly, so that even a one-shot reader (``elastic-run status``) can tell a
    departure from a loss."""

    rev: int
    host: str = ""
    at: float = 0.0

    def encode(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: bytes) -> GoneRecord:
        obj = _load(key, raw)
        return cls(
            rev=_field(key, obj, "rev", int),
            host=str(obj.get("host", "")),
            at=float(obj.get("at") or 0.0),
        )


@dataclass(frozen=True)
class Member:
    """A node as a round saw it. ``rev`` (its record's create revision) tells incarnations
    apart: a node that lost its lease and registered again is a new member."""

    id: str
    rev: int
    addr: str
    nproc: int


@dataclass(frozen=True)
class RoundRecord:
    number: int
    members: tuple[Member, ...]
    master_addr: str
    master_port: int
    store_port: int
    restarts: int = 0
    cause: RoundCause = RoundCause.START
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    root_cause: dict[str, Any] = field(default_factory=dict)
    formed_at: float = 0.0

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    def rank_of(self, node_id: str) -> int:
        for i, m in enumerate(self.members):
            if m.id == node_id:
                return i
        return -1

    def base_rank(self, group_rank: int) -> int:
        return sum(m.nproc for m in self.members[:group_rank])

    def encode(self) -> bytes:
        obj = asdict(self)
        obj["members"] = [asdict(m) for m in self.members]
        return dumps(obj)

    @classmethod
    def decode(cls, key: str, raw: bytes) -> RoundRecord:
        obj = _load(key, raw)
        members = []
        for i, m in enumerate(_field(key, obj, "members", list)):
            if not isinstance(m, dict):
                raise _bad(key, f"member {i} is not an object")
            members.append(
                Member(
                    id=_field(key, m, "id", str),
                    rev=_field(key, m, "rev", int),
                    addr=_field(key, m, "addr", str),
                    nproc=_field(key, m, "nproc", int),
                )
            )
        root = obj.get("root_cause") or {}
        return cls(
            number=_field(key, obj, "number", int),
            members=tuple(members),
            master_addr=_field(key, obj, "master_addr", str),
            master_port=_field(key, obj, "master_port", int),
            store_port=_field(key, obj, "store_port", int),
            restarts=_field(key, obj, "restarts", int),
            cause=_enum(key, RoundCause, obj.get("cause", RoundCause.START.value)),
            joined=_names(obj.get("joined")),
            left=_names(obj.get("left")),
            lost=_names(obj.get("lost")),
            root_cause=root if isinstance(root, dict) else {},
            formed_at=float(obj.get("formed_at") or 0.0),
        )


@dataclass(frozen=True)
class ClosedRecord:
    state: JobOutcome
    reason: str = ""
    by: str = ""
    round: int = 0
    at: float = 0.0
    root_cause: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: bytes) -> ClosedRecord:
        obj = _load(key, raw)
        root = obj.get("root_cause") or {}
        return cls(
            state=_enum(key, JobOutcome, _field(key, obj, "state", str)),
            reason=str(obj.get("reason", "")),
            by=str(obj.get("by", "")),
            round=_int(obj, "round"),
            at=float(obj.get("at") or 0.0),
            root_cause=root if isinstance(root, dict) else {},
        )


@dataclass(frozen=True)
class FailureRecord:
    """A node's report that its workers failed in ``round``; ``detail`` is the agent's own."""

    node: str
    round: int
    time: float
    detail: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: bytes) -> FailureRecord:
        obj = _load(key, raw)
        detail = obj.get("detail") or {}
        return cls(
            node=_field(key, obj, "node", str),
            round=_field(key, obj, "round", int),
            time=float(_field(key, obj, "time", (int, float))),
            detail=detail if isinstance(detail, dict) else {},
        )
