"""The membership rules (member_state, plan, round_end) on hand-made views; the
real-etcd behaviour is in test_rendezvous."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rendezvous import records
from rendezvous.records import (
    ClosedRecord,
    FailureRecord,
    FailureReport,
    GoneRecord,
    JobOutcome,
    LeaderRecord,
    Member,
    NodeRecord,
    NodeState,
    NoticeRecord,
    ProgressRecord,
    RoundCause,
    RoundRecord,
    WorkerFailure,
)
from rendezvous.rules import (
    CLAIM_AFTER,
    SUCCESSORS,
    LeadStep,
    MemberState,
    RoundEnd,
    earliest_failure,
    fenced,
    lead_step,
    leads,
    lean_round_end,
    member_state,
    neighbours,
    next_number,
    notice_to_give,
    plan,
    progress_due,
    round_end,
    spends_budget,
    successor,
    waiting,
    waiting_by_count,
)
from rendezvous.view import KV, Decoded, JobView, PresentNode

LEAVING = NodeState.LEAVING


def node(i: str, rev: int, done: int = 0, state: NodeState = NodeState.WAITING) -> PresentNode:
    return PresentNode(NodeRecord(id=i, addr="h", nproc=2, done=done, state=state), rev)


def rnd(number: int, *members: PresentNode, restarts: int = 0) -> RoundRecord:
    return RoundRecord(
        number, tuple(Member(n.record.id, n.rev, "h", 2) for n in members), "h", 1, 2, restarts
    )


def view(
    *nodes: PresentNode,
    r: RoundRecord | None = None,
    last_join: float = 0.0,
    gone: tuple[PresentNode, ...] = (),
    failures: dict[int, dict[str, FailureRecord]] | None = None,
    closed: ClosedRecord | None = None,
) -> JobView:
    return JobView(
        nodes={n.record.id: n for n in nodes},
        gone={n.record.id: GoneRecord(n.rev, "host") for n in gone},
        round_record=r,
        closed_record=closed,
        last_join=last_join,
        failures=failures or {},
    )


# -- member_state ---------------------------------------------------------------------------
def test_member_states() -> None:
    a, b, c, d = node("a", 1), node("b", 2, done=1), node("c", 3, state=LEAVING), node("d", 4)
    e, f = node("e", 5), node("f", 6)
    r = rnd(1, a, b, c, e, f)
    v = view(a, b, c, d, node("e", 50), gone=(f,), r=r)
    revs = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}
    states = {i: member_state(v, i, rev, max_nodes=5) for i, rev in revs.items()}
    assert states == {
        "a": MemberState.RUNNING,
        "b": MemberState.STOPPING,
        "c": MemberState.LEAVING,
        "d": MemberState.STANDBY,  # the round is full
        "e": MemberState.LOST,  # a new incarnation of e is not the member
        "f": MemberState.LEFT,  # its tombstone names the member's incarnation
    }
    assert member_state(v, "e", 50, max_nodes=5) is MemberState.STANDBY  # e's new incarnation
    assert member_state(v, "d", 4, max_nodes=6) is MemberState.JOINING
    assert member_state(view(a), "a", 1, max_nodes=1) is MemberState.JOINING  # no round yet
    with pytest.raises(KeyError):
        member_state(v, "zz", 1, max_nodes=5)


# -- plan -------------------------------------------------------------------------------------
def test_first_round_waits_for_min_then_last_call_then_forms_in_join_order() -> None:
    a, b, c = node("a", 10), node("b", 5), node("c", 7)
    p = plan(view(a, last_join=100), 2, 4, 2.0, 0, now=100.5)
    assert not p.form and not p.enough_nodes and p.present == 1
    p = plan(view(a, b, c, last_join=100), 2, 4, 2.0, 0, now=101)
    assert not p.form and p.wake_at == 102
    p = plan(view(a, b, c, last_join=100), 2, 4, 2.0, 0, now=102)
    assert p.form and [m.id for m in p.members] == ["b", "c", "a"] and p.writer == "b"
    assert p.cause is RoundCause.START


def test_max_forms_at_once_and_extra_nodes_wait() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    p = plan(view(a, b, c, last_join=100), 1, 2, 30.0, 0, now=100)
    assert p.form and [m.id for m in p.members] == ["a", "b"]


def test_a_non_writer_learns_only_the_writer() -> None:
    a, b = node("a", 1), node("b", 2)
    p = plan(view(a, b, last_join=100), 1, 2, 30.0, 0, now=100, me="b")
    assert not p.form and p.writer == "a" and "waiting for a" in p.reason


def test_running_round_is_left_alone_and_standbys_wait() -> None:
    a, b, s = node("a", 1), node("b", 2), node("s", 3)
    p = plan(view(a, b, s, r=rnd(1, a, b)), 1, 2, 0.1, 0, now=100)
    assert not p.form and "running" in p.reason


def test_member_lost_waits_for_live_members_to_stop_then_keeps_order() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b, c)
    p = plan(view(b, c, r=r), 1, 3, 0.1, 0, now=100)
    assert not p.form and "waiting for b, c" in p.reason and p.busy == ("b", "c")
    b, c = node("b", 2, done=1), node("c", 3, done=1)
    p = plan(view(b, c, r=r), 1, 3, 0.1, 0, now=100)
    assert p.form and [m.id for m in p.members] == ["b", "c"] and p.writer == "b"
    assert p.cause is RoundCause.LOST and p.lost == ("a",) and p.restarts == 0


def test_a_leaving_member_is_waited_for_until_it_has_stopped() -> None:
    a, b = node("a", 1, done=1), node("b", 2, state=LEAVING)
    p = plan(view(a, b, r=rnd(1, a, b)), 1, 2, 0.1, 0, now=100)
    assert not p.form and p.busy == ("b",)


def test_a_reincarnated_node_is_a_new_member() -> None:
    a, b = node("a", 1), node("b", 2)
    r = rnd(1, a, b)
    p = plan(view(node("a", 9), node("b", 2, done=1), r=r), 1, 2, 0.1, 0, now=100)
    assert p.form and [(m.id, m.rev) for m in p.members] == [("b", 2), ("a", 9)]
    assert p.lost == ("a",) and p.joined == ("a",)


def test_graceful_leave_is_left_not_lost_and_leaving_nodes_are_not_candidates() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b, c)
    v = view(node("a", 1, done=1), node("b", 2, done=1, state=LEAVING), r=r, gone=(c,))
    p = plan(v, 1, 3, 0.1, 0, now=100)
    assert p.form and [m.id for m in p.members] == ["a"]
    # b said it leaves and stopped its workers: it has left, whether its record is gone yet
    assert p.left == ("b", "c") and p.lost == () and p.cause is RoundCause.LEFT


def test_failure_charges_one_restart_and_past_budget_closes() -> None:
    a, b = node("a", 1, done=1), node("b", 2, done=1)
    fails = {
        1: {
            "b": FailureRecord("b", 1, 50.0, FailureReport("boom")),
            "a": FailureRecord("a", 1, 51.0, FailureReport("cascade")),
        }
    }
    p = plan(view(a, b, r=rnd(1, a, b), failures=fails), 2, 2, 0.1, 1, now=100)
    assert p.form and p.cause is RoundCause.FAILURE and p.restarts == 1 and not p.budget_spent
    assert p.root_cause is not None
    assert (p.root_cause.node, p.root_cause.summary, p.root_cause.time) == ("b", "boom", 50.0)
    p = plan(view(a, b, r=rnd(1, a, b, restarts=1), failures=fails), 2, 2, 0.1, 1, now=100)
    assert p.budget_spent


def test_root_cause_is_the_first_failure_that_is_no_consequence() -> None:
    def rec(node_id: str, reported: float, failed: float, consequence: bool) -> FailureRecord:
        row = WorkerFailure(0, 0, 1, 1, failed, consequence=consequence)
        return FailureRecord(node_id, 1, reported, FailureReport(node_id, "h", (row,)))

    fails = {
        "a": rec("a", reported=10.0, failed=5.0, consequence=True),  # reported first
        "b": rec("b", reported=11.0, failed=5.0, consequence=False),
        "c": rec("c", reported=9.0, failed=6.0, consequence=False),
    }
    assert getattr(earliest_failure(fails), "summary", None) == "b"
    del fails["b"]
    assert getattr(earliest_failure(fails), "summary", None) == "c"
    assert earliest_failure({}) is None


def test_a_loss_is_never_charged_even_with_cascading_failures() -> None:
    a, b = node("a", 1), node("b", 2, done=1)
    cascade = WorkerFailure(0, 0, 1, 1, 50.0, consequence=True)
    for report in (FailureReport(""), FailureReport("b", "h", (cascade,))):
        fails = {1: {"b": FailureRecord("b", 1, 50.0, report)}}
        p = plan(view(b, r=rnd(1, a, b), failures=fails), 1, 2, 0.1, 0, now=100)
        assert p.form and p.cause is RoundCause.LOST and p.restarts == 0 and not p.budget_spent


def test_a_failure_of_its_own_is_charged_though_a_member_was_lost() -> None:
    """c's worker hung (no consequence of anything) while b was lost: the round is
    formed for the loss, and c's failure still costs the job one restart."""
    a, b, c = node("a", 1, done=1), node("b", 2), node("c", 3, done=1)
    hung = WorkerFailure(2, 0, 1, 1, 50.0, consequence=False)
    fails = {1: {"c": FailureRecord("c", 1, 50.0, FailureReport("c", "h", (hung,)))}}
    p = plan(view(a, c, r=rnd(1, a, b, c), failures=fails), 1, 3, 0.1, 1, now=100)
    assert p.form and p.cause is RoundCause.LOST and p.lost == ("b",)
    assert p.restarts == 1 and not p.budget_spent
    assert p.root_cause is not None and p.root_cause.node == "c"
    p = plan(view(a, c, r=rnd(1, a, b, c, restarts=1), failures=fails), 1, 3, 0.1, 1, now=100)
    assert p.budget_spent
    # a hang its agent found (SIGKILLed by it) counts too; a death by a signal of its own
    # does not: NCCL's watchdog aborts (SIGABRT) a process whose peer died
    found = WorkerFailure(2, 0, 1, -9, 50.0, message="hung: no progress for 3.1s")
    aborted = WorkerFailure(2, 0, 1, -6, 50.0, message="")
    for row, charged in ((found, 1), (aborted, 0)):
        fails = {1: {"c": FailureRecord("c", 1, 50.0, FailureReport("c", "h", (row,)))}}
        p = plan(view(a, c, r=rnd(1, a, b, c), failures=fails), 1, 3, 0.1, 1, now=100)
        assert p.cause is RoundCause.LOST and p.restarts == charged, row


