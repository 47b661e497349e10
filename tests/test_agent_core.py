"""The agent's decision table, row by row, against the pure ``decide``."""

from __future__ import annotations

import signal

import pytest

from elastic.agent.core import (
    AgentState,
    Exit,
    LocalEvent,
    LostCause,
    Reaction,
    RestartCause,
    Stop,
    decide,
)
from rendezvous.rules import RoundEnd

J, R = AgentState.JOINING, AgentState.RUNNING

# (state, event) -> (stop, next state, restart cause, exit)
TABLE = {
    (J, LocalEvent.ROUND_FORMED): (Stop.NONE, R, None, None),
    (J, LocalEvent.SIGNALLED): (Stop.NONE, AgentState.LEFT, None, Exit.SIGNALLED),
    (J, LocalEvent.JOIN_TIMED_OUT): (Stop.NONE, AgentState.FAILED, None, Exit.FAILED),
    (J, RoundEnd.JOB_SUCCEEDED): (Stop.NONE, AgentState.SUCCEEDED, None, Exit.SUCCEEDED),
    (J, RoundEnd.JOB_FAILED): (Stop.NONE, AgentState.FAILED, None, Exit.FAILED),
    (R, LocalEvent.WORKERS_SUCCEEDED): (Stop.NONE, AgentState.SUCCEEDED, None, Exit.SUCCEEDED),
    (R, LocalEvent.WORKERS_SAVED): (Stop.NONE, AgentState.RESIZING, RestartCause.RESIZE, None),
    (R, LocalEvent.WORKERS_FAILED): (
        Stop.URGENT,
        AgentState.RESTARTING,
        RestartCause.FAILURE,
        None,
    ),
    (R, LocalEvent.WORKERS_HUNG): (Stop.URGENT, AgentState.RESTARTING, RestartCause.HANG, None),
    (R, LocalEvent.SIGNALLED): (Stop.DRAIN, AgentState.LEFT, None, Exit.SIGNALLED),
    (R, RoundEnd.JOB_SUCCEEDED): (Stop.FINISH, AgentState.SUCCEEDED, None, Exit.SUCCEEDED),
    (R, RoundEnd.JOB_FAILED): (Stop.URGENT, AgentState.FAILED, None, Exit.FAILED),
    (R, RoundEnd.FENCED): (Stop.KILL, AgentState.RESTARTING, RestartCause.FENCED, None),
    (R, RoundEnd.SUPERSEDED): (Stop.URGENT, AgentState.RESTARTING, RestartCause.RESIZE, None),
    (R, RoundEnd.LOST): (Stop.URGENT, AgentState.RESTARTING, RestartCause.MEMBER_LOST, None),
    (R, RoundEnd.PEER_FAILED): (Stop.URGENT, AgentState.RESTARTING, RestartCause.FAILURE, None),
    (R, RoundEnd.LEFT): (Stop.URGENT, AgentState.RESTARTING, RestartCause.MEMBER_LEFT, None),
    (R, RoundEnd.LEAVING): (Stop.DRAIN, AgentState.RESIZING, RestartCause.MEMBER_LEFT, None),
    (R, RoundEnd.STOPPING): (Stop.DRAIN, AgentState.RESIZING, RestartCause.RESIZE, None),
    (R, RoundEnd.WAITING): (Stop.DRAIN, AgentState.RESIZING, RestartCause.RESIZE, None),
    # a drain for a resize that the workers answered by finishing
    (AgentState.RESIZING, LocalEvent.WORKERS_SUCCEEDED): (
        Stop.NONE,
        AgentState.SUCCEEDED,
        None,
        Exit.SUCCEEDED,
    ),
}


@pytest.mark.parametrize(("state", "event"), list(TABLE), ids=lambda x: getattr(x, "name", x))
def test_every_row(state: AgentState, event: LocalEvent | RoundEnd) -> None:
    r = decide(state, event)
    assert (r.stop, r.next, r.cause, r.exit) == TABLE[state, event]
    assert r.why  # every reaction says why, for the log


def test_the_table_covers_every_event_a_running_agent_can_see() -> None:
    seen = {e for (s, e) in TABLE if s is R}
    assert seen == {*LocalEvent, *RoundEnd} - {LocalEvent.ROUND_FORMED, LocalEvent.JOIN_TIMED_OUT}


def test_impossible_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match="joining agent"):
        decide(J, LocalEvent.WORKERS_FAILED)
    with pytest.raises(ValueError, match="running agent"):
        decide(R, LocalEvent.ROUND_FORMED)
    for state in set(AgentState) - {J, R}:
        with pytest.raises(ValueError, match="does not observe"):
            decide(state, LocalEvent.SIGNALLED)
    with pytest.raises(ValueError, match="does not observe"):
        decide(AgentState.RESIZING, LocalEvent.WORKERS_SAVED)


def test_side_effects_of_the_rows() -> None:
    assert decide(J, LocalEvent.ROUND_FORMED).start
    failed = decide(R, LocalEvent.WORKERS_FAILED)
    assert failed.report_failure and decide(R, LocalEvent.WORKERS_HUNG).report_failure
    assert not decide(R, RoundEnd.PEER_FAILED).report_failure  # the peer reports its own
    assert decide(R, LocalEvent.SIGNALLED).announce_leaving
    assert decide(R, LocalEvent.WORKERS_SUCCEEDED).close_job
    assert decide(AgentState.RESIZING, LocalEvent.WORKERS_SUCCEEDED).close_job
    plain = Reaction("x", R)
    assert not (plain.start or plain.report_failure or plain.announce_leaving or plain.close_job)


def test_exit_codes_and_lost_time() -> None:
    assert Exit.SUCCEEDED.code() == 0 and Exit.FAILED.code() == 1
    assert Exit.SIGNALLED.code(int(signal.SIGTERM)) == 143
    planned = {RestartCause.RESIZE, RestartCause.MEMBER_LEFT}
    for cause in RestartCause:
        assert cause.lost_as is (LostCause.RESIZE if cause in planned else LostCause.FAILURE)


# with live workers, the changes of other nodes keep them: (stop) instead of TABLE's
LIVE = {
    RoundEnd.SUPERSEDED: Stop.ABANDON,
    RoundEnd.LOST: Stop.ABANDON,
    RoundEnd.PEER_FAILED: Stop.ABANDON,
    RoundEnd.LEFT: Stop.ABANDON,
    RoundEnd.LEAVING: Stop.PAUSE,
    RoundEnd.STOPPING: Stop.PAUSE,
    RoundEnd.WAITING: Stop.PAUSE,
}


@pytest.mark.parametrize(("state", "event"), list(TABLE), ids=lambda x: getattr(x, "name", x))
def test_every_row_with_live_workers(state: AgentState, event: LocalEvent | RoundEnd) -> None:
    """Only the changes of other nodes differ; this node's own events stop its workers."""
    r = decide(state, event, live=True)
    stop, next_state, cause, end = TABLE[state, event]
    expected = LIVE.get(event, stop) if state is R else stop
    assert (r.stop, r.next, r.cause, r.exit) == (expected, next_state, cause, end)
    assert r.stop.keeps_workers == (state is R and event in LIVE)
