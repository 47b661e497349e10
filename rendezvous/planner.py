"""When to form the next round, with whom, and who writes it. Pure: a view in, a plan out.

Rules (every agent computes the same plan from the same view; only the writer acts):

- A round is re-formed when there is none yet, when one of its members is gone (lost:
  its lease expired; left: it said so first), or when a live member has declared it is
  done with the round (its workers failed, or it drained them for a resize).
- It is formed only once every live member is done with the current round, so no old
  worker still runs when new ones start.
- Candidates are the live members in their current order, then the other live nodes in
  join order (create revision); nodes that are leaving are never candidates. So
  survivors keep their relative order and the rank-0 node stays rank 0 while it lives.
- With fewer than MIN candidates nothing forms. With MAX or more, the first MAX form the
  round now (the rest are standbys). In between, the round forms once last_call_timeout
  has passed since the latest node registered.
- The writer is the first candidate, that is the new rank 0: it can pick a free port on
  its own host for MASTER_PORT.
- A restart is charged only when the round ends because workers failed and no member
  was lost; past the budget the writer closes the job as failed with the earliest
  failure as root cause.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rendezvous.mirror import JobView, LiveNode
from rendezvous.records import FailureRecord, Member, RoundRecord


@dataclass(frozen=True)
class Plan:
    form: bool
    reason: str
    members: tuple[Member, ...] = ()
    writer: str | None = None
    cause: str = ""
    restarts: int = 0
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    root_cause: dict = field(default_factory=dict)
    budget_spent: bool = False
    wake_at: float | None = None  # monotonic time the plan may change without an event
    enough_nodes: bool = True
    busy: tuple[str, ...] = ()  # live members the round waits on


def _member(node: LiveNode) -> Member:
    return Member(node.record.id, node.rev, node.record.addr, node.record.nproc)


def earliest_failure(failures: dict[str, FailureRecord]) -> dict:
    if not failures:
        return {}
    first = min(failures.values(), key=lambda f: f.time)
    return {"node": first.node, "time": first.time, **first.detail}


def plan(
    view: JobView,
    min_nodes: int,
    max_nodes: int,
    last_call: float,
    max_restarts: int,
    now: float,
    me: str | None = None,
) -> Plan:
    """The plan as node ``me`` needs it (all of it when ``me`` is None or the writer).

    A node that is not the writer learns who is, and nothing more: its view may be lean
    (see mirror.py), and with many nodes waiting every event would wake every one.
    """
    current: RoundRecord | None = view.round
    number = current.number if current else 0
    previous = current.members if current else ()
    live_members = [m for m in previous if view.is_live(m)]
    in_round = {m.id for m in live_members}
    staying = [m for m in live_members if view.nodes[m.id].record.state != "leaving"]
    newcomers = [
        n for i, n in view.nodes.items() if i not in in_round and n.record.state != "leaving"
    ]
    count = len(staying) + len(newcomers)
    writer = (
        staying[0].id
        if staying
        else (min(newcomers, key=lambda n: n.rev).record.id if newcomers else None)
    )
    if me is not None and me != writer:
        return Plan(False, f"waiting for {writer} to form round {number + 1}", writer=writer)

    gone = [m for m in previous if not view.is_live(m)]
    left = tuple(m.id for m in gone if view.was_leaving(m))
    lost = tuple(m.id for m in gone if m.id not in left)
    done = [m for m in live_members if view.nodes[m.id].record.done >= number]
    if current is not None and not gone and not done:
        return Plan(False, f"round {number} is running", writer=writer)
    if len(done) < len(live_members):
        busy = tuple(m.id for m in live_members if m not in done)
        return Plan(
            False,
            f"waiting for {', '.join(busy)} to stop the workers of round {number}",
            writer=writer,
            busy=busy,
        )
    if count < min_nodes:
        return Plan(
            False,
            f"{count} of at least {min_nodes} nodes present",
            writer=writer,
            enough_nodes=False,
        )
    if count < max_nodes and now < view.last_join + last_call:
        return Plan(
            False,
            f"{count} of up to {max_nodes} nodes present; last call",
            writer=writer,
            wake_at=view.last_join + last_call,
        )

    newcomers.sort(key=lambda n: n.rev)
    chosen = tuple([*staying, *map(_member, newcomers)][:max_nodes])
    failures = view.failures.get(number, {}) if current else {}
    if current is None:
        cause = "start"
    elif lost:
        cause = "lost"
    elif failures:
        cause = "failure"
    elif left:
        cause = "left"
    else:
        cause = "resize"
    restarts = (current.restarts if current else 0) + (cause == "failure")
    before = {(m.id, m.rev) for m in previous}
    return Plan(
        True,
        f"forming round {number + 1} ({cause})",
        members=chosen,
        writer=writer,
        cause=cause,
        restarts=restarts,
        joined=tuple(m.id for m in chosen if (m.id, m.rev) not in before),
        left=left,
        lost=lost,
        root_cause=earliest_failure(failures),
        budget_spent=cause == "failure" and restarts > max_restarts,
    )