def test_scale_up_once_members_drained() -> None:
    a, b, n = node("a", 1, done=1), node("b", 2), node("n", 9)
    r = rnd(1, a, b)
    assert not plan(view(a, b, n, r=r), 1, 3, 0.1, 0, now=100).form
    p = plan(view(a, node("b", 2, done=1), n, r=r, last_join=99), 1, 3, 0.1, 0, now=100)
    assert p.form and [m.id for m in p.members] == ["a", "b", "n"]
    assert p.cause is RoundCause.RESIZE and p.joined == ("n",)


# -- round_end --------------------------------------------------------------------------------
def end(v: JobView, mine: RoundRecord | None, me: str = "a", fenced: bool = False) -> object:
    change = round_end(v, me, 1, mine, max_nodes=3, fenced=fenced)
    return None if change is None else (change.end, change.nodes)


def test_round_end_in_order_of_urgency() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b, c)
    assert end(view(a, b, c, r=r), r) is None
    assert end(view(a, b, c, r=r), None) is None  # not in a round
    failed = ClosedRecord(JobOutcome.FAILED, "budget")
    assert end(view(a, r=r, closed=failed), r) == (RoundEnd.JOB_FAILED, ())
    done = ClosedRecord(JobOutcome.SUCCEEDED)
    assert end(view(a, b, c, r=r, closed=done), r) == (RoundEnd.JOB_SUCCEEDED, ())
    # ... by a round formed without this node (it was away): its workers can never finish
    later = view(b, c, r=rnd(2, b, c), closed=done)
    assert end(later, r) == end(later, r, fenced=True) == (RoundEnd.JOB_DONE_WITHOUT, ())
    assert end(view(node("a", 9), b, r=rnd(2, node("a", 9), b), closed=done), r) == (
        RoundEnd.JOB_DONE_WITHOUT,  # the newer round holds another incarnation of its id
        (),
    )
    assert end(view(a, b, r=rnd(2, a, b), closed=done), r) == (RoundEnd.JOB_SUCCEEDED, ())
    # fenced with no round formed without it (etcd was away): nothing is stale yet
    assert end(view(a, b, c, r=r), r, fenced=True) == (RoundEnd.LAPSED, ())
    assert end(view(b, c, r=r), r, fenced=True) == (RoundEnd.LAPSED, ())  # its record gone
    # ... unless another incarnation of its id registered: that one is the node now
    again = end(view(node("a", 9), b, c, r=r), r, fenced=True)
    assert again == (RoundEnd.FENCED, ())
    assert end(view(a, b, r=rnd(2, a, b)), r, fenced=True) == (RoundEnd.FENCED, ())
    assert end(view(b, c, r=r), r, me="b") == (RoundEnd.LOST, ("a",))
    assert end(view(a, c, r=r, gone=(b,)), r) == (RoundEnd.LEFT, ("b",))
    fails = {
        1: {
            "c": FailureRecord("c", 1, 1.0, FailureReport("c")),
            "a": FailureRecord("a", 1, 1.0, FailureReport("a")),
        }
    }
    assert end(view(a, b, c, r=r, failures=fails), r) == (RoundEnd.PEER_FAILED, ("c",))
    leaving = node("b", 2, state=LEAVING)
    assert end(view(a, leaving, c, r=r), r) == (RoundEnd.LEAVING, ("b",))
    assert end(view(a, b, node("c", 3, done=1), r=r), r) == (RoundEnd.STOPPING, ("c",))


