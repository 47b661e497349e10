"""This node's presence in a job: one lease, kept alive, and the record attached to it.

As etcd's ``concurrency.Session``: the session owns the lease (granted when the node
registers, kept alive in the background, revoked when it leaves); whatever else this
node keeps on that lease (the lead, see ``lead.py``) takes the session and never owns
the lease. A node whose lease expired (frozen, cut off) is *fenced*: it registers again
as a new incarnation (``rev``, its record's create revision), never as the old one, unless
no round formed without it (an etcd outage drops every lease): then it *resumes*, the same
incarnation on a new lease.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from rendezvous import records, rules
from rendezvous.client import EtcdClient
from rendezvous.config import RendezvousOptions
from rendezvous.errors import (
    EtcdUnavailableError,
    LeaseLostError,
    LeaseNotFoundError,
    MalformedRecordError,
    RendezvousCancelled,
    RendezvousClosedError,
    RendezvousError,
)
from rendezvous.lease import LeaseKeeper
from rendezvous.net import answers
from rendezvous.probe import ProbeListener, gone_among
from rendezvous.records import ClosedRecord, GoneRecord, JobOutcome, NodeRecord, NodeState
from rendezvous.view import KV, JobView

log = logging.getLogger(__name__)

GONE_TTL = 60  # seconds a departed node's tombstone stays
# seconds each write of a leaving node may retry: saying goodbye is a courtesy (the lease
# expires anyway), and a SIGTERM's grace period (Kubernetes: 30 s) is not for etcd to spend
LEAVE_TIMEOUT = 1.0
# a write that is said again later if it fails: it never holds the agent's loop longer
RETRIED_TIMEOUT = 1.0
# new leases granted for one registration, each dropped before the write that names it
# (etcd away past the TTL right after the grant): then etcd is not fit to join through
REGRANTS = 3
# seconds each try to register may take with an etcd that answered this process before
OUTAGE_TRY = 2.0


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


def closed_error(run_id: str, closed: ClosedRecord) -> RendezvousClosedError:
    verb = "finished" if closed.state is JobOutcome.SUCCEEDED else "failed"
    why = f": {closed.reason}" if closed.reason else ""
    return RendezvousClosedError(f"job {run_id!r} has {verb}{why}", closed)


class Session:
    """One node's lease and record (see the module doc). ``on_record`` sees every write
    of the record (the mirror applies it at once: a lean watch never shows it one)."""

    def __init__(
        self,
        client: EtcdClient,
        options: RendezvousOptions,
        me: NodeSpec,
        on_change: Callable[[], None] = lambda: None,
        on_record: Callable[[KV], None] = lambda kv: None,
    ) -> None:
        self.client = client
        self.options = options
        self.me = me
        self.lease = LeaseKeeper(
            client, options.lease_ttl, options.keep_alive_interval, on_change=on_change
        )
        self._on_record = on_record
        self.rev = 0  # create revision of this node's record: its incarnation
        self.registered_at = 0  # etcd revision of the registration (or resumption)
        self.created = 0  # create revision of the record now (``resume`` keeps ``rev``)
        self.record: NodeRecord | None = None
        self._probe: ProbeListener | None = None
        self.closed = False
        self.leaving = False  # said it leaves (or tried to): its writes are last words
        self._silent = ""  # why a leaving node writes to etcd no more

    def key(self, rel: str) -> str:
        return self.options.job_prefix + rel

    @property
    def node_key(self) -> str:
        return self.key(records.NODES + self.me.id)

    @property
    def probe_port(self) -> int:
        return self._probe.port if self._probe else 0

    @property
    def lease_id(self) -> int:
        return self.lease.lease_id

    # -- registering ---------------------------------------------------------------------------
    def register(
        self,
        reads: tuple[list[str], list[str]],
        claim: Callable[[], tuple[str, bytes]],
        cancel: threading.Event | None = None,
    ) -> tuple[int, list[KV]]:
        """Register and read ``reads`` (keys, prefixes) in one transaction, claiming the
        key and value ``claim()`` gives if absent (on this lease). Raises for a closed job
        or a node id already taken, with the lease revoked. Through an outage of an etcd
        that answered before, it tries again (``_outage``) until ``cancel`` is set."""
        if self._probe is None:
            self._probe = ProbeListener()
        # the id may be held by this node's previous agent, dead (a restarted pod): its
        # record goes with its lease, within a TTL, or at once if its probe port refuses
        deadline = time.monotonic() + self.options.lease_ttl + 1.0
        expired = 0
        outage: float | None = None  # since when etcd has not answered this registration
        lease_id = 0
        while True:
            # an etcd that answered before is waited for in short tries (a signal is heard
            # between them); one that never did gets connect_timeout to answer at all
            timeout = OUTAGE_TRY if self.client.answered else self.client.options.connect_timeout
            try:
                lease_id = lease_id or self.lease.grant(timeout=timeout)
                rec = self._new_record()
                revision, kvs, _ = self.client.create_and_read(
                    self.node_key,
                    rec.encode(),
                    lease_id,
                    reads,
                    self.key(records.CLOSED),
                    claim=claim(),
                    timeout=timeout,
                )
            except LeaseNotFoundError:
                lease_id, expired = 0, expired + 1
                if expired > REGRANTS:
                    raise
                log.info("etcd dropped the new lease before it answered: registering anew")
                continue
            except EtcdUnavailableError as e:
                outage = self._outage(e, outage, cancel)
                continue
            if revision:
                break
            holder = {kv.key: kv for kv in kvs}.get(self.node_key)
            if holder is not None and holder.lease == lease_id:  # a try etcd applied late,
                rec = NodeRecord.decode(holder.key, holder.value)  # its answer lost
                revision = holder.mod_revision
                break
            self.lease.revoke()
            lease_id = 0
            closed = {kv.key: kv for kv in kvs}.get(self.key(records.CLOSED))
            if closed is not None and self._clear_junk_closed(closed):
                continue
            if (
                holder is None
                or time.monotonic() > deadline
                or closed is not None
                or not self._clear_dead_holder(holder)
            ):
                self._refused(kvs)
        self._registered(rec, revision, lease_id)
        if outage is not None:  # the others' leases may have gone with it: their grace
            self.lease.came_back(time.monotonic())
        return revision, kvs

    def _outage(
        self, error: EtcdUnavailableError, since: float | None, cancel: threading.Event | None
    ) -> float:
        """etcd did not answer this registration. An etcd that answered this process
        before is away for a while (the nodes in the job train on through that): wait
        for it, up to ``join_timeout``, unless ``cancel`` is set (a signal). One that never
        answered may be no etcd at all: ``connect_timeout`` said so (raise). Returns since
        when it has been away."""
        now = time.monotonic()
        if since is None:
            if not self.client.answered:
                raise error
            log.warning(
                "etcd stopped answering while this node joined: trying again until it "
                "answers (join_timeout %ss): %s",
                self.options.join_timeout,
                error,
            )
            since = now
        if now - since > self.options.join_timeout:
            raise error
        if cancel is not None and cancel.wait(OUTAGE_TRY / 4):
            raise RendezvousCancelled("cancelled while etcd was away") from None
        return since

    def _clear_dead_holder(self, holder: KV) -> bool:
        """This node's id is held: revoke the holder's lease if its probe port refuses
        (its agent is dead), or wait a moment for the lease to expire if the probe proves
        nothing (a frozen or unreachable holder); False if the holder answers: it is
        alive, and the id is taken."""
        if self._clear_foreign(holder):
            return True
        try:
            rec: NodeRecord | None = NodeRecord.decode(holder.key, holder.value)
        except RendezvousError:
            rec = None
        if rec is not None and holder.lease and gone_among({0: (rec.addr, rec.probe)}):
            log.info(
                "node id %s is held by this node's previous agent (pid %d on %s), which is "
                "gone: revoking its lease",
                self.me.id,
                rec.pid,
                rec.host,
            )
            with contextlib.suppress(RendezvousError):
                self.client.revoke(holder.lease, timeout=2.0)
            return True
        if rec is not None and rec.probe and answers(rec.addr, rec.probe, timeout=0.5):
            return False
        time.sleep(0.25)
        return True

    def _clear_foreign(self, holder: KV) -> bool:
        """Remove what holds this node's key where no agent wrote it
        (``NodeRecord.foreign``), unless it was written since: True if it was such a
        value (a junk value there, on no lease, would never go by itself)."""
        why = NodeRecord.foreign(holder.key, holder.value, holder.lease)
        if why is not None:
            self.remove(holder, f"{why}: removing it, this node's id is its own")
        return why is not None

    def _clear_junk_closed(self, kv: KV) -> bool:
        """Remove a value no agent wrote at the closed key, unless written since: True if
        it was one (it closes nothing, and no node could join over it)."""
        try:
            ClosedRecord.decode(kv.key, kv.value)
        except MalformedRecordError as e:
            self.remove(kv, f"{e}: removing it, it closes nothing")
            return True
        return False

    def remove(self, kv: KV, why: str, timeout: float = OUTAGE_TRY) -> None:
        """Delete a value no agent wrote, at ``kv``'s key, unless it was written since,
        saying ``why`` (a failed try is left to the next look at what is there)."""
        log.warning("%s", why)
        with contextlib.suppress(RendezvousError):
            self.client.delete_if(kv.key, kv.mod_revision, timeout=timeout)

    def register_again(self) -> None:
        """Join again as a new incarnation (the old lease is gone): new lease, new record.
        In tries of ``OUTAGE_TRY`` (EtcdUnavailableError: etcd went away meanwhile, and
        the caller tries again, hearing its signals in between)."""
        rec = self._new_record()
        revision, existing, lease_id = self._recreate(rec, timeout=OUTAGE_TRY)
        if not revision:
            self._refused([existing] if existing is not None else [])
        self._registered(rec, revision, lease_id)

    def resume(self, round_mod_revision: int) -> None:
        """Carry this incarnation on under a new lease: etcd dropped the old one in an
        outage, but no round formed without this node (``rules.round_end``: LAPSED), so
        nothing it holds is stale. Its record comes back as it was, naming the incarnation
        it ``resumes``, and its round goes on: no worker stops. Only while the round key
        is as the view saw it (``round_mod_revision``): never into a job that moved on.
        Raises RendezvousError when etcd does not answer or either key changed (then the
        view tells what happened)."""
        assert self.record is not None, "only a registered node resumes"
        rec = replace(self.record, resumes=self.rev)
        round_key = (self.key(records.ROUND), round_mod_revision)
        revision, _, lease_id = self._recreate(rec, round_key)
        if not revision:
            raise RendezvousError("its record or the round changed meanwhile")
        self._written(rec, revision, lease_id)
        log.info("carries on as incarnation %d on lease %x", self.rev, lease_id)

    def _recreate(
        self,
        rec: NodeRecord,
        unchanged: tuple[str, int] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, KV | None, int]:
        """``rec`` on a new lease in place of the old one, written only if its key is
        absent (and ``unchanged`` holds): (revision or 0, what holds the key, lease id).
        A new lease that carries nothing is revoked at once; one a failed call left is
        revoked by the next attempt, as the old one is here. A value no agent wrote at
        the key is removed and the write tried again."""
        for attempt in range(REGRANTS + 1):
            self.lease.revoke()
            lease_id = self.lease.grant(timeout=timeout)
            try:
                revision, existing = self.client.create(
                    self.node_key,
                    rec.encode(),
                    lease=lease_id,
                    unchanged=unchanged,
                    timeout=timeout,
                )
            except LeaseNotFoundError:
                if attempt == REGRANTS:
                    raise
                log.info("etcd dropped the new lease before it answered: writing anew")
                continue
            if revision or existing is None or not self._clear_foreign(existing):
                break
        if not revision:
            self.lease.revoke()
        return revision, existing, lease_id

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
            probe=self.probe_port,
            metrics=self.me.metrics_port,
            min_nodes=self.options.min_nodes,
            max_nodes=self.options.max_nodes,
            rank=self.me.rank,
        )

    def _refused(self, kvs: list[KV]) -> NoReturn:
        """Explain why registration found the job closed or this node's id taken."""
        found = {kv.key: kv for kv in kvs}
        closed = found.get(self.key(records.CLOSED))
        if closed is not None:
            raise closed_error(self.options.run_id, ClosedRecord.decode(closed.key, closed.value))
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
        self._written(rec, revision, lease_id)
        job = "" if self.options.run_id == "none" else f" in job {self.options.run_id}"
        log.info(
            "registered as %s%s (lease %x, ttl %ss)",
            self.me.id,
            job,
            lease_id,
            self.options.lease_ttl,
        )

    def _written(self, rec: NodeRecord, revision: int, lease_id: int) -> None:
        """``rec`` was created at ``revision`` (a registration or a resumption)."""
        self.registered_at = self.created = revision
        self.record = rec
        self._on_record(KV(self.node_key, rec.encode(), revision, revision, lease_id))

    def fenced(self, view: JobView, connected: bool) -> bool:
        """etcd has dropped this incarnation (see ``rules.fenced``)."""
        return rules.fenced(
            view, self.me.id, self.rev, self.registered_at, self.lease.lost, connected
        )

    def outage(self) -> tuple[float, float] | None:
        """(now, until) while etcd's answers to this node lapsed lately (see
        ``rules.round_end``), else None."""
        now = time.monotonic()
        until = self.lease.outage_until(now)
        return (now, until) if until > now else None

    # -- the record -------------------------------------------------------------------------------
    def mark_done(self, number: int, reachable: bool = True) -> None:
        """Say this node stopped the workers of round ``number`` (a leaving node: if it
        can; ``reachable``: etcd's watch is up, as far as this node knows)."""
        if self.record is not None and self.record.done < number:
            rec = replace(self.record, done=number)
            if self.leaving:
                self._last_words("say its workers stopped", reachable, lambda: self._put(rec))
            else:
                self._put(rec)

    def mark_in_place(self, in_place: bool) -> None:
        """Say whether this node's workers re-form in place now (see ``lobby``); the
        caller says it again if this fails, so it waits for etcd only briefly."""
        if self.record is not None and self.record.in_place != in_place:
            self._put(replace(self.record, in_place=in_place), RETRIED_TIMEOUT)

    def mark_awaits(self, names: tuple[str, ...]) -> None:
        """Say, leading, which nodes the next round waits for (``NodeRecord.awaits``); the
        caller says it again at its next look if this fails."""
        if self.record is not None and self.record.awaits != names:
            self._put(replace(self.record, awaits=names), RETRIED_TIMEOUT)

    def mark_leaving(self, reachable: bool = True) -> bool:
        """Say this node is about to leave; False if it said so already, or could not."""
        if self.leaving or self.record is None or self.record.state is NodeState.LEAVING:
            return False
        self.leaving = True
        rec = replace(self.record, state=NodeState.LEAVING)
        return self._last_words("announce leaving", reachable, lambda: self._put(rec))

    def _last_words(self, what: str, reachable: bool, write: Callable[[], object]) -> bool:
        """A leaving node's write, if etcd answers: the first that fails (or a watch
        that is down) ends them all, so a node cut off from etcd leaves at once, its
        lease left to expire, instead of waiting out a timeout per write."""
        if not self._silent and not reachable:
            self._silent = "etcd's watch is down"
            log.warning(
                "etcd unreachable (%s): this node leaves without telling it; the others "
                "see its lease expire within %gs",
                self._silent,
                self.options.lease_ttl,
            )
        if self._silent:
            return False
        try:
            write()
        except RendezvousError as e:
            self._silent = str(e)
            log.warning(
                "could not %s: %s; this node leaves without telling etcd more: the others "
                "see its lease expire within %gs",
                what,
                e,
                self.options.lease_ttl,
            )
            return False
        return True

    def _put(self, rec: NodeRecord, timeout: float | None = None) -> None:
        value = rec.encode()
        timeout = LEAVE_TIMEOUT if self.leaving else timeout
        try:
            revision = self.client.put(
                self.node_key, value, lease=self.lease.lease_id, timeout=timeout
            )
        except LeaseNotFoundError:
            self.lease.lost = True
            raise LeaseLostError("etcd dropped this node's lease") from None
        self.record = rec
        self._on_record(KV(self.node_key, value, self.created, revision, self.lease.lease_id))

    # -- leaving -----------------------------------------------------------------------------------
    def close(
        self,
        leave: bool = True,
        resign: tuple[Any, Any] | None = None,
        reachable: bool = True,
        back: bool = False,
    ) -> None:
        """End the session. With ``leave`` the others see this node go at once, as a
        departure (its tombstone, and ``resign``: a compare and an operation that give
        up the lead in the same transaction), not a loss; the lease is revoked. Unless
        etcd does not answer (``reachable``: its watch is up): then the lease expires.
        ``back``: it leaves for now, and its tombstone says so (``GoneRecord.back``)."""
        if self.closed:
            return
        self.closed = True
        if leave:
            self.leaving = True
            if self.record is not None and self.lease.lease_id and not self.lease.lost:
                self._last_words(
                    "tell etcd it leaves", reachable, lambda: self._leave(resign, back)
                )
            if not self._silent:  # else it is left to expire
                self.lease.revoke(timeout=LEAVE_TIMEOUT)
        self.lease.stop()
        if self._probe is not None:
            self._probe.close()

    def _leave(self, resign: tuple[Any, Any] | None, back: bool) -> None:
        """In one transaction: this node's tombstone (on a short lease of its own, so it
        goes away by itself) and the removal of its record."""
        ttl = max(GONE_TTL, 2 * self.options.lease_ttl)
        gone_lease = self.client.grant(ttl, timeout=LEAVE_TIMEOUT)
        rec = GoneRecord(rev=self.rev, host=self.me.host, at=time.time(), back=back)
        ops = self.client.ops
        leave = [
            ops.put(self.key(records.GONE + self.me.id), rec.encode(), lease=gone_lease),
            ops.delete(self.node_key),
        ]
        if resign is not None:
            still_leads, drop = resign
            self.client.txn([still_leads], [*leave, drop], leave, LEAVE_TIMEOUT)
        else:
            self.client.txn([], leave, timeout=LEAVE_TIMEOUT)
