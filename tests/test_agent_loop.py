"""The agent loop with a fake rendezvous and a fake worker group: events in, actions out.

Each fake takes a script (what the job and the workers do, in order) and records what the
agent asked of it, so a test reads as: this happened, the agent did that.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from elastic.agent import lobby, loop
from elastic.agent.core import AgentState
from elastic.agent.failures import FailureReport, WorkerFailure
from elastic.agent.loop import Agent
from elastic.agent.metrics import AgentMetrics
from elastic.agent.placement import Placement, round_env
from elastic.agent.storehost import StoreError
from elastic.agent.workers import Drained, GroupState, Held
from rendezvous.errors import (
    RendezvousCancelled,
    RendezvousClosedError,
    RendezvousTimeoutError,
)
from rendezvous.records import (
    ClosedRecord,
    JobOutcome,
    Member,
    NodeRecord,
    ProgressRecord,
    RoundCause,
    RoundRecord,
)
from rendezvous.rules import Change, RoundEnd
from rendezvous.view import Glance


def round_of(
    number: int,
    *nodes: str,
    restarts: int = 0,
    cause: RoundCause = RoundCause.START,
    joined: tuple[str, ...] = (),
) -> RoundRecord:
    members = tuple(Member(n, i + 1, "10.0.0.1", 2) for i, n in enumerate(nodes))
    return RoundRecord(
        number, members, "10.0.0.1", 29500 + number, 0, restarts, cause, joined=joined
    )


class FakeJob:
    """The rendezvous: ``rounds`` are what next_round returns (or raises), in order;
    ``changes`` what check() returns on successive calls (None: nothing happened)."""

    def __init__(self, rounds: list[Any], changes: list[Change | None] | None = None) -> None:
        self.rounds = deque(rounds)
        self.changes = deque(changes or [])
        self.calls: list[str] = []
        self.reported: list[FailureReport] = []
        self.closed_as: list[JobOutcome] = []
        self.closed_record: ClosedRecord | None = None
        self.glances: deque[Glance] = deque()  # successive glance() results, then glance_view

    node_id = "a"
    run_id = "job"
    version = 0
    lease_ttl = 1
    alive_at = 0.0
    leads = False

    glance_view = Glance()  # what the job looks like before registering
    in_place_said: list[bool] = []

    def glance(self, timeout: float | None = None) -> Glance:
        self.calls.append("glance")
        return self.glances.popleft() if self.glances else self.glance_view

    present = 0  # nodes but this one registered or on their way

    def announce_arrival(self) -> None:
        self.calls.append("announce_arrival")

    def others(self) -> int:
        return self.present

    def start(self, cancel: threading.Event | None = None) -> None:
        self.calls.append("start")
        if self.rounds and isinstance(self.rounds[0], RendezvousClosedError):
            raise self.rounds.popleft()

    def announce_in_place(self, in_place: bool) -> None:
        self.in_place_said = [*self.in_place_said, in_place]

    recorded: ProgressRecord | None = None  # the job's progress as etcd holds it
    progress_said: list[tuple[int, bool]] = []  # (step, final: as the node leaves)
    progress_raised: list[int] = []  # fenced: over an older record only

    def report_progress(self, step: int, final: bool = False) -> None:
        self.progress_said = [*self.progress_said, (step, final)]

    def raise_progress(self, step: int, final: bool = False) -> None:
        self.progress_raised = [*self.progress_raised, step]

    def progress(self) -> ProgressRecord | None:
        return self.recorded

    def next_round(
        self,
        cancel: threading.Event | None = None,
        timeout: float | None = None,
        wake: Callable[[], bool] | None = None,
    ) -> RoundRecord:
        self.calls.append("next_round")
        if wake is not None and wake():
            raise RendezvousCancelled("woken while waiting for the next round")
        step = self.rounds.popleft()
        if isinstance(step, Exception):
            raise step
        return step  # type: ignore[no-any-return]

    def upkeep(self) -> None:
        pass

    def check(self) -> Change | None:
        return self.changes.popleft() if self.changes else None

    resumes: deque[bool] = deque()  # successive resume() results (then True)

    def resume(self) -> bool:
        self.calls.append("resume")
        return self.resumes.popleft() if self.resumes else True

    def probe_members(self, broken: bool = False) -> None:
        self.calls.append("probe_members")

    outage_until = 0.0  # monotonic: etcd counts as away until then

    def outage(self) -> tuple[float, float] | None:
        now = time.monotonic()
        return (now, self.outage_until) if self.outage_until > now else None

    def closed(self) -> ClosedRecord | None:
        return self.closed_record

    def wait(self, version: int, timeout: float | None) -> int:
        return version

    def poke(self) -> None:
        self.calls.append("poke")

    def report_failure(self, report: FailureReport, done: bool = True) -> None:
        self.reported.append(report)
        self.calls.append("report" if done else "report, not done")

    def finish_round(self) -> None:
        self.calls.append("finish_round")

    def announce_leaving(self) -> None:
        self.calls.append("announce_leaving")

    def close(self, state: JobOutcome, reason: str = "") -> bool:
        self.closed_as.append(state)
        return True

    def shutdown(self, leave: bool = True, back: bool = False) -> None:
        self.calls.append("shutdown")
        self.left_for_now = back


class FakeWorkers:
    """The worker group: ``polls`` are the successive poll() results while running."""

    def __init__(self, polls: list[tuple[GroupState, list[WorkerFailure]]]) -> None:
        self.polls = deque(polls)
        self.started: list[list[Placement]] = []
        self.actions: list[str] = []
        self.hangs: list[WorkerFailure] = []
        self.released: list[bool] = []  # release_withheld(show) calls
        self._running = False
        self.live = False  # the workers run State.run (they can re-form in place)
        self.coming = False  # ... or are on their way there, from the lobby's group
        self.held_for: list[float] = []  # hold()'s timeouts
        self.drain_frozen: list[WorkerFailure] = []
        self.hold_frozen: list[WorkerFailure] = []
        self.holds_state = False  # save_held(): State users out of their group
        self.strand: deque[list[WorkerFailure]] = deque()  # successive stranded() results
        self.held: tuple[Held, str] = (Held.HELD, "")  # what hold() answers
        self.reformed: list[list[Placement]] = []
        self.drained = Drained.STOPPED  # how drain() ends
        self.restores: deque[int | None] = deque()  # successive restored() results
        self.ahead: list[Placement] = []  # started ahead of joining
        self.lobby: deque[bool] = deque()  # successive in_lobby() results (then True)
        self.forms: deque[bool] = deque()  # successive forming() results (then False)
        # polls for which new workers are on their way into State.run (starting());
        # then they are there (live) if ``arrive``, else they never get there
        self.on_the_way = 0
        self.arrive = False
        self.expected: list[bool] = []  # what starting() was told

    @property
    def pids(self) -> list[int]:
        return [100 + len(self.started)] if self.started else []

    def start(self, placements: list[Placement], ahead: bool = False) -> None:
        self.started.append(placements)
        self.ahead = placements if ahead else []
        self._running = True

    def fits(self, placements: list[Placement]) -> bool:
        return not self.ahead or lobby.fits(self.ahead, placements, unplaced=False)

    def in_lobby(self) -> bool:
        return self.lobby.popleft() if self.lobby else True

    def forming(self) -> bool:
        return self.forms.popleft() if self.forms else False

    def starting(self, expected: bool) -> bool:
        self.expected.append(expected)
        return self.on_the_way > 0

    def poll(self) -> tuple[GroupState, list[WorkerFailure]]:
        if self.on_the_way > 0:
            self.on_the_way -= 1
            self.live = self.live or (self.on_the_way == 0 and self.arrive)
        if self.polls:
            return self.polls.popleft()
        return GroupState.RUNNING, []

    def hung(self, timeout: float) -> list[WorkerFailure]:
        return self.hangs

    def frozen(self) -> list[WorkerFailure]:
        return self.hangs

    def drain(self, sig: int, timeout: float, let_go: Callable[[], None] | None = None) -> Drained:
        self.actions.append(f"drain {signal.Signals(sig).name}")
        if let_go is not None:
            let_go()
        return self.drained

    def finish(self, timeout: float, grace: float) -> bool:
        self.actions.append("finish")
        return True

    def stop(self, grace: float) -> None:
        self.actions.append(f"stop {grace:g}")

    def release_withheld(self, show: bool) -> dict[int, Path]:
        self.released.append(show)
        return {} if show else {1: Path("/logs/1/stderr.log")}

    last = 41  # the newest step the workers reported
    use_state = True

    def last_step(self) -> int:
        return self.last

    def restored(self) -> int | None:
        return self.restores.popleft() if self.restores else None

    def stranded(self) -> list[WorkerFailure]:
        return self.strand.popleft() if self.strand else []

    def save_held(self, timeout: float) -> bool:
        if self.holds_state:
            self.actions.append("save held")
        return self.holds_state

    escalating = False  # hold asks escalate() once, as the real one does while it waits

    def hold(
        self, urgent: bool, timeout: float, escalate: Callable[[], bool] | None = None
    ) -> tuple[Held, str]:
        self.actions.append("abandon" if urgent else "pause")
        self.held_for.append(timeout)
        if self.escalating and not urgent and escalate is not None and escalate():
            self.actions.append("abandon")
        if self.held[0] is Held.HELD and self.coming:  # they let go in State.run
            self.coming, self.live = False, True
        return self.held

    def reform(self, placements: list[Placement]) -> None:
        self.ahead = []
        self.reformed.append(placements)


class FakeStore:
    """The round's store host: ``hosted`` says, per round, how many worker groups had
    started when it was hosted (so a test sees the order)."""

    def __init__(self, workers: FakeWorkers, ready: bool = True, fails: bool = False) -> None:
        self.workers, self.ready, self.fails = workers, ready, fails
        self.hosted: list[tuple[int, int]] = []  # (port, worker groups started by then)
        self.warmed = 0  # warm() calls

    def warm(self) -> None:
        self.warmed += 1

    def host_round(self, addr: str, port: int) -> None:
        self.hosted.append((port, len(self.workers.started)))
        if self.fails:
            raise StoreError(f"cannot host the round's store on port {port}: taken")

    def drop_round(self) -> None:
        pass


RUNNING: tuple[GroupState, list[WorkerFailure]] = (GroupState.RUNNING, [])
SUCCEEDED: tuple[GroupState, list[WorkerFailure]] = (GroupState.SUCCEEDED, [])
CRASH = WorkerFailure(rank=1, local_rank=1, pid=7, exitcode=1, time=1.0, message="boom")


def signal_as_members_are_probed(job: FakeJob, a: Agent) -> None:
    """SIGTERM reaches ``a`` as it probes the members (it looks for a change)."""
    probe = job.probe_members

    def signalled(broken: bool = False) -> None:
        a.on_signal(signal.SIGTERM)
        probe(broken)

    job.probe_members = signalled  # type: ignore[method-assign]


def agent(job: FakeJob, workers: FakeWorkers, **kw: Any) -> Agent:
    kw = {
        "monitor_interval": 0.0,
        "shutdown_timeout": 5.0,
        "close_timeout": 1.0,
        "max_restarts": 3,
        **kw,
    }
    return Agent(job, workers, host="host-a", **kw)


def test_a_round_starts_workers_with_torchrun_placements_and_success_closes_the_job() -> None:
    job = FakeJob([round_of(1, "x", "a")])
    workers = FakeWorkers([RUNNING, SUCCEEDED])
    a = agent(job, workers)
    assert a.run() == 0
    [placements] = workers.started
    assert [(p.rank, p.local_rank, p.group_rank, p.world_size) for p in placements] == [
        (2, 0, 1, 4),
        (3, 1, 1, 4),
    ]
    assert job.closed_as == [JobOutcome.SUCCEEDED] and job.calls[-1] == "shutdown"
    assert a.state is AgentState.SUCCEEDED


def test_a_worker_failure_is_reported_and_the_next_round_restarts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = FakeJob([round_of(1, "a"), round_of(2, "a", restarts=1)])
    workers = FakeWorkers([RUNNING, (GroupState.FAILED, [CRASH]), RUNNING, SUCCEEDED])
    with caplog.at_level(logging.INFO):
        assert agent(job, workers).run() == 0
    assert workers.actions[0] == "stop 1"  # urgent: SIGTERM, SIGKILL a second later
    [detail] = job.reported
    assert detail.summary == "rank 1 (local_rank 1) on a: exit code 1: boom"
    assert len(workers.started) == 2
    assert "restarts 1" in caplog.text


def test_a_lost_member_stops_workers_now_without_a_failure_report() -> None:
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a", cause=RoundCause.LOST)], [None, lost])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    metrics = AgentMetrics("job", "a", 0, "dev", workers=lambda: [])
    assert agent(job, workers, metrics=metrics).run() == 0
    assert workers.actions[0] == "stop 1" and job.reported == []
    assert _sample(metrics.registry, "elastic_run_restarts_total", cause="member_lost") == 1
    # torchrun's count (its survivors' workers fail), though the budget was not charged
    assert [ps[0].restart_count for ps in workers.started] == [0, 1]
    assert _sample(metrics.registry, "elastic_run_world_size") == 2


def judged(
    job: FakeJob, workers: FakeWorkers, caplog: pytest.LogCaptureFixture
) -> tuple[float, list[str]]:
    """Run the agent to its end: the steps it counted as trained again, and what it said
    of each round that resumed behind what was committed."""
    metrics = AgentMetrics("job", "a", 0, "dev", workers=lambda: [])
    with caplog.at_level(logging.WARNING, logger="elastic.agent.loop"):
        assert agent(job, workers, metrics=metrics).run() == 0
    redone = _sample(metrics.registry, "elastic_run_steps_redone_total")
    return redone, [r.getMessage() for r in caplog.records if "resumes from" in r.getMessage()]


def test_a_round_that_resumes_behind_what_was_committed_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Never silent: the workers committed step 41; the new round resumed from 30."""
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a", cause=RoundCause.LOST)], [None, lost])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.restores.extend([41, None, 30])  # round 1's own answer; then round 2's
    redone, warned = judged(job, workers, caplog)
    assert redone == 11
    assert warned == [
        "round 2 resumes from step 30, 11 step(s) behind the newest this node's workers "
        "committed (41): the newest state any member of the round held is step 30"
    ]