def test_after_an_etcd_outage_a_vanished_member_has_until_the_grace_ends_to_come_back() -> None:
    """An outage that dropped one lease dropped them all: the others come back as they
    were (``resumes``) within moments, and a round re-formed meanwhile would be for nothing."""
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b, c)
    vanished = view(a, b, r=r)

    def ends(now: float, until: float) -> object:
        change = round_end(vanished, "a", 1, r, 3, False, outage=(now, until))
        return None if change is None else (change.end, change.nodes)

    assert ends(10.0, 13.0) is None
    assert ends(13.0, 13.0) == (RoundEnd.LOST, ("c",))
    assert end(vanished, r) == (RoundEnd.LOST, ("c",))  # no outage: lost at once
    # the grace defers losses only: a departure, or a failure, ends the round as ever
    left = view(a, b, r=r, gone=(c,))
    assert round_end(left, "a", 1, r, 3, False, outage=(10.0, 13.0)) is not None
    # the leader's notice waits as well
    assert notice_to_give(vanished, 3, None, outage=(10.0, 13.0)) is None
    notice = notice_to_give(vanished, 3, None, outage=(13.5, 13.0))
    assert notice is not None and notice.end is RoundEnd.LOST
    # back as it was, it is a member again: nothing ends the round
    back = PresentNode(replace(c.record, resumes=3), 3)
    assert end(view(a, b, back, r=r), r) is None


