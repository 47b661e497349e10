"""The etcd key layout of one job and its JSON records.

Values are JSON, never pickle: whoever can write a key must not be able to run code in
an agent. Anything under the job's prefix that does not decode to the expected shape
raises ``MalformedRecordError`` naming the key.

    <prefix>/<run_id>/nodes/<node_id>          NodeRecord, attached to the node's lease
    <prefix>/<run_id>/round                    RoundRecord, written by transaction only
    <prefix>/<run_id>/failures/<round>/<node>  a node's worker failures in that round
    <prefix>/<run_id>/closed                   ClosedRecord: the job is over
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from rendezvous.errors import MalformedRecordError

NODES = "nodes/"
ROUND = "round"
FAILURES = "failures/"
CLOSED = "closed"


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


def _field(key: str, obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in obj:
        raise MalformedRecordError(f"malformed value at etcd key {key}: missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedRecordError(
            f"malformed value at etcd key {key}: field {name!r} has the wrong type "
            f"({type(value).__name__})"
        )
    return value


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


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
    state: str = "waiting"  # waiting | running | leaving
    probe: int = 0  # TCP port that refuses connections once this agent is gone
    metrics: int = 0  # the agent's /metrics port, for people and scrapers (0: none)

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
            pid=int(obj.get("pid", 0)) if isinstance(obj.get("pid", 0), int) else 0,
            version=str(obj.get("version", "")),
            done=_field(key, obj, "done", int),
            state=str(obj.get("state", "waiting")),
            probe=obj["probe"] if isinstance(obj.get("probe"), int) else 0,
            metrics=obj["metrics"] if isinstance(obj.get("metrics"), int) else 0,
        )
        if rec.nproc < 1:
            raise MalformedRecordError(f"malformed value at etcd key {key}: nproc must be >= 1")
        if key.rsplit("/", 1)[-1] != rec.id:
            raise MalformedRecordError(
                f"malformed value at etcd key {key}: id {rec.id!r} does not match the key"
            )
        return rec


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
    cause: str = "start"  # start | lost | left | failure | resize
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
                raise MalformedRecordError(
                    f"malformed value at etcd key {key}: member {i} is not an object"
                )
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
            cause=str(obj.get("cause", "")),
            joined=tuple(map(str, obj.get("joined") or ())),
            left=tuple(map(str, obj.get("left") or ())),
            lost=tuple(map(str, obj.get("lost") or ())),
            root_cause=root if isinstance(root, dict) else {},
            formed_at=float(obj.get("formed_at") or 0.0),
        )


@dataclass(frozen=True)
class ClosedRecord:
    state: str  # succeeded | failed
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
        state = _field(key, obj, "state", str)
        if state not in ("succeeded", "failed"):
            raise MalformedRecordError(f"malformed value at etcd key {key}: state {state!r}")
        root = obj.get("root_cause") or {}
        return cls(
            state=state,
            reason=str(obj.get("reason", "")),
            by=str(obj.get("by", "")),
            round=int(obj.get("round") or 0),
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