def test_a_round_cut_short_before_it_said_where_it_resumed_keeps_what_was_committed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Never silent through two changes: the workers committed step 41; round 2 resumed
    from 30 (their step reads 30 now) but was cut short before they said so; round 3
    resumes from 30 too: 11 steps trained again, said against the 41 committed before
    round 2, not the 30 that round 2 had rewound to (a live Lightning re-formation
    re-shards in memory and says where it resumed only at the next fit's start)."""

    class Rewound(FakeWorkers):
        def last_step(self) -> int:
            return 41 if len(self.started) < 2 else 30

        def restored(self) -> int | None:  # round 2's workers never say
            return {1: 41, 2: None, 3: 30}[len(self.started)]

    lost_b = Change(RoundEnd.LOST, "lost b", ("b",))
    lost_c = Change(RoundEnd.LOST, "lost c", ("c",))
    rounds = [
        round_of(1, "a", "b", "c"),
        round_of(2, "a", "c", cause=RoundCause.LOST),
        round_of(3, "a", cause=RoundCause.LOST),
    ]
    job = FakeJob(rounds, [None, lost_b, lost_c])
    workers = Rewound([RUNNING] * 6 + [SUCCEEDED])
    redone, warned = judged(job, workers, caplog)
    assert len(workers.started) == 3
    assert redone == 11
    assert warned == [
        "round 3 resumes from step 30, 11 step(s) behind the newest this node's workers "
        "committed (41): the newest state any member of the round held is step 30"
    ]


def test_a_round_that_said_where_it_resumed_only_as_the_next_formed_is_judged_then(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The workers committed step 260; round 2 resumed from 221 and trained step 222,
    but said so only after the agent last looked, as round 3 formed (a join re-formed
    them in place moments after they restored: chaos seed 62). Round 2 is judged as it
    ends (or, held in place, as round 3 starts): 39 steps trained again, said for it;
    round 3 resumes from 222, their newest, and trains nothing again (before, round 3
    said 38 against 260, and the step round 2 trained again went unsaid)."""

    class Resumed(FakeWorkers):
        def last_step(self) -> int:
            return 260 if len(self.started) < 2 else 222  # round 2 trained step 222

    lost_b = Change(RoundEnd.LOST, "lost b", ("b",))
    join = Change(RoundEnd.WAITING, "c waiting to join", ("c",))
    rounds = [
        round_of(1, "a", "b"),
        round_of(2, "a", cause=RoundCause.LOST),
        round_of(3, "a", "c", cause=RoundCause.RESIZE),
    ]
    job = FakeJob(rounds, [None, lost_b, join])
    workers = Resumed([RUNNING] * 6 + [SUCCEEDED])
    workers.restores.extend([260, None, 221, 222])  # round 1; round 2, as it stops; round 3
    redone, warned = judged(job, workers, caplog)
    assert len(workers.started) == 3
    assert redone == 39
    assert warned == [
        "round 2 resumes from step 221, 39 step(s) behind the newest this node's workers "
        "committed (260): the newest state any member of the round held is step 221"
    ]


@pytest.mark.parametrize(
    ("final", "floor"),
    [
        (True, ""),  # b's last word, as it left
        (False, " (node b records its step every 0.5 s or so, and may have committed more since)"),
    ],
)
def test_a_round_of_new_nodes_behind_the_jobs_recorded_progress_says_so(
    caplog: pytest.LogCaptureFixture, final: bool, floor: str
) -> None:
    """Never silent, even when every node that trained the steps is gone: a restarted
    node alone, nothing committed on it, nothing to restore; the job recorded step 292.
    Once judged, the round's steps are what it records as the job's progress. A record
    that was not its writer's last word may lag it: the count is then a floor."""
    job = FakeJob([round_of(3, "a", cause=RoundCause.LOST)])
    job.recorded = ProgressRecord(step=292, node="b", round=2, final=final)
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    workers.last = -1
    workers.restores.extend([None, -1])
    redone, warned = judged(job, workers, caplog)
    assert redone == 292
    assert warned == [
        f"round 3 resumes from step 0, {'' if final else 'at least '}292 step(s) behind the "
        "newest the job recorded as committed (292, by node b): no member of the round "
        f"held a snapshot or checkpoint: training starts over{floor}"
    ]
    # after the verdict only (the rule skips -1), and as the node leaves: its last steps
    assert job.progress_said == [(-1, False), (-1, True)]


def test_a_collective_failing_under_a_lost_peer_is_the_loss_not_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gone = WorkerFailure(
        1, 1, 7, 1, 1.0, "RuntimeError: Connection closed by peer", consequence=True
    )
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a")], [None, None, lost])
    workers = FakeWorkers([RUNNING, (GroupState.FAILED, [gone]), RUNNING, SUCCEEDED])
    with caplog.at_level(logging.INFO):
        assert agent(job, workers).run() == 0
    assert job.reported == [] and "probe_members" in job.calls  # no failure is charged
    assert workers.released[0] is False  # its traceback stays in its log file
    text = caplog.text
    assert text.index("lost b: stopping workers now") < text.index("its collective failed")
    assert "rank 1 (local_rank 1): its collective failed when lost b" in text
    assert "traceback in /logs/1/stderr.log" in text and "workers failed" not in text


def test_a_collective_failure_with_no_loss_in_sight_is_a_failure() -> None:
    gone = WorkerFailure(
        1, 1, 7, 1, 1.0, "RuntimeError: Connection reset by peer", consequence=True
    )
    job = FakeJob([round_of(1, "a"), round_of(2, "a", restarts=1)])
    workers = FakeWorkers([(GroupState.FAILED, [gone]), RUNNING, SUCCEEDED])
    assert agent(job, workers).run() == 0
    assert len(job.reported) == 1 and workers.released[0] is True


def test_a_collective_failure_of_a_node_told_to_leave_as_the_loss_is_looked_for_is_no_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gone = WorkerFailure(
        1, 1, 7, 1, 1.0, "RuntimeError: Connection reset by peer", consequence=True
    )
    job = FakeJob([round_of(1, "a", "b")])
    workers = FakeWorkers([(GroupState.FAILED, [gone])])
    a = agent(job, workers)
    signal_as_members_are_probed(job, a)
    with caplog.at_level(logging.INFO):
        assert a.run() == 143
    assert job.reported == [] and "workers failed" not in caplog.text
    assert "its collective failed when a peer vanished" in caplog.text


def test_a_newcomer_drains_the_workers_with_sigterm_for_scripts_without_state() -> None:
    waiting = Change(RoundEnd.WAITING, "n waiting to join", ("n",))
    job = FakeJob([round_of(1, "a"), round_of(2, "a", "n")], [waiting])
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    assert agent(job, workers).run() == 0
    assert workers.actions[0] == "drain SIGTERM"


def test_rank_0_hosts_the_store_before_its_workers_start_once_the_helper_is_ready() -> None:
    job = FakeJob([round_of(1, "a", "b")])
    workers = FakeWorkers([SUCCEEDED])
    store = FakeStore(workers)
    assert agent(job, workers, store=store).run() == 0
    assert store.hosted == [(29501, 0)]


def test_new_workers_import_torch_while_the_store_helper_still_does() -> None:
    job = FakeJob([round_of(1, "a", "b")])
    workers = FakeWorkers([SUCCEEDED])
    store = FakeStore(workers, ready=False)
    assert agent(job, workers, store=store).run() == 0
    assert store.hosted == [(29501, 1)]


def test_a_store_that_cannot_be_hosted_leaves_the_round(caplog: pytest.LogCaptureFixture) -> None:
    job = FakeJob([round_of(1, "a", "b"), RendezvousTimeoutError("too few nodes")])
    workers = FakeWorkers([])
    store = FakeStore(workers, ready=False, fails=True)
    assert agent(job, workers, store=store).run() == 1
    assert store.hosted == [(29501, 1)] and workers.actions == ["stop 0"]  # started, stopped
    assert job.calls.count("finish_round") == 1 and "port 29501: taken" in caplog.text


def test_a_store_is_hosted_only_by_group_rank_0_and_readied_by_rank_1() -> None:
    for members, warmed in ((("b", "a"), 1), (("b", "c", "a"), 0)):
        job = FakeJob([round_of(1, *members)])
        workers = FakeWorkers([SUCCEEDED])
        store = FakeStore(workers)
        assert agent(job, workers, store=store).run() == 0
        assert store.hosted == [] and store.warmed == warmed, members


def test_the_leader_readies_its_store_before_the_first_round() -> None:
    job = FakeJob([RendezvousTimeoutError("too few nodes")])
    job.leads = True
    workers = FakeWorkers([])
    store = FakeStore(workers)
    assert agent(job, workers, store=store).run() == 1
    assert store.warmed == 1


def test_workers_that_finish_while_drained_for_a_newcomer_end_the_job() -> None:
    """They had left their training loop when the newcomer came: a new round would only
    train again from their last snapshot, so the job closes as succeeded instead."""
    waiting = Change(RoundEnd.WAITING, "n waiting to join", ("n",))
    job = FakeJob([round_of(1, "a"), round_of(2, "a", "n")], [waiting])
    workers = FakeWorkers([RUNNING])
    workers.drained = Drained.FINISHED
    a = agent(job, workers)
    assert a.run() == 0
    assert job.closed_as == [JobOutcome.SUCCEEDED] and len(workers.started) == 1
    assert a.state is AgentState.SUCCEEDED


def test_a_signal_announces_leaving_drains_with_that_signal_and_exits_128_plus_it() -> None:
    job = FakeJob([round_of(1, "a")])
    workers = FakeWorkers([RUNNING])
    a = agent(job, workers)
    workers.polls = deque([RUNNING])

    def poll() -> tuple[GroupState, list[WorkerFailure]]:
        a.on_signal(signal.SIGINT)  # Ctrl-C while the workers run
        return RUNNING

    workers.poll = poll  # type: ignore[method-assign]
    assert a.run() == 128 + signal.SIGINT
    assert "announce_leaving" in job.calls and workers.actions == ["drain SIGINT"]
    # the next round need not wait for the workers' interpreters to end
    assert job.calls.index("finish_round") < job.calls.index("shutdown")
    assert a.state is AgentState.LEFT


@pytest.mark.parametrize(("recorded", "said"), [(103, [(127, True)]), (258, [])])
def test_a_node_that_leaves_records_its_last_step_only_past_the_job_before_its_round_judged(
    recorded: int, said: list[tuple[int, bool]]
) -> None:
    """SIGTERM before the round's workers said where they resumed (they form its group):
    their last step, 127, was trained in an earlier round and is the job's newest unless
    the job recorded more (the workers may predate a fence: 258 stays)."""
    job = FakeJob([round_of(1, "a")])
    job.recorded = ProgressRecord(step=recorded, node="b", round=1)
    workers = FakeWorkers([RUNNING])
    workers.last = 127
    workers.restores.extend([None] * 10)  # never said: the judgment is pending
    a = agent(job, workers)

    def poll() -> tuple[GroupState, list[WorkerFailure]]:
        a.on_signal(signal.SIGTERM)
        return RUNNING

    workers.poll = poll  # type: ignore[method-assign]
    assert a.run() == 128 + signal.SIGTERM
    assert job.progress_said == said


def test_a_signal_while_joining_leaves_at_once() -> None:
    job = FakeJob([])
    workers = FakeWorkers([])
    a = agent(job, workers)
    a.on_signal(signal.SIGTERM)
    assert a.run() == 143 and workers.started == [] and "poke" in job.calls


def test_a_job_closed_as_failed_elsewhere_ends_with_the_root_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = FailureReport("rank 3 on b: exit code 1", node="b")
    job = FakeJob([round_of(1, "a", "b")], [Change(RoundEnd.JOB_FAILED, "job failed: budget")])
    job.closed_record = ClosedRecord(JobOutcome.FAILED, "budget spent", root_cause=root)
    workers = FakeWorkers([RUNNING])
    with caplog.at_level(logging.ERROR):
        assert agent(job, workers).run() == 1
    assert workers.actions == ["stop 1"]
    assert "job job FAILED: budget spent" in caplog.text and "node      : b" in caplog.text


def test_a_job_finished_elsewhere_lets_local_workers_finish() -> None:
    job = FakeJob([round_of(1, "a", "b")], [Change(RoundEnd.JOB_SUCCEEDED, "job succeeded")])
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    assert agent(job, workers).run() == 0
    assert workers.actions == ["finish"]


def test_a_job_finished_by_a_round_without_this_node_kills_its_stale_workers_and_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The node was away (frozen, cut off) while the others formed a round without it
    and finished the job: its workers' round is gone, so they can never finish on their
    own. Waiting ``close_timeout`` for them and calling it their failure (chaos seed
    106) was wrong; the job succeeded."""
    done = Change(RoundEnd.JOB_DONE_WITHOUT, "job succeeded in round 3, formed without this node")
    job = FakeJob([round_of(1, "a", "b")], [done])
    workers = FakeWorkers([RUNNING, RUNNING, (GroupState.FAILED, [])])
    with caplog.at_level(logging.INFO):
        assert agent(job, workers).run() == 0
    assert workers.actions == ["stop 0"]
    assert "while this node was away: its workers' round is gone; killing them" in caplog.text
    assert "FAILED" not in caplog.text


def test_fenced_kills_stale_workers_at_once_and_joins_again() -> None:
    """Stale workers are killed; State users that wait out of their group (their
    collective failed) hold the job's last committed step: they save it first."""
    for holds, actions in ((False, ["stop 0"]), (True, ["save held", "stop 0"])):
        fenced = Change(RoundEnd.FENCED, "etcd dropped this node's lease")
        job = FakeJob([round_of(1, "a", "b"), round_of(3, "b", "a")], [fenced])
        workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
        workers.holds_state = holds
        workers.last = 41
        assert agent(job, workers).run() == 0
        assert workers.actions[:2] == actions and len(workers.started) == 2
        # their newest step may be in no record (etcd was away while they trained); and
        # raised again as it leaves the job, as rank 1 of round 3 (over 41: etcd's no-op)
        assert job.progress_raised == [41, 41]


def test_a_node_not_rank_0_raises_the_record_to_its_last_step_as_it_leaves() -> None:
    """The record's writer, rank 0, may lag (its agent frozen, or gone): a node that
    leaves raises the record to its workers' last step, so that a round that resumes
    behind it says how many steps it trains again (chaos seed 404)."""
    job = FakeJob([round_of(1, "x", "a")])
    workers = FakeWorkers([RUNNING, RUNNING])
    workers.last = 26
    a = agent(job, workers)

    def poll() -> tuple[GroupState, list[WorkerFailure]]:
        a.on_signal(signal.SIGTERM)  # as its workers train
        return RUNNING

    workers.poll = poll  # type: ignore[method-assign]
    assert a.run() == 143
    assert job.progress_raised == [26] and (26, True) in job.progress_said


def test_a_hung_worker_is_a_failure() -> None:
    job = FakeJob([round_of(1, "a"), round_of(2, "a", restarts=1)])
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    workers.hangs = [WorkerFailure(0, 0, 5, -9, 1.0, "hung: no progress for 9s")]
    a = agent(job, workers, hang_timeout=3.0)
    original = workers.hung

    def hung_once(timeout: float) -> list[WorkerFailure]:
        found = original(timeout)
        workers.hangs = []
        return found

    workers.hung = hung_once  # type: ignore[method-assign]
    assert a.run() == 0
    assert "hung: no progress" in job.reported[0].summary


def test_closed_on_arrival_and_join_timeout() -> None:
    done = ClosedRecord(JobOutcome.SUCCEEDED, "all workers succeeded")
    job = FakeJob([RendezvousClosedError("job 'job' has finished", done)])
    assert agent(job, FakeWorkers([])).run() == 0
    job = FakeJob([RendezvousTimeoutError("1 of at least 2 nodes present")])
    assert agent(job, FakeWorkers([])).run() == 1
    failed = ClosedRecord(JobOutcome.FAILED, "budget spent")
    job = FakeJob([round_of(1, "a"), RendezvousClosedError("job 'job' has failed", failed)])
    workers = FakeWorkers([RUNNING, (GroupState.STOPPED, [])])
    assert agent(job, workers).run() == 1


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"job": "job", "node": "a", **labels})
    assert value is not None, (name, labels)
    return value