def test_a_member_proven_dead_is_lost_at_once_even_in_an_etcd_outage() -> None:
    """Its agent refused its probe port (a kill while etcd restarts): it will not come
    back, so the round re-forms as soon as its lease is gone, not a TTL after etcd
    answers again, unless another member is gone as well and may come back. Proof of an
    older incarnation proves nothing about this one."""
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b, c)
    vanished = view(a, b, r=r)
    outage = (10.0, 13.0)
    change = round_end(vanished, "a", 1, r, 3, False, outage=outage, proven={"c": 3})
    assert change is not None and (change.end, change.nodes) == (RoundEnd.LOST, ("c",))
    assert round_end(vanished, "a", 1, r, 3, False, outage=outage, proven={"c": 2}) is None
    notice = notice_to_give(vanished, 3, None, outage=outage, proven={"c": 3})
    assert notice is not None and notice.end is RoundEnd.LOST and notice.nodes == ("c",)
    # b gone too, not proven dead: its lease may have gone with etcd's outage, and it
    # carries on in a moment; a round formed now would leave it out
    both = view(a, r=r)
    assert round_end(both, "a", 1, r, 3, False, outage=outage, proven={"c": 3}) is None


def test_a_round_after_an_etcd_outage_waits_for_the_members_it_may_have_dropped() -> None:
    """The members a and b train on through an outage longer than the TTL; newcomer c
    registers as etcd answers again, before a and b carry on (``resumes``). It leads
    (their lead went with the lease), and a round of c alone would fence them though no
    node died: it waits until the grace ends, unless each is known not to come back."""
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b)
    alone = view(c, r=r, last_join=0.0)
    grace = (10.0, 13.0)
    p = plan(alone, 1, 3, 0.1, 0, now=10.0, outage=grace)
    assert not p.form and p.lapsed == ("a", "b") and p.wake_at == 13.0, p
    assert "waiting up to 3.0s for a, b: etcd was away" in p.reason
    # both proven dead, or one of them too and the other registered again: form now
    assert plan(alone, 1, 3, 0.1, 0, now=10.0, outage=grace, proven={"a": 1, "b": 2}).form
    again = view(c, node("b", 9), r=r)
    p = plan(again, 1, 3, 0.1, 0, now=10.0, outage=grace, proven={"a": 1})
    assert p.form and {m.id for m in p.members} == {"b", "c"} and p.lost == ("a", "b")
    # an older incarnation's proof proves nothing; a grace that is over, no outage: form
    assert not plan(alone, 1, 3, 0.1, 0, now=10.0, outage=grace, proven={"a": 1, "b": 1}).form
    assert plan(alone, 1, 3, 0.1, 0, now=13.0, outage=(13.0, 13.0)).form
    p = plan(alone, 1, 3, 0.1, 0, now=10.0)
    assert p.form and p.members == (Member("c", 3, "h", 2, since=2),) and p.lost == ("a", "b")
    # back as they were: the round runs, c waits to join it
    back = view(c, *(PresentNode(replace(n.record, resumes=n.rev), n.rev) for n in (a, b)), r=r)
    assert "running" in plan(back, 1, 3, 0.1, 0, now=10.0, outage=grace).reason


def test_after_an_etcd_outage_a_member_whose_workers_failed_is_not_waited_for() -> None:
    """b's worker was SIGKILLed while etcd was away; b reported the failure as etcd
    answered, and its record is gone with its lease: it steps out, or joins again, with
    new workers either way. a and c carry on: the round re-forms without b at once (it
    waited the grace for b, and b, awaited, came back into it: a and c waited for its new
    worker). One that may hold the job's newest state alone is still waited for."""
    a, b, c = node("a", 1, done=1), node("b", 2), node("c", 3, done=1)
    r = rnd(1, a, b, c)
    boom = WorkerFailure(1, 0, -9, 1, 50.0)
    fails = {1: {"b": FailureRecord("b", 1, 50.0, FailureReport("b", "h", (boom,)))}}
    grace = (10.0, 13.0)
    carried = view(a, c, r=r, failures=fails)
    p = plan(carried, 1, 3, 0.1, 5, now=10.0, outage=grace)
    assert p.form and p.lost == ("b",) and {m.id for m in p.members} == {"a", "c"}, p
    change = round_end(carried, "a", 1, r, 3, False, outage=grace)
    assert change is not None and change.end is RoundEnd.LOST and change.nodes == ("b",)
    # without the report it may be back as it was in a moment: the grace is waited
    assert plan(view(a, c, r=r), 1, 3, 0.1, 5, now=10.0, outage=grace).lapsed == ("b",)
    training = view(node("a", 1), node("c", 3), r=r)
    assert round_end(training, "a", 1, r, 3, False, outage=grace) is None
    # b alone holds what round 1 trained (a joined in round 2, which trained nothing):
    # it is waited for as a holder
    r2 = RoundRecord(
        2, (Member("a", 1, "h", 2, since=2), Member("b", 2, "h", 2, since=1)), "h", 1, 2
    )
    held = replace(
        view(node("a", 1, done=2), r=r2, failures={2: fails[1]}),
        progress=ProgressRecord(40, "b", 1),
        last_loss=10.0,
    )
    p = plan(held, 1, 3, 0.1, 5, now=10.5, outage=grace, lease_ttl=3)
    assert not p.form and p.lapsed == ("b",), p


