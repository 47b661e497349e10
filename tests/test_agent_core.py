"""The agent's decision table, row by row, against the pure ``decide``; and the table in
``core``'s docstring, read as data, against the same function."""

from __future__ import annotations

import signal

import pytest

from elastic.agent import core
from elastic.agent.core import (
    AgentState,
    Exit,
    LocalEvent,
    LostCause,
    Reaction,
    RestartCause,
    Start,
    Stop,
    decide,
)
from rendezvous.rules import RoundEnd

P, J, H, R = AgentState.PREPARING, AgentState.JOINING, AgentState.HOLDING, AgentState.RUNNING
RZ, RS, OUT = AgentState.RESIZING, AgentState.RESTARTING, AgentState.OUT
L = LocalEvent
C = RestartCause
Row = tuple[Stop, AgentState, RestartCause | None, Exit | None, Start]
N = Start.NONE

# (state, event, in place) -> (stop, next state, restart cause, exit, start)
TABLE: dict[tuple[AgentState, L | RoundEnd, bool], Row] = {
    # preparing: a newcomer's workers started ahead of joining (lobby.py)
    (P, L.WORKERS_HELD, False): (Stop.NONE, H, None, None, N),
    (P, L.HOLD_FAILED, False): (Stop.KILL, J, None, None, N),
    (P, L.SIGNALLED, False): (Stop.KILL, AgentState.LEFT, None, Exit.SIGNALLED, N),
    (J, L.ROUND_FORMED, False): (Stop.NONE, R, None, None, Start.NEW),
    (J, L.SIGNALLED, False): (Stop.NONE, AgentState.LEFT, None, Exit.SIGNALLED, N),
    (J, L.JOIN_TIMED_OUT, False): (Stop.NONE, AgentState.FAILED, None, Exit.FAILED, N),
    (J, L.WARM, False): (Stop.NONE, J, None, None, N),  # a standby steps back to warm up
    (J, RoundEnd.JOB_SUCCEEDED, False): (
        Stop.NONE,
        AgentState.SUCCEEDED,
        None,
        Exit.SUCCEEDED,
        N,
    ),
    (J, RoundEnd.JOB_FAILED, False): (Stop.NONE, AgentState.FAILED, None, Exit.FAILED, N),
    # holding: the workers let go of their group and wait for the next round
    (H, L.ROUND_FORMED, True): (Stop.NONE, R, None, None, Start.REFORM),
    (H, L.ROUND_FORMED, False): (Stop.KILL, R, None, None, Start.NEW),  # one of them died
    (H, L.SIGNALLED, True): (Stop.DRAIN, AgentState.LEFT, None, Exit.SIGNALLED, N),
    (H, L.JOIN_TIMED_OUT, True): (Stop.URGENT, AgentState.FAILED, None, Exit.FAILED, N),
    (H, RoundEnd.JOB_SUCCEEDED, True): (
        Stop.URGENT,
        AgentState.SUCCEEDED,
        None,
        Exit.SUCCEEDED,
        N,
    ),
    (H, RoundEnd.JOB_FAILED, True): (Stop.URGENT, AgentState.FAILED, None, Exit.FAILED, N),
    # running
    (R, L.WORKERS_SUCCEEDED, False): (Stop.NONE, AgentState.SUCCEEDED, None, Exit.SUCCEEDED, N),
    (R, L.WORKERS_SAVED, False): (Stop.NONE, RZ, C.RESIZE, None, N),
    (R, L.WORKERS_FAILED, False): (Stop.URGENT, RS, C.FAILURE, None, N),
    (R, L.WORKERS_HUNG, False): (Stop.URGENT, RS, C.HANG, None, N),
    # its own failure, the others going on in place without it: out, back as a newcomer
    (R, L.WORKERS_FAILED, True): (Stop.URGENT, OUT, C.FAILURE, None, N),
    (R, L.WORKERS_HUNG, True): (Stop.URGENT, OUT, C.HANG, None, N),
    (R, L.SIGNALLED, False): (Stop.DRAIN, AgentState.LEFT, None, Exit.SIGNALLED, N),
    (R, RoundEnd.JOB_SUCCEEDED, False): (
        Stop.FINISH,
        AgentState.SUCCEEDED,
        None,
        Exit.SUCCEEDED,
        N,
    ),
    # ... by a round formed without this node (it was away): its workers are stale
    (R, RoundEnd.JOB_DONE_WITHOUT, False): (
        Stop.KILL,
        AgentState.SUCCEEDED,
        None,
        Exit.SUCCEEDED,
        N,
    ),
    (R, RoundEnd.JOB_FAILED, False): (Stop.URGENT, AgentState.FAILED, None, Exit.FAILED, N),
    (R, RoundEnd.FENCED, False): (Stop.KILL, RS, C.FENCED, None, N),
    # etcd dropped its lease, the job did not move on: it carries on, so do its workers
    (R, RoundEnd.LAPSED, False): (Stop.NONE, R, None, None, N),
    (R, RoundEnd.SUPERSEDED, False): (Stop.URGENT, RS, C.RESIZE, None, N),
    (R, RoundEnd.LOST, False): (Stop.URGENT, RS, C.MEMBER_LOST, None, N),
    (R, RoundEnd.PEER_FAILED, False): (Stop.URGENT, RS, C.FAILURE, None, N),
    (R, RoundEnd.LEFT, False): (Stop.URGENT, RS, C.MEMBER_LEFT, None, N),
    (R, RoundEnd.LEAVING, False): (Stop.DRAIN, RZ, C.MEMBER_LEFT, None, N),
    (R, RoundEnd.STOPPING, False): (Stop.DRAIN, RZ, C.RESIZE, None, N),
    (R, RoundEnd.WAITING, False): (Stop.DRAIN, RZ, C.RESIZE, None, N),
    # running, in place: the changes of other nodes keep the processes
    (R, RoundEnd.SUPERSEDED, True): (Stop.ABANDON, RS, C.RESIZE, None, N),
    (R, RoundEnd.LOST, True): (Stop.ABANDON, RS, C.MEMBER_LOST, None, N),
    (R, RoundEnd.PEER_FAILED, True): (Stop.ABANDON, RS, C.FAILURE, None, N),
    (R, RoundEnd.LEFT, True): (Stop.ABANDON, RS, C.MEMBER_LEFT, None, N),
    (R, RoundEnd.LEAVING, True): (Stop.PAUSE, RZ, C.MEMBER_LEFT, None, N),
    (R, RoundEnd.STOPPING, True): (Stop.PAUSE, RZ, C.RESIZE, None, N),
    (R, RoundEnd.WAITING, True): (Stop.PAUSE, RZ, C.RESIZE, None, N),
    # what a stop came to
    (RZ, L.WORKERS_STOPPED, False): (Stop.NONE, J, None, None, N),
    (RZ, L.WORKERS_SUCCEEDED, False): (Stop.NONE, AgentState.SUCCEEDED, None, Exit.SUCCEEDED, N),
    (RZ, L.WORKERS_HELD, False): (Stop.NONE, H, None, None, N),
    (RZ, L.HOLD_FAILED, False): (Stop.URGENT, J, None, None, N),
    # not held, the others going on in place without it: out, back as a newcomer
    (RZ, L.HOLD_FAILED, True): (Stop.URGENT, OUT, None, None, N),
    (RS, L.WORKERS_STOPPED, False): (Stop.NONE, J, None, None, N),
    (RS, L.WORKERS_SUCCEEDED, False): (Stop.NONE, AgentState.SUCCEEDED, None, Exit.SUCCEEDED, N),
    (RS, L.WORKERS_HELD, False): (Stop.NONE, H, None, None, N),
    (RS, L.HOLD_FAILED, False): (Stop.URGENT, J, None, None, N),
    (RS, L.HOLD_FAILED, True): (Stop.URGENT, OUT, None, None, N),
    # a worker hung as it was to let go: this node's own fault, charged as a hang
    (RZ, L.WORKERS_HUNG, False): (Stop.URGENT, J, C.HANG, None, N),
    (RZ, L.WORKERS_HUNG, True): (Stop.URGENT, OUT, C.HANG, None, N),
    (RS, L.WORKERS_HUNG, False): (Stop.URGENT, J, C.HANG, None, N),
    (RS, L.WORKERS_HUNG, True): (Stop.URGENT, OUT, C.HANG, None, N),
    (OUT, L.WENT_ON, False): (Stop.NONE, J, None, None, N),
    (OUT, L.SIGNALLED, False): (Stop.NONE, AgentState.LEFT, None, Exit.SIGNALLED, N),
}


