"""One node's part in a job's rendezvous on etcd v3: the I/O around ``rules``.

Knows nothing about processes: the agent (or torch's agent through the handler) asks it
for the next round, tells it when this node is done with a round, and asks it whether
anything happened that should end the current one (``check``). What the answers are is
decided by the pure functions in ``rules``; this module reads and writes etcd.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from etcd3.utils import prefix_range_end

from rendezvous import records
from rendezvous.client import KV, EtcdClient
from rendezvous.config import RendezvousOptions
from rendezvous.errors import (
    LeaseLostError,
    RendezvousCancelled,
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)
from rendezvous.lease import LeaseKeeper
from rendezvous.mirror import JobMirror, JobView
from rendezvous.net import free_port
from rendezvous.probe import ProbeListener, gone_among
from rendezvous.records import (
    ClosedRecord,
    FailureRecord,
    GoneRecord,
    JobOutcome,
    LeaderRecord,
    NodeRecord,
    NodeState,
    NoticeRecord,
    RoundEnd,
    RoundRecord,
)
from rendezvous.rules import Change, Plan, lean_round_end, plan, round_end

log = logging.getLogger(__name__)

GONE_TTL = 60  # seconds a departed node's tombstone stays
# what the leader gives notice of: the rest each member sees for itself
# seconds a node waits for the leader to form a round before it probes it, and between
# probes: at 10,000 nodes, at most 2,000 connections a second to the leader's probe port
WAITING_PROBE = 5.0
SUCCESSORS = 3  # ranks (0 aside) that probe the leader and claim its post at once
CLAIM_AFTER = 0.5  # seconds the lead stays vacant before any other node claims it
NOTICED = (RoundEnd.LOST, RoundEnd.LEFT, RoundEnd.LEAVING, RoundEnd.STOPPING, RoundEnd.WAITING)


@dataclass(frozen=True)
class NodeSpec:
    """What this node tells the others about itself."""

    id: str
    addr: str
    nproc: int
    host: str = socket.gethostname()
    pid: int = 0
    version: str = ""
    metrics_port: int = 0
    rank: int = -1  # the group rank this node asks for (torchrun's --node-rank); -1: none


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
        self.lease = LeaseKeeper(
            client, options.lease_ttl, options.keep_alive_interval, on_change=self.mirror.poke
        )
        self.rev = 0  # create revision of this node's record: its incarnation
        self.round: RoundRecord | None = None  # the round this node is (or was last) in
        self._registered_at = 0  # etcd revision of the registration
        self._record: NodeRecord | None = None
        self._shut = False
        self._probe: ProbeListener | None = None
        self._probed: dict[str, float] = {}  # node id -> monotonic time last probed
        self._noticed: tuple[int, RoundEnd] | None = None  # the last notice this node gave
        self._vacant_since: float | None = None  # monotonic time the lead was seen vacant

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
    def leads(self) -> bool:
        """This node holds the lead now: it writes the rounds (and has rank 0 in the first)."""
        return self._is_leader(self.mirror.view())

    def poke(self) -> None:
        """Wake whoever waits on the job (a signal arrived, a deadline moved)."""
        self.mirror.poke()

    def probe_members(self) -> None:
        """Find out now whether a member of this node's round is gone: a member whose agent
        refuses its probe port loses its lease at once (see ``probe``). The leader probes
        them all; the others probe the leader, which hears of the rest from etcd."""
        view = self.mirror.view()
        if not self.mirror.full:
            if self._successor():  # the others hear of a dead leader from etcd
                self._probe_leader(view)
        elif self.round is not None:
            self._probe_gone(view, tuple(m.id for m in self.round.members))

    # -- keys -----------------------------------------------------------------------------
    def key(self, rel: str) -> str:
        return self.options.job_prefix + rel

    @property
    def node_key(self) -> str:
        return self.key(records.NODES + self.me.id)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Register this node and read the job, in one transaction; refuse a closed job."""
        self._probe = ProbeListener()
        lease_id = self.lease.grant(timeout=self.client.options.connect_timeout)
        rec = self._new_record()
        value = rec.encode()
        # the first to come claims the vacant lead in the same transaction (rev 0: see
        # LeaderRecord), so that a thousand nodes starting at once do not each try it
        claim = LeaderRecord(self.me.id, 0, self.me.addr, self._probe_port()).encode()
        revision, kvs, _ = self.client.create_and_read(
            self.node_key,
            value,
            lease_id,
            self.mirror.lean_keys(),
            self.key(records.CLOSED),
            claim=(self.key(records.LEADER), claim),
        )
        try:
            if not revision:
                self._refused(kvs)
            self.mirror.start(initial=(revision, kvs))
            self._raise_if_closed(self.mirror.view())
            _ = self.mirror.view().round  # a malformed round fails here, not later
        except RendezvousError:
            self.lease.revoke()
            raise
        self._registered(rec, revision, lease_id)

    def _new_record(self) -> NodeRecord:
        return NodeRecord(
            id=self.me.id,
            addr=self.me.addr,
            nproc=self.me.nproc,
            host=self.me.host,
            pid=self.me.pid,
            version=self.me.version,
            done=0,
            state=NodeState.WAITING,
            probe=self._probe.port if self._probe else 0,
            metrics=self.me.metrics_port,
            min_nodes=self.options.min_nodes,
            max_nodes=self.options.max_nodes,
            rank=self.me.rank,
        )

    def _refused(self, kvs: list[KV]) -> None:
        """Explain why registration found the job closed or this node's id taken."""
        found = {kv.key: kv for kv in kvs}
        closed = found.get(self.key(records.CLOSED))
        if closed is not None:
            self._raise_closed(ClosedRecord.decode(closed.key, closed.value))
        other = ""
        holder_kv = found.get(self.node_key)
        if holder_kv is not None:
            with contextlib.suppress(RendezvousError):
                holder = NodeRecord.decode(holder_kv.key, holder_kv.value)
                other = f" (pid {holder.pid} on {holder.host})"
        raise RendezvousError(
            f"node id {self.me.id!r} is already taken in job "
            f"{self.options.run_id!r}{other}; every agent needs its own id"
        )

    def _registered(self, rec: NodeRecord, revision: int, lease_id: int) -> None:
        self.rev = revision
        self._registered_at = revision
        self._record = rec
        self.round = None
        self.mirror.record_own(KV(self.node_key, rec.encode(), revision, revision, lease_id))
        log.info(
            "registered as %s in job %s (lease %x, ttl %ss)",
            self.me.id,
            self.options.run_id,
            lease_id,
            self.options.lease_ttl,
        )

    def shutdown(self, leave: bool = True) -> None:
        """Stop the background threads; with ``leave`` the others see this node go at once,
        as a departure (its tombstone), not a loss."""
        if self._shut:
            return
        self._shut = True
        if leave:
            if self._record is not None and self.lease.lease_id and not self.lease.lost:
                try:
                    self._leave_record()
                except RendezvousError as e:
                    log.warning("could not tell etcd this node leaves: %s", e)
            self.lease.revoke()
        self.lease.stop()
        self.mirror.stop()
        if self._probe is not None:
            self._probe.close()

    def _register(self) -> None:
        """Join again as a new incarnation (the old lease is gone): new lease, new record."""
        lease_id = self.lease.grant()
        rec = self._new_record()
        revision, existing = self.client.create(self.node_key, rec.encode(), lease=lease_id)
        if not revision:
            self.lease.revoke()
            self._refused([existing] if existing is not None else [])
        self._registered(rec, revision, lease_id)

    def _leave_record(self) -> None:
        """In one transaction: this node's tombstone (on a short lease of its own, so it
        goes away by itself) and the removal of its record."""
        ttl = max(GONE_TTL, 2 * self.options.lease_ttl)
        gone_lease = self.client.grant(ttl, timeout=2.0)
        rec = GoneRecord(rev=self.rev, host=self.me.host, at=time.time())
        ops = self.client.ops
        leave = [
            ops.put(self.key(records.GONE + self.me.id), rec.encode(), lease=gone_lease),
            ops.delete(self.node_key),
        ]
        view = self.mirror.view()
        if self._is_leader(view) and view.leader_kv is not None:  # resign in the same step
            held = ops.mod(self.key(records.LEADER)) == view.leader_kv.mod_revision
            self.client.txn([held], [*leave, ops.delete(self.key(records.LEADER))], leave, 2.0)
        else:
            self.client.txn([], leave, timeout=2.0)

    def _put_record(self, rec: NodeRecord) -> None:
        value = rec.encode()
        try:
            revision = self.client.put(self.node_key, value, lease=self.lease.lease_id)
        except RendezvousError as e:
            if "lease not found" in str(e):
                self.lease.lost = True
                raise LeaseLostError("etcd dropped this node's lease") from None
            raise
        self._record = rec
        self.mirror.record_own(KV(self.node_key, value, self.rev, revision, self.lease.lease_id))

    # -- rounds ---------------------------------------------------------------------------
    def _raise_closed(self, closed: ClosedRecord) -> None:
        verb = "finished" if closed.state is JobOutcome.SUCCEEDED else "failed"
        why = f": {closed.reason}" if closed.reason else ""
        raise RendezvousClosedError(f"job {self.options.run_id!r} has {verb}{why}", closed)

    def _raise_if_closed(self, view: JobView) -> None:
        closed = view.closed
        if closed is not None:
            self._raise_closed(closed)

    def _fenced(self, view: JobView) -> bool:
        """etcd has dropped this incarnation (lease expired while frozen or cut off)."""
        if self.lease.lost:
            return True
        if not self.mirror.connected or view.revision < self._registered_at:
            return False
        node = view.nodes.get(self.me.id)
        return node is None or node.rev != self.rev

    def _member_of(self, r: RoundRecord) -> bool:
        return r.member(self.me.id, self.rev) is not None

    def next_round(
        self, cancel: threading.Event | None = None, timeout: float | None = None
    ) -> RoundRecord:
        """Block until a new round that includes this node has formed; return it.

        Leaves the current round first (marks this node done with it). Takes part in
        forming the round when this node is the writer. Raises RendezvousClosedError
        when the job is over, RendezvousTimeoutError when fewer than MIN nodes are
        present for ``timeout`` (join_timeout) seconds, RendezvousCancelled once ``cancel``
        is set (wake the wait with ``mirror.poke()``).
        """
        if not self._fenced(self.mirror.view()):
            with contextlib.suppress(LeaseLostError):  # then it registers again below
                self.finish_round()
        timeout = self.options.join_timeout if timeout is None else timeout
        waiting_since = time.monotonic()
        deadline = waiting_since + timeout
        note = _Progress(deadline)
        while True:
            self.alive_at = time.monotonic()
            if cancel is not None and cancel.is_set():
                raise RendezvousCancelled("cancelled while waiting for the next round")
            if self._shut:  # never join again once shut down (its lease is revoked)
                raise RendezvousCancelled("this node has left the job")
            version = self.mirror.version
            view = self.mirror.view()
            self._raise_if_closed(view)
            if self._fenced(view):
                log.warning("this node's lease is gone; joining again as a new node")
                self.lease.revoke()
                self.mirror.set_full(False)
                self._register()
                continue
            r = view.round
            newer = r is not None and (self.round is None or r.number > self.round.number)
            if r is not None and newer and self._member_of(r):
                self.round = r
                return r
            if not self._leads(view):
                # the leader forms the round: only its writing, or its going, matters here
                leader = view.leader.id if view.leader else "a leader"
                note.say(f"waiting for {leader} to form round {(r.number if r else 0) + 1}")
                if time.monotonic() - waiting_since >= WAITING_PROBE:
                    self._probe_leader(view, every=WAITING_PROBE)
                self.mirror.wait(version, 1.0)
                continue
            if not self.mirror.complete:  # going full in another thread: the read is due
                self.mirror.wait(version, 0.5)
                continue
            view = self.mirror.view()
            self._give_notice(view)
            p = plan(
                view,
                self.options.min_nodes,
                self.options.max_nodes,
                self.options.last_call_timeout,
                self.max_restarts,
                time.monotonic(),
            )
            note.say(p.reason)
            if p.writer is not None and p.writer != self.me.id:
                self._hand_over(view, p.writer)  # the next round's rank 0 writes it
                continue
            if p.form:
                if p.budget_spent:
                    self._close_failed(view, p)
                elif self._write_round(view, p):
                    log.debug("wrote %s", p.reason)
                self.mirror.wait(version, 0.5)
                continue
            if p.busy:
                self._probe_gone(view, p.busy)
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

    # -- the leader ---------------------------------------------------------------------
    def _is_leader(self, view: JobView) -> bool:
        ld = view.leader
        return ld is not None and ld.id == self.me.id and ld.rev == self.rev

    def _leads(self, view: JobView) -> bool:
        """Whether this node leads: reads the whole job, writes rounds, gives notice. A
        vacant post is claimed first (whoever's create lands first holds it)."""
        if view.leader is not None:
            self._vacant_since = None
        elif not self._fenced(view) and self._may_claim():
            record = LeaderRecord(self.me.id, self.rev, self.me.addr, self._probe_port())
            key = self.key(records.LEADER)
            revision, held = self.client.create(key, record.encode(), lease=self.lease.lease_id)
            if revision:
                log.debug("leading job %s", self.options.run_id)
                held = KV(key, record.encode(), revision, revision, self.lease.lease_id)
            if held is not None:
                self.mirror.record_own(held)
            view = self.mirror.view()
        mine = self._is_leader(view)
        if mine != self.mirror.full:
            self.mirror.set_full(mine)
        return mine

    def _successor(self) -> bool:
        """One of the first ranks of this node's round, which step in for a dead leader
        at once: a thousand nodes probing the leader and claiming its post when it dies
        would cost etcd a thousand requests each time, for one that matters."""
        m = self.round.member(self.me.id, self.rev) if self.round is not None else None
        return m is not None and m.rank <= SUCCESSORS

    def _may_claim(self) -> bool:
        """Whether to claim the vacant lead now: a successor at once, any other node once
        the post has stayed vacant for CLAIM_AFTER (the successors are gone too)."""
        now = time.monotonic()
        if self._vacant_since is None:
            self._vacant_since = now
        return self._successor() or now - self._vacant_since >= CLAIM_AFTER

    def _probe_port(self) -> int:
        return self._probe.port if self._probe else 0

    def _hand_over(self, view: JobView, writer: str) -> None:
        """Make ``writer`` the leader (on its own lease), unless the post changed since."""
        node, held = view.nodes.get(writer), view.leader_kv
        if node is None or held is None:
            return
        value = LeaderRecord(writer, node.rev, node.record.addr, node.record.probe).encode()
        key = self.key(records.LEADER)
        try:
            revision = self.client.put_if(key, value, held.mod_revision, lease=node.lease)
        except RendezvousError as e:  # its lease just expired: the view will say so
            log.debug("could not hand the lead to %s: %s", writer, e)
            return
        if revision:
            log.debug("handed the lead to %s, the next round's rank 0", writer)
            self.mirror.record_own(KV(key, value, held.create_revision, revision, node.lease))
            self.mirror.set_full(False)

    def _give_notice(self, view: JobView) -> None:
        """Tell the members what ends their round, once per round (again only to make it
        urgent): what the leader sees in everyone's records, the others cannot."""
        r = view.round
        c = round_end(view, "", 0, r, self.options.max_nodes, False) if r else None
        if r is None or c is None or c.end not in NOTICED:
            return
        given = self._noticed
        old = view.notice
        if old is not None and old.round == r.number and (old.end.urgent or not c.end.urgent):
            return
        if given is not None and given[0] == r.number and (given[1].urgent or not c.end.urgent):
            return
        rec = NoticeRecord(r.number, c.end, c.detail, c.nodes)
        ops = self.client.ops
        if self.client.txn(
            [ops.mod(self.key(records.ROUND)) == view.round_mod_revision],
            [ops.put(self.key(records.NOTICE), rec.encode())],
        ):
            self._noticed = (r.number, c.end)

    def _probe_leader(self, view: JobView, every: float = 0.5) -> None:
        held, ld = view.leader_kv, view.leader
        if held is not None and ld is not None and ld.id != self.me.id:
            self._check_gone({ld.id: (ld.addr, ld.probe, held.lease)}, every)

    def _probe_gone(self, view: JobView, nodes: tuple[str, ...]) -> None:
        """Revoke the leases of nodes whose agents are provably gone (see probe.py)."""
        live = {n: view.nodes[n] for n in nodes if n in view.nodes and n != self.me.id}
        targets = {n: (x.record.addr, x.record.probe, x.lease) for n, x in live.items()}
        self._check_gone(targets)

    def _check_gone(self, targets: dict[str, tuple[str, int, int]], every: float = 0.5) -> None:
        """Probe ``targets`` (node id: address, probe port, lease) not probed in the last
        ``every`` seconds, all at once; revoke the leases of those that refuse."""
        now = time.monotonic()
        due = {n: t for n, t in targets.items() if now - self._probed.get(n, 0.0) >= every}
        self._probed.update(dict.fromkeys(due, now))
        for node_id in gone_among({n: (addr, port) for n, (addr, port, _) in due.items()}):
            log.warning("%s refuses its probe port: its agent is gone; revoking its lease", node_id)
            try:
                self.client.revoke(due[node_id][2], timeout=2.0)
            except RendezvousError as e:
                log.warning("could not revoke %s's lease: %s", node_id, e)

    def _write_round(self, view: JobView, p: Plan) -> bool:
        current = view.round
        used = {current.master_port, current.store_port} if current else set()
        master_port = self.options.master_port or free_port("", avoid=used)
        store_port = free_port("", avoid=used | {master_port})
        rec = RoundRecord(
            number=(current.number if current else 0) + 1,
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
        # Guarded by the round's revision only: a per-member liveness compare would cap
        # jobs at etcd's --max-txn-ops (128). A member that died since the view was taken
        # is seen as lost by everyone right after, and the round re-forms without it.
        compare = [
            ops.mod(self.key(records.ROUND)) == view.round_mod_revision,
            ops.create(self.key(records.CLOSED)) == 0,
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
        where = f" on {root.get('node')}" if root.get("node") else ""
        reason = (
            f"workers failed with the restart budget spent (--max-restarts "
            f"{self.max_restarts}, all used); last failure{where}: "
            f"{root.get('summary', 'workers failed')}"
        )
        number = view.round.number if view.round else 0
        self.close(JobOutcome.FAILED, reason, root_cause=root, round_number=number)

    def close(
        self,
        state: JobOutcome,
        reason: str = "",
        root_cause: dict[str, Any] | None = None,
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
            root_cause=root_cause or {},
        )
        ops = self.client.ops
        key = self.key(records.CLOSED)
        return self.client.txn([ops.create(key) == 0], [ops.put(key, rec.encode())])

    def finish_round(self) -> None:
        """Tell the others this node has stopped the workers of its current round."""
        if self.round is None or self._record is None:
            return
        if self._record.done >= self.round.number:
            return
        self._put_record(replace(self._record, done=self.round.number))

    def report_failure(self, detail: dict[str, Any]) -> None:
        """Record this node's worker failure for the current round and leave the round."""
        if self.round is None:
            return
        rec = FailureRecord(
            node=self.me.id, round=self.round.number, time=time.time(), detail=detail
        )
        self.client.put(
            self.key(f"{records.FAILURES}{self.round.number}/{self.me.id}"), rec.encode()
        )
        self.finish_round()

    def announce_leaving(self) -> None:
        """Say this node is about to leave, so the others drain for a resize (a leader
        gives the notice itself: nobody else reads its record)."""
        if self._record is not None and self._record.state is not NodeState.LEAVING:
            self._put_record(replace(self._record, state=NodeState.LEAVING))
            if self.mirror.complete:
                self._give_notice(self.mirror.view())

    # -- watching a running round ---------------------------------------------------------
    @property
    def version(self) -> int:
        return self.mirror.version

    def wait(self, version: int, timeout: float | None) -> int:
        """Block until anything in the job changes (or ``timeout``); returns the new version."""
        return self.mirror.wait(version, timeout)

    def check(self) -> Change | None:
        """What, if anything, should end this node's current round (see ``round_end``).
        The leader reads everyone's records and gives the others notice of what it sees."""
        view = self.mirror.view()
        try:
            leads = self._leads(view)
        except RendezvousError as e:  # etcd unreachable: the lease keeper says so in time
            log.debug("could not take up a vacant lead: %s", e)
            leads = self.mirror.full
        fenced = self._fenced(self.mirror.view())
        if not leads:
            return lean_round_end(self.mirror.view(), self.me.id, self.rev, self.round, fenced)
        if not self.mirror.complete:
            return None  # the full view is a moment away
        view = self.mirror.view()
        with contextlib.suppress(RendezvousError):
            self._give_notice(view)
        return round_end(view, self.me.id, self.rev, self.round, self.options.max_nodes, fenced)

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