def test_a_round_waits_for_lost_members_that_may_hold_the_jobs_newest_state_alone() -> None:
    """Round 1 is a alone; it is lost (its lease ran out: frozen, or cut off) after it
    committed step 40, and b waits to join. A round of b alone would resume from whatever
    b holds and lose a's steps, so it waits two lease TTLs from the loss for a to come
    back into its round, unless a is known not to: proven dead, or registered again (its
    new incarnation's workers find its snapshots). A member that stays holds the state,
    if it trained with them."""
    a, b = node("a", 1), node("b", 2)
    held = replace(view(b, r=rnd(1, a)), progress=ProgressRecord(40, "a", 1), last_loss=10.0)
    p = plan(held, 1, 3, 0.1, 0, now=11.0, lease_ttl=3)
    assert not p.form and p.lapsed == ("a",) and p.wake_at == 16.0, p
    assert p.reason.startswith("waiting up to 5.0s for a: no other member of round 1 is left")
    assert "newest state (step 40)" in p.reason
    assert plan(held, 1, 3, 0.1, 0, now=16.0, lease_ttl=3).form  # the hold is over
    assert plan(held, 1, 3, 0.1, 0, now=11.0, lease_ttl=3, proven={"a": 1}).form
    assert not plan(held, 1, 3, 0.1, 0, now=11.0, lease_ttl=3, proven={"a": 7}).form
    again = replace(held, nodes={**held.nodes, "a": node("a", 9)})
    assert plan(again, 1, 3, 0.1, 0, now=11.0, lease_ttl=3).form
    # nothing committed: nothing to lose; a member stays: it holds what a trained
    assert plan(replace(held, progress=None), 1, 3, 0.1, 0, now=11.0, lease_ttl=3).form
    stopped = node("c", 3, done=1)
    both = replace(held, nodes={"b": b, "c": stopped}, round_record=rnd(1, a, stopped))
    p = plan(both, 1, 3, 0.1, 0, now=11.0, lease_ttl=3)
    assert p.form and p.lost == ("a",) and [m.id for m in p.members] == ["c", "b"]
    # ... unless it joined in this round, and the round trained nothing yet (the record
    # is an earlier round's): it received none of the state (chaos seed 112)
    c2 = node("c", 3, done=2)
    fresh = replace(rnd(2, a, c2), joined=("c",))
    two = replace(both, nodes={"b": b, "c": c2}, round_record=fresh)
    p = plan(two, 1, 3, 0.1, 0, now=11.0, lease_ttl=3)
    assert not p.form and p.lapsed == ("a",), p
    trained = replace(two, progress=ProgressRecord(41, "a", 2))
    assert plan(trained, 1, 3, 0.1, 0, now=11.0, lease_ttl=3).form
    unnamed = replace(fresh, counts=(9, 0, 0))  # the names of those who joined cut short
    assert plan(replace(two, round_record=unnamed), 1, 3, 0.1, 0, now=11.0, lease_ttl=3).form


def test_a_member_holds_the_state_only_if_it_was_in_the_round_that_last_trained() -> None:
    """Each member says the round it joined in (``since``), which the round it forms in
    sets for newcomers and carries for the rest. c joined round 5 as a was lost; round 6
    re-formed for the loss, and neither trained a step (the newest record is round 4's,
    b's); b stepped out holding it. c stayed in round 6, but it holds none of the state:
    the next round waits for b (chaos seed 60: c formed a round alone and trained 282
    steps again). Had c joined in round 4, it would hold it; a round written before
    members said ``since`` judges by its own joiners, as before."""
    c = node("c", 3, done=6)
    six = RoundRecord(
        6, (Member("b", 2, "h", 2, since=1), Member("c", 3, "h", 2, since=5)), "h", 1, 2
    )
    gone = {"b": GoneRecord(2, "host", back=True)}
    held = replace(view(c, r=six), gone=gone, progress=ProgressRecord(282, "b", 4), last_loss=10.0)
    p = plan(held, 1, 3, 0.1, 0, now=11.0, lease_ttl=3)
    assert not p.form and p.lapsed == ("b",), p
    four = replace(six, members=(six.members[0], replace(six.members[1], since=4)))
    p = plan(replace(held, round_record=four), 1, 3, 0.1, 0, now=11.0, lease_ttl=3)
    assert p.form and [m.id for m in p.members] == ["c"] and p.left == ("b",), p
    unknown = replace(six, members=(six.members[0], replace(six.members[1], since=-1)))
    p = plan(replace(held, round_record=unknown), 1, 3, 0.1, 0, now=11.0, lease_ttl=3)
    assert p.form, p  # not among round 6's joiners: it counts as holding, as before


def test_a_round_carries_its_members_since_and_sets_its_newcomers() -> None:
    a, b = node("a", 1, done=3), node("b", 2)  # a stopped its workers of round 3 for b
    r = RoundRecord(3, (Member("a", 1, "h", 2, since=2),), "h", 1, 2)
    p = plan(view(a, b, r=r, last_join=0.0), 1, 3, 0.1, 0, now=10.0)
    assert p.form and [(m.id, m.since) for m in p.members] == [("a", 2), ("b", 4)], p
    first = plan(view(node("a", 1), b, last_join=0.0), 1, 3, 0.1, 0, now=10.0)
    assert [m.since for m in first.members] == [1, 1], first