STRANDED = WorkerFailure(0, 0, 7, 1, 1.0, "its collective failed and no member changed")


def test_live_workers_leave_the_group_on_a_loss_and_re_form_in_place() -> None:
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a")], [None, lost])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    metrics = AgentMetrics("job", "a", 0, "dev", workers=lambda: [])
    assert agent(job, workers, metrics=metrics).run() == 0
    assert workers.actions == ["abandon"] and len(workers.started) == 1
    [placements] = workers.reformed
    assert [(p.rank, p.world_size, p.master_port) for p in placements] == [
        (0, 2, 29502),
        (1, 2, 29502),
    ]
    assert _sample(metrics.registry, "elastic_run_restarts_total", cause="member_lost") == 0
    reformed = _sample(metrics.registry, "elastic_run_live_reformations_total", cause="member_lost")
    assert reformed == 1


def test_a_live_rank_0_whose_store_helper_still_starts_has_its_worker_host_the_store() -> None:
    """a becomes rank 0 (b, rank 0, lost) before its helper has imported torch: its
    re-forming worker, which has torch, hosts the round's store (torchrun's static form),
    and the round forms at once instead of after the helper's import; with the helper
    ready, the agent hosts it as usual."""
    for ready, hosted in ((False, []), (True, [(29502, 1)])):
        lost = Change(RoundEnd.LOST, "lost b", ("b",))
        job = FakeJob([round_of(1, "b", "a"), round_of(2, "a")], [None, lost])
        workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
        workers.live = True
        store = FakeStore(workers, ready=ready)
        assert agent(job, workers, store=store).run() == 0
        [placements] = workers.reformed
        assert store.hosted == hosted, ready
        assert [p.agent_store for p in placements] == [ready, ready]
        env = round_env(placements[0])
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == str(ready) and env["RANK"] == "0"


