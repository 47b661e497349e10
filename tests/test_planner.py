"""The round-forming rules on hand-made views (the real-etcd behaviour is in test_rendezvous)."""

from __future__ import annotations

from rendezvous.mirror import JobView, LiveNode
from rendezvous.planner import plan
from rendezvous.records import FailureRecord, Member, NodeRecord, RoundRecord


def node(i: str, rev: int, done: int = 0, state: str = "waiting") -> LiveNode:
    return LiveNode(NodeRecord(id=i, addr="h", nproc=2, done=done, state=state), rev)


def rnd(number: int, *members: LiveNode, restarts: int = 0) -> RoundRecord:
    return RoundRecord(
        number, tuple(Member(n.record.id, n.rev, "h", 2) for n in members), "h", 1, 2, restarts
    )


def view(
    *nodes: LiveNode,
    r: RoundRecord | None = None,
    last_join: float = 0.0,
    departed: tuple[LiveNode, ...] = (),
    failures: dict | None = None,
) -> JobView:
    return JobView(
        nodes={n.record.id: n for n in nodes},
        round_record=r,
        departed={n.record.id: n for n in departed},
        last_join=last_join,
        failures=failures or {},
    )


def test_first_round_waits_for_min_then_last_call_then_forms_in_join_order() -> None:
    a, b, c = node("a", 10), node("b", 5), node("c", 7)
    p = plan(view(a, last_join=100), 2, 4, 2.0, 0, now=100.5)
    assert not p.form and not p.enough_nodes
    p = plan(view(a, b, c, last_join=100), 2, 4, 2.0, 0, now=101)
    assert not p.form and p.wake_at == 102
    p = plan(view(a, b, c, last_join=100), 2, 4, 2.0, 0, now=102)
    assert p.form and [m.id for m in p.members] == ["b", "c", "a"] and p.writer == "b"
    assert p.cause == "start"


def test_max_forms_at_once_and_extra_nodes_wait() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    p = plan(view(a, b, c, last_join=100), 1, 2, 30.0, 0, now=100)
    assert p.form and [m.id for m in p.members] == ["a", "b"]


def test_running_round_is_left_alone_and_standbys_wait() -> None:
    a, b, s = node("a", 1), node("b", 2), node("s", 3)
    p = plan(view(a, b, s, r=rnd(1, a, b)), 1, 2, 0.1, 0, now=100)
    assert not p.form and "running" in p.reason


def test_member_lost_waits_for_live_members_to_stop_then_keeps_order() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b, c)
    p = plan(view(b, c, r=r), 1, 3, 0.1, 0, now=100)
    assert not p.form and "waiting for b, c" in p.reason
    b, c = node("b", 2, done=1), node("c", 3, done=1)
    p = plan(view(b, c, r=r), 1, 3, 0.1, 0, now=100)
    assert p.form and [m.id for m in p.members] == ["b", "c"] and p.writer == "b"
    assert p.cause == "lost" and p.lost == ("a",) and p.restarts == 0


def test_a_reincarnated_node_is_a_new_member() -> None:
    a, b = node("a", 1), node("b", 2)
    r = rnd(1, a, b)
    p = plan(view(node("a", 9), node("b", 2, done=1), r=r), 1, 2, 0.1, 0, now=100)
    assert p.form and [(m.id, m.rev) for m in p.members] == [("b", 2), ("a", 9)]
    assert p.lost == ("a",) and p.joined == ("a",)


def test_graceful_leave_is_left_not_lost_and_leaving_nodes_are_not_candidates() -> None:
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    r = rnd(1, a, b, c)
    gone = node("c", 3, state="leaving")
    p = plan(
        view(node("a", 1, done=1), node("b", 2, done=1, state="leaving"), r=r, departed=(gone,)),
        1,
        3,
        0.1,
        0,
        now=100,
    )
    assert p.form and [m.id for m in p.members] == ["a"]
    assert p.left == ("c",) and p.lost == () and p.cause == "left"


def test_failure_charges_one_restart_and_past_budget_closes() -> None:
    a, b = node("a", 1, done=1), node("b", 2, done=1)
    fails = {
        1: {
            "b": FailureRecord("b", 1, 50.0, {"summary": "boom"}),
            "a": FailureRecord("a", 1, 51.0, {"summary": "cascade"}),
        }
    }
    p = plan(view(a, b, r=rnd(1, a, b), failures=fails), 2, 2, 0.1, 1, now=100)
    assert p.form and p.cause == "failure" and p.restarts == 1 and not p.budget_spent
    assert p.root_cause["node"] == "b" and p.root_cause["summary"] == "boom"
    p = plan(view(a, b, r=rnd(1, a, b, restarts=1), failures=fails), 2, 2, 0.1, 1, now=100)
    assert p.budget_spent


def test_a_loss_is_never_charged_even_with_cascading_failures() -> None:
    a, b = node("a", 1), node("b", 2, done=1)
    fails = {1: {"b": FailureRecord("b", 1, 50.0, {})}}
    p = plan(view(b, r=rnd(1, a, b), failures=fails), 1, 2, 0.1, 0, now=100)
    assert p.form and p.cause == "lost" and p.restarts == 0 and not p.budget_spent


def test_scale_up_once_members_drained() -> None:
    a, b, n = node("a", 1, done=1), node("b", 2), node("n", 9)
    r = rnd(1, a, b)
    assert not plan(view(a, b, n, r=r), 1, 3, 0.1, 0, now=100).form
    p = plan(view(a, node("b", 2, done=1), n, r=r, last_join=99), 1, 3, 0.1, 0, now=100)
    assert p.form and [m.id for m in p.members] == ["a", "b", "n"] and p.cause == "resize"
    assert p.joined == ("n",)