def test_a_round_waits_for_members_that_stepped_out_holding_the_jobs_newest_state() -> None:
    """c and d, round 4's only members, both step out (their workers hung at once: each
    left for the other to go on); f, fresh, would form a round alone from what it holds,
    nothing. Their tombstones say they come back (they left for now, snapshots kept): the
    round waits for them as for members lost, and takes them first once registered, over
    fresh nodes (chaos seed 24: f and e took the two places and trained 284 steps again).
    A member that left for good (SIGTERM: it handed the state over first) is not waited
    for."""
    c, d, f, e = node("c", 3), node("d", 4), node("f", 8), node("e", 9)
    gone = {
        "c": GoneRecord(3, "host", back=True),
        "d": GoneRecord(4, "host", back=True),
    }
    four = rnd(4, c, d)
    held = replace(view(f, r=four), gone=gone, progress=ProgressRecord(284, "c", 4), last_loss=10.0)
    p = plan(held, 1, 2, 0.1, 0, now=11.0, lease_ttl=3)
    assert not p.form and p.lapsed == ("c", "d") and p.wake_at == 16.0, p
    assert "newest state (step 284) may be theirs alone, and they may yet come back" in p.reason
    assert plan(held, 1, 2, 0.1, 0, now=16.0, lease_ttl=3).form  # the hold is over
    for_good = {k: replace(g, back=False) for k, g in gone.items()}
    assert plan(replace(held, gone=for_good), 1, 2, 0.1, 0, now=11.0, lease_ttl=3).form
    # their old incarnations' probe ports refuse (closed as they stepped out): no proof
    # that they are gone (chaos seed 35: f formed a round alone from step 0)
    refused = {"c": 3, "d": 4}
    p = plan(held, 1, 2, 0.1, 0, now=11.0, lease_ttl=3, proven=refused)
    assert not p.form and p.lapsed == ("c", "d"), p
    # c back (d not yet): it holds what round 4 trained, as d does; no wait for d
    c2, d2 = node("c", 20), node("d", 21)
    p = plan(replace(held, nodes={"f": f, "c": c2}), 1, 2, 0.1, 0, now=11.0, lease_ttl=3)
    assert p.form and [m.id for m in p.members] == ["c", "f"], p
    # back, registered after f and e: they take the two places
    back = replace(held, nodes={n.record.id: n for n in (f, e, c2, d2)})
    p = plan(back, 1, 2, 0.1, 0, now=11.0, lease_ttl=3)
    assert p.form and [m.id for m in p.members] == ["c", "d"], p


def test_newcomers_that_were_members_before_come_first() -> None:
    """Among nodes waiting, a former member (a new incarnation) is admitted before nodes
    new to the job, and static ranks before both."""
    a, b, x = node("a", 1, done=1), node("b", 2), node("x", 3, done=1)
    r = rnd(1, a, b, x)
    fresh, b2 = node("n", 10), node("b", 11)
    p = plan(view(a, x, fresh, b2, r=r), 1, 3, 0.1, 0, now=1.0)
    assert p.form and p.lost == ("b",) and [m.id for m in p.members] == ["a", "x", "b"], p


def test_round_end_for_newcomers_and_newer_rounds() -> None:
    a, b, n = node("a", 1), node("b", 2), node("n", 9)
    r = rnd(1, a, b)
    assert end(view(a, b, n, r=r), r) == (RoundEnd.WAITING, ("n",))
    full = rnd(1, a, b, node("x", 3))
    assert end(view(a, b, node("x", 3), n, r=full), full) is None  # a standby waits
    newer = rnd(2, a, b)
    assert end(view(a, b, r=newer), r) == (RoundEnd.SUPERSEDED, ())
    without = rnd(2, b)
    assert end(view(a, b, r=without), r) == (RoundEnd.FENCED, ())
    assert end(view(a, b, r=r), newer) is None  # our view lags behind our own round


def test_urgent_changes_are_the_ones_that_break_a_round() -> None:
    assert {e for e in RoundEnd if not e.urgent} == {
        RoundEnd.LEAVING,
        RoundEnd.STOPPING,
        RoundEnd.WAITING,
    }


# -- the leader's notice and the lean members -------------------------------------------------
def lean(r: RoundRecord, me: str) -> RoundRecord:
    """What a lean node holds of ``r``: the header and a bucket with only ``me`` in it."""
    return r.with_members([m for m in r.members if m.id == me])


def test_the_notice_is_what_ends_the_round_for_every_member() -> None:
    a, b, c, n = node("a", 1), node("b", 2), node("c", 3), node("n", 9)
    r = rnd(1, a, b, c)
    outsider = round_end(view(a, b, n, r=r), "", 0, r, max_nodes=4, fenced=False)
    assert outsider is not None and (outsider.end, outsider.nodes) == (RoundEnd.LOST, ("c",))
    waiting = round_end(view(a, b, c, n, r=r), "", 0, r, max_nodes=4, fenced=False)
    assert waiting is not None and (waiting.end, waiting.nodes) == (RoundEnd.WAITING, ("n",))
    assert round_end(view(a, b, c, r=r), "", 0, r, max_nodes=4, fenced=False) is None


def test_nodes_waiting_to_join_end_the_round_once_its_last_call_is_over() -> None:
    """The members train on through the last call for more nodes: pausing at once would
    idle them until the round that admits the newcomer forms, which waits it out."""
    a, b, n, m = node("a", 1), node("b", 2), node("n", 9), node("m", 10)
    r = rnd(1, a, b)
    v = view(a, b, n, r=r, last_join=100.0)
    assert round_end(v, "", 0, r, max_nodes=4, fenced=False, last_call=(101.5, 2.0)) is None
    late = round_end(v, "", 0, r, max_nodes=4, fenced=False, last_call=(102.0, 2.0))
    assert late is not None and (late.end, late.nodes) == (RoundEnd.WAITING, ("n",))
    full = view(a, b, n, m, r=r, last_join=100.0)  # no room for more: no reason to wait
    now = round_end(full, "", 0, r, max_nodes=4, fenced=False, last_call=(100.1, 2.0))
    assert now is not None and now.nodes == ("n", "m")
    assert notice_to_give(v, 4, None, (101.5, 2.0)) is None
    notice = notice_to_give(v, 4, None, (102.5, 2.0))
    assert notice is not None and notice.end is RoundEnd.WAITING