def _id(x: object) -> str:
    return str(getattr(x, "name", x))


@pytest.mark.parametrize(("state", "event", "in_place"), list(TABLE), ids=_id)
def test_every_row(state: AgentState, event: L | RoundEnd, in_place: bool) -> None:
    r = decide(state, event, in_place)
    assert (r.stop, r.next, r.cause, r.exit, r.start) == TABLE[state, event, in_place]
    assert r.why  # every reaction says why, for the log


def test_in_place_changes_only_the_changes_of_other_nodes_and_the_formed_round() -> None:
    """Where ``in place`` is not part of a row, it changes nothing."""
    for (state, event, in_place), row in TABLE.items():
        if (state, event, not in_place) not in TABLE:
            r = decide(state, event, not in_place)
            assert (r.stop, r.next, r.cause, r.exit, r.start) == row, (state, event)


def test_the_table_covers_every_event_each_state_can_see() -> None:
    seen: dict[AgentState, set[object]] = {}
    for s, e, _ in TABLE:
        seen.setdefault(s, set()).add(e)
    outcomes = {L.WORKERS_STOPPED, L.WORKERS_HELD, L.HOLD_FAILED}
    local = set(L) - outcomes - {L.WENT_ON, L.WARM}
    outcomes.add(L.WORKERS_HUNG)  # seen by a hold, and while running
    assert seen[R] == {*local, *RoundEnd} - {L.ROUND_FORMED, L.JOIN_TIMED_OUT}
    waiting_events = {L.ROUND_FORMED, L.SIGNALLED, L.JOIN_TIMED_OUT}
    ends = {RoundEnd.JOB_SUCCEEDED, RoundEnd.JOB_FAILED}
    assert seen[H] == waiting_events | ends
    assert seen[J] == waiting_events | ends | {L.WARM}  # without workers: it may warm up
    assert seen[RZ] == seen[RS] == outcomes | {L.WORKERS_SUCCEEDED}
    assert seen[P] == {L.WORKERS_HELD, L.HOLD_FAILED, L.SIGNALLED}
    assert seen[OUT] == {L.WENT_ON, L.SIGNALLED}


