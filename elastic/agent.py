"""The agent: a small state machine that joins rounds, runs workers and reacts.

    JOINING -> RUNNING -> (RESIZING | RESTARTING) -> RUNNING ... -> SUCCEEDED | FAILED

| event                                   | reaction                                          |
|-----------------------------------------|---------------------------------------------------|
| round formed, this node a member        | start workers with torchrun's environment         |
| a member lost (crash, freeze, cut off)  | stop local workers now, re-form; no restart       |
| a node waiting and room, a peer leaving | drain: State users save at their next step and    |
|                                         | exit 75; others get SIGTERM. Then re-form         |
| workers exited 75 (saved for a resize)  | re-form; not a failure                            |
| a worker hung (no progress reported)    | as a failure (--worker-hang-timeout)              |
| a local worker failed                   | stop the rest, report it (the job charges one     |
|                                         | restart), re-form; budget spent: exit 1 w/ cause  |
| all local workers exited 0              | close the job, leave, exit 0                      |
| job closed by another node              | let local workers finish, exit 0 (or 1 if failed) |
| this node fenced (lease gone)           | kill stale workers at once, join as a newcomer    |
| SIGTERM/SIGINT/...                      | say we leave, forward, grace, kill, revoke, exit  |
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from dataclasses import dataclass

from elastic import store
from elastic.failures import WorkerFailure, format_report, summarize
from elastic.metrics import AgentMetrics
from elastic.worker_env import Placement
from elastic.workers import GroupState, WorkerGroup
from rendezvous.errors import RendezvousCancelled, RendezvousClosedError, RendezvousError
from rendezvous.protocol import Change, Rendezvous
from rendezvous.records import RoundRecord

log = logging.getLogger("elastic.agent")

URGENT_GRACE = 1.0  # seconds a worker gets to die quietly when its round is already broken


class State(enum.Enum):
    JOINING = "joining"
    RUNNING = "running"
    RESIZING = "resizing"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class Outcome:
    """Why the monitor loop stopped watching the current round."""

    kind: str  # succeeded | failed | hung | stopped | change | signal
    failures: tuple[WorkerFailure, ...] = ()
    change: Change | None = None


class Agent:
    def __init__(
        self,
        rdzv: Rendezvous,
        workers: WorkerGroup,
        *,
        monitor_interval: float,
        shutdown_timeout: float,
        close_timeout: float,
        host: str,
        hang_timeout: float = 0.0,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.rdzv = rdzv
        self.workers = workers
        self.monitor_interval = monitor_interval
        self.shutdown_timeout = shutdown_timeout
        self.close_timeout = close_timeout
        self.hang_timeout = hang_timeout
        self.host = host
        self.metrics = metrics
        self._state = State.JOINING
        self.signal: int | None = None
        self.round: RoundRecord | None = None
        self._cancel = threading.Event()
        self._change_at = time.monotonic()
        self._change_why = "start"
        self._lost_cause: str | None = None  # failure | resize, for the time it costs
        self._store: object | None = None  # the round's TCPStore, on the rank-0 node only

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, value: State) -> None:
        self._state = value
        if self.metrics is not None:
            self.metrics.set_state(value.value)

    def health(self) -> dict:
        """What /healthz says: this agent's state and round."""
        r = self.round
        return {
            "node": self.node_id,
            "job": self.rdzv.options.run_id,
            "state": self.state.value,
            "round": r.number if r else 0,
            "world_size": r.world_size if r else 0,
            "workers": sum(1 for _ in self.workers.pids),
        }

    @property
    def node_id(self) -> str:
        return self.rdzv.me.id

    # -- signals --------------------------------------------------------------------------
    def on_signal(self, signum: int) -> None:
        """From the signal handler: remember the first signal and wake the main loop."""
        if self.signal is None:
            self.signal = signum
        self._cancel.set()
        self.rdzv.mirror.poke()

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends for this node; returns the process exit code."""
        try:
            self.rdzv.start()
        except RendezvousClosedError as e:
            return self._closed_on_arrival(e)
        previous: RoundRecord | None = None
        while True:
            if self.signal is not None:
                return self._leave()
            self.state = State.JOINING
            asked = time.monotonic()
            try:
                r = self.rdzv.next_round(cancel=self._cancel)
            except RendezvousCancelled:
                return self._leave()
            except RendezvousClosedError as e:
                return self._closed(e)
            try:
                self._start(r, previous, time.monotonic() - asked)
            except store.StoreError as e:
                log.error("%s; leaving this round", e)
                self._change_why = str(e)
                self.rdzv.finish_round()
                continue
            previous = r
            outcome = self._monitor()
            code = self._react(outcome)
            self._store = None  # the round's store goes with the round
            if code is not None:
                return code

    def _start(self, r: RoundRecord, previous: RoundRecord | None, waited: float) -> None:
        group_rank = r.rank_of(self.node_id)
        nproc = r.members[group_rank].nproc
        base = r.base_rank(group_rank)
        placements = [
            Placement(
                local_rank=lr,
                rank=base + lr,
                group_rank=group_rank,
                local_world_size=nproc,
                world_size=r.world_size,
                group_world_size=len(r.members),
                master_addr=r.master_addr,
                master_port=r.master_port,
                restart_count=r.restarts,
            )
            for lr in range(nproc)
        ]
        if group_rank == 0:
            self._store = store.host(r.master_addr, r.master_port)
        self.workers.start(placements)
        self.round = r
        took = time.monotonic() - self._change_at
        if self.metrics is not None:
            if self._lost_cause is not None:
                self.metrics.lost(self._lost_cause, took)
            self.metrics.round_started(
                r.number,
                r.world_size,
                len(r.members),
                group_rank,
                r.restarts,
                joined=len(r.joined) if previous is not None else 0,
                left=len(r.left),
                lost=len(r.lost),
                waited=waited,
                workers=nproc,
            )
        self.state = State.RUNNING
        log.info("%s", membership_line(r, previous, took, self._change_why))
        ranks = f"rank {base}" if nproc == 1 else f"ranks {base}-{base + nproc - 1}"
        log.info(
            "node %s: group rank %d, %s, master %s:%d, restarts %d",
            self.node_id,
            group_rank,
            ranks,
            r.master_addr,
            r.master_port,
            r.restarts,
        )

    def _monitor(self) -> Outcome:
        while True:
            version = self.rdzv.version
            if self.signal is not None:
                return Outcome("signal")
            state, failures = self.workers.poll()
            if state is GroupState.SUCCEEDED:
                return Outcome("succeeded")
            if state is GroupState.FAILED:
                return Outcome("failed", tuple(failures))
            if state is GroupState.STOPPED:
                return Outcome("stopped")
            if self.hang_timeout > 0:
                hung = self.workers.hung(self.hang_timeout)
                if hung:
                    return Outcome("hung", tuple(hung))
            change = self.rdzv.check()
            if change is not None:
                return Outcome("change", change=change)
            if self.metrics is not None:
                self.metrics.tick()
            self.rdzv.wait(version, self.monitor_interval)

    def _react(self, o: Outcome) -> int | None:
        """Act on an outcome; an int is the exit code, None means join the next round."""
        self._change_at = time.monotonic()
        pids = self.workers.pids
        code = self._respond(o)
        cause = _restart_cause(o) if code is None else None
        self._lost_cause = _LOST.get(cause) if cause else None
        if self.metrics is not None:
            self.metrics.workers_stopped(cause)
            for pid in pids:
                self.metrics.worker_exited(pid)
        return code

    def _respond(self, o: Outcome) -> int | None:
        if o.kind == "signal":
            return self._leave()
        if o.kind == "succeeded":
            return self._succeeded()
        if o.kind == "stopped":
            log.info("workers saved their state and stopped for a resize")
            self._change_why = "workers stopped for a resize"
            self.state = State.RESIZING
            return None
        if o.kind in ("failed", "hung"):
            self.state = State.RESTARTING
            self.workers.stop(URGENT_GRACE)
            detail = summarize(list(o.failures), self.node_id, self.host)
            log.error("workers failed: %s", detail["summary"])
            self._change_why = f"workers failed on {self.node_id}"
            try:
                self.rdzv.report_failure(detail)
            except RendezvousError as e:
                log.warning("could not report the failure to etcd: %s", e)
            return None
        change = o.change
        assert change is not None
        self._change_why = change.detail
        if change.kind == "closed":
            return self._finish_after_close()
        if change.kind == "fenced":
            log.warning("fenced: %s; killing stale workers and joining again", change.detail)
            self.workers.stop(0)
            return None
        if change.urgent:
            log.warning("%s: stopping workers now", change.detail)
            self.state = State.RESTARTING
            self.workers.stop(URGENT_GRACE)
        else:
            log.info("%s: resizing", change.detail)
            self.state = State.RESIZING
            self._drain(signal.SIGTERM)
        return None

    def _drain(self, sig: int) -> None:
        """Stop workers without losing a step: State users save at their next commit and
        exit EXIT_RESIZE; other scripts get ``sig``. SIGKILL after --shutdown-timeout."""
        if self.workers.use_state:
            self.workers.request_stop()
        else:
            self.workers.signal(sig)
        if not self.workers.wait(self.shutdown_timeout):
            log.warning(
                "workers still running %gs after being asked to stop; killing them",
                self.shutdown_timeout,
            )
        self.workers.stop(0)

    # -- endings --------------------------------------------------------------------------
    def _succeeded(self) -> int:
        self.state = State.SUCCEEDED
        try:
            if self.rdzv.close("succeeded", f"all workers succeeded ({self.node_id} first)"):
                log.info("all workers succeeded; job closed")
            else:
                log.info("all workers succeeded")
        except RendezvousError as e:
            log.warning("could not mark the job closed in etcd: %s", e)
        self.rdzv.shutdown(leave=True)
        return 0

    def _finish_after_close(self) -> int:
        """Another node closed the job: let local workers finish, then leave."""
        view = self.rdzv.mirror.view()
        closed = view.closed_record
        if closed is not None and closed.state == "failed":
            self.workers.stop(URGENT_GRACE)
            self.rdzv.shutdown(leave=True)
            return self._report_failed(closed.reason, closed.root_cause)
        if not self.workers.wait(self.close_timeout):
            log.warning(
                "job closed as succeeded but local workers still run after "
                "close_timeout=%gs; stopping them",
                self.close_timeout,
            )
            self.workers.stop(self.shutdown_timeout)
        state, failures = self.workers.poll()
        self.rdzv.shutdown(leave=True)
        if state is GroupState.FAILED:
            detail = {**summarize(failures, self.node_id, self.host), "node": self.node_id}
            return self._report_failed("workers failed after the job was closed", detail)
        self.state = State.SUCCEEDED
        log.info("job finished")
        return 0

    def _closed(self, e: RendezvousClosedError) -> int:
        self.rdzv.shutdown(leave=True)
        if e.state == "failed":
            closed = self.rdzv.mirror.view().closed_record
            return self._report_failed(e.reason, closed.root_cause if closed else {})
        self.state = State.SUCCEEDED
        log.info("%s", e)
        return 0

    def _closed_on_arrival(self, e: RendezvousClosedError) -> int:
        if e.state == "failed":
            return self._report_failed(e.reason, {})
        log.info("%s; nothing to do (to run the job again, give it a new --rdzv-id)", e)
        return 0

    def _report_failed(self, reason: str, root: dict) -> int:
        self.state = State.FAILED
        log.error("%s", format_report(f"job {self.rdzv.options.run_id} FAILED: {reason}", root))
        return 1

    def _leave(self) -> int:
        """Leave on a signal: others drain, our workers get the signal, then we go."""
        sig = self.signal or signal.SIGTERM
        name = signal.Signals(sig).name
        log.warning("received %s: leaving the job", name)
        try:
            self.rdzv.announce_leaving()
        except RendezvousError as e:
            log.warning("could not announce leaving: %s", e)
        self._drain(sig)
        self.rdzv.shutdown(leave=True)
        return 128 + int(sig)


_LOST = {
    "failure": "failure",
    "hang": "failure",
    "member_lost": "failure",
    "fenced": "failure",
    "member_left": "resize",
    "resize": "resize",
}


def _restart_cause(o: Outcome) -> str:
    """The metrics' restart cause for an outcome that leads to a new round."""
    if o.kind in ("failed", "hung"):
        return "failure" if o.kind == "failed" else "hang"
    if o.kind == "stopped" or o.change is None:
        return "resize"
    return {
        "lost": "member_lost",
        "left": "member_left",
        "fenced": "fenced",
        "failed": "failure",
    }.get(o.change.kind, "resize")


def membership_line(r: RoundRecord, previous: RoundRecord | None, took: float, why: str) -> str:
    """One line per membership change: who left or joined, the new size, how long it took."""
    nodes = ", ".join(m.id for m in r.members)
    parts = [f"round {r.number}: world size {r.world_size} on {len(r.members)} node(s) [{nodes}]"]
    if r.lost:
        parts.append(f"lost {', '.join(r.lost)}")
    if r.left:
        parts.append(f"left {', '.join(r.left)}")
    if previous is not None and r.joined:
        parts.append(f"joined {', '.join(r.joined)}")
    if r.cause == "failure":
        parts.append(f"restart {r.restarts} after a worker failure")
    parts.append(f"{took:.2f}s after {why}")
    return "; ".join(parts)