def test_lean_round_end_reads_the_notice_failures_and_the_round() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b, c)
    mine = lean(r, "b")
    assert mine.size == 3 and mine.world_size == 6 and not mine.complete
    assert mine.member("b") == Member("b", 2, "h", 2, rank=1, base=2)

    def lean_end(v: JobView, fenced: bool = False) -> tuple[RoundEnd, tuple[str, ...]] | None:
        c = lean_round_end(v, "b", 2, mine, fenced)
        return None if c is None else (c.end, c.nodes)

    own = view(b, r=mine)
    assert lean_end(own) is None  # the others' records are not read: no news is no change
    lost = NoticeRecord(1, RoundEnd.LOST, "lost c", ("c",))
    assert lean_end(replace(own, notice=lost)) == (RoundEnd.LOST, ("c",))
    stale = NoticeRecord(0, RoundEnd.LOST, "lost c", ("c",))
    assert lean_end(replace(own, notice=stale)) is None  # about an earlier round
    about_me = NoticeRecord(1, RoundEnd.STOPPING, "b stopping", ("b",))
    assert lean_end(replace(own, notice=about_me)) is None
    fails = {1: {"a": FailureRecord("a", 1, 1.0, FailureReport("a"))}}
    assert lean_end(view(b, r=mine, failures=fails)) == (RoundEnd.PEER_FAILED, ("a",))
    assert lean_end(own, fenced=True) == (RoundEnd.LAPSED, ())
    newer = rnd(2, a, b)
    assert lean_end(view(b, r=lean(newer, "b"))) == (RoundEnd.SUPERSEDED, ())
    assert lean_end(view(b, r=lean(rnd(2, a, c), "b"))) == (RoundEnd.FENCED, ())
    closed = ClosedRecord(JobOutcome.SUCCEEDED)
    assert lean_end(view(b, r=mine, closed=closed)) == (RoundEnd.JOB_SUCCEEDED, ())
    without = view(b, r=lean(rnd(2, a, c), "b"), closed=closed)
    assert lean_end(without) == (RoundEnd.JOB_DONE_WITHOUT, ())


# -- leading, notice and fencing --------------------------------------------------------------
def led_by(v: JobView, node_id: str, rev: int) -> JobView:
    return replace(v, leader=LeaderRecord(node_id, rev, "h"))


def test_who_leads_is_the_incarnation_the_leader_key_names() -> None:
    a, b = node("a", 1), node("b", 2)
    v = led_by(view(a, b, r=rnd(1, a, b)), "a", 1)
    assert leads(v, "a", 1) and not leads(v, "a", 7) and not leads(v, "b", 2)
    assert not leads(view(a, b), "a", 1)  # vacant


def test_successors_are_the_first_ranks_of_the_round() -> None:
    ns = [node(str(i), i + 1) for i in range(6)]
    r = rnd(1, *ns)
    assert [successor(r, n.record.id, n.rev) for n in ns] == [True] * (SUCCESSORS + 1) + [False] * (
        5 - SUCCESSORS
    )
    assert not successor(r, "0", 99)  # another incarnation
    assert not successor(None, "0", 1)  # no round yet


def test_a_node_whose_group_broke_probes_two_neighbours_a_side_never_the_leader() -> None:
    ns = [node(str(i), i + 1) for i in range(8)]
    r = rnd(1, *ns)  # ranks 0..7 in this order
    assert neighbours(r, "4") == ("2", "3", "5", "6")
    assert neighbours(r, "7") == ("1", "5", "6")  # the order wraps; rank 0 (the leader) aside
    assert neighbours(r, "1") == ("2", "3", "7")  # the successors probe the leader
    assert neighbours(rnd(1, *ns[:3]), "1") == ("2",)  # fewer members than neighbours
    assert neighbours(r, "x") == () and neighbours(None, "1") == ()
    # every member but the leader has a neighbour on each side that probes it
    probed_by = {m: [n for n in map(str, range(8)) if m in neighbours(r, n)] for m in "1234567"}
    assert all(len(by) >= 2 for by in probed_by.values()), probed_by


def test_a_vacant_lead_is_claimed_by_successors_at_once_and_by_others_later() -> None:
    ns = [node(str(i), i + 1) for i in range(6)]
    r = rnd(1, *ns)
    v = view(*ns, r=r)

    def step(i: int, vacant_for: float, fenced: bool = False) -> LeadStep:
        return lead_step(v, str(i), i + 1, r, vacant_for, fenced).step

    assert step(1, 0.0) is LeadStep.CLAIM  # a successor
    assert step(5, 0.0) is LeadStep.WAIT  # the successors first
    assert step(5, CLAIM_AFTER) is LeadStep.CLAIM  # they are gone too
    assert step(1, 10.0, fenced=True) is LeadStep.WAIT  # never on a lost lease
    held = led_by(v, "2", 3)
    assert lead_step(held, "2", 3, r, 0.0, False).step is LeadStep.LEAD
    follow = lead_step(held, "1", 2, r, 0.0, False)
    assert follow.step is LeadStep.FOLLOW and "2 leads" in follow.reason
    assert all(lead_step(v, "5", 6, r, t, False).reason for t in (0.0, 1.0))