def test_a_loss_abandons_workers_on_their_way_into_state_run_and_holds_them_there() -> None:
    """A newcomer's workers, placed in place, build their model before State.run when b
    is lost: they are asked to leave the broken group and held until they do, in
    State.run, for at most ``--shutdown-timeout`` (a new worker would cost everyone a
    worker start and the whole build); one that does not let go by then is replaced."""
    for held, started in (((Held.HELD, ""), 1), ((Held.FAILED, "rank 1 still in..."), 2)):
        lost = Change(RoundEnd.LOST, "lost b", ("b",))
        job = FakeJob([round_of(1, "a", "b"), round_of(2, "a")], [None, lost])
        workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
        workers.coming, workers.held = True, held
        assert agent(job, workers, shutdown_timeout=30.0).run() == 0
        assert workers.actions[0] == "abandon" and workers.held_for == [30.0]
        assert len(workers.started) == started and len(workers.reformed) == 2 - started


def test_a_lapse_is_said_once_while_the_node_waits_to_carry_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """etcd dropped the lease in an outage, no round formed without this node: it carries
    on once it reads etcd anew; meanwhile every look sees the lapse again, said once."""
    lapsed = Change(RoundEnd.LAPSED, "etcd dropped this node's lease, but no round formed")
    job = FakeJob([round_of(1, "a")], [None, lapsed, lapsed, lapsed])
    job.resumes = deque([False, False, True])
    workers = FakeWorkers([RUNNING] * 6 + [SUCCEEDED])
    with caplog.at_level(logging.WARNING, logger="elastic"):
        assert agent(job, workers).run() == 0
    said = [r for r in caplog.records if "it carries on" in r.getMessage()]
    assert len(said) == 1 and job.calls.count("resume") == 3, caplog.text
    assert len(workers.started) == 1, "its workers trained on"


def test_a_join_waits_for_new_workers_on_their_way_into_state_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The round's new workers (their script imported elastic) build their model when a
    newcomer waits: the change waits for them to get into State.run, said once, and they
    pause in place there instead of being replaced; workers that never get there are
    drained as before, once the change stops waiting. Meanwhile the job is told that its
    workers re-form in place."""
    for arrive, actions, started in ((True, ["pause"], 1), (False, ["drain SIGTERM"], 2)):
        waiting = Change(RoundEnd.WAITING, "n waiting to join", ("n",))
        job = FakeJob([round_of(1, "a"), round_of(2, "a", "n")], [waiting] * 3)
        workers = FakeWorkers([RUNNING] * 5 + [SUCCEEDED])
        workers.on_the_way, workers.arrive = 3, arrive
        with caplog.at_level(logging.INFO, logger="elastic"):
            assert agent(job, workers).run() == 0
        assert workers.actions == actions and len(workers.started) == started, arrive
        assert workers.expected[0] is False  # never live before: only what they said counts
        # as they start, the job hears that its workers re-form in place (a newcomer starts
        # its own ahead); of workers that never got there, that is taken back
        assert job.in_place_said == ([True] if arrive else [True, False]), job.in_place_said
        said = [r for r in caplog.records if "on their way into State.run" in r.getMessage()]
        assert len(said) == 1, caplog.text
        caplog.clear()


def test_a_loss_while_a_join_waits_for_starting_workers_is_acted_on_at_once() -> None:
    """A join waits for the round's new workers on their way into State.run; b is lost
    meanwhile: the round is broken, and workers not in State.run cannot leave it in
    place, so they are stopped now and new ones follow, without waiting out the rest of
    ``COMING_LIVE_S``."""
    waiting = Change(RoundEnd.WAITING, "n waiting to join", ("n",))
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a", "n")], [waiting, waiting, lost])
    workers = FakeWorkers([RUNNING] * 4 + [SUCCEEDED])
    workers.on_the_way = 10  # still starting when b is lost
    started = time.monotonic()
    assert agent(job, workers).run() == 0
    assert workers.actions == ["stop 1"] and len(workers.started) == 2, workers.actions
    assert time.monotonic() - started < 5.0, "the loss waited for the starting workers"


def test_live_workers_pause_for_a_newcomer() -> None:
    waiting = Change(RoundEnd.WAITING, "n waiting to join", ("n",))
    job = FakeJob([round_of(1, "a"), round_of(2, "a", "n")], [waiting])
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    assert agent(job, workers).run() == 0
    assert workers.actions == ["pause"] and len(workers.reformed) == 1


def test_stranded_workers_wait_for_the_change_that_explains_them() -> None:
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a")], [None, None, lost])
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.strand.append([STRANDED])
    assert agent(job, workers).run() == 0
    assert "probe_members" in job.calls and job.reported == []
    assert len(workers.reformed) == 1 and len(workers.started) == 1


def test_stranded_workers_while_etcd_is_away_wait_for_it_to_say_what_changed() -> None:
    """A peer dies while etcd is frozen: the collective fails at once, but the loss can
    be read from etcd only once it answers, later than the usual TTL + 1 s of looking.
    The outage extends the look; the loss found then is the event, not a failure."""

    class Frozen(FakeJob):
        seen_at = 0.0  # monotonic: the loss can be read from then on

        def check(self) -> Change | None:
            if time.monotonic() < self.seen_at:
                return None
            return super().check()

        def wait(self, version: int, timeout: float | None) -> int:
            time.sleep(min(timeout or 0.0, 0.05))
            return version

    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = Frozen([round_of(1, "a", "b"), round_of(2, "a")], [lost])
    started = time.monotonic()
    job.seen_at = started + job.lease_ttl + 1.5  # past the usual look
    job.outage_until = started + job.lease_ttl + 2.0
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.strand.append([STRANDED])
    assert agent(job, workers).run() == 0
    assert job.reported == [] and len(workers.reformed) == 1


def test_stranded_workers_with_no_change_in_sight_are_a_failure() -> None:
    job = FakeJob([round_of(1, "a"), round_of(2, "a", restarts=1)])
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.strand.append([STRANDED])
    assert agent(job, workers).run() == 0
    assert workers.actions[0] == "stop 1" and len(job.reported) == 1
    assert len(workers.started) == 2 and workers.reformed == []


def test_stranded_workers_of_a_node_told_to_leave_as_the_change_is_looked_for_charge_nothing() -> (
    None
):
    """Chaos seed 404: a peer's leave broke the collective before etcd said so, and a
    SIGTERM came as the agent looked for the change: it leaves (drains its waiting
    workers), and reports no failure of its own."""
    job = FakeJob([round_of(1, "a", "b")])
    workers = FakeWorkers([RUNNING, RUNNING])
    workers.live = True
    workers.strand.append([STRANDED])
    a = agent(job, workers)
    signal_as_members_are_probed(job, a)
    assert a.run() == 143
    assert job.reported == [] and workers.actions == ["drain SIGTERM"]


def test_a_live_re_formation_that_cannot_hold_the_workers_falls_back_to_new_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a")], [None, lost])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.held = (Held.FAILED, "rank(s) [1] still in their step after 5s")
    with caplog.at_level(logging.INFO):
        assert agent(job, workers).run() == 0
    assert workers.actions == ["abandon", "stop 1"] and len(workers.started) == 2
    assert "no live re-formation (rank(s) [1] still in their step" in caplog.text


@pytest.mark.parametrize(
    ("change", "asked"),
    [
        (Change(RoundEnd.WAITING, "n waiting to join", ("n",)), "pause"),
        (Change(RoundEnd.LOST, "lost b", ("b",)), "abandon"),
    ],
    ids=["join", "loss"],
)
def test_workers_that_finish_while_asked_to_let_go_end_the_job(
    change: Change, asked: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The ask came in their last step: they left the training loop and exited 0 instead
    of letting go, so the job closes as succeeded; new workers would only train again
    from the last snapshot (CI saw that: steps 29 and 30 a second time)."""
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a", "n")], [None, change])
    workers = FakeWorkers([RUNNING, RUNNING])
    workers.live = True
    workers.held = (Held.FINISHED, "the workers finished training")
    a = agent(job, workers)
    with caplog.at_level(logging.INFO):
        assert a.run() == 0
    assert workers.actions == [asked] and len(workers.started) == 1
    assert job.closed_as == [JobOutcome.SUCCEEDED] and a.state is AgentState.SUCCEEDED
    assert "had finished training before the" in caplog.text


