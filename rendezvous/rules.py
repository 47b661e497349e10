"""Membership rules: pure functions of a ``JobView``, the same on every node.

``member_state`` says what each node is doing as far as the job can tell; ``plan`` says
when to form the next round, with whom, and who writes it; ``round_end`` says what, if
anything, ends a node's current round. Everything else (``Rendezvous``, the agent,
``elastic-run status``) reads the job through these three. The leadership rules (who
leads, who claims a vacant lead and when, which notice the leader gives, whom a node
probes) and fencing are here too; ``session.py`` and ``lead.py`` carry them out.

Forming rounds (every agent computes the same plan from the same view; only the writer
acts):

- A round is re-formed when there is none yet, when one of its members is gone (lost:
  its lease expired; left: it said so first), or when a present member has declared it is
  done with the round (its workers failed, or it drained them for a resize).
- It is formed only once every present member is done with the current round, so no old
  worker still runs when new ones start.
- Candidates are the present members in their current order, then the other present nodes in
  join order (create revision); nodes that are leaving are never candidates. So
  survivors keep their relative order and the rank-0 node stays rank 0 while it lives.
- With fewer than MIN candidates nothing forms. With MAX or more, the first MAX form the
  round now (the rest are standbys). In between, the round forms once last_call_timeout
  has passed since the latest node registered.
- The writer is the first candidate, that is the new rank 0: it can pick a free port on
  its own host for MASTER_PORT.
- A restart is charged when the round ends because workers failed: with no member lost,
  for any failure report; with one lost, only for a failure of a worker's own (a hang
  its agent found, or an error exit that does not read as a vanished peer: see ``_own``),
  never for the survivors' broken collectives. Past the
  budget the writer closes the job as failed, naming as root cause the earliest failure
  that is not a consequence of another (see ``earliest_failure``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from rendezvous.records import (
    FailureRecord,
    FailureReport,
    JobOutcome,
    Member,
    NodeState,
    NoticeRecord,
    RoundCause,
    RoundEnd,
    RoundRecord,
)
from rendezvous.view import JobView, PresentNode

__all__ = [
    "Change",
    "LeadChoice",
    "LeadStep",
    "MemberState",
    "Plan",
    "RoundEnd",
    "fenced",
    "lead_step",
    "leads",
    "lean_round_end",
    "notice_to_give",
    "plan",
    "round_end",
    "successor",
    "waiting",
    "waiting_by_count",
]


class MemberState(enum.Enum):
    """A node as the job sees it, relative to the current round."""

    RUNNING = "running"  # a member, present, its workers in the round
    STOPPING = "stopping"  # a member that stopped its workers (done with the round)
    LEAVING = "leaving"  # present, said it is going (SIGTERM, or its job ended)
    LEFT = "left"  # a member gone after saying it leaves
    LOST = "lost"  # a member gone without a word (crash, freeze, partition)
    JOINING = "joining"  # present, not a member, and the round has room (or none exists)
    STANDBY = "standby"  # present, not a member, the round is full


def member_state(view: JobView, node_id: str, rev: int, max_nodes: int) -> MemberState:
    """What incarnation ``rev`` of ``node_id`` is doing, as the job can tell from ``view``:
    a member of the round (present or gone) or a present node outside it."""
    r = view.round
    present = view.nodes.get(node_id)
    if present is not None and present.rev != rev:
        present = None
    member = r is not None and r.member(node_id, rev) is not None
    if member and present is None:
        gone = view.gone.get(node_id)
        return MemberState.LEFT if gone is not None and gone.rev == rev else MemberState.LOST
    if present is None:
        raise KeyError(f"{node_id} (rev {rev}) is neither present nor a member of the round")
    if present.record.state is NodeState.LEAVING:
        return MemberState.LEAVING
    if not member:
        full = r is not None and len(r.members) >= max_nodes
        return MemberState.STANDBY if full else MemberState.JOINING
    assert r is not None
    return MemberState.STOPPING if present.record.done >= r.number else MemberState.RUNNING


def _members(view: JobView, max_nodes: int) -> dict[str, MemberState]:
    """The state of every member of the round, by id."""
    r = view.round
    return {m.id: member_state(view, m.id, m.rev, max_nodes) for m in r.members} if r else {}


def _newcomers(view: JobView, max_nodes: int) -> list[PresentNode]:
    """Present incarnations outside the round that may join it: those that ask for a rank
    (torchrun's static form) in that order, then those that were members of the round (as
    an earlier incarnation: one that stepped out, or came back after a loss; what it
    trained may be the job's newest state, kept on its host), then the others in join
    order (chaos seed 24: two fresh nodes took the only places, and the round trained
    284 steps again while the members that held them waited as standbys)."""
    r = view.round

    def member_before(n: PresentNode) -> bool:
        return r is not None and r.member(n.record.id) is not None

    return sorted(
        (
            n
            for n in view.nodes.values()
            if member_state(view, n.record.id, n.rev, max_nodes)
            in (MemberState.JOINING, MemberState.STANDBY)
        ),
        key=lambda n: (n.record.rank < 0, n.record.rank, not member_before(n), n.rev),
    )


# -- forming rounds ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    form: bool
    reason: str
    members: tuple[Member, ...] = ()
    writer: str | None = None
    cause: RoundCause = RoundCause.START
    restarts: int = 0
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    root_cause: FailureReport | None = None
    budget_spent: bool = False
    wake_at: float | None = None  # monotonic time the plan may change without an event
    enough_nodes: bool = True
    present: int = 0  # candidates for the next round
    busy: tuple[str, ...] = ()  # present members the round waits on
    lapsed: tuple[str, ...] = ()  # members gone the round waits for (to prove them dead)


def _member(node: PresentNode) -> Member:
    r = node.record
    return Member(r.id, node.rev, r.addr, r.nproc, probe=r.probe)


def earliest_failure(failures: dict[str, FailureRecord]) -> FailureReport | None:
    """The root cause among the round's failure reports: the earliest failure that is not
    a consequence of another (a worker whose peer vanished under it), by the time the
    failure happened, then by the time it was reported."""
    if not failures:
        return None

    def key(f: FailureRecord) -> tuple[bool, float, float]:
        first = f.report.failures[0] if f.report.failures else None
        if first is None:
            return (False, f.time, f.time)
        return (first.consequence, first.time or f.time, f.time)

    return min(failures.values(), key=key).root_cause()


def _own(failures: dict[str, FailureRecord]) -> bool:
    """Whether a report names a worker failure of its own beside a loss: a hang its agent
    found, or an exit with an error that does not read as a vanished peer. A death by a
    signal is not counted: NCCL's watchdog aborts a process whose peer died."""
    return any(
        w.hung or (w.exitcode > 0 and not w.consequence)
        for f in failures.values()
        for w in f.report.failures
    )


def spends_budget(restarts: int, max_restarts: int) -> bool:
    """Whether a failure charged to a round with ``restarts`` restarts behind it closes the
    job (torchrun's ``--max-restarts`` N: N restarts, and the failure after them fails the
    job; failures in one round are charged once)."""
    return restarts >= max_restarts


def plan(
    view: JobView,
    min_nodes: int,
    max_nodes: int,
    last_call: float,
    max_restarts: int,
    now: float,
    me: str | None = None,
    outage: tuple[float, float] | None = None,
    proven: Mapping[str, int] | None = None,
    lease_ttl: float = 0.0,
) -> Plan:
    """The plan as node ``me`` needs it (all of it when ``me`` is None or the writer).

    A node that is not the writer learns who is, and nothing more: its view may be lean
    (see mirror.py), and with many nodes waiting every event would wake every one.
    ``outage`` and ``proven`` as for ``round_end``: members gone in an outage of etcd
    may be on their way back (``lapsed``), and the next round waits for them until the
    outage's grace ends (a newcomer that registered as etcd answered again would form a
    round without them, and fence them, though no node died). Members lost with no
    member of their round left may hold the job's newest state alone: the next round
    waits ``HOLD_TTLS`` lease TTLs of ``lease_ttl`` for them too (see ``holders_away``).
    """
    current: RoundRecord | None = view.round
    number = current.number if current else 0
    states = _members(view, max_nodes)
    previous = current.members if current else ()
    staying = [m for m in previous if states[m.id] in (MemberState.RUNNING, MemberState.STOPPING)]
    newcomers = _newcomers(view, max_nodes)
    count = len(staying) + len(newcomers)
    writer = staying[0].id if staying else newcomers[0].record.id if newcomers else None
    if me is not None and me != writer:
        return Plan(False, f"waiting for {writer} to form round {number + 1}", writer=writer)

    def stopped(m: Member) -> bool:
        return view.nodes[m.id].record.done >= number

    # a member that said it leaves has left once its workers stopped, gone from etcd or not
    left = tuple(
        m.id
        for m in previous
        if states[m.id] is MemberState.LEFT or (states[m.id] is MemberState.LEAVING and stopped(m))
    )
    lost = tuple(m.id for m in previous if states[m.id] is MemberState.LOST)
    present = [m for m in previous if m.id not in left and m.id not in lost]
    busy = tuple(
        m.id
        for m in present
        if states[m.id] in (MemberState.RUNNING, MemberState.LEAVING)  # LEAVING: not stopped
    )
    if current is not None and not left and not lost and len(busy) == len(present):
        return Plan(False, f"round {number} is running", writer=writer, present=count)
    if busy:
        return Plan(
            False,
            f"waiting for {', '.join(busy)} to stop the workers of round {number}",
            writer=writer,
            busy=busy,
            present=count,
        )
    lapsed = lapsed_in_outage(view, number, previous, lost, outage, proven)
    if lapsed and outage is not None:
        return Plan(
            False,
            f"waiting up to {outage[1] - now:.1f}s for {', '.join(lapsed)}: etcd was away, "
            "and the outage may have dropped their leases as it drops every lease",
            writer=writer,
            wake_at=outage[1],
            present=count,
            lapsed=lapsed,
        )
    back = tuple(m.id for m in previous if m.id in left and _comes_back(view, m))
    away = holders_away(view, current, staying, lost + back, proven)
    until = view.last_loss + HOLD_TTLS * lease_ttl
    if away and now < until:
        assert view.progress is not None
        return Plan(
            False,
            f"waiting up to {until - now:.1f}s for {', '.join(away)}: no other member of "
            f"round {number} is left, so the job's newest state (step {view.progress.step}) "
            "may be theirs alone, and they may yet come back",
            writer=writer,
            wake_at=until,
            present=count,
            lapsed=away,
        )
    if count < min_nodes:
        return Plan(
            False,
            f"{count} of at least {min_nodes} nodes present",
            writer=writer,
            enough_nodes=False,
            present=count,
        )
    if count < max_nodes and now < view.last_join + last_call:
        return Plan(
            False,
            f"{count} of up to {max_nodes} nodes present; last call",
            writer=writer,
            wake_at=view.last_join + last_call,
            present=count,
        )

    joining = (replace(_member(n), since=number + 1) for n in newcomers)
    chosen = tuple([*staying, *joining][:max_nodes])
    failures = view.failures.get(number, {}) if current else {}
    if current is None:
        cause = RoundCause.START
    elif lost:
        cause = RoundCause.LOST
    elif failures:
        cause = RoundCause.FAILURE
    elif left:
        cause = RoundCause.LEFT
    else:
        cause = RoundCause.RESIZE
    charged = cause is RoundCause.FAILURE or (cause is RoundCause.LOST and _own(failures))
    behind = current.restarts if current else 0
    before = {(m.id, m.rev) for m in previous}
    return Plan(
        True,
        f"forming round {number + 1} ({cause.value})",
        members=chosen,
        writer=writer,
        cause=cause,
        restarts=behind + charged,
        joined=tuple(m.id for m in chosen if (m.id, m.rev) not in before),
        left=left,
        lost=lost,
        root_cause=earliest_failure(failures),
        budget_spent=charged and spends_budget(behind, max_restarts),
        present=count,
    )


HOLD_TTLS = 2  # lease TTLs a round waits for the lost holders of the job's newest state


def holders_away(
    view: JobView,
    current: RoundRecord | None,
    staying: list[Member],
    lost: tuple[str, ...],
    proven: Mapping[str, int] | None,
) -> tuple[str, ...]:
    """The members among ``lost`` (lost, or left for now: ``_comes_back``) that may hold
    the job's newest state alone and may yet come back: when no member that stays in
    round ``current``, or is back in the job as a new incarnation, holds what its members
    trained (``_holds_its_rounds``), the job committed a step, and they are not known to
    be gone for good (proven dead, or registered again as a new incarnation, whose
    workers find the old one's snapshots on its host, and which ``_newcomers`` puts
    first; a member that stepped out is proven nothing by its old incarnation's probe
    port, which it closed as it left: chaos seed 35). A node frozen past its lease's end
    comes back to its round
    (``RoundEnd.LAPSED``) if none formed without it, one that stepped out once its new
    workers wait; a round formed at once would lose every step since the newest state
    another node holds (chaos seed 24: the only two members' workers hung at once, each
    stepped out for the other to go on, and a node that had just come formed a round
    alone from step 0)."""
    if current is None or not lost or view.progress is None:
        return ()
    # a member back as a new incarnation holds what it held (its host's snapshots)
    back = [m for m in current.members if m.id in view.nodes and view.nodes[m.id].rev != m.rev]
    if any(_holds_its_rounds(view, current, m) for m in (*staying, *back)):
        return ()
    members = current.members
    # one that stepped out shut its old incarnation's probe port with it: proof of nothing
    return tuple(
        m.id
        for m in members
        if m.id in lost and not _gone_for_good(view, m, None if _comes_back(view, m) else proven)
    )


def _comes_back(view: JobView, m: Member) -> bool:
    """Member ``m`` left for now (``GoneRecord.back``: its own worker failed, and it steps
    out to join again with new workers, its snapshots kept)."""
    gone = view.gone.get(m.id)
    return gone is not None and gone.rev == m.rev and gone.back


def _holds_its_rounds(view: JobView, current: RoundRecord, m: Member) -> bool:
    """Member ``m`` of ``current`` holds what the rounds trained: it was a member (this
    incarnation, its node's snapshots kept through its workers' restarts) of the round
    the progress record is of, whose rank 0 records its first step at once, so every
    member of it trained or received the state. One that joined in a later round, all of
    whose rounds trained nothing, holds none of it (chaos seed 112: a round of it alone
    started over from step 0; chaos seed 60: one that joined as a member was lost, and
    stayed as the round re-formed for the loss, formed a round alone as the holders
    stepped out: 282 steps trained again). A round written before members said ``since``
    tells only who joined in ``current`` (and of those who joined beyond ``NAMES``, not
    even that: any member may be one of the round's before them)."""
    assert view.progress is not None
    if m.since >= 0:
        return m.since <= view.progress.round
    trained = view.progress.round >= current.number
    joined, cut_short = current.joined, current.counts[0] > len(current.joined)
    return trained or m.id not in joined or cut_short


def _gone_for_good(view: JobView, m: Member, proven: Mapping[str, int] | None) -> bool:
    """Member ``m`` will not come back: proven dead (its agent refused its probe port,
    ``proven``: node id to incarnation) or registered again as a new incarnation."""
    return (proven or {}).get(m.id) == m.rev or m.id in view.nodes


def lapsed_in_outage(
    view: JobView,
    number: int,
    members: tuple[Member, ...],
    lost: tuple[str, ...],
    outage: tuple[float, float] | None,
    proven: Mapping[str, int] | None,
) -> tuple[str, ...]:
    """The members among ``lost`` from round ``number`` that may yet come back to it, all
    of them while etcd's outage grace lasts (``outage``: (now, until)), since an outage
    that drops one lease drops them all; unless each is known not to: proven dead (its
    agent refused its probe port, ``proven``: node id to incarnation), registered again
    as a new incarnation, or one whose workers failed in the round (it reported it): it
    steps out, or joins again, with new workers either way, and a round that waited for
    it would wait for their start (a worker SIGKILLed in an outage: its node stepped out
    as etcd answered, the round re-formed waited for it, and the others for its new
    worker). One that may hold the newest state alone is waited for (``holders_away``)."""
    if not lost or outage is None or outage[0] >= outage[1]:
        return ()
    failed = view.failures.get(number, {})
    gone = {m.id for m in members if _gone_for_good(view, m, proven) or m.id in failed}
    return () if gone.issuperset(lost) else lost


# -- ending rounds ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Change:
    """Something that ends this node's current round, with the nodes concerned."""

    end: RoundEnd
    detail: str
    nodes: tuple[str, ...] = ()


def _settled(
    view: JobView, me: str, rev: int, mine: RoundRecord | None, fenced: bool
) -> tuple[bool, Change | None]:
    """What ends round ``mine`` whatever else happens: the job's end, this node's fencing,
    a newer round. (True, change) when decided, (False, None) to look further."""
    closed, r = view.closed, view.round
    if closed is not None:
        detail = f"job {closed.state.value}: {closed.reason}".rstrip(": ")
        if closed.state is not JobOutcome.SUCCEEDED:
            return True, Change(RoundEnd.JOB_FAILED, detail)
        newer = r if r is not None and mine is not None and r.number > mine.number else None
        if me and newer is not None and newer.member(me, rev) is None:
            # a round formed without this node (it was away) and finished the job: its
            # workers' round is gone, so they can never finish on their own
            n, reason = newer.number, f": {closed.reason}" if closed.reason else ""
            detail = f"job succeeded in round {n}, formed without this node{reason}"
            return True, Change(RoundEnd.JOB_DONE_WITHOUT, detail)
        return True, Change(RoundEnd.JOB_SUCCEEDED, detail)
    if fenced:
        node = view.nodes.get(me)
        if node is not None and node.rev != rev:
            return True, Change(
                RoundEnd.FENCED, f"node id {me} was registered again (incarnation {node.rev})"
            )
        if mine is None or r is None or r.number <= mine.number:
            # etcd was away longer than the lease TTL (or this node was): its lease is
            # gone, but no round formed without it, so nothing its workers hold is stale
            return True, Change(
                RoundEnd.LAPSED,
                "etcd dropped this node's lease, but no round has formed without it",
            )
        return True, Change(
            RoundEnd.FENCED, "etcd dropped this node's lease; the job moved on without it"
        )
    if mine is None or r is None or r.number < mine.number:
        return True, None  # no round, or our own view lags behind one we already joined
    if r.number > mine.number:
        if r.member(me, rev) is not None:
            return True, Change(RoundEnd.SUPERSEDED, f"round {r.number} formed")
        return True, Change(RoundEnd.FENCED, f"round {r.number} formed without this node")
    return False, None


def _peer_failed(view: JobView, me: str, number: int) -> Change | None:
    failed = tuple(sorted(n for n in view.failures.get(number, {}) if n != me))
    if failed:
        return Change(RoundEnd.PEER_FAILED, f"workers failed on {', '.join(failed)}", failed)
    return None


def round_end(
    view: JobView,
    me: str,
    rev: int,
    mine: RoundRecord | None,
    max_nodes: int,
    fenced: bool,
    last_call: tuple[float, float] | None = None,
    outage: tuple[float, float] | None = None,
    proven: Mapping[str, int] | None = None,
) -> Change | None:
    """What, if anything, ends round ``mine`` for node ``me`` (incarnation ``rev``), read
    from the whole job; ``fenced``: etcd has dropped this incarnation (see
    ``Rendezvous.fenced``). With ``me`` empty: what ends the round for all its members
    (the leader's notice). ``last_call``: (now, last_call_timeout), monotonic: nodes
    waiting to join end the round only once no round would wait for more (the members
    train on meanwhile, where pausing at once would leave them idle through it, as
    ``plan`` forms a round below MAX only then); None: at once. ``outage``: (now, until):
    etcd did not answer this node lately (``LeaseKeeper.outage_until``), and an outage
    that drops one lease drops them all: a member gone counts as lost only from ``until``
    on, if it has not come back by then (``Session.resume``), unless every member gone
    is ``proven`` dead (node id: the incarnation whose agent refused its probe port, see
    probe.py): then no other is still on its way back into the round that follows."""
    decided, change = _settled(view, me, rev, mine, fenced)
    if decided or mine is None:
        return change
    states = _members(view, max_nodes)
    others = [m.id for m in mine.members if m.id != me]

    def having(*wanted: MemberState) -> tuple[str, ...]:
        return tuple(i for i in others if states[i] in wanted)

    lost = having(MemberState.LOST)
    if lost and not lapsed_in_outage(view, mine.number, mine.members, lost, outage, proven):
        return Change(RoundEnd.LOST, f"lost {', '.join(lost)}", lost)
    if failed := _peer_failed(view, me, mine.number):
        return failed
    if left := having(MemberState.LEFT):
        return Change(RoundEnd.LEFT, f"{', '.join(left)} left", left)
    if leaving := having(MemberState.LEAVING):
        return Change(RoundEnd.LEAVING, f"{', '.join(leaving)} leaving", leaving)
    if stopping := having(MemberState.STOPPING):
        return Change(RoundEnd.STOPPING, f"{', '.join(stopping)} stopping", stopping)
    waiting = tuple(n.record.id for n in _newcomers(view, max_nodes))
    room = max_nodes - len(mine.members)
    if not waiting or room <= 0:
        return None
    if last_call is not None and len(waiting) < room:
        now, timeout = last_call
        if now < view.last_join + timeout:
            return None  # more may come: the round that admits them would wait for them
    return Change(RoundEnd.WAITING, f"{', '.join(waiting)} waiting to join", waiting)


def lean_round_end(
    view: JobView, me: str, rev: int, mine: RoundRecord | None, fenced: bool
) -> Change | None:
    """``round_end`` for a node that reads only its share of the job (see mirror.py): the
    job's end, fencing, a newer round, failure reports, and the leader's notice of the rest
    (a notice about this node alone is no news to it)."""
    decided, change = _settled(view, me, rev, mine, fenced)
    if decided or mine is None:
        return change
    if failed := _peer_failed(view, me, mine.number):
        return failed
    notice = view.notice
    if notice is None or notice.round != mine.number:
        return None
    nodes = tuple(n for n in notice.nodes if n != me)
    if notice.nodes and not nodes:
        return None
    return Change(notice.end, notice.detail, nodes)


# -- nodes waiting to join ---------------------------------------------------------------------
def waiting(view: JobView, mine: RoundRecord | None, max_nodes: int) -> int:
    """Nodes waiting to join round ``mine`` while it has room, from the whole job."""
    if mine is None or mine.size >= max_nodes:
        return 0
    return len([n for n in _newcomers(view, max_nodes) if n.record.state is NodeState.WAITING])


def waiting_by_count(present: int, mine: RoundRecord | None, max_nodes: int) -> int:
    """The same from a count of the present nodes alone (a node that reads only its share
    of the job): those beyond the round's members, while it has room. A member that went
    meanwhile is a change of its own (``round_end``)."""
    if mine is None or mine.size >= max_nodes:
        return 0
    return max(0, present - mine.size)


# -- fencing --------------------------------------------------------------------------------
def fenced(
    view: JobView, me: str, rev: int, registered_at: int, lease_lost: bool, connected: bool
) -> bool:
    """etcd has dropped incarnation ``rev`` of ``me`` (its lease expired while the node
    was frozen or cut off): its record is gone or is another incarnation's. Only a view
    as new as the registration (``registered_at``), read while connected, can say so;
    the lease keeper's word (``lease_lost``) is enough on its own."""
    if lease_lost:
        return True
    if not connected or view.revision < registered_at:
        return False
    node = view.nodes.get(me)
    return node is None or node.rev != rev


# -- the job's progress -----------------------------------------------------------------------
PROGRESS_EVERY = 0.5  # seconds between writes of the job's progress, at least
PROGRESS_FANOUT = 200  # ... or a second per this many members, if more: each gets each write


def progress_due(
    step: int, written: int, since: float, members: int, new_round: bool, final: bool = False
) -> bool:
    """Whether the rank-0 node of a round of ``members`` nodes records ``step`` as the
    job's progress now, ``since`` seconds after its last write (of ``written``): a step
    it has not written, at once in a round it has not written in (the step it resumed
    from replaces an older round's, so a loss is never counted twice) or as it leaves
    the job (``final``: its last steps may be the job's newest), else at a pace every
    node's watch can take. A kill loses at most one interval's steps from the record: a
    later warning then says its count is a floor (``ProgressRecord.final``)."""
    if step < 0 or step == written:
        return False
    return new_round or final or since >= max(PROGRESS_EVERY, members / PROGRESS_FANOUT)


# -- leading ----------------------------------------------------------------------------------
SUCCESSORS = 3  # ranks (0 aside) that probe the leader and claim its post at once
CLAIM_AFTER = 0.5  # seconds the lead stays vacant before any other node claims it
# what the leader gives notice of: the rest each member sees for itself
NOTICED = (RoundEnd.LOST, RoundEnd.LEFT, RoundEnd.LEAVING, RoundEnd.STOPPING, RoundEnd.WAITING)


def leads(view: JobView, me: str, rev: int) -> bool:
    """Incarnation ``rev`` of ``me`` holds the lead in ``view``."""
    ld = view.leader
    return ld is not None and ld.id == me and ld.rev == rev


def next_number(view: JobView) -> int:
    """The number of the round to write: above every round any key names (the header,
    the members' buckets, a node's last round done, the job's progress). A leader whose
    view holds no readable header (a value no leader wrote hides it, and it never saw
    the one before) numbered the next round 1 again; the members, in a round of that
    number or above, took it for no news, and their broken collectives for failures of
    their own (chaos seed 8, with junk)."""
    named = [view.newest_round, *(n.record.done for n in view.nodes.values())]
    if view.round is not None:
        named.append(view.round.number)
    if view.progress is not None:
        named.append(view.progress.round)
    return max(named) + 1


def successor(mine: RoundRecord | None, me: str, rev: int) -> bool:
    """``me`` is one of the first ranks of its round, which step in for a dead leader at
    once: a thousand nodes probing the leader and claiming its post when it dies would
    cost etcd a thousand requests each time, for one that matters."""
    m = mine.member(me, rev) if mine is not None else None
    return m is not None and m.rank <= SUCCESSORS


NEIGHBOURS = 2  # members on each side that a lean node whose group broke probes


def neighbours(mine: RoundRecord | None, me: str, k: int = NEIGHBOURS) -> tuple[str, ...]:
    """The members next to ``me`` in its round's rank order, ``k`` on each side (the
    order wraps), rank 0 aside: whom a node that does not lead probes once its workers'
    group broke. The leader probes every member then, unless its own workers report
    nothing (a send gloo never fails holds them); a lost member is next to a survivor
    on each side, so it is still found at once, for 2k probes a node, not one a member."""
    if mine is None:
        return ()
    order = sorted(mine.members, key=lambda m: m.rank)
    at = next((i for i, m in enumerate(order) if m.id == me), None)
    if at is None:
        return ()
    n = len(order)
    near = {order[(at + d) % n] for d in range(-k, k + 1) if d}
    return tuple(m.id for m in sorted(near, key=lambda m: m.rank) if m.rank != 0 and m.id != me)


class LeadStep(enum.Enum):
    """What a node does about the lead."""

    LEAD = "lead"  # it holds the lead: read the whole job, write rounds, give notice
    FOLLOW = "follow"  # another node leads
    CLAIM = "claim"  # the post is vacant: claim it now
    WAIT = "wait"  # the post is vacant, but others claim first (or this node is fenced)


@dataclass(frozen=True)
class LeadChoice:
    step: LeadStep
    reason: str


def lead_step(
    view: JobView, me: str, rev: int, mine: RoundRecord | None, vacant_for: float, fenced: bool
) -> LeadChoice:
    """What incarnation ``rev`` of ``me`` (in round ``mine``) does about the lead, the post
    having been seen vacant for ``vacant_for`` seconds."""
    ld = view.leader
    if ld is not None:
        if leads(view, me, rev):
            return LeadChoice(LeadStep.LEAD, "this node holds the lead")
        return LeadChoice(LeadStep.FOLLOW, f"{ld.id} leads")
    if fenced:
        return LeadChoice(LeadStep.WAIT, "the lead is vacant, but this node's lease is gone")
    if successor(mine, me, rev):
        return LeadChoice(LeadStep.CLAIM, "the lead is vacant and this node is a successor")
    if vacant_for >= CLAIM_AFTER:
        return LeadChoice(
            LeadStep.CLAIM,
            f"the lead has been vacant for {vacant_for:.1f}s: the successors are gone too",
        )
    return LeadChoice(LeadStep.WAIT, "the lead is vacant; its successors claim it first")


def notice_to_give(
    view: JobView,
    max_nodes: int,
    given: tuple[int, RoundEnd] | None,
    last_call: tuple[float, float] | None = None,
    outage: tuple[float, float] | None = None,
    proven: Mapping[str, int] | None = None,
) -> NoticeRecord | None:
    """The notice the leader writes now, if any: what ends the running round for all its
    members, once per round, and once more only to make it urgent (``given``: the last
    notice this node wrote, which its view may not show yet; ``last_call`` and
    ``outage`` and ``proven`` as for ``round_end``)."""
    r = view.round
    c = round_end(view, "", 0, r, max_nodes, False, last_call, outage, proven) if r else None
    if r is None or c is None or c.end not in NOTICED:
        return None

    def answered(number: int, end: RoundEnd) -> bool:
        return number == r.number and (end.urgent or not c.end.urgent)

    old = view.notice
    if old is not None and answered(old.round, old.end):
        return None
    if given is not None and answered(*given):
        return None
    return NoticeRecord(r.number, c.end, c.detail, c.nodes)