def test_the_leader_gives_notice_once_per_round_and_again_only_to_make_it_urgent() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3, state=LEAVING)
    r = rnd(1, a, b, c)
    v = view(a, b, c, r=r)
    first = notice_to_give(v, 5, None)
    assert first is not None and (first.round, first.end, first.nodes) == (
        1,
        RoundEnd.LEAVING,
        ("c",),
    )
    assert notice_to_give(v, 5, (1, RoundEnd.LEAVING)) is None  # given, not yet seen
    seen = replace(v, notice=first)
    assert notice_to_give(seen, 5, None) is None  # in the view already
    lost = view(a, b, r=r)  # c vanished without a word: more urgent than leaving
    urgent = notice_to_give(replace(lost, notice=first), 5, (1, RoundEnd.LEAVING))
    assert urgent is not None and urgent.end is RoundEnd.LOST
    assert notice_to_give(replace(lost, notice=urgent), 5, None) is None
    assert notice_to_give(view(a, b, r=rnd(1, a, b)), 5, None) is None  # nothing ends it
    assert notice_to_give(view(a, b), 5, None) is None  # no round


def test_fenced_only_on_a_lost_lease_or_a_connected_view_without_this_incarnation() -> None:
    a = node("a", 5)
    v = replace(view(a), revision=10)
    assert not fenced(v, "a", 5, registered_at=5, lease_lost=False, connected=True)
    assert fenced(v, "a", 5, registered_at=5, lease_lost=True, connected=True)
    assert fenced(v, "a", 4, registered_at=4, lease_lost=False, connected=True)  # old one
    gone = replace(view(), revision=10)
    assert fenced(gone, "a", 5, registered_at=5, lease_lost=False, connected=True)
    assert not fenced(gone, "a", 5, registered_at=5, lease_lost=False, connected=False)
    assert not fenced(gone, "a", 5, registered_at=11, lease_lost=False, connected=True)


def test_nodes_waiting_from_the_whole_job_or_from_a_count() -> None:
    a, b, n, m = node("a", 1), node("b", 2), node("n", 3), node("m", 4, state=LEAVING)
    r = rnd(1, a, b)
    assert waiting(view(a, b, n, m, r=r), r, max_nodes=3) == 1  # a leaving node is not
    assert waiting(view(a, b, n, r=r), r, max_nodes=2) == 0  # no room: n is a standby
    assert waiting(view(a, b), None, max_nodes=3) == 0
    assert waiting_by_count(3, r, max_nodes=3) == 1
    assert waiting_by_count(3, r, max_nodes=2) == 0
    assert waiting_by_count(1, r, max_nodes=3) == 0  # a member went: a change of its own


@pytest.mark.parametrize(
    ("step", "written", "since", "members", "new_round", "due"),
    [
        (10, 5, 0.6, 3, False, True),  # an interval on, a new step
        (10, 5, 0.3, 3, False, False),  # too soon
        (5, 5, 60.0, 3, False, False),  # nothing new
        (-1, 5, 60.0, 3, True, False),  # the workers said no step yet
        (3, 292, 0.0, 3, True, True),  # a new round resumed behind: at once
        (300, 292, 10.0, 10_000, False, False),  # 10,000 watchers: once in 50 s
        (300, 292, 51.0, 10_000, False, True),
        (300, 292, 0.1, 3, False, False),
    ],
)
def test_the_jobs_progress_is_written_at_a_pace_every_watch_can_take(
    step: int, written: int, since: float, members: int, new_round: bool, due: bool
) -> None:
    assert progress_due(step, written, since, members, new_round) is due
    # as the node leaves, its last steps at once (they may be the job's newest)
    assert progress_due(step, written, since, members, new_round, final=True) is (
        step >= 0 and step != written
    )


def test_the_next_round_is_numbered_above_every_round_a_key_names() -> None:
    """Its header hidden by a value no leader wrote (and never seen before), the round's
    number still shows in its members' bucket, the nodes' last rounds and the job's
    progress: the next is above all of them, not round 1 again."""
    assert next_number(JobView()) == 1
    assert next_number(JobView(round_record=rnd(4))) == 5
    decoded = Decoded()
    decoded.put(records.ROUND, KV("/j/job/round", b"\x80junk", 9, 9, 0))
    header = rnd(3, node("a", 1), node("b", 2))
    for b, v in header.encode_buckets().items():
        decoded.put(f"{records.MEMBERS}{b}", KV(f"/j/members/{b}", v, 8, 8, 0))
    view = decoded.view(9, 0.0)
    assert view.round is None and next_number(view) == 4
    assert next_number(replace(view, nodes={"a": node("a", 1, done=5)})) == 6
    progress = ProgressRecord(step=10, node="a", round=7)
    assert next_number(replace(view, progress=progress)) == 8


@pytest.mark.parametrize(
    ("restarts", "max_restarts", "spent"),
    [(0, 0, True), (0, 1, False), (1, 1, True), (2, 3, False), (3, 3, True)],
)
def test_a_failure_spends_the_budget_once_the_round_has_used_every_restart(
    restarts: int, max_restarts: int, spent: bool
) -> None:
    """torchrun's --max-restarts N: N restarts, then the next failure fails the job."""
    assert spends_budget(restarts, max_restarts) is spent