@pytest.mark.parametrize("then", ["lost", "signal"])
def test_a_pause_becomes_an_abandon_when_the_round_breaks_or_a_signal_comes_meanwhile(
    then: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The workers were asked to pause for a join; before they let go, a member is lost
    (its workers may have been the ones this node's worker formed a group with: chaos
    seed 90 waited out --shutdown-timeout), or this node is told to leave: the pause
    becomes an abandon. After a signal the node leaves, its workers saving first."""
    waiting = Change(RoundEnd.WAITING, "n waiting to join", ("n",))
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a", "n")], [None, waiting])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live, workers.escalating = True, True
    a = agent(job, workers)
    if then == "lost":
        job.changes.append(lost)  # what the job shows while the workers let go
    else:
        hold = workers.hold

        def signalled(urgent: bool, timeout: float, escalate: Any = None) -> tuple[Held, str]:
            a.on_signal(signal.SIGTERM)
            return hold(urgent, timeout, escalate)

        workers.hold = signalled  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        code = a.run()
    if then == "lost":
        assert code == 0 and workers.actions == ["pause", "abandon"]
        assert "the round broke meanwhile (lost): lost b: the workers leave their group now" in (
            caplog.text
        )
    else:
        assert code == 143 and workers.actions == ["pause", "abandon", "drain SIGTERM"]
        assert "a signal came: the workers leave their group now" in caplog.text


def test_respawn_mode_never_holds_workers() -> None:
    from elastic.contract import RestartMode

    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a")], [None, lost])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    assert agent(job, workers, restart_mode=RestartMode.RESPAWN).run() == 0
    assert workers.actions == ["stop 1"] and len(workers.started) == 2


# -- held workers (the HOLDING rows) ---------------------------------------------------------
def _held_after_a_loss(rounds: list[Any]) -> tuple[FakeJob, FakeWorkers]:
    lost = Change(RoundEnd.LOST, "lost b", ("b",))
    job = FakeJob([round_of(1, "a", "b"), *rounds], [None, lost])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    return job, workers


def test_a_signal_while_the_workers_are_held_has_them_save_and_exit() -> None:
    job, workers = _held_after_a_loss([])
    a = agent(job, workers)
    hold = workers.hold

    def hold_then_signal(urgent: bool, timeout: float, escalate: Any = None) -> tuple[Held, str]:
        a.on_signal(signal.SIGTERM)  # arrives while the workers wait for their placement
        return hold(urgent, timeout)

    workers.hold = hold_then_signal  # type: ignore[method-assign]
    assert a.run() == 143
    assert workers.actions == ["abandon", "drain SIGTERM"] and a.state is AgentState.LEFT


def test_a_held_worker_that_exited_before_the_round_gives_new_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job, workers = _held_after_a_loss([round_of(2, "a")])
    hold = workers.hold

    def hold_then_die(urgent: bool, timeout: float, escalate: Any = None) -> tuple[Held, str]:
        held = hold(urgent, timeout)
        workers.live = False  # one of them exits while the round forms
        return held

    workers.hold = hold_then_die  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        assert agent(job, workers).run() == 0
    assert workers.actions == ["abandon", "stop 0"] and len(workers.started) == 2
    assert workers.reformed == [] and "a held worker exited" in caplog.text


def test_the_job_failing_while_the_workers_are_held_stops_them() -> None:
    failed = ClosedRecord(JobOutcome.FAILED, "budget spent")
    job, workers = _held_after_a_loss([RendezvousClosedError("job 'job' has failed", failed)])
    a = agent(job, workers)
    assert a.run() == 1
    assert workers.actions == ["abandon", "stop 1"] and a.state is AgentState.FAILED


# -- a newcomer's workers started ahead of joining (lobby.py) ------------------------------------
def _ahead(glance: Glance, restart_count: int, live: bool) -> lobby.Ahead:
    return lobby.ahead(
        glance,
        restart_count,
        live,
        nproc=2,
        max_nodes=4,
        static=False,
        in_place=True,
        store=("10.0.0.2", 41999),
    )


class FakeWire:
    def __init__(self, tripped: bool = False) -> None:
        self.trips, self.resets = tripped, 0

    def tripped(self) -> bool:
        return self.trips

    def reset(self) -> None:
        self.resets += 1


def ahead_agent(job: FakeJob, workers: FakeWorkers, tripped: bool = False, **kw: Any) -> Agent:
    return agent(job, workers, prepare=_ahead, tripwire=FakeWire(tripped), **kw)


def _running_round() -> Glance:
    leader = NodeRecord("x", "10.0.0.1", 2, in_place=True)
    return Glance(round_of(1, "x"), leader=leader)


def test_a_newcomer_starts_its_workers_before_it_joins_and_they_re_form_in_place(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The job trains while the newcomer's workers start; it registers once they wait
    for their placement, and round 2 places them as they were started: they form it in
    place, no new process."""
    job = FakeJob([round_of(2, "x", "a")])
    job.glance_view = _running_round()
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.lobby.extend([False, False])  # two looks (and polls) before they all wait
    with caplog.at_level(logging.INFO):
        assert ahead_agent(job, workers).run() == 0
    # on its way as the workers start, registered once they are ready
    assert job.calls[:3] == ["glance", "announce_arrival", "start"]
    [ahead] = workers.started
    assert [(p.rank, p.group_rank, p.world_size, p.master_port) for p in ahead] == [
        (2, 1, 4, 41999),
        (3, 1, 4, 41999),
    ]
    [placed] = workers.reformed  # the round's own store port, published to them
    assert [(p.rank, p.master_port) for p in placed] == [(2, 29502), (3, 29502)]
    assert "starting workers before joining: round 1 trains with room" in caplog.text
    assert "joining the job with them" in caplog.text


def test_a_newcomer_placed_otherwise_than_its_workers_were_started_replaces_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another node joined first: round 2 gives this node group rank 2, not 1. Its
    workers may have read RANK already, so new ones start."""
    job = FakeJob([round_of(2, "x", "y", "a")])
    job.glance_view = _running_round()
    workers = FakeWorkers([RUNNING, SUCCEEDED])
    workers.live = True
    with caplog.at_level(logging.WARNING):
        assert ahead_agent(job, workers).run() == 0
    assert workers.actions == ["stop 0"] and workers.reformed == []
    assert [p.rank for p in workers.started[1]] == [4, 5]
    assert "places this node otherwise than its workers were started ahead" in caplog.text


def test_a_worker_started_ahead_that_exits_gives_a_plain_join(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = FakeJob([round_of(2, "x", "a")])
    job.glance_view = _running_round()
    workers = FakeWorkers([(GroupState.FAILED, [CRASH]), RUNNING, SUCCEEDED])
    workers.lobby.append(False)
    with caplog.at_level(logging.WARNING):
        assert ahead_agent(job, workers).run() == 0
    assert workers.actions[0] == "stop 0"
    assert job.calls[:3] == ["glance", "announce_arrival", "start"]
    assert len(workers.started) == 2 and workers.reformed == []  # new workers in round 2
    assert "joining without them, new workers start in the round" in caplog.text
    assert job.reported == []  # not a member of any round yet: nothing is charged


def test_a_worker_started_ahead_that_went_past_the_hook_gives_a_plain_join_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its script imported elastic after init_process_group: it connected to the tripwire
    instead of waiting for its placement. The agent joins without it, at once."""
    job = FakeJob([round_of(2, "x", "a")])
    job.glance_view = _running_round()
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    workers.lobby.extend([False] * 1000)  # never all in the lobby
    with caplog.at_level(logging.WARNING):
        assert ahead_agent(job, workers, tripped=True).run() == 0
    assert workers.actions[0] == "stop 0" and len(workers.started) == 2
    assert "import elastic before init_process_group" in caplog.text


def test_a_signal_while_the_workers_start_ahead_stops_them_and_never_joins() -> None:
    job = FakeJob([])
    job.glance_view = _running_round()
    workers = FakeWorkers([])
    workers.lobby.extend([False] * 1000)
    a = ahead_agent(job, workers)
    a.on_signal(signal.SIGTERM)
    assert a.run() == 128 + signal.SIGTERM
    assert workers.actions == ["stop 0"] and "start" not in job.calls


def test_without_a_running_round_the_node_joins_first() -> None:
    job = FakeJob([round_of(1, "a")])
    workers = FakeWorkers([SUCCEEDED])
    assert ahead_agent(job, workers).run() == 0
    assert job.calls[:2] == ["glance", "start"] and len(workers.started) == 1
    assert workers.ahead == []


def test_the_leader_says_when_its_workers_re_form_in_place() -> None:
    """Once, however many turns; and not taken back while its workers are replaced (new
    ones, not in State.run yet): newcomers still start theirs ahead of joining."""
    job = FakeJob([round_of(1, "a")])
    job.leads = True
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, RUNNING, SUCCEEDED])
    polls = workers.poll

    def poll() -> tuple[GroupState, list[WorkerFailure]]:
        said = len(job.in_place_said)
        workers.live = said == 0 or not job.in_place_said[0]  # live, then between processes
        return polls()

    workers.poll = poll  # type: ignore[method-assign]
    assert agent(job, workers).run() == 0
    assert job.in_place_said == [True]


