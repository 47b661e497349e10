"""The agent's decisions: one pure function from (state, event) to a reaction.

Every rule about what an agent does when something happens lives here, as data, and
nowhere else: ``loop.Agent`` only gathers events and carries out reactions. The table
(``decide`` implements it; ``tests/test_agent_core.py`` checks every row):

| state   | event                  | stop workers | next       | restart cause | also         |
|---------|------------------------|--------------|------------|---------------|--------------|
| JOINING | ROUND_FORMED           | -            | RUNNING    |               | start them   |
| JOINING | SIGNALLED              | -            | LEFT       |               | exit 128+sig |
| JOINING | JOB_SUCCEEDED          | -            | SUCCEEDED  |               | exit 0       |
| JOINING | JOB_FAILED             | -            | FAILED     |               | exit 1       |
| JOINING | JOIN_TIMED_OUT         | -            | FAILED     |               | exit 1       |
| RUNNING | WORKERS_SUCCEEDED      | -            | SUCCEEDED  |               | close, exit 0|
| RUNNING | WORKERS_SAVED          | - (gone)     | RESIZING   | resize        |              |
| RUNNING | WORKERS_FAILED         | urgent       | RESTARTING | failure       | report       |
| RUNNING | WORKERS_HUNG           | urgent       | RESTARTING | hang          | report       |
| RUNNING | SIGNALLED              | drain        | LEFT       |               | announce,    |
|         |                        |              |            |               | exit 128+sig |
| RUNNING | JOB_SUCCEEDED          | finish       | SUCCEEDED  |               | exit 0       |
| RUNNING | JOB_FAILED             | urgent       | FAILED     |               | exit 1       |
| RUNNING | FENCED                 | kill         | RESTARTING | fenced        |              |
| RUNNING | SUPERSEDED             | urgent       | RESTARTING | resize        |              |
| RUNNING | LOST                   | urgent       | RESTARTING | member_lost   |              |
| RUNNING | PEER_FAILED            | urgent       | RESTARTING | failure       |              |
| RUNNING | LEFT                   | urgent       | RESTARTING | member_left   |              |
| RUNNING | LEAVING                | drain        | RESIZING   | member_left   |              |
| RUNNING | STOPPING               | drain        | RESIZING   | resize        |              |
| RUNNING | WAITING                | drain        | RESIZING   | resize        |              |
| RESIZING| WORKERS_SUCCEEDED      | -            | SUCCEEDED  |               | close, exit 0|

RESIZING and RESTARTING last while the workers stop; then the agent joins the next
round (JOINING). SUCCEEDED, FAILED and LEFT are ends: the agent exits. A drain can
end in WORKERS_SUCCEEDED: ``elastic.State`` users asked to save that exit 0 instead
had already left their training loop, so the job is done; a new round would only
train again from their last snapshot.

Live workers (all alive, all in ``State.run``, ``--restart-mode live``) keep their
processes through the changes of other nodes, SUPERSEDED to WAITING: *urgent* becomes
*abandon* and *drain* becomes *pause*, and the next round re-forms them in place instead
of starting new ones. This node's own failures, signals and fencing stop them as above.

Stops: *drain* asks ``elastic.State`` users to save at their next step and exit
``EXIT_RESIZE`` (other scripts get SIGTERM, or the signal the agent got), SIGKILL after
``--shutdown-timeout``; *urgent* is SIGTERM and SIGKILL a second later (the round is
broken, there is nothing to save); *kill* is SIGKILL now (the workers are stale: the job
moved on without them); *finish* lets them end on their own (``close_timeout``). Live:
*pause* asks them to stop at their next step and wait, *abandon* to leave their process
group at once (out of a blocked collective too) and wait; either falls back to *urgent*
(and new workers) when a worker does not get there within ``--shutdown-timeout``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rendezvous.rules import RoundEnd


class AgentState(enum.Enum):
    """Where the agent is. Transitions (see the table above)::

    JOINING -> RUNNING                    a round formed with this node in it
    RUNNING -> RESIZING -> JOINING        a graceful change: workers save and stop
    RUNNING -> RESTARTING -> JOINING      the round broke: workers stop at once
    JOINING | RUNNING -> SUCCEEDED        the job finished
    JOINING | RUNNING -> FAILED           the job failed
    JOINING | RUNNING -> LEFT             a signal: this node left the job
    """

    JOINING = "joining"
    RUNNING = "running"
    RESIZING = "resizing"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LEFT = "left"


class LocalEvent(enum.Enum):
    """What the agent sees of its own node: the rendezvous, its workers, signals."""

    ROUND_FORMED = "round formed"
    JOIN_TIMED_OUT = "join timed out"
    WORKERS_SUCCEEDED = "workers succeeded"
    WORKERS_SAVED = "workers saved"  # all exited EXIT_RESIZE (or 0) after a drain
    WORKERS_FAILED = "workers failed"
    WORKERS_HUNG = "workers hung"
    SIGNALLED = "signalled"


Event = LocalEvent | RoundEnd  # RoundEnd: what the job did (rendezvous.rules.round_end)


class Stop(enum.Enum):
    """How to stop the workers (see the module doc)."""

    NONE = "none"
    FINISH = "finish"
    DRAIN = "drain"
    URGENT = "urgent"
    KILL = "kill"
    PAUSE = "pause"  # live: stop at the next step, keep the process
    ABANDON = "abandon"  # live: leave the process group now, keep the process

    @property
    def keeps_workers(self) -> bool:
        return self in (Stop.PAUSE, Stop.ABANDON)


class RestartCause(enum.Enum):
    """Why a node's workers stop and new ones follow (``elastic_run_restarts_total``)."""

    FAILURE = "failure"
    HANG = "hang"
    MEMBER_LOST = "member_lost"
    MEMBER_LEFT = "member_left"
    RESIZE = "resize"
    FENCED = "fenced"

    @property
    def lost_as(self) -> LostCause:
        """Which kind of lost time the pause counts as (``elastic_run_lost_seconds``)."""
        planned = self in (RestartCause.MEMBER_LEFT, RestartCause.RESIZE)
        return LostCause.RESIZE if planned else LostCause.FAILURE


