"""The agent's decisions: one pure function from (state, event) to a reaction.

Every rule about what an agent does when something happens lives here, as data, and
nowhere else: ``loop.Agent`` only gathers events and carries out reactions. The table
(``decide`` implements it; ``tests/test_agent_core.py`` checks every row). *in place*:
the workers can re-form in place (all alive, all in ``State.run``, ``--restart-mode
live``), the input ``decide`` takes besides the state and the event; for this node's own
failure, and for workers that could not be held, that the others can go on in place
without it (``lobby.step_out``).

| state      | event             | in place | stop           | next           | cause       |
|------------|-------------------|----------|----------------|----------------|-------------|
| PREPARING  | WORKERS_HELD      |          | -              | HOLDING        |             |
| PREPARING  | HOLD_FAILED       |          | kill           | JOINING        |             |
| PREPARING  | SIGNALLED         |          | kill           | LEFT           |             |
| JOINING    | ROUND_FORMED      |          | -              | RUNNING        |             |
| JOINING    | SIGNALLED         |          | -              | LEFT           |             |
| JOINING    | JOB_SUCCEEDED     |          | -              | SUCCEEDED      |             |
| JOINING    | JOB_FAILED        |          | -              | FAILED         |             |
| JOINING    | JOIN_TIMED_OUT    |          | -              | FAILED         |             |
| JOINING    | WARM              |          | -              | JOINING        |             |
| HOLDING    | ROUND_FORMED      | yes      | -              | RUNNING        |             |
| HOLDING    | ROUND_FORMED      | no       | kill           | RUNNING        |             |
| HOLDING    | SIGNALLED         |          | drain          | LEFT           |             |
| HOLDING    | JOB_SUCCEEDED     |          | urgent         | SUCCEEDED      |             |
| HOLDING    | JOB_FAILED        |          | urgent         | FAILED         |             |
| HOLDING    | JOIN_TIMED_OUT    |          | urgent         | FAILED         |             |
| RUNNING    | WORKERS_SUCCEEDED |          | -              | SUCCEEDED      |             |
| RUNNING    | WORKERS_SAVED     |          | - (gone)       | RESIZING       | resize      |
| RUNNING    | WORKERS_FAILED    | no/yes   | urgent         | RESTARTING/OUT | failure     |
| RUNNING    | WORKERS_HUNG      | no/yes   | urgent         | RESTARTING/OUT | hang        |
| RUNNING    | SIGNALLED         |          | drain          | LEFT           |             |
| RUNNING    | JOB_SUCCEEDED     |          | finish         | SUCCEEDED      |             |
| RUNNING    | JOB_DONE_WITHOUT  |          | kill           | SUCCEEDED      |             |
| RUNNING    | JOB_FAILED        |          | urgent         | FAILED         |             |
| RUNNING    | FENCED            |          | kill           | RESTARTING     | fenced      |
| RUNNING    | LAPSED            |          | -              | RUNNING        |             |
| RUNNING    | SUPERSEDED        | no/yes   | urgent/abandon | RESTARTING     | resize      |
| RUNNING    | LOST              | no/yes   | urgent/abandon | RESTARTING     | member_lost |
| RUNNING    | PEER_FAILED       | no/yes   | urgent/abandon | RESTARTING     | failure     |
| RUNNING    | LEFT              | no/yes   | urgent/abandon | RESTARTING     | member_left |
| RUNNING    | LEAVING           | no/yes   | drain/pause    | RESIZING       | member_left |
| RUNNING    | STOPPING          | no/yes   | drain/pause    | RESIZING       | resize      |
| RUNNING    | WAITING           | no/yes   | drain/pause    | RESIZING       | resize      |
| RESIZING   | WORKERS_STOPPED   |          | -              | JOINING        |             |
| RESIZING   | WORKERS_SUCCEEDED |          | -              | SUCCEEDED      |             |
| RESIZING   | WORKERS_HELD      |          | -              | HOLDING        |             |
| RESIZING   | HOLD_FAILED       | no       | urgent         | JOINING        |             |
| RESIZING   | HOLD_FAILED       | yes      | urgent         | OUT            |             |
| RESIZING   | WORKERS_HUNG      | no/yes   | urgent         | JOINING/OUT    | hang        |
| RESTARTING | WORKERS_STOPPED   |          | -              | JOINING        |             |
| RESTARTING | WORKERS_SUCCEEDED |          | -              | SUCCEEDED      |             |
| RESTARTING | WORKERS_HELD      |          | -              | HOLDING        |             |
| RESTARTING | HOLD_FAILED       | no       | urgent         | JOINING        |             |
| RESTARTING | HOLD_FAILED       | yes      | urgent         | OUT            |             |
| RESTARTING | WORKERS_HUNG      | no/yes   | urgent         | JOINING/OUT    | hang        |
| OUT        | WENT_ON           |          | -              | JOINING        |             |
| OUT        | SIGNALLED         |          | -              | LEFT           |             |

Besides: leaving PREPARING registers this node in the job; ROUND_FORMED starts new
workers (JOINING; HOLDING when a held worker died, after killing the rest) or re-forms
the held ones in place; WORKERS_FAILED and WORKERS_HUNG report the failure to the job
(one restart, job-wide), and, going OUT, leave it; leaving OUT joins again as a
newcomer (its workers started ahead where they can be); RUNNING | SIGNALLED announces
that this node leaves (the loop holds a signal back while the node hands the job's
newest state, which it alone holds, to a node joining: ``handover``);
WORKERS_SUCCEEDED closes the job; JOINING | WARM (a standby that registered without
workers, before the job's workers re-formed in place) steps back and joins again with
its workers started ahead (``lobby.warm_up``); RUNNING | LAPSED (etcd dropped this
node's lease in an outage, but no round formed without it) resumes the node as it was,
on a new lease, and its workers train on. The ends exit: SUCCEEDED 0, FAILED 1, LEFT 128 + the
signal.

OUT: this node's own worker failed or hung (or, as a change re-forms the round, could
not be held), and the others go on in place without it (``lobby.step_out``): it reported
the failure (not a failed hold, which was not its own, unless a worker hung in it),
left the job, and waits
until they have re-formed (WENT_ON; or too few of them are left to, or a bound passed,
or the job ended), then joins again as a newcomer, its new workers started ahead
(PREPARING) where they can be.
PREPARING is a newcomer's first state when its workers start before it joins
(``lobby``): it observes only them and signals, until they all wait for their placement
(WORKERS_HELD: join with them held) or one exits or ``lobby.LOBBY_MAX`` passes
(HOLD_FAILED: join without them). A round that places them otherwise than they were
started is, for HOLDING, a round they cannot re-form in place.
JOINING, HOLDING and RUNNING observe the job, the workers and signals. RESIZING and
RESTARTING last while the workers stop (or, in place, let go of their process group);
what the stop came to is their event. SUCCEEDED, FAILED and LEFT are ends: the agent
exits. HOLDING is JOINING with the workers held: they left their process group and wait
for their placement in the next round, which re-forms them in place, unless one of them
died meanwhile (then new workers follow).

A drain or a hold can end in WORKERS_SUCCEEDED: ``elastic.State`` users asked to save,
or to let go of their group, that all exit 0 instead had already left their training
loop (the ask came in their last step), so the job is done; a new round would only train
again from their last snapshot. HOLD_FAILED: a worker did not let go within
``--shutdown-timeout``, said it is stuck in a send only its group's timeout ends, or
exited otherwise; new workers follow. Where the others can go on in place without this
node, it steps out (OUT) rather than have them wait for its new workers' start: nothing
is reported (the failure was not its own), and it joins again with them started ahead.
WORKERS_HUNG while stopping: a worker hung (by the rule learned from its steps) as it was
asked to let go; that is this node's own fault, whatever the change that asked, so it is
reported and charged as a hang in RUNNING is, and otherwise handled as HOLD_FAILED.

Stops: *drain* asks ``elastic.State`` users to save at their next step and exit
``EXIT_RESIZE`` (other scripts get SIGTERM, or the signal the agent got), SIGKILL after
``--shutdown-timeout``; held workers save and exit at once. *urgent* is SIGTERM and
SIGKILL a second later (the round is broken, there is nothing to save); *kill* is
SIGKILL now (the workers are stale: the job moved on without them; ``elastic.State``
users waiting out of their group save their last committed step first, at once);
*finish* lets them end on their own (``close_timeout``). In place: *pause* asks them to
stop at their next step and wait, *abandon* to leave their process group at once (out of
a blocked collective too) and wait. This node's own failures, signals and fencing always
stop them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rendezvous.rules import RoundEnd


class AgentState(enum.Enum):
    """Where the agent is. Transitions (see the table above)::

    PREPARING -> HOLDING | JOINING        a newcomer's workers, started ahead, wait or not
    RUNNING -> OUT -> PREPARING | JOINING its own worker failed: out until the others
                                          re-formed, then back as a newcomer
    JOINING -> RUNNING                    a round formed with this node in it
    RUNNING -> RESIZING -> JOINING        a graceful change: workers save and stop
    RUNNING -> RESTARTING -> JOINING      the round broke: workers stop at once
    RUNNING -> RESIZING | RESTARTING -> HOLDING -> RUNNING
                                          in place: the workers let go of their group,
                                          wait, and form the next round's
    JOINING | HOLDING | RUNNING -> SUCCEEDED | FAILED | LEFT
                                          the job finished or failed; a signal
    """

    PREPARING = "preparing"  # a newcomer's workers start before it joins (lobby.py)
    JOINING = "joining"
    HOLDING = "holding"  # joining, with the workers held for the next round
    RUNNING = "running"
    RESIZING = "resizing"
    RESTARTING = "restarting"
    OUT = "out"  # its own worker failed: out of the job until the others re-formed
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
    # what a stop came to (RESIZING, RESTARTING)
    WORKERS_STOPPED = "workers stopped"  # they are gone
    WORKERS_HELD = "workers held"  # they let go of their group and wait for a placement
    HOLD_FAILED = "hold failed"  # one did not let go in time, or exited
    WENT_ON = "went on"  # OUT: the others re-formed without this node (or did not in time)
    WARM = "warm"  # JOINING: a standby without workers can start them ahead (lobby.warm_up)


Event = LocalEvent | RoundEnd  # RoundEnd: what the job did (rendezvous.rules.round_end)


class Stop(enum.Enum):
    """How to stop the workers (see the module doc)."""

    NONE = "none"
    FINISH = "finish"
    DRAIN = "drain"
    URGENT = "urgent"
    KILL = "kill"
    PAUSE = "pause"  # in place: stop at the next step, keep the process
    ABANDON = "abandon"  # in place: leave the process group now, keep the process

    @property
    def keeps_workers(self) -> bool:
        return self in (Stop.PAUSE, Stop.ABANDON)


class Start(enum.Enum):
    """What a round that formed does with the workers."""

    NONE = "none"
    NEW = "new"  # start new worker processes
    REFORM = "reform"  # publish the placements: the held workers re-form in place


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
    start: Start = Start.NONE
    report_failure: bool = False  # tell the job: it charges one restart, job-wide
    announce_leaving: bool = False  # before stopping: the others drain now
    close_job: bool = False  # mark the job finished for everyone
    register: bool = False  # join the job now (a newcomer whose workers started ahead)
    leave: bool = False  # leave the job for now, reported (OUT: it joins again later)
    rejoin: bool = False  # join again as a newcomer, its workers started ahead if they can
    withdraw: bool = False  # leave the job for good (not a member: nothing changes), to rejoin
    resume: bool = False  # carry on this node's incarnation on a new lease (see LAPSED)
    # after the stop: the workers' newest step goes on the job's record where it says less
    # (fenced: the job went on without them, and their step may be in no record)
    record_step: bool = False
    exit: Exit | None = None


_END = {
    RoundEnd.JOB_SUCCEEDED: (AgentState.SUCCEEDED, Exit.SUCCEEDED),
    RoundEnd.JOB_FAILED: (AgentState.FAILED, Exit.FAILED),
}

# RUNNING, a change in the job: (stop, next state, restart cause)
_CHANGES: dict[RoundEnd, tuple[Stop, AgentState, RestartCause]] = {
    RoundEnd.SUPERSEDED: (Stop.URGENT, AgentState.RESTARTING, RestartCause.RESIZE),
    RoundEnd.LOST: (Stop.URGENT, AgentState.RESTARTING, RestartCause.MEMBER_LOST),
    RoundEnd.PEER_FAILED: (Stop.URGENT, AgentState.RESTARTING, RestartCause.FAILURE),
    RoundEnd.LEFT: (Stop.URGENT, AgentState.RESTARTING, RestartCause.MEMBER_LEFT),
    RoundEnd.LEAVING: (Stop.DRAIN, AgentState.RESIZING, RestartCause.MEMBER_LEFT),
    RoundEnd.STOPPING: (Stop.DRAIN, AgentState.RESIZING, RestartCause.RESIZE),
    RoundEnd.WAITING: (Stop.DRAIN, AgentState.RESIZING, RestartCause.RESIZE),
}


_IN_PLACE = {Stop.URGENT: Stop.ABANDON, Stop.DRAIN: Stop.PAUSE}

# How long a graceful change (a join, a leave announced, a stop asked) waits for workers
# on their way into State.run (``OnTheWay``). Once there they re-form in place; stopped,
# they would cost the job a worker start (3-9 s with spawn on a busy host) with every
# member waiting for it. A script that never goes into State.run is stopped as before,
# this much later (one that trains outside it says so at its first step, and is stopped
# then).
COMING_LIVE_S = 10.0


class OnTheWay(enum.Enum):
    """Workers, all alive, not in State.run yet but on their way there."""

    NO = "no"
    # a newcomer's, started ahead and placed in place: between the first group their
    # init_process_group formed and State.run (building the model, DDP)
    PLACED = "the workers placed in place are on their way into State.run"
    # new in this round (live mode), their script imported elastic or this node's workers
    # went into State.run before: importing torch, forming the round's group, building
    # the model (stopped for a join as they start, they start again: chaos seed 58 had
    # rounds of new workers, each replaced by the next change, 57 s without a step)
    STARTING = "the workers, new in this round, are on their way into State.run"


def waits_for_live(end: RoundEnd, on_the_way: OnTheWay, waited: float) -> str | None:
    """Why the running agent does not act on ``end`` yet (None: it acts now); ``waited``:
    seconds since it first saw ``end``. An urgent change never waits: the round is
    broken, and the workers are asked to leave it, which they do in State.run (new ones
    that are not there yet cannot: they are replaced)."""
    change = _CHANGES.get(end)
    if change is None or change[0] is not Stop.DRAIN or on_the_way is OnTheWay.NO:
        return None
    if waited >= COMING_LIVE_S:
        return None
    return (
        f"{on_the_way.value}: they re-form there, not anew (waited {waited:.1f} of "
        f"{COMING_LIVE_S:.0f}s for a {end.value} change)"
    )


# changes that leave the group the workers form or train in broken, while they were
# asked to pause for a graceful one
_BREAKING = (
    RoundEnd.LOST,
    RoundEnd.LEFT,
    RoundEnd.PEER_FAILED,
    RoundEnd.FENCED,
    RoundEnd.SUPERSEDED,
    RoundEnd.JOB_FAILED,
)


def escalates(now: RoundEnd | None, signalled: bool) -> str | None:
    """Why a pause the workers were asked for (a graceful change) becomes an abandon
    while it is waited for (None: it stays a pause): a worker that forms its group, or
    waits in a collective on a peer that is gone, never reaches a step to pause at. So:
    a signal came (this node leaves: its workers save once out of their group), or the
    job now shows a change ``now`` that breaks the group (a member went, its workers
    failed, the job moved on without this node)."""
    if signalled:
        return "a signal came"
    if now in _BREAKING:
        assert now is not None
        return f"the round broke meanwhile ({now.value})"
    return None


def decide(state: AgentState, event: Event, in_place: bool = False) -> Reaction:
    """The reaction to ``event`` in ``state``; ``in_place``: the workers can re-form in
    place. Raises ValueError for an event that cannot happen in that state."""
    match state:
        case AgentState.PREPARING:
            return _preparing(event)
        case AgentState.JOINING:
            return _joining(event)
        case AgentState.HOLDING:
            return _holding(event, in_place)
        case AgentState.RUNNING:
            return _running(event, in_place)
        case AgentState.RESIZING | AgentState.RESTARTING:
            return _stopping(state, event, in_place)
        case AgentState.OUT:
            return _out(event)
    raise ValueError(f"an agent in state {state.name} does not observe {event}")


def _preparing(event: Event) -> Reaction:
    match event:
        case LocalEvent.WORKERS_HELD:
            return Reaction(
                "the workers started ahead wait for their placement: join with them held",
                AgentState.HOLDING,
                register=True,
            )
        case LocalEvent.HOLD_FAILED:
            return Reaction(
                "the workers started ahead are not ready: stop them, join without them",
                AgentState.JOINING,
                stop=Stop.KILL,
                register=True,
            )
        case LocalEvent.SIGNALLED:
            return Reaction(
                "signalled before joining: the workers started ahead stop (nothing to save)",
                AgentState.LEFT,
                stop=Stop.KILL,
                exit=Exit.SIGNALLED,
            )
    raise ValueError(f"a preparing agent cannot see {event}")


def _joining(event: Event) -> Reaction:
    match event:
        case LocalEvent.ROUND_FORMED:
            return Reaction(
                "a round formed with this node in it", AgentState.RUNNING, start=Start.NEW
            )
        case LocalEvent.SIGNALLED:
            return Reaction("signalled while joining: leave", AgentState.LEFT, exit=Exit.SIGNALLED)
        case LocalEvent.JOIN_TIMED_OUT:
            return Reaction(
                "too few nodes within join_timeout", AgentState.FAILED, exit=Exit.FAILED
            )
        case LocalEvent.WARM:
            return Reaction(
                "a standby without workers, in a job whose workers re-form in place: it "
                "steps back, starts them ahead and joins again with them, so that taking a "
                "lost member's place costs the others no start-up",
                AgentState.JOINING,
                withdraw=True,
                rejoin=True,
            )
        case RoundEnd.JOB_SUCCEEDED | RoundEnd.JOB_FAILED:
            next_state, end = _END[event]
            return Reaction(f"the {event.value} while this node joined", next_state, exit=end)
    raise ValueError(f"a joining agent cannot see {event}")


def _holding(event: Event, in_place: bool) -> Reaction:
    match event:
        case LocalEvent.ROUND_FORMED if in_place:
            return Reaction(
                "a round formed: the held workers re-form in place",
                AgentState.RUNNING,
                start=Start.REFORM,
            )
        case LocalEvent.ROUND_FORMED:
            return Reaction(
                "a round formed, but a held worker exited meanwhile (or, started ahead, "
                "was placed otherwise): new workers follow",
                AgentState.RUNNING,
                stop=Stop.KILL,
                start=Start.NEW,
            )
        case LocalEvent.SIGNALLED:
            return Reaction(
                "signalled while holding the workers: they save and exit, this node leaves",
                AgentState.LEFT,
                stop=Stop.DRAIN,
                exit=Exit.SIGNALLED,
            )
        case LocalEvent.JOIN_TIMED_OUT:
            return Reaction(
                "too few nodes within join_timeout: the held workers stop",
                AgentState.FAILED,
                stop=Stop.URGENT,
                exit=Exit.FAILED,
            )
        case RoundEnd.JOB_SUCCEEDED | RoundEnd.JOB_FAILED:
            next_state, end = _END[event]
            return Reaction(
                f"the {event.value} while the workers were held: they stop",
                next_state,
                stop=Stop.URGENT,
                exit=end,
            )
    raise ValueError(f"a holding agent cannot see {event}")


def _stopping(state: AgentState, event: Event, in_place: bool) -> Reaction:
    match event:
        case LocalEvent.WORKERS_STOPPED:
            return Reaction("the workers stopped: join the next round", AgentState.JOINING)
        case LocalEvent.WORKERS_HELD:
            return Reaction(
                "the workers let go of their group: join the next round with them",
                AgentState.HOLDING,
            )
        case LocalEvent.HOLD_FAILED if in_place:
            return Reaction(
                "the workers could not be held: this node steps out while the others go "
                "on, and joins again with new workers",
                AgentState.OUT,
                stop=Stop.URGENT,
                leave=True,
            )
        case LocalEvent.HOLD_FAILED:
            return Reaction(
                "the workers could not be held: stop them, new workers follow",
                AgentState.JOINING,
                stop=Stop.URGENT,
            )
        case LocalEvent.WORKERS_HUNG:
            return Reaction(
                "a worker hung as the workers were to let go: it is this node's own fault "
                + (
                    "(reported): this node steps out while the others go on"
                    if in_place
                    else "(reported): stop them, new workers follow"
                ),
                AgentState.OUT if in_place else AgentState.JOINING,
                stop=Stop.URGENT,
                cause=RestartCause.HANG,
                report_failure=True,
                leave=in_place,
            )
        case LocalEvent.WORKERS_SUCCEEDED:
            return Reaction(
                "the workers finished training before they could stop or let go",
                AgentState.SUCCEEDED,
                close_job=True,
                exit=Exit.SUCCEEDED,
            )
    raise ValueError(f"an agent in state {state.name} does not observe {event}")


def _out(event: Event) -> Reaction:
    match event:
        case LocalEvent.WENT_ON:
            return Reaction(
                "the others went on without this node: it joins again as a newcomer",
                AgentState.JOINING,
                rejoin=True,
            )
        case LocalEvent.SIGNALLED:
            return Reaction(
                "signalled while out of the job: leave", AgentState.LEFT, exit=Exit.SIGNALLED
            )
    raise ValueError(f"an agent out of the job cannot see {event}")


def _running(event: Event, in_place: bool) -> Reaction:
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
            what = "a worker hung" if hung else "a worker failed"
            return Reaction(
                f"{what}: this node steps out while the others go on" if in_place else what,
                AgentState.OUT if in_place else AgentState.RESTARTING,
                stop=Stop.URGENT,
                cause=RestartCause.HANG if hung else RestartCause.FAILURE,
                report_failure=True,
                leave=in_place,
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
        case RoundEnd.JOB_DONE_WITHOUT:
            return Reaction(
                "a round formed without this node finished the job: its workers' round is "
                "gone, they stop now",
                AgentState.SUCCEEDED,
                stop=Stop.KILL,
                exit=Exit.SUCCEEDED,
            )
        case RoundEnd.JOB_FAILED:
            return Reaction(
                "the job failed elsewhere", AgentState.FAILED, stop=Stop.URGENT, exit=Exit.FAILED
            )
        case RoundEnd.LAPSED:
            return Reaction(
                "etcd dropped this node's lease, but the job did not move on: it resumes, "
                "its workers train on",
                AgentState.RUNNING,
                resume=True,
            )
        case RoundEnd.FENCED:
            return Reaction(
                "fenced: stop the stale workers now, and join again",
                AgentState.RESTARTING,
                stop=Stop.KILL,
                cause=RestartCause.FENCED,
                record_step=True,
            )
        case RoundEnd():
            stop, next_state, cause = _CHANGES[event]
            if in_place and stop in _IN_PLACE:
                how = "workers leave the group now" if event.urgent else "workers pause"
                return Reaction(
                    f"{event.value}: {how}, to re-form in place",
                    next_state,
                    stop=_IN_PLACE[stop],
                    cause=cause,
                )
            how = "stop workers now" if event.urgent else "workers save and stop"
            return Reaction(f"{event.value}: {how}", next_state, stop=stop, cause=cause)
    raise ValueError(f"a running agent cannot see {event}")
