"""The lead: the one node that reads the whole job, writes its rounds and gives notice.

Held on the leading node's session lease (``job/leader``), as etcd's ``Election`` holds a
key on a ``Session`` it never owns: the post goes with the lease. The rules (who leads,
who claims a vacant post and when, which notice is due, whom to probe) are pure
functions in ``rules``; this module carries them out in etcd.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rendezvous import records, rules
from rendezvous.client import EtcdClient
from rendezvous.errors import LeaseNotFoundError, MalformedRecordError, RendezvousError
from rendezvous.mirror import JobMirror
from rendezvous.probe import gone_among
from rendezvous.records import LeaderRecord, RoundEnd, RoundRecord
from rendezvous.rules import LeadStep
from rendezvous.session import Session
from rendezvous.view import KV, JobView

log = logging.getLogger(__name__)

PROBE_EVERY = 0.2  # seconds between probes of one node


class Lead:
    """Claims, holds, hands over and resigns the lead for ``session``'s node; gives the
    leader's notice; probes the nodes whose agents may be gone."""

    def __init__(self, session: Session, client: EtcdClient, mirror: JobMirror) -> None:
        self.session = session
        self.client = client
        self.mirror = mirror
        self._vacant_since: float | None = None  # monotonic time the post was seen vacant
        self._noticed: tuple[int, RoundEnd] | None = None  # the last notice this node gave
        self._probed: dict[str, float] = {}  # node id -> monotonic time last probed
        # node id -> the incarnation its probe port proved dead: lost at once, even while
        # etcd's outage keeps the silent ones in (``rules.round_end``)
        self.proven: dict[str, int] = {}

    @property
    def _key(self) -> str:
        return self.session.key(records.LEADER)

    def _record(self, rev: int) -> bytes:
        s = self.session
        return LeaderRecord(s.me.id, rev, s.me.addr, s.probe_port).encode()

    def registration_claim(self) -> tuple[str, bytes]:
        """The claim a registering node makes in its registering transaction (rev 0: see
        ``LeaderRecord``), so that a thousand nodes starting at once do not each try."""
        return self._key, self._record(0)

    def holds(self, view: JobView) -> bool:
        return rules.leads(view, self.session.me.id, self.session.rev)

    def upkeep(self, view: JobView, mine: RoundRecord | None) -> bool:
        """Claim the post if the rules say so, and keep the mirror's mode to match (whole
        job when leading); whether this node leads."""
        vacant_for = 0.0
        if view.leader is not None:
            self._vacant_since = None
        else:
            now = time.monotonic()
            self._vacant_since = self._vacant_since or now
            vacant_for = now - self._vacant_since
        s = self.session
        fenced = s.fenced(view, self.mirror.connected)
        choice = rules.lead_step(view, s.me.id, s.rev, mine, vacant_for, fenced)
        if choice.step is LeadStep.CLAIM:
            self._claim(view.leader_kv)
            view = self.mirror.view()
        mine_now = self.holds(view)
        if mine_now != self.mirror.full:
            self.mirror.set_full(mine_now)
        if mine_now and view.closed_junk is not None:  # no round, no close, is written over it
            why = f"removing the value at {view.closed_junk.key}: it closes nothing"
            self.session.remove(view.closed_junk, why, timeout=1.0)  # the next upkeep looks again
        return mine_now

    def _claim(self, junk: KV | None) -> None:
        """Create the post, or replace ``junk``: what the key holds that is no live
        leader's (a foreign or leaseless value), as long as nobody wrote it since."""
        s = self.session
        value = self._record(s.rev)
        try:
            if junk is not None:
                log.warning("claiming the lead over a value that is no leader's at %s", self._key)
                revision = self.client.put_if(self._key, value, junk.mod_revision, lease=s.lease_id)
                existing = None
            else:
                revision, existing = self.client.create(self._key, value, lease=s.lease_id)
        except LeaseNotFoundError as e:
            # etcd dropped this node's lease (an outage past its TTL) after the view was
            # read: the session finds it (fenced, or lapsed) and the node registers again
            # (chaos seed 27: a standby's claim ended its agent with exit 1)
            log.info("not claiming the lead: %s", e)
            return
        if revision:
            log.debug("leading job %s", s.options.run_id)
            created = junk.create_revision if junk is not None else revision
            existing = KV(self._key, value, created, revision, s.lease_id)
        if existing is not None:  # ours, or the one whose create landed first
            self.mirror.record_own(existing)

    def hand_over(self, view: JobView, writer: str) -> None:
        """Make ``writer`` the leader (on its own lease), unless the post changed since."""
        node, lead_kv = view.nodes.get(writer), view.leader_kv
        if node is None or lead_kv is None:
            return
        value = LeaderRecord(writer, node.rev, node.record.addr, node.record.probe).encode()
        try:
            revision = self.client.put_if(self._key, value, lead_kv.mod_revision, lease=node.lease)
        except RendezvousError as e:  # its lease just expired: the view will say so
            log.debug("could not hand the lead to %s: %s", writer, e)
            return
        if revision:
            log.debug("handed the lead to %s, the next round's rank 0", writer)
            self.mirror.record_own(
                KV(self._key, value, lead_kv.create_revision, revision, node.lease)
            )
            self.mirror.set_full(False)

    def resignation(self, view: JobView) -> tuple[Any, Any] | None:
        """(compare, operation) that give up the post in a leaving transaction, if held."""
        if not self.holds(view) or view.leader_kv is None:
            return None
        ops = self.client.ops
        return ops.mod(self._key) == view.leader_kv.mod_revision, ops.delete(self._key)

    def give_notice(self, view: JobView) -> None:
        """Tell the members what ends their round (see ``rules.notice_to_give``): what the
        leader sees in everyone's records, the others cannot."""
        options = self.session.options
        last_call = (time.monotonic(), options.last_call_timeout)
        outage = self.session.outage()
        rec = rules.notice_to_give(
            view, options.max_nodes, self._noticed, last_call, outage, self.proven
        )
        if rec is None:
            return
        ops = self.client.ops
        if self.client.txn(
            [ops.mod(self.session.key(records.ROUND)) == view.round_mod_revision],
            [ops.put(self.session.key(records.NOTICE), rec.encode())],
        ):
            self._noticed = (rec.round, rec.end)

    # -- probes ----------------------------------------------------------------------------------
    def probe_leader(self, view: JobView, every: float = PROBE_EVERY) -> None:
        lead_kv, ld = view.leader_kv, view.leader
        if lead_kv is not None and ld is not None and ld.id != self.session.me.id:
            node = view.nodes.get(ld.id)
            rev = node.rev if node is not None else ld.rev
            self._check_gone({ld.id: (ld.addr, ld.probe, lead_kv.lease, rev)}, every)

    def probe_nodes(self, view: JobView, nodes: tuple[str, ...]) -> None:
        """Revoke the leases of ``nodes`` whose agents are provably gone (see probe.py)."""
        self._check_gone(self._present(view, nodes))

    def probe_round(self, view: JobView, mine: RoundRecord) -> bool:
        """``probe_nodes`` for the members of ``mine``, and those whose records are gone
        already too, from the probe ports the round recorded, to prove them dead
        (``proven``): the next round waits a grace for members gone in an outage, or
        holding the job's newest state alone, and the node that proved it before may not
        lead after it. True when it proved one dead (the plan may change at once)."""
        targets = self._present(view, tuple(m.id for m in mine.members))
        for m in mine.members:
            if m.id not in view.nodes and m.probe and self.proven.get(m.id) != m.rev:
                targets[m.id] = (m.addr, m.probe, 0, m.rev)  # no lease left to revoke
        before = dict(self.proven)
        self._check_gone(targets)
        return self.proven != before

    def probe_neighbours(self, mine: RoundRecord) -> None:
        """A node that does not lead, its workers' group broken: probe the members next
        to it (``rules.neighbours``) at the probe ports its round recorded, and revoke
        the lease of any that refuses, read from its record in etcd, if the record is
        still that incarnation's (a node that came back under the same name is alive)."""
        near = set(rules.neighbours(mine, self.session.me.id))
        targets = {m.id: (m.addr, m.probe, 0, m.rev) for m in mine.members if m.id in near}
        for node_id, (_, _, _, rev) in self._refused(targets, PROBE_EVERY).items():
            try:
                kv = self.client.get(self.session.key(records.NODES + node_id), timeout=2.0)
                if kv is None or not kv.lease:
                    continue
                rec = records.NodeRecord.decode(kv.key, kv.value)
                if (rec.resumes or kv.create_revision) != rev:
                    continue  # another incarnation holds the name now
                log.warning(
                    "%s refuses its probe port: its agent is gone; revoking its lease", node_id
                )
                self.client.revoke(kv.lease, timeout=2.0)
            except (RendezvousError, MalformedRecordError) as e:
                log.warning("could not revoke %s's lease: %s", node_id, e)

    def _present(
        self, view: JobView, nodes: tuple[str, ...]
    ) -> dict[str, tuple[str, int, int, int]]:
        """The probe targets among ``nodes`` that the view holds (this node aside)."""
        me = self.session.me.id
        present = {n: view.nodes[n] for n in nodes if n in view.nodes and n != me}
        return {n: (x.record.addr, x.record.probe, x.lease, x.rev) for n, x in present.items()}

    def _refused(
        self, targets: dict[str, tuple[str, int, int, int]], every: float
    ) -> dict[str, tuple[str, int, int, int]]:
        """Probe ``targets`` (node id: address, probe port, lease, incarnation) not probed
        in the last ``every`` seconds, all at once: those whose probe port refuses."""
        now = time.monotonic()
        due = {n: t for n, t in targets.items() if now - self._probed.get(n, 0.0) >= every}
        self._probed.update(dict.fromkeys(due, now))
        return {n: due[n] for n in gone_among({n: (t[0], t[1]) for n, t in due.items()})}

    def _check_gone(
        self, targets: dict[str, tuple[str, int, int, int]], every: float = PROBE_EVERY
    ) -> None:
        """Probe ``targets`` (``_refused``); revoke the leases of those that refuse."""
        for node_id, (_, _, lease, rev) in self._refused(targets, every).items():
            self.proven[node_id] = rev
            if not lease:
                log.warning("%s refuses its probe port: its agent is gone", node_id)
                continue
            log.warning("%s refuses its probe port: its agent is gone; revoking its lease", node_id)
            try:
                self.client.revoke(lease, timeout=2.0)
            except RendezvousError as e:
                log.warning("could not revoke %s's lease: %s", node_id, e)