class LostCause(enum.Enum):
    FAILURE = "failure"
    RESIZE = "resize"


class Exit(enum.Enum):
    """How the agent's process ends."""

    SUCCEEDED = "succeeded"  # 0
    FAILED = "failed"  # 1
    SIGNALLED = "signalled"  # 128 + the signal, as a shell reports a process it killed

    def code(self, signum: int = 0) -> int:
        if self is Exit.SIGNALLED:
            return 128 + signum
        return 0 if self is Exit.SUCCEEDED else 1


@dataclass(frozen=True)
class Reaction:
    """What to do about an event, and why (``why`` is for people: logs and tests)."""

    why: str
    next: AgentState
    stop: Stop = Stop.NONE
    cause: RestartCause | None = None  # charged when new workers follow
    start: bool = False  # start workers for the new round
    report_failure: bool = False  # tell the job: it charges one restart, job-wide
    announce_leaving: bool = False  # before stopping: the others drain now
    close_job: bool = False  # mark the job finished for everyone
    exit: Exit | None = None


_END = {
    RoundEnd.JOB_SUCCEEDED: (AgentState.SUCCEEDED, Exit.SUCCEEDED),
    RoundEnd.JOB_FAILED: (AgentState.FAILED, Exit.FAILED),
}

# RUNNING, a change in the job: (stop, next state, restart cause)
_CHANGES: dict[RoundEnd, tuple[Stop, AgentState, RestartCause]] = {
    RoundEnd.FENCED: (Stop.KILL, AgentState.RESTARTING, RestartCause.FENCED),
    RoundEnd.SUPERSEDED: (Stop.URGENT, AgentState.RESTARTING, RestartCause.RESIZE),
    RoundEnd.LOST: (Stop.URGENT, AgentState.RESTARTING, RestartCause.MEMBER_LOST),
    RoundEnd.PEER_FAILED: (Stop.URGENT, AgentState.RESTARTING, RestartCause.FAILURE),
    RoundEnd.LEFT: (Stop.URGENT, AgentState.RESTARTING, RestartCause.MEMBER_LEFT),
    RoundEnd.LEAVING: (Stop.DRAIN, AgentState.RESIZING, RestartCause.MEMBER_LEFT),
    RoundEnd.STOPPING: (Stop.DRAIN, AgentState.RESIZING, RestartCause.RESIZE),
    RoundEnd.WAITING: (Stop.DRAIN, AgentState.RESIZING, RestartCause.RESIZE),
}