def test_impossible_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match="preparing agent"):
        decide(P, L.ROUND_FORMED)  # not registered yet: no round can include it
    with pytest.raises(ValueError, match="joining agent"):
        decide(J, L.WORKERS_FAILED)
    with pytest.raises(ValueError, match="holding agent"):
        decide(H, RoundEnd.LOST)
    with pytest.raises(ValueError, match="running agent"):
        decide(R, L.ROUND_FORMED)
    with pytest.raises(ValueError, match="running agent"):
        decide(R, L.WORKERS_HELD)
    for state in (AgentState.SUCCEEDED, AgentState.FAILED, AgentState.LEFT):
        with pytest.raises(ValueError, match="does not observe"):
            decide(state, L.SIGNALLED)
    with pytest.raises(ValueError, match="does not observe"):
        decide(RS, L.WORKERS_FAILED)  # what a stop came to is an outcome, never a failure
    with pytest.raises(ValueError, match="does not observe"):
        decide(RZ, RoundEnd.LOST)


def test_side_effects_of_the_rows() -> None:
    failed = decide(R, L.WORKERS_FAILED)
    assert failed.report_failure and decide(R, L.WORKERS_HUNG).report_failure
    assert not decide(R, RoundEnd.PEER_FAILED).report_failure  # the peer reports its own
    assert decide(R, L.SIGNALLED).announce_leaving
    assert not decide(H, L.SIGNALLED).announce_leaving  # not a member of any round
    assert decide(R, L.WORKERS_SUCCEEDED).close_job
    assert decide(RZ, L.WORKERS_SUCCEEDED).close_job
    # leaving PREPARING, and only then, joins the job
    assert decide(P, L.WORKERS_HELD).register and decide(P, L.HOLD_FAILED).register
    assert not decide(P, L.SIGNALLED).register
    assert not any(decide(s, e, i).register for s, e, i in TABLE if s is not P)
    # going OUT, and only then, leaves the job (reported first); leaving it rejoins
    assert (
        decide(R, L.WORKERS_HUNG, True).leave and decide(R, L.WORKERS_FAILED, True).report_failure
    )
    assert decide(OUT, L.WENT_ON).rejoin and not decide(OUT, L.SIGNALLED).rejoin
    # a standby warming up leaves for good (in no round: nothing to report) and rejoins
    assert [(s, e, i) for s, e, i in TABLE if decide(s, e, i).withdraw] == [(J, L.WARM, False)]
    assert decide(J, L.WARM).rejoin and not decide(J, L.WARM).leave
    # only a lapse resumes, whatever the workers can do
    assert [(s, e, i) for s, e, i in TABLE if decide(s, e, i).resume] == [
        (R, RoundEnd.LAPSED, False)
    ]
    assert decide(R, RoundEnd.LAPSED, True).resume
    # only fencing puts the stale workers' newest step on the job's record (a raise)
    assert [(s, e, i) for s, e, i in TABLE if decide(s, e, i).record_step] == [
        (R, RoundEnd.FENCED, False)
    ]
    assert [(s, e, i) for s, e, i in TABLE if decide(s, e, i).leave] == [
        (R, L.WORKERS_FAILED, True),
        (R, L.WORKERS_HUNG, True),
        (RZ, L.HOLD_FAILED, True),
        (RS, L.HOLD_FAILED, True),
        (RZ, L.WORKERS_HUNG, True),
        (RS, L.WORKERS_HUNG, True),
    ]
    # ... reported only where the failure was its own: not holding them, unless one hung
    for s in (RZ, RS):
        for in_place in (False, True):
            assert not decide(s, L.HOLD_FAILED, in_place).report_failure
            assert decide(s, L.WORKERS_HUNG, in_place).report_failure
    plain = Reaction("x", R)
    assert not (plain.report_failure or plain.announce_leaving or plain.close_job)
    assert plain.start is Start.NONE