def test_while_the_workers_form_in_place_the_members_are_probed() -> None:
    """A member lost as a round forms leaves no collective to fail: the agent probes the
    members (its agent gone: its lease revoked at once) instead of waiting for its TTL."""
    job = FakeJob([round_of(1, "a", "b")])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.forms.extend([False, True])  # the second turn: a placement is being formed
    assert agent(job, workers).run() == 0
    assert job.calls.count("probe_members") == 1


# -- a node whose own worker fails steps out while the others go on (lobby.step_out) -------------
def _step_out(were_live: bool, size: int, alone: bool, spent: bool) -> lobby.StepOut:
    return lobby.step_out(were_live, size, alone, spent, in_place=True, min_nodes=1, static=False)


def _back(present: int, awaited: bool) -> str | None:
    return lobby.back_now(present, awaited, min_nodes=2)


def test_a_node_whose_worker_hangs_steps_out_and_comes_back_with_workers_started_ahead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """c's worker hangs: c reports it (the restart is charged) and leaves the job, so a
    and b re-form in place without it at once; once they have (a round newer than the
    one c left), c joins again as a newcomer, its new workers started ahead with the
    ranks of round 3 and the restart count one up."""
    old = FakeJob([round_of(1, "a", "b", "c")])
    old.node_id = "c"
    new = FakeJob([round_of(3, "a", "b", "c", cause=RoundCause.RESIZE)])
    new.node_id = "c"
    two = round_of(2, "a", "b", cause=RoundCause.FAILURE)
    leader = NodeRecord("a", "10.0.0.1", 2, in_place=True)
    # round 2 formed; its new leader has not said yet that its workers re-form in place
    new.glances.extend([Glance(round_of(1, "a", "b", "c"), leader=leader), Glance(two)])
    new.glance_view = Glance(two)
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.hangs = [CRASH]
    hung = iter([True])

    def frozen() -> list[WorkerFailure]:
        return [CRASH] if next(hung, False) else []

    workers.frozen = frozen  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        a = ahead_agent(old, workers, step_out=_step_out, rejoin=lambda: new)
        assert a.run() == 0
    assert old.calls[-2:] == ["report, not done", "shutdown"]  # reported, then left
    assert old.left_for_now  # its tombstone says it comes back (rules.plan waits for it)
    # out, ahead (on its way), registered
    assert new.calls[:5] == ["glance", "glance", "glance", "announce_arrival", "start"]
    (ahead,) = workers.started[1:]
    assert [(p.rank, p.group_rank, p.restart_count) for p in ahead] == [(4, 2, 1), (5, 2, 1)]
    assert [p.master_port for p in workers.reformed[0]] == [29503, 29503]  # round 3's store
    assert "leaving the job for now: the other 2 node(s) re-form in place" in caplog.text


def test_a_standby_registered_without_workers_steps_back_to_start_them_ahead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """c came as the job started, before its leader said that its workers re-form in
    place: it registered without workers. Once the leader says so (the round full: c is
    a standby), c steps back (a departure: it was in no round) and joins again with its
    workers started ahead for a lost member's place; round 2, z lost, places them as
    they were started: they re-form in place, no new process."""
    monkeypatch.setattr(loop, "WARM_CHECK_S", 0.0)
    full = round_of(1, "w", "x", "y", "z")  # _ahead's max_nodes is 4
    leader = NodeRecord("w", "10.0.0.1", 2)
    old = FakeJob([])  # a round from it would mean c never warmed up
    old.node_id = "c"
    old.glances.append(Glance(full, leader=leader))  # as it arrives: not in place yet
    old.glance_view = Glance(full, leader=replace(leader, in_place=True))
    new = FakeJob([round_of(2, "w", "x", "y", "c", cause=RoundCause.LOST)])
    new.node_id = "c"
    new.glance_view = old.glance_view
    workers = FakeWorkers([RUNNING, SUCCEEDED])
    workers.live = True
    with caplog.at_level(logging.INFO):
        assert ahead_agent(old, workers, rejoin=lambda: new).run() == 0
    assert old.calls == ["glance", "start", "next_round", "glance", "shutdown"]
    assert not old.left_for_now  # a plain departure: it holds nothing
    assert new.calls[:3] == ["glance", "announce_arrival", "start"]
    [ahead] = workers.started
    assert [(p.rank, p.group_rank, p.world_size) for p in ahead] == [(6, 3, 8), (7, 3, 8)]
    assert [p.rank for p in workers.reformed[0]] == [6, 7]
    assert "stepping back to start workers ahead: registered without workers" in caplog.text


def test_a_standby_whose_workers_failed_ahead_before_never_warms_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its workers started ahead failed once (their script goes past init_process_group
    before it imports elastic, say): it would fail them again. It waits as it is."""
    monkeypatch.setattr(loop, "WARM_CHECK_S", 0.0)
    full = Glance(round_of(1, "w", "x", "y", "z"), leader=NodeRecord("w", "x", 2, in_place=True))
    job = FakeJob([round_of(2, "w", "x", "y", "a", cause=RoundCause.LOST)])
    job.glance_view = full
    workers = FakeWorkers([RUNNING, RUNNING, SUCCEEDED])
    workers.lobby.extend([False] * 1000)
    assert ahead_agent(job, workers, tripped=True, rejoin=lambda: FakeJob([])).run() == 0
    assert job.calls.count("shutdown") == 1 and job.calls[-1] == "shutdown"  # at the end
    assert len(workers.started) == 2 and workers.reformed == []  # new ones in round 2


@pytest.mark.parametrize("joined", [(), ("c",)], ids=["veterans", "c-new"])
def test_a_node_whose_workers_cannot_be_held_steps_out_while_the_others_go_on(
    joined: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """c is lost (a member since the start, or new in the round); a's worker is stuck in
    a send to it (gloo never fails it), so a's workers cannot be held. b trained with a
    and holds what a did: a steps out, reporting nothing (the failure was not its own),
    so that b re-forms in place without waiting for a's new workers to start; a joins
    again as a newcomer with them started ahead."""
    lost = Change(RoundEnd.LOST, "lost c", ("c",))
    old = FakeJob([round_of(1, "a", "b", "c", joined=joined)], [None, lost])
    new = FakeJob([round_of(3, "b", "a", cause=RoundCause.RESIZE)])
    two = round_of(2, "b", cause=RoundCause.LOST)
    new.glances.append(Glance(two))
    new.glance_view = Glance(two, leader=NodeRecord("b", "10.0.0.1", 2, in_place=True))
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.held = (Held.FAILED, "rank 0 is stuck in a collective ...")
    with caplog.at_level(logging.INFO):
        a = ahead_agent(old, workers, step_out=_step_out, rejoin=lambda: new)
        assert a.run() == 0
    assert workers.actions[:2] == ["abandon", "stop 1"]
    assert old.reported == [] and old.calls[-1] == "shutdown"  # left, nothing charged
    assert new.calls[:2] == ["glance", "glance"] and "start" in new.calls
    assert len(workers.started) == 2 and len(workers.reformed) == 1  # started ahead, placed
    assert "no live re-formation for this node (rank 0 is stuck" in caplog.text
    assert "leaving the job for now: the other 1 node(s) re-form in place" in caplog.text


@pytest.mark.parametrize(
    ("first", "gone"),
    [(round_of(1, "a", "b"), "b"), (round_of(1, "a", "b", "c", joined=("b",)), "c")],
    ids=["its-one-peer", "b-new"],
)
def test_a_node_that_alone_holds_what_it_trained_stays_in_when_its_workers_cannot_be_held(
    first: RoundRecord, gone: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The node lost was the only other one that trained with a (b is new in the round,
    and has not trained a step), so a does not step out (the round without it would go
    on from older state): new workers follow in the next round, as before."""
    lost = Change(RoundEnd.LOST, f"lost {gone}", (gone,))
    job = FakeJob([first, round_of(2, "a", *(["b"] if gone == "c" else []))], [None, lost])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.held = (Held.FAILED, "rank 0 is stuck in a collective ...")
    rejoined: list[FakeJob] = []
    with caplog.at_level(logging.INFO):
        a = agent(job, workers, step_out=_step_out, rejoin=lambda: rejoined.append(job) or job)
        assert a.run() == 0
    assert rejoined == [] and workers.actions == ["abandon", "stop 1"]
    assert len(workers.started) == 2 and "no live re-formation (rank 0 is stuck" in caplog.text


