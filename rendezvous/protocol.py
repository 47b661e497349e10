"""One node's part in a job's rendezvous on etcd v3: the rounds, around ``rules``.

Knows nothing about processes: the agent (or torch's agent through the handler) asks it
for the next round, tells it when this node is done with a round, and asks it whether
anything happened that should end the current one (``check``, a read of the view). The
parts: ``Session`` (this node's lease and record), ``Lead`` (the one node that writes
rounds and gives notice, on its session), ``JobMirror`` (the watch-fed view of the job);
what the answers are is decided by the pure functions in ``rules``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from etcd3.utils import prefix_range_end

from rendezvous import records, rules
from rendezvous.arrival import Arrival, others
from rendezvous.client import EtcdClient
from rendezvous.config import RendezvousOptions
from rendezvous.errors import (
    EtcdUnavailableError,
    LeaseLostError,
    RendezvousCancelled,
    RendezvousError,
    RendezvousTimeoutError,
)
from rendezvous.lead import PROBE_EVERY, Lead
from rendezvous.mirror import JobMirror, glance
from rendezvous.net import free_port
from rendezvous.progress import ProgressWriter
from rendezvous.records import (
    ClosedRecord,
    FailureRecord,
    FailureReport,
    JobOutcome,
    ProgressRecord,
    RoundRecord,
)
from rendezvous.rules import Change, Plan, lean_round_end, plan, round_end
from rendezvous.session import RETRIED_TIMEOUT, NodeSpec, Session, closed_error
from rendezvous.view import KV, Glance, JobView

__all__ = ["NodeSpec", "Rendezvous"]

log = logging.getLogger(__name__)

# seconds a node waits for the leader to form a round before it probes it, and between
# probes: at 10,000 nodes, at most 2,000 connections a second to the leader's probe port
WAITING_PROBE = 5.0


class Rendezvous:
    def __init__(
        self, client: EtcdClient, options: RendezvousOptions, me: NodeSpec, max_restarts: int = 0
    ) -> None:
        self.alive_at = time.monotonic()  # last turn of next_round: liveness
        self.client = client
        self.options = options
        self.me = me
        self.max_restarts = max_restarts
        self.mirror = JobMirror(
            client, options.job_prefix, own=me.id, expected_size=options.max_nodes
        )
        self.session = Session(
            client, options, me, on_change=self.mirror.poke, on_record=self.mirror.record_own
        )
        self.lead = Lead(self.session, client, self.mirror)
        self.round: RoundRecord | None = None  # the round this node is (or was last) in
        self._in_place = False  # its workers re-form in place: said in its record while it leads
        self._progress = (-1, 0.0, 0)  # the job's progress: (step written, when, round)
        self._progress_writer = ProgressWriter(
            client, self.key(records.PROGRESS), self.key(records.ROUND), RETRIED_TIMEOUT
        )
        self._round_rev = 0  # the revision that wrote self.round's header
        self._arrival = Arrival(client, options, me.id)
        self._job = os.urandom(8).hex()  # this run's token, if this node writes progress first

    @property
    def node_id(self) -> str:
        return self.me.id

    @property
    def run_id(self) -> str:
        return self.options.run_id

    @property
    def lease_ttl(self) -> int:
        return self.options.lease_ttl

    @property
    def rev(self) -> int:
        """This node's incarnation: its record's create revision."""
        return self.session.rev

    @property
    def leads(self) -> bool:
        """This node holds the lead now: it writes the rounds (and has rank 0 in the first)."""
        return self.lead.holds(self.mirror.view())

    def poke(self) -> None:
        """Wake whoever waits on the job (a signal arrived, a deadline moved)."""
        self.mirror.poke()

    def probe_members(self, broken: bool = False) -> None:
        """Find out now whether a member of this node's round is gone: a member whose agent
        refuses its probe port loses its lease at once (see ``probe``). The leader probes
        them all; the successors probe the leader; the others hear of it from etcd, or,
        once their workers' group broke (``broken``), probe their neighbours in the
        round: the leader's own workers may be held where they report nothing."""
        view = self.mirror.view()
        if not self.mirror.full:
            if rules.successor(self.round, self.me.id, self.rev):
                self.lead.probe_leader(view)
            if broken and self.round is not None:
                self.lead.probe_neighbours(self.round)
        elif self.round is not None:
            self.lead.probe_round(view, self.round)

    def key(self, rel: str) -> str:
        return self.options.job_prefix + rel

    # -- lifecycle ------------------------------------------------------------------------
    def glance(self, timeout: float | None = None) -> Glance:
        """The job as a node sees it before registering (``mirror.glance``); ``timeout``
        bounds each of its reads (a loop that looks again soon passes a short one: etcd
        frozen would hold it for the connect timeout, three times)."""
        return glance(self.client, self.options.job_prefix, timeout)

    def announce_arrival(self) -> None:
        """Say in etcd that this node is on its way (its workers start before it
        registers: ``rendezvous.arrival``); withdrawn as it registers. Best effort."""
        try:
            self._arrival.announce(timeout=RETRIED_TIMEOUT)
        except RendezvousError as e:
            log.debug("could not say that this node is on its way: %s", e)

    def others(self) -> int:
        """The nodes other than this one registered in the job or on their way to it.
        Raises RendezvousError."""
        return others(self.client, self.options.job_prefix, self.me.id, RETRIED_TIMEOUT)

    def start(self, cancel: threading.Event | None = None) -> None:
        """Register this node and read the job, in one transaction; refuse a closed job.
        Raises RendezvousCancelled once ``cancel`` is set while etcd is away."""
        try:
            revision, kvs = self.session.register(
                self.mirror.lean_keys(), claim=self.lead.registration_claim, cancel=cancel
            )
        finally:
            self._arrival.withdraw()  # registered, its record says the rest
        try:
            self.mirror.start(initial=(revision, kvs))
            self._raise_if_closed(self.mirror.view())
        except RendezvousError:
            self.session.lease.revoke()
            raise
        self.round = None

    def shutdown(self, leave: bool = True, back: bool = False) -> None:
        """Stop the background threads; with ``leave`` the others see this node go at once,
        as a departure (its tombstone), not a loss; ``back``: for now (it steps out, and
        joins again as a newcomer)."""
        self._arrival.withdraw()  # one that never registered
        if self.session.closed:
            return
        self._progress_writer.stop()
        resign = self.lead.resignation(self.mirror.view()) if leave else None
        self.session.close(leave, resign, reachable=self.mirror.connected, back=back)
        self.mirror.stop()

    # -- rounds ---------------------------------------------------------------------------
    def _raise_if_closed(self, view: JobView) -> None:
        closed = view.closed
        if closed is not None:
            raise closed_error(self.options.run_id, closed)

    def _fenced(self, view: JobView) -> bool:
        return self.session.fenced(view, self.mirror.connected)

    def next_round(
        self,
        cancel: threading.Event | None = None,
        timeout: float | None = None,
        wake: Callable[[], bool] | None = None,
    ) -> RoundRecord:
        """Block until a new round that includes this node has formed; return it.

        Leaves the current round first (marks this node done with it). Takes part in
        forming the round when this node is the writer. Raises RendezvousClosedError
        when the job is over, RendezvousTimeoutError when fewer than MIN nodes are
        present for ``timeout`` (join_timeout) seconds, RendezvousCancelled once ``cancel``
        is set (wake the wait with ``mirror.poke()``) or ``wake`` (asked at each look at
        the job, at least once a second) says so.
        """
        if not self._fenced(self.mirror.view()):
            with contextlib.suppress(LeaseLostError):  # then it registers again below
                self.finish_round()
        timeout = self.options.join_timeout if timeout is None else timeout
        waiting_since = time.monotonic()
        deadline = waiting_since + timeout
        note = _Progress(deadline)
        rejoining = False  # fenced, and registering again failed while etcd was away
        while True:
            self.alive_at = time.monotonic()
            if cancel is not None and cancel.is_set():
                raise RendezvousCancelled("cancelled while waiting for the next round")
            if wake is not None and wake():
                raise RendezvousCancelled("woken while waiting for the next round")
            if self.session.closed:  # never join again once shut down (lease revoked)
                raise RendezvousCancelled("this node has left the job")
            if time.monotonic() >= deadline and self.session.outage() is not None:
                # the leader enforces the deadline; with etcd away, nobody can, for good
                raise RendezvousTimeoutError(
                    f"job {self.options.run_id!r}: no round formed within "
                    f"join_timeout={timeout:g}s, and etcd does not answer this node"
                )
            version = self.mirror.version
            view = self.mirror.view()
            self._raise_if_closed(view)
            if self._fenced(view):
                if not rejoining:
                    log.warning("this node's lease is gone; joining again as a new node")
                self.mirror.set_full(False)
                try:
                    self.session.register_again()
                except EtcdUnavailableError as e:  # etcd went away again: try once more
                    if not rejoining:
                        log.warning("could not join again yet: %s", e)
                    rejoining = True
                    self.mirror.wait(version, 1.0)
                    continue
                rejoining = False
                self.round = None
                continue
            r = view.round
            newer = r is not None and (self.round is None or r.number > self.round.number)
            if r is not None and newer and r.member(self.me.id, self.rev) is not None:
                self.round, self._round_rev = r, view.round_mod_revision
                return r
            if not self.lead.upkeep(view, self.round):
                # the leader forms the round: only its writing, or its going, matters here
                leader = view.leader.id if view.leader else "a leader"
                note.say(f"waiting for {leader} to form round {(r.number if r else 0) + 1}")
                if rules.successor(self.round, self.me.id, self.rev):
                    # a leader lost while the next round forms: found now, not at its TTL
                    self.lead.probe_leader(view)
                    self.mirror.wait(version, PROBE_EVERY)
                    continue
                if time.monotonic() - waiting_since >= WAITING_PROBE:
                    self.lead.probe_leader(view, every=WAITING_PROBE)
                self.mirror.wait(version, 1.0)
                continue
            self._say_in_place()
            if not self.mirror.complete:  # going full in another thread: the read is due
                self.mirror.wait(version, 0.5)
                continue
            view = self.mirror.view()
            self.lead.give_notice(view)
            p = plan(
                view,
                self.options.min_nodes,
                self.options.max_nodes,
                self.options.last_call_timeout,
                self.max_restarts,
                time.monotonic(),
                outage=self.session.outage(),
                proven=self.lead.proven,
                lease_ttl=self.options.lease_ttl,
            )
            note.say(p.reason)
            self._say_awaited(p)
            if p.writer is not None and p.writer != self.me.id:
                self.lead.hand_over(view, p.writer)  # the next round's rank 0 writes it
                continue
            if p.form:
                if p.budget_spent:
                    self._close_failed(view, p)
                elif self._write_round(view, p):
                    log.debug("wrote %s", p.reason)
                self.mirror.wait(version, 0.5)
                continue
            if p.busy:
                self.lead.probe_nodes(view, p.busy)
            if p.lapsed and view.round is not None and self.lead.probe_round(view, view.round):
                continue  # dead ones need not be waited for
            now = time.monotonic()
            if not p.enough_nodes and now >= deadline:
                raise RendezvousTimeoutError(
                    f"job {self.options.run_id!r}: {p.reason} after join_timeout={timeout:g}s"
                )
            wait = 1.0
            if p.wake_at is not None:
                wait = min(wait, max(p.wake_at - now, 0.01))
            if not p.enough_nodes:
                wait = min(wait, max(deadline - now, 0.01))
            self.mirror.wait(version, wait)

    def _say_awaited(self, p: Plan) -> None:
        """Leading, say in this node's record whom the next round waits for: a member out
        of the job for now reads it, and comes back at once rather than wait for the
        others to go on without it (two members out at once: each waits for the other).
        Not while etcd's watch is down (tried again at the next look)."""
        if not self.mirror.connected:
            return
        awaited = p.lapsed if not p.form else ()
        try:
            self.session.mark_awaits(tuple(sorted(awaited)))
        except RendezvousError as e:
            log.debug("could not say whom the next round waits for: %s", e)

    def _write_round(self, view: JobView, p: Plan) -> bool:
        current = view.round
        used = {current.master_port, current.store_port} if current else set()
        master_port = self.options.master_port or free_port("", avoid=used)
        store_port = free_port("", avoid=used | {master_port})
        rec = RoundRecord(
            number=rules.next_number(view),
            members=p.members,
            master_addr=self.me.addr,
            master_port=master_port,
            store_port=store_port,
            restarts=p.restarts,
            cause=p.cause,
            joined=p.joined,
            left=p.left,
            lost=p.lost,
            root_cause=p.root_cause,
            formed_at=time.time(),
        )
        ops = self.client.ops
        failures = self.key(records.FAILURES).encode()
        nodes = self.key(records.NODES).encode()
        # Guarded by the round's revision, and by no node having registered since the
        # view (one range compare, whatever the job's size): a watch that lags under load
        # would leave out a node that registered before the round formed (it waited a
        # whole round more). A per-member liveness compare would cap jobs at etcd's
        # --max-txn-ops (128): a member that died since the view was taken is seen as
        # lost by everyone right after, and the round re-forms without it.
        compare = [
            ops.mod(self.key(records.ROUND)) == view.round_mod_revision,
            ops.create(self.key(records.CLOSED)) == 0,
            ops.create(nodes, range_end=prefix_range_end(nodes)) < view.revision + 1,
        ]
        buckets = rec.encode_buckets()
        stale = range(len(buckets), current.buckets if current else 0)
        return self.client.txn(
            compare,
            [
                ops.put(self.key(records.ROUND), rec.encode()),
                *(ops.put(self.key(f"{records.MEMBERS}{b}"), v) for b, v in buckets.items()),
                *(ops.delete(self.key(f"{records.MEMBERS}{b}")) for b in stale),
                ops.delete(failures, range_end=prefix_range_end(failures)),
            ],
        )

    def _close_failed(self, view: JobView, p: Plan) -> None:
        root = p.root_cause
        where = f" on {root.node}" if root is not None and root.node else ""
        summary = root.summary if root is not None and root.summary else "workers failed"
        reason = (
            f"workers failed with the restart budget spent (--max-restarts "
            f"{self.max_restarts}, all used); last failure{where}: {summary}"
        )
        number = view.round.number if view.round else 0
        self.close(JobOutcome.FAILED, reason, root_cause=root, round_number=number)

    def close(
        self,
        state: JobOutcome,
        reason: str = "",
        root_cause: FailureReport | None = None,
        round_number: int | None = None,
    ) -> bool:
        """Mark the job over; the first to close wins. Late joiners see it and stop."""
        if round_number is None:
            round_number = self.round.number if self.round else 0
        rec = ClosedRecord(
            state=state,
            reason=reason,
            by=self.me.id,
            round=round_number,
            at=time.time(),
            root_cause=root_cause,
        )
        ops = self.client.ops
        key = self.key(records.CLOSED)
        return self.client.txn([ops.create(key) == 0], [ops.put(key, rec.encode())])

    def finish_round(self) -> None:
        """Tell the others this node has stopped the workers of its current round."""
        if self.round is not None:
            self.session.mark_done(self.round.number, reachable=self.mirror.connected)

    def report_failure(self, report: FailureReport, done: bool = True) -> None:
        """Record this node's worker failure for the current round and (``done``) leave
        the round; a node that is about to leave the job says nothing more, so that no
        round forms with it in between (it is LEFT once it has gone)."""
        if self.round is None:
            return
        rec = FailureRecord(
            node=self.me.id, round=self.round.number, time=time.time(), report=report
        )
        key, value = self.key(f"{records.FAILURES}{self.round.number}/{self.me.id}"), rec.encode()
        revision = self.client.put(key, value)
        # shown at once, like the record's "done" below: a view with the done and without
        # the report (still on its way through the watch) plans a restart nobody pays for
        self.mirror.record_own(KV(key, value, revision, revision, 0))
        if done:
            self.finish_round()

    def announce_in_place(self, in_place: bool) -> None:
        """Whether this node's workers re-form in place now: a newcomer starts its workers
        ahead of joining only when the leader's do (``elastic.agent.lobby``). Only the
        leader's record is read, so it is written only while this node leads: now, or as
        it claims the lead (a newcomer arriving just after a leader's loss reads it)."""
        self._in_place = in_place
        if self.leads:
            self._say_in_place()

    def _say_in_place(self) -> None:
        """This node leads: its record says what its workers do (a write only on a change;
        one that fails, or waits while etcd's watch is down, is tried again at the next
        ``upkeep``: during an outage the agent's loop goes on answering its signals)."""
        if not self.mirror.connected:
            return
        try:
            self.session.mark_in_place(self._in_place)
        except RendezvousError as e:
            log.debug("could not say whether the workers re-form in place: %s", e)

    def announce_leaving(self) -> None:
        """Say this node is about to leave, so the others drain for a resize (a leader
        gives the notice itself: nobody else reads its record)."""
        if self.session.mark_leaving(self.mirror.connected) and self.mirror.complete:
            self.lead.give_notice(self.mirror.view())

    def report_progress(self, step: int, final: bool = False) -> None:
        """Record ``step``, the newest this node's workers committed, as the job's
        (``records.ProgressRecord``, without a lease) where this node is rank 0 of its
        round and a write is due (``rules.progress_due``; ``final``: it leaves the job,
        and waits for the write). Only while that round is the job's: a node that was
        frozen, or cut off, and does not know yet that the job re-formed without it, never
        writes its older step over the new round's. The write runs on a thread of its own
        (``ProgressWriter``): the caller's loop does not wait on etcd. A write that fails
        waits for the next interval: the record only makes a later warning exact."""
        r = self.round
        if r is None or r.rank_of(self.me.id) != 0 or not self.mirror.connected:
            return
        writer = self._progress_writer
        if writer.busy and not final:
            return  # the write before it is still under way
        now = time.monotonic()
        written, at, number = self._progress
        if not rules.progress_due(step, written, now - at, r.size, number != r.number, final):
            return
        self._progress = (written, now, number)  # a write that fails waits an interval
        recorded = self.mirror.view().progress
        job = recorded.job if recorded is not None and recorded.job else self._job
        rec = ProgressRecord(
            step=step, node=self.me.id, round=r.number, at=time.time(), job=job, final=final
        )

        def done() -> None:
            self._progress = (step, now, rec.round)

        writer.submit(rec, self._round_rev, done)
        if final:
            self.flush_progress()

    def raise_progress(self, step: int, final: bool = False) -> None:
        """Record ``step`` as the job's progress, whatever round this node is in, if the
        record says less: a node whose round the job left behind (fenced) may hold the
        only copy of its workers' newest step, a record kept from them while etcd was
        away; should it die before a round takes that state, the round that resumes
        behind it says how many steps it trains again. So may a node that leaves while
        the record's writer, rank 0, lags (frozen, gone). Never lowers the record.
        ``final``: it leaves the job, and waits for the write while etcd answers."""
        recorded = self.mirror.view().progress
        if step < 0 or (recorded is not None and recorded.step >= step):
            return
        number = self.round.number if self.round is not None else 0
        rec = ProgressRecord(
            step=step, node=self.me.id, round=number, at=time.time(), job=self._job
        )
        self._progress_writer.raise_to(rec)
        if final and self.mirror.connected:
            self.flush_progress()

    def flush_progress(self, timeout: float = 2 * RETRIED_TIMEOUT) -> bool:
        """Wait (up to ``timeout``) for the progress handed over to be written, or to fail."""
        return self._progress_writer.flush(timeout)

    def progress(self) -> ProgressRecord | None:
        """The job's progress as recorded (``report_progress``), if any."""
        return self.mirror.view().progress

    # -- watching a running round ---------------------------------------------------------
    @property
    def version(self) -> int:
        return self.mirror.version

    def wait(self, version: int, timeout: float | None) -> int:
        """Block until anything in the job changes (or ``timeout``); returns the new version."""
        return self.mirror.wait(version, timeout)

    def outage(self) -> tuple[float, float] | None:
        """(now, until) while etcd has not answered this node lately, and a TTL after it
        answers again (``Session.outage``); None otherwise."""
        return self.session.outage()

    def upkeep(self) -> None:
        """The lead's part while a round runs: claim a vacant lead when the rules say so
        (switching the mirror to the whole job), and give the members notice of what the
        leader sees. Call it before ``check``; an unreachable etcd is left to the lease
        keeper to report."""
        try:
            if self.lead.upkeep(self.mirror.view(), self.round):
                self._say_in_place()
                if self.mirror.complete:
                    self.lead.give_notice(self.mirror.view())
        except RendezvousError as e:
            log.debug("lead upkeep failed: %s", e)

    def check(self) -> Change | None:
        """What, if anything, ends this node's current round (see ``round_end``), read from
        the view alone: the whole job when leading, else this node's share and the
        leader's notice. Writes nothing (``upkeep`` does)."""
        view = self.mirror.view()
        fenced = self._fenced(view)
        if not self.mirror.full:
            return lean_round_end(view, self.me.id, self.rev, self.round, fenced)
        if not self.mirror.complete:
            return None  # the full view is a moment away
        return round_end(
            view,
            self.me.id,
            self.rev,
            self.round,
            self.options.max_nodes,
            fenced,
            (time.monotonic(), self.options.last_call_timeout),
            self.session.outage(),
            self.lead.proven,
        )

    def resume(self) -> bool:
        """Carry this node's incarnation on after etcd dropped its lease in an outage
        (``check`` said LAPSED): False while the view is not one read since etcd came
        back, so cannot tell whether a round formed without this node. Raises
        RendezvousError if etcd does not answer, or the job moved on meanwhile."""
        if not self.mirror.connected:
            return False
        self.session.resume(self.mirror.view().round_mod_revision)
        return True

    def nodes_waiting(self) -> int:
        """How many nodes wait to join this node's round while it has room, read by this
        node itself: from the whole job where it leads, else from one count of the
        present nodes (no values read)."""
        if self.round is None:
            return 0
        if self.mirror.complete:
            return rules.waiting(self.mirror.view(), self.round, self.options.max_nodes)
        present = self.client.count(self.key(records.NODES))
        return rules.waiting_by_count(present, self.round, self.options.max_nodes)

    def closed(self) -> ClosedRecord | None:
        """The job's end, if another node has closed it."""
        return self.mirror.view().closed


class _Progress:
    """Says now and then what the wait for a round waits on: after a few seconds, then
    every half minute (a node waiting for others is otherwise silent for minutes)."""

    FIRST, EVERY = 5.0, 30.0

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._next = time.monotonic() + self.FIRST

    def say(self, reason: str) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.EVERY
        left = max(self._deadline - now, 0.0)
        log.info("still waiting: %s (join_timeout in %s)", reason, _duration(left))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
