"""The job mirror against a real etcd: switching between the lean and the full share,
following a lean node's bucket, and the lead claimed at registration."""

from __future__ import annotations

import time
from collections.abc import Callable

from harness import wait_until

from elastic.agent.etcd_server import EtcdServer
from rendezvous import records
from rendezvous.client import EtcdClient
from rendezvous.config import build_options
from rendezvous.mirror import JobMirror
from rendezvous.protocol import NodeSpec, Rendezvous
from rendezvous.records import (
    MAX_BUCKETS,
    FailureReport,
    LeaderRecord,
    Member,
    NodeRecord,
    RoundCause,
    RoundRecord,
    bucket_of,
    buckets_for,
)
from rendezvous.rules import plan


def until(what: Callable[[], object], timeout: float = 10.0) -> None:
    wait_until(what, timeout, "the condition")


def put_node(client: EtcdClient, prefix: str, node: str) -> None:
    """A node's record, on a lease as every agent holds it (one on none is no node's)."""
    record = NodeRecord(node, "127.0.0.1", 1).encode()
    client.put(prefix + records.NODES + node, record, lease=client.grant(60))


def test_going_full_again_sees_keys_dropped_while_lean(client: EtcdClient, run_id: str) -> None:
    """A lean read drops the keys outside its share; reading them again later, unchanged
    (older than that lean read), must bring them back: a leader that took the lead twice
    once planned rounds without them."""
    prefix = f"/elastic-run/{run_id}/"
    for node in "abx":
        put_node(client, prefix, node)
    mirror = JobMirror(client, prefix, own="x")
    mirror.start(timeout=5)
    try:
        assert set(mirror.view().nodes) == {"x"}
        mirror.set_full(True)
        assert mirror.complete and set(mirror.view().nodes) == {"a", "b", "x"}
        mirror.set_full(False)
        until(lambda: set(mirror.view().nodes) == {"x"})
        client.put(prefix + "unrelated", b"{}")  # the revision moves on
        mirror.set_full(True)
        assert set(mirror.view().nodes) == {"a", "b", "x"}
        put_node(client, prefix, "c")
        until(lambda: "c" in mirror.view().nodes)  # and the full watch goes on from there
        client.raw().delete(prefix + records.NODES + "a")
        until(lambda: "a" not in mirror.view().nodes)
    finally:
        mirror.stop()


def test_full_view_is_not_complete_until_read(client: EtcdClient, run_id: str) -> None:
    """Going full without waiting leaves the read to the watch thread; ``complete`` says
    when the view holds the whole job (deciding on it before would miss nodes)."""
    prefix = f"/elastic-run/{run_id}/"
    for node in "ax":
        put_node(client, prefix, node)
    mirror = JobMirror(client, prefix, own="x")
    mirror.start(timeout=5)
    try:
        mirror.set_full(True, wait=False)
        assert mirror.full
        until(lambda: mirror.complete)
        assert set(mirror.view().nodes) == {"a", "x"}
    finally:
        mirror.stop()


def _write_round(client: EtcdClient, prefix: str, number: int, ids: list[str]) -> RoundRecord:
    """A round as the leader writes it: the header and its buckets in one transaction
    (buckets a smaller round no longer uses are deleted)."""
    members = tuple(Member(i, 1, "127.0.0.1", 1) for i in ids)
    rec = RoundRecord(number, members, "127.0.0.1", 1, 2)
    ops = client.ops
    puts = [ops.put(prefix + records.ROUND, rec.encode())]
    puts += [ops.put(f"{prefix}{records.MEMBERS}{b}", v) for b, v in rec.encode_buckets().items()]
    stale = [ops.delete(f"{prefix}{records.MEMBERS}{b}") for b in range(rec.buckets, MAX_BUCKETS)]
    assert client.txn([], puts + stale)
    return rec


def test_lean_view_follows_its_bucket_as_the_round_resizes(client: EtcdClient, run_id: str) -> None:
    """A lean node watches its own bucket of the round; when the round's size moves it
    to another bucket, it reads the new one: every round shows this node's true rank."""
    prefix = f"/elastic-run/{run_id}/"
    mirror = JobMirror(client, prefix, own="x", expected_size=8)
    mirror.start(timeout=5)
    try:
        for number, size in enumerate([8, 8, 200, 200, 70, 8], start=1):
            ids = [f"n{i:03d}" for i in range(size - 1)] + ["x"]
            rec = _write_round(client, prefix, number, ids)
            assert rec.buckets == buckets_for(size)

            def shown(n: int = number) -> bool:
                r = mirror.view().round
                return r is not None and r.number == n

            until(shown)
            r = mirror.view().round
            assert r is not None and r.size == size
            mine = r.member("x")
            assert mine is not None and mine.rank == size - 1
            assert all(bucket_of(m.id, r.buckets) == bucket_of("x", r.buckets) for m in r.members)
    finally:
        mirror.stop()


def test_the_first_node_claims_the_lead_as_it_registers(
    etcd: EtcdServer, client: EtcdClient, run_id: str
) -> None:
    """The lead is claimed in the registering transaction (its record says rev 0: the
    key's create revision, which is the node's own); later nodes find it taken."""
    _, opts = build_options(etcd.endpoint, run_id, 1, 3)
    nodes = [Rendezvous(client, opts, NodeSpec(id=n, addr="127.0.0.1", nproc=1)) for n in "ab"]
    try:
        for node in nodes:
            node.start()
        a, b = nodes
        until(lambda: b.mirror.view().leader is not None)
        for node in nodes:
            leader = node.mirror.view().leader
            assert leader is not None and (leader.id, leader.rev) == ("a", a.rev)
        held = client.get(opts.job_prefix + records.LEADER)
        assert held is not None and held.create_revision == a.rev
        assert LeaderRecord.decode(held.key, held.value).rev == 0
        assert a.leads and not b.leads  # a's agent readies the round's store at once
    finally:
        for node in nodes:
            node.shutdown()


def test_a_failure_is_in_the_own_view_as_soon_as_the_done_is(
    etcd: EtcdServer, client: EtcdClient, run_id: str
) -> None:
    """A node's failure report and its 'done' are two writes; its own view shows the done
    at once, so it must show the report at once too: planned between the two, the next
    round read as a resize and charged no restart (CI saw a third attempt under
    --max-restarts 1)."""
    _, opts = build_options(etcd.endpoint, run_id, 1, 1)
    node = Rendezvous(client, opts, NodeSpec(id="a", addr="127.0.0.1", nproc=1), max_restarts=1)
    try:
        node.start()
        assert node.next_round(timeout=10).number == 1
        node.mirror.stop()  # no watch event comes now: the view holds only what is shown
        node.report_failure(FailureReport("worker failed on a"))
        view = node.mirror.view()
        assert view.nodes["a"].record.done == 1 and "a" in view.failures.get(1, {})
        p = plan(view, 1, 1, 0.0, max_restarts=1, now=time.monotonic())
        assert (p.form, p.cause, p.restarts) == (True, RoundCause.FAILURE, 1), p.reason
    finally:
        node.shutdown()