_LIVE = {Stop.URGENT: Stop.ABANDON, Stop.DRAIN: Stop.PAUSE}


def decide(state: AgentState, event: Event, live: bool = False) -> Reaction:
    """The reaction to ``event`` in ``state``; ``live``: the workers can re-form in place.
    Raises ValueError for an event that cannot happen in that state (JOINING and
    RUNNING observe events; RESIZING only how the drain ended)."""
    if state is AgentState.JOINING:
        return _joining(event)
    if state is AgentState.RUNNING:
        return _running(event, live)
    if state is AgentState.RESIZING and event is LocalEvent.WORKERS_SUCCEEDED:
        return Reaction(
            "the workers finished training before they could stop for the resize",
            AgentState.SUCCEEDED,
            close_job=True,
            exit=Exit.SUCCEEDED,
        )
    raise ValueError(f"an agent in state {state.name} does not observe {event}")


def _joining(event: Event) -> Reaction:
    match event:
        case LocalEvent.ROUND_FORMED:
            return Reaction("a round formed with this node in it", AgentState.RUNNING, start=True)
        case LocalEvent.SIGNALLED:
            return Reaction("signalled while joining: leave", AgentState.LEFT, exit=Exit.SIGNALLED)
        case LocalEvent.JOIN_TIMED_OUT:
            return Reaction(
                "too few nodes within join_timeout", AgentState.FAILED, exit=Exit.FAILED
            )
        case RoundEnd.JOB_SUCCEEDED | RoundEnd.JOB_FAILED:
            next_state, end = _END[event]
            return Reaction(f"the {event.value} while this node joined", next_state, exit=end)
    raise ValueError(f"a joining agent cannot see {event}")


def _running(event: Event, live: bool) -> Reaction:
    match event:
        case LocalEvent.WORKERS_SUCCEEDED:
            return Reaction(
                "all local workers succeeded: the job is done",
                AgentState.SUCCEEDED,
                close_job=True,
                exit=Exit.SUCCEEDED,
            )
        case LocalEvent.WORKERS_SAVED:
            return Reaction(
                "workers saved their state and stopped for a resize",
                AgentState.RESIZING,
                cause=RestartCause.RESIZE,
            )
        case LocalEvent.WORKERS_FAILED | LocalEvent.WORKERS_HUNG:
            hung = event is LocalEvent.WORKERS_HUNG
            return Reaction(
                "a worker hung" if hung else "a worker failed",
                AgentState.RESTARTING,
                stop=Stop.URGENT,
                cause=RestartCause.HANG if hung else RestartCause.FAILURE,
                report_failure=True,
            )
        case LocalEvent.SIGNALLED:
            return Reaction(
                "signalled: this node leaves the job",
                AgentState.LEFT,
                stop=Stop.DRAIN,
                announce_leaving=True,
                exit=Exit.SIGNALLED,
            )
        case RoundEnd.JOB_SUCCEEDED:
            return Reaction(
                "another node finished the job: let local workers finish",
                AgentState.SUCCEEDED,
                stop=Stop.FINISH,
                exit=Exit.SUCCEEDED,
            )
        case RoundEnd.JOB_FAILED:
            return Reaction(
                "the job failed elsewhere", AgentState.FAILED, stop=Stop.URGENT, exit=Exit.FAILED
            )
        case RoundEnd():
            stop, next_state, cause = _CHANGES[event]
            if live and stop in _LIVE:
                how = "workers leave the group now" if event.urgent else "workers pause"
                return Reaction(
                    f"{event.value}: {how}, to re-form live",
                    next_state,
                    stop=_LIVE[stop],
                    cause=cause,
                )
            how = "stop workers now" if event.urgent else "workers save and stop"
            return Reaction(f"{event.value}: {how}", next_state, stop=stop, cause=cause)
    raise ValueError(f"a running agent cannot see {event}")