def test_exit_codes_and_lost_time() -> None:
    assert Exit.SUCCEEDED.code() == 0 and Exit.FAILED.code() == 1
    assert Exit.SIGNALLED.code(int(signal.SIGTERM)) == 143
    planned = {C.RESIZE, C.MEMBER_LEFT}
    for cause in RestartCause:
        assert cause.lost_as is (LostCause.RESIZE if cause in planned else LostCause.FAILURE)


# -- the docstring's table is the same table --------------------------------------------------
_STOPS = {"-": Stop.NONE, "- (gone)": Stop.NONE, "-(gone)": Stop.NONE, **{s.value: s for s in Stop}}


def _doc_rows() -> list[tuple[AgentState, str, str, str, str, str]]:
    rows = []
    assert core.__doc__ is not None
    for line in core.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0] or cells[0] == "state" or cells[0].startswith("-"):
            continue
        state, event, in_place, stop, nxt, cause = cells
        rows.append((AgentState[state], event, in_place, stop, nxt, cause))  # a/b: no/yes
    return rows


def test_the_docstring_table_is_what_decide_does() -> None:
    rows = _doc_rows()
    checked = 0
    for state, event_name, in_place, stop, nxt, cause in rows:
        event = L[event_name] if event_name in L.__members__ else RoundEnd[event_name]
        places = in_place.split("/") if in_place else ["no"]
        stops, nexts = stop.split("/"), nxt.split("/")
        for i, place in enumerate(places):
            r = decide(state, event, place == "yes")
            assert r.stop is _STOPS[stops[min(i, len(stops) - 1)]], (state, event, place)
            assert r.next is AgentState[nexts[min(i, len(nexts) - 1)]], (state, event, place)
            assert (r.cause.value if r.cause else "") == cause, (state, event, place)
            checked += 1
    assert checked == len(TABLE)  # every row of the test's table is in the docstring


@pytest.mark.parametrize("end", list(RoundEnd))
def test_only_a_graceful_change_waits_for_workers_on_their_way_into_state_run(
    end: RoundEnd,
) -> None:
    """A join, a leave announced or a stop asked waits (bounded) while workers placed in
    place, or new ones whose script imported elastic, go into State.run, where they
    re-form; anything urgent, or workers that are not on their way, is acted on at once."""
    graceful = end in (RoundEnd.WAITING, RoundEnd.LEAVING, RoundEnd.STOPPING)
    for way in (core.OnTheWay.PLACED, core.OnTheWay.STARTING):
        why = core.waits_for_live(end, way, waited=0.0)
        assert (why is not None) is graceful
        if why is not None:
            assert why.startswith(way.value) and "State.run" in why
        assert core.waits_for_live(end, way, waited=core.COMING_LIVE_S) is None
    assert core.waits_for_live(end, core.OnTheWay.NO, waited=0.0) is None
    # what it waits for is the in-place stop: a graceful change pauses live workers
    if graceful:
        assert decide(R, end, in_place=True).stop is Stop.PAUSE


@pytest.mark.parametrize("now", [None, *RoundEnd])
def test_a_pause_becomes_an_abandon_only_when_the_group_breaks_or_a_signal_comes(
    now: RoundEnd | None,
) -> None:
    """A worker asked to pause (a graceful change) that forms its group, or waits in a
    collective, never reaches a step: once a member went, its workers failed, or the job
    moved on without this node, the group is broken, and a signal means this node
    leaves. Graceful changes, a lapse (no round formed without it) and the job's success
    (its workers end their last steps) leave the pause as it is."""
    breaking = now in (
        RoundEnd.LOST,
        RoundEnd.LEFT,
        RoundEnd.PEER_FAILED,
        RoundEnd.FENCED,
        RoundEnd.SUPERSEDED,
        RoundEnd.JOB_FAILED,
    )
    why = core.escalates(now, signalled=False)
    assert (why is not None) is breaking
    if now is not None and why is not None:
        assert now.value in why
    assert core.escalates(now, signalled=True) == "a signal came"