FROZEN = WorkerFailure(0, 0, 9, -19, 1.0, "hung: no progress for 4s (process stopped)")


@pytest.mark.parametrize("others", [("b", "c"), ("c",)], ids=["steps-out", "stays-in"])
def test_a_worker_that_hangs_as_it_is_asked_to_let_go_is_this_nodes_own_failure(
    others: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """c is lost, and a's worker freezes as it is asked to let go for the re-formation:
    the hold ends by the learned allowance. Unlike a worker stuck in a send to c, that is
    a's own fault: it is reported (the hung rank, its process state) and a's restart is
    charged as a hang, whether a steps out for b to go on or stays in (c was its only
    peer) and takes new workers (the item left in stop 48: uncharged)."""
    lost = Change(RoundEnd.LOST, "lost c", ("c",))
    old = FakeJob([round_of(1, "a", *others)], [None, lost])
    if "b" in others:
        new = FakeJob([round_of(3, "b", "a", cause=RoundCause.RESIZE)])
        two = round_of(2, "b", cause=RoundCause.LOST)
        new.glances.append(Glance(two))
        new.glance_view = Glance(two, leader=NodeRecord("b", "10.0.0.1", 2, in_place=True))
    else:
        old.rounds.append(round_of(2, "a", cause=RoundCause.LOST))
        new = old
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.held = (Held.HUNG, f"rank 0 did not let go: {FROZEN.message}")
    workers.hold_frozen = [FROZEN]
    metrics = AgentMetrics("job", "a", 0, "dev", workers=lambda: [])
    with caplog.at_level(logging.INFO):
        a = ahead_agent(old, workers, step_out=_step_out, rejoin=lambda: new, metrics=metrics)
        assert a.run() == 0
    [report] = old.reported
    assert report.summary.startswith("rank 0 (local_rank 0) on a: ") and "stopped" in report.summary
    assert workers.actions[:2] == ["abandon", "stop 1"] and len(workers.started) == 2
    assert _sample(metrics.registry, "elastic_run_restarts_total", cause="hang") == 1
    assert _sample(metrics.registry, "elastic_run_restarts_total", cause="member_lost") == 0
    assert "a hang of this node's own, reported" in caplog.text
    stepped = "leaving the job for now" in caplog.text
    assert stepped == ("b" in others), caplog.text


def test_a_node_whose_workers_cannot_be_held_as_the_only_other_member_leaves_stays_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """b, the only other member, leaves (it goes with what it holds), and a's workers
    cannot be held as the round re-forms for it: a does not step out for b to go on, but
    takes new workers in the next round (chaos seed 35: b stepped out as e left, and a
    standby formed a round alone from step 0)."""
    leaving = Change(RoundEnd.LEAVING, "b leaving", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a")], [None, leaving])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    workers.held = (Held.FAILED, "rank 0 is stuck in a collective ...")
    rejoined: list[FakeJob] = []
    with caplog.at_level(logging.INFO):
        a = agent(job, workers, step_out=_step_out, rejoin=lambda: rejoined.append(job) or job)
        assert a.run() == 0
    assert rejoined == [] and len(workers.started) == 2, job.calls
    assert "leaving the job for now" not in caplog.text


def test_a_node_whose_worker_fails_as_the_only_other_member_leaves_stays_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """a's worker fails as etcd already shows b, the only other member, leaving: b holds
    nothing a could step out to leave with it, so a restarts in the round (chaos seed 27:
    it stepped out for b to go on, and the job's state went with both)."""
    leaving = Change(RoundEnd.LEAVING, "b leaving", ("b",))
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a", restarts=1)], [None, leaving])
    workers = FakeWorkers([RUNNING, (GroupState.FAILED, [CRASH]), RUNNING, SUCCEEDED])
    workers.live = True
    rejoined: list[FakeJob] = []
    with caplog.at_level(logging.INFO):
        a = agent(job, workers, step_out=_step_out, rejoin=lambda: rejoined.append(job) or job)
        assert a.run() == 0
    assert rejoined == [] and len(workers.started) == 2, job.calls
    assert "leaving the job for now" not in caplog.text


def test_a_failure_that_spends_the_restart_budget_says_so_and_steps_out_for_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--max-restarts 0 (torchrun's default), a's worker fails in a live round of three:
    no round follows, so a does not leave "for now" to come back (it said so, then the
    job failed), but says the budget is spent and ends with the job."""
    failed = ClosedRecord(JobOutcome.FAILED, "budget spent")
    job = FakeJob([round_of(1, "a", "b", "c"), RendezvousClosedError("job failed", failed)])
    workers = FakeWorkers([RUNNING, (GroupState.FAILED, [CRASH])])
    workers.live = True
    rejoined: list[FakeJob] = []
    with caplog.at_level(logging.INFO):
        a = agent(
            job,
            workers,
            step_out=_step_out,
            rejoin=lambda: rejoined.append(job) or job,
            max_restarts=0,
        )
        assert a.run() == 1
    assert rejoined == [] and "leaving the job for now" not in caplog.text
    said = "the restart budget is spent (--max-restarts 0, all used): the job fails"
    assert job.reported and said in caplog.text


@pytest.mark.parametrize(("restarts", "spent"), [(1, False), (2, True)])
def test_a_peer_failure_that_spends_the_restart_budget_says_so(
    caplog: pytest.LogCaptureFixture, restarts: int, spent: bool
) -> None:
    """b's workers fail in a round with 1 (then 2) restarts behind it, --max-restarts 2:
    a says whether the job goes on, not "workers re-form live" before it fails."""
    failed = Change(RoundEnd.PEER_FAILED, "workers failed on b", ("b",))
    job = FakeJob([round_of(1, "a", "b", restarts=restarts), round_of(2, "a")], [None, failed])
    workers = FakeWorkers([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    workers.live = True
    with caplog.at_level(logging.INFO):
        assert agent(job, workers, max_restarts=2).run() == 0
    said = "workers failed on b: the restart budget is spent (--max-restarts 2, all used)"
    assert (said in caplog.text) is spent
    assert ("workers failed on b: workers re-form live" in caplog.text) is not spent


def test_a_failed_worker_of_a_job_that_cannot_go_on_without_this_node_restarts_in_it() -> None:
    """Two nodes, at least two: without this one no round forms, so it stays in."""
    job = FakeJob([round_of(1, "a", "b"), round_of(2, "a", "b", restarts=1)])
    workers = FakeWorkers([RUNNING, (GroupState.FAILED, [CRASH]), RUNNING, SUCCEEDED])
    workers.live = True

    def two_at_least(were_live: bool, size: int, alone: bool, spent: bool) -> lobby.StepOut:
        return lobby.step_out(
            were_live, size, alone, spent, in_place=True, min_nodes=2, static=False
        )

    rejoined: list[FakeJob] = []
    a = agent(job, workers, step_out=two_at_least, rejoin=lambda: rejoined.append(job) or job)
    assert a.run() == 0
    assert rejoined == [] and len(workers.started) == 2 and "shutdown" not in job.calls[:-1]


def _c_steps_out(
    first: RoundRecord, then: RoundRecord, seen: Glance
) -> tuple[FakeJob, FakeJob, FakeWorkers]:
    """c, a member of ``first``, whose worker fails, and which steps out: its rendezvous
    (``old``), the one it joins again with (``new``: ``then`` is its next round, ``seen``
    what it reads of the job while out) and its workers."""
    old = FakeJob([first])
    old.node_id = "c"
    new = FakeJob([then])
    new.node_id = "c"
    new.glance_view = seen
    workers = FakeWorkers([RUNNING, (GroupState.FAILED, [CRASH]), RUNNING, SUCCEEDED])
    workers.live = True
    return old, new, workers


def test_a_node_out_of_the_job_joins_again_when_the_others_are_too_few(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """c's worker hung; c stepped out for a and b to go on (min 2), and b was lost
    meanwhile: a alone cannot re-form, so c joins again at once (it waited OUT_MAX)."""
    leader = NodeRecord(id="a", addr="10.0.0.1", nproc=1)
    old, new, workers = _c_steps_out(
        round_of(1, "a", "b", "c"),
        round_of(2, "a", "c", restarts=1),
        Glance(round_of(1, "a", "b", "c"), leader=leader, present=1),
    )
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        a = agent(old, workers, step_out=_step_out, rejoin=lambda: new, back=_back)
        assert a.run() == 0
    assert time.monotonic() - started < 5.0
    assert "below the minimum of 2: they cannot re-form without this node" in caplog.text


def test_a_node_out_of_the_job_after_an_outage_does_not_count_the_others_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """c's worker failed while etcd was away, and c stepped out as etcd answered again.
    Every lease went with the outage: a and b's records come back only as each carries on,
    so c first counts 0 others. Within a TTL of the outage that count is not known: c
    waits for a and b to re-form without it (before: it said "the others are 0 node(s),
    below the minimum of 2" and joined again at once, into the round they re-formed; or,
    the lead's key gone as well, "no node leads the job" after VACANT_MAX; or, the leader
    having read the job before c's failure report, "the leader waits for this node")."""
    leader = NodeRecord(id="a", addr="10.0.0.1", nproc=1)
    old, new, workers = _c_steps_out(
        round_of(1, "a", "b", "c"),
        round_of(3, "a", "b", "c", restarts=1),
        Glance(round_of(2, "a", "b"), leader=leader, present=2),  # they went on
    )
    old.outage_until = time.monotonic() + 8.0  # etcd answered moments ago
    # 25 looks, 0.05 s apart: longer than VACANT_MAX (no lead either), within the grace
    waits = NodeRecord(id="a", addr="10.0.0.1", nproc=1, awaits=("c",))  # before c's report
    new.glances.extend([Glance(round_of(1, "a", "b", "c"), present=0)] * 25)
    new.glances.extend([Glance(round_of(1, "a", "b", "c"), leader=waits, present=2)] * 5)
    with caplog.at_level(logging.INFO):
        a = agent(old, workers, step_out=_step_out, rejoin=lambda: new, back=_back)
        assert a.run() == 0
    assert "below the minimum" not in caplog.text and "no node leads" not in caplog.text
    assert "waits for this node" not in caplog.text, caplog.text
    assert new.calls.count("glance") >= 31 and new.calls.index("start") > 30, new.calls


def test_a_node_out_of_the_job_joins_again_at_once_when_the_leader_waits_for_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """c's worker hung and c stepped out; so did a (both at once, each for the other to
    go on). The leader, x, holds the next round for them (its record says so): c joins
    again at once, registered before its new workers start (the round waits on it,
    nobody trains meanwhile), not once a round formed without it (that one would begin
    from older state)."""
    leader = NodeRecord(id="x", addr="10.0.0.1", nproc=1, awaits=("a", "c"))
    old, new, workers = _c_steps_out(
        round_of(1, "a", "c"),
        round_of(2, "c", "x", restarts=1),
        Glance(round_of(1, "a", "c"), leader=leader, present=3),
    )
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        a = ahead_agent(old, workers, step_out=_step_out, rejoin=lambda: new, back=_back)
        assert a.run() == 0
    assert time.monotonic() - started < 5.0
    assert "the leader waits for this node" in caplog.text
    assert new.calls[:2] == ["glance", "start"]  # no workers started ahead: in at once
    assert len(workers.started) == 2 and workers.reformed == []


def test_a_node_out_of_the_job_joins_again_when_no_one_is_left_to_re_form(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every node's worker failed at once (a bug in the script): all stepped out, the lead
    is vacant and no round will form without them; c joins again within a second, not
    after OUT_MAX."""
    old, new, workers = _c_steps_out(
        round_of(1, "a", "c"),
        round_of(2, "a", "c", restarts=1),
        Glance(round_of(1, "a", "c")),  # no newer round, no leader
    )
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        a = agent(old, workers, step_out=_step_out, rejoin=lambda: new)
        assert a.run() == 0
    assert time.monotonic() - started < 5.0
    assert "no node leads the job: joining again" in caplog.text
    assert new.calls[-3:] == ["start", "next_round", "shutdown"] and len(workers.started) == 2


def _told_to_leave_alone(
    job: FakeJob, workers: FakeWorkers, **kw: Any
) -> tuple[Agent, Callable[[], None]]:
    """An agent whose workers resumed round 1 from step 40 and trained no further; ``tell()``
    sends it SIGTERM from inside its next poll of the workers."""
    a = agent(job, workers, **kw)
    workers.last = 40
    told: list[int] = []

    def poll() -> tuple[GroupState, list[WorkerFailure]]:
        if told and told[-1] == 0:
            told[-1] = 1
            a.on_signal(signal.SIGTERM)
        return RUNNING

    workers.poll = poll  # type: ignore[method-assign]
    workers.restored = lambda: 40  # type: ignore[method-assign]
    return a, lambda: told.append(0)


def test_a_node_told_to_leave_while_alone_trains_on_until_a_newcomers_round_took_a_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Round 1 is a alone; SIGTERM comes while n is registered to join. a trains on: n
    joins (round 2), and a leaves once its workers trained past the step round 2 resumed
    from (n's ranks received it and keep it in their node's slot)."""
    waiting = Change(RoundEnd.WAITING, "n waiting to join", ("n",))
    job = FakeJob([round_of(1, "a"), round_of(2, "a", "n", joined=("n",))], [None, waiting])
    job.present = 1
    workers = FakeWorkers([])
    a, tell = _told_to_leave_alone(job, workers, handover_timeout=30.0)
    tell()
    said: deque[int | None] = deque([None, None, 40, 40])  # round 2: not said, then 40

    def restored() -> int | None:
        if a.round is None or a.round.number == 1:
            return 40
        answer = said.popleft() if said else 40
        if not said:
            workers.last = 41  # the first step of round 2
        return answer

    workers.restored = restored  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        assert a.run() == 143
    assert len(workers.started) == 2 and workers.actions == ["drain SIGTERM", "drain SIGTERM"]
    assert job.calls.index("announce_leaving") > job.calls.index("next_round", 2)
    assert "alone holds the job's newest state (step 40)" in caplog.text
    assert "the other nodes of round 2 hold step 41 now: leaving the job now" in caplog.text


def test_a_node_handing_over_leaves_at_once_on_a_second_signal_or_at_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for again in (True, False):
        job = FakeJob([round_of(1, "a")])
        job.present = 1  # n registered, but never joins
        workers = FakeWorkers([])
        a, tell = _told_to_leave_alone(job, workers, handover_timeout=30.0 if again else 0.2)
        tell()
        if again:
            deferred = threading.Event()
            threading.Thread(
                target=lambda a=a, d=deferred: d.wait(5) and a.on_signal(signal.SIGINT),
                daemon=True,
            ).start()
            job.check = lambda d=deferred: d.set()  # type: ignore[method-assign,misc]
        started = time.monotonic()
        with caplog.at_level(logging.INFO):
            code = a.run()
        assert time.monotonic() - started < 5
        assert job.calls.count("next_round") == 1 and workers.actions == ["drain SIGTERM"]
        assert code == 143, again  # the first signal's (SIGTERM), as without the handover
    assert "not handed over within 0.2s: leaving the job" in caplog.text


def test_a_node_told_to_leave_as_its_workers_stop_for_a_newcomer_hands_over_too() -> None:
    """The signal comes while a's workers stop for n's join (a held it alone): a waits
    for the round with n as it would have, and leaves once it trained a step."""
    waiting = Change(RoundEnd.WAITING, "n waiting to join", ("n",))
    job = FakeJob([round_of(1, "a"), round_of(2, "a", "n", joined=("n",))], [waiting])
    job.present = 1
    workers = FakeWorkers([])
    workers.last = 40
    a = agent(job, workers, handover_timeout=30.0)

    def drain(sig: int, timeout: float, let_go: Callable[[], None] | None = None) -> Drained:
        workers.actions.append(f"drain {signal.Signals(sig).name}")
        if len(workers.actions) == 1:
            a.on_signal(signal.SIGTERM)  # as the workers stop for the resize
        return Drained.STOPPED

    said: deque[int | None] = deque([40, None, 40])  # round 1; round 2: not yet, then 40

    def restored() -> int | None:
        answer = said.popleft() if said else 40
        if not said:
            workers.last = 41  # round 2's first step
        return answer

    workers.drain = drain  # type: ignore[method-assign]
    workers.restored = restored  # type: ignore[method-assign]
    assert a.run() == 143
    assert len(workers.started) == 2  # round 2 formed and its workers trained
    assert job.calls.index("announce_leaving") > job.calls.index("next_round", 2)


def test_a_failed_worker_whose_node_alone_holds_the_newest_state_restarts_in_the_round() -> None:
    """n joined a's round and has not trained a step with it when a's worker fails: the
    others stepping on without a would start from an older state, so a stays in."""
    job = FakeJob([round_of(1, "a", "n", joined=("n",)), round_of(2, "a", "n", restarts=1)])
    workers = FakeWorkers([RUNNING, (GroupState.FAILED, [CRASH]), RUNNING, SUCCEEDED])
    workers.live = True
    workers.last = 40  # trained alone before n came
    workers.restored = lambda: None  # type: ignore[method-assign]  # not resumed in round 1
    rejoined: list[FakeJob] = []
    a = agent(job, workers, step_out=_step_out, rejoin=lambda: rejoined.append(job) or job)
    assert a.run() == 0
    assert rejoined == [] and len(workers.started) == 2  # new workers, in round 2
    assert "no other node of the round holds" in a._stepping
