"""A leaving node's last words to etcd, against a real one: said when etcd answers,
skipped when it does not (the lease expires by itself), so that a SIGTERM during an etcd
outage ends the agent at once instead of after a timeout per write (25 s, exit 1, before)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import wait_until

from elastic.agent.etcd_server import EtcdServer
from rendezvous import records
from rendezvous.client import EtcdClient
from rendezvous.config import RdzvConf, build_options
from rendezvous.protocol import NodeSpec, Rendezvous
from rendezvous.records import NodeRecord, NodeState


@pytest.fixture
def node(fresh_etcd: EtcdServer, run_id: str) -> Iterator[tuple[Rendezvous, EtcdClient]]:
    """Node a of a one-node job, in round 1, on an etcd of the test's own (a write not
    allowed to fail gives up after 2 s: the default 10 s would only slow the test)."""
    e, opts = build_options(
        fresh_etcd.endpoint, run_id, 1, 1, RdzvConf(connect_timeout=2, lease_ttl=2)
    )
    client = EtcdClient(e)
    a = Rendezvous(client, opts, NodeSpec(id="a", addr="127.0.0.1", nproc=1))
    a.start()
    assert a.next_round(timeout=10).number == 1
    yield a, client
    a.shutdown(leave=False)
    client.close()


def counted(client: EtcdClient, name: str) -> list[tuple[Any, ...]]:
    """The calls the client makes to etcd's ``name`` from now on (still made)."""
    calls: list[tuple[Any, ...]] = []
    real: Callable[..., Any] = getattr(client, name)

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        return real(*args, **kw)

    setattr(client, name, spy)
    return calls


def record(client: EtcdClient, a: Rendezvous) -> NodeRecord | None:
    kv = client.get(a.session.node_key)
    return None if kv is None else NodeRecord.decode(kv.key, kv.value)


def test_with_etcd_answering_the_node_says_it_leaves_and_goes_at_once(
    node: tuple[Rendezvous, EtcdClient],
) -> None:
    a, client = node
    a.announce_leaving()
    rec = record(client, a)
    assert rec is not None and rec.state is NodeState.LEAVING
    a.shutdown()
    assert record(client, a) is None  # removed, and its tombstone written
    assert client.get(a.session.key(records.GONE + "a")) is not None


def test_with_the_watch_down_it_writes_nothing_and_leaves_the_lease_to_expire(
    node: tuple[Rendezvous, EtcdClient],
) -> None:
    """etcd answers, but this node's watch says it does not (a node cut off, as far as
    it can tell): no write at all, the record stays until its lease expires."""
    a, client = node
    puts, revokes = counted(client, "put"), counted(client, "revoke")
    s = a.session
    assert not s.mark_leaving(reachable=False)
    s.mark_done(2, reachable=False)
    s.close(reachable=False)
    assert puts == [] and revokes == []
    rec = record(client, a)
    assert rec is not None and rec.state is not NodeState.LEAVING  # untouched, on its lease
    wait_until(lambda: record(client, a) is None, 3 * a.options.lease_ttl, "the lease to expire")


def test_the_first_write_that_fails_ends_the_last_words(
    node: tuple[Rendezvous, EtcdClient], fresh_etcd: EtcdServer
) -> None:
    """etcd gone while this node's watch has not noticed yet: one bounded write fails,
    and the node says nothing more (no revoke, no tombstone)."""
    a, client = node
    fresh_etcd.stop(signal.SIGKILL)
    puts, revokes, grants = (counted(client, n) for n in ("put", "revoke", "grant"))
    s = a.session
    assert not s.mark_leaving(reachable=True)  # tried once, for LEAVE_TIMEOUT
    assert len(puts) == 1
    s.mark_done(2, reachable=True)
    s.close(reachable=True)
    assert len(puts) == 1 and revokes == [] and grants == []


def test_a_node_that_is_not_leaving_still_fails_loudly(
    node: tuple[Rendezvous, EtcdClient], fresh_etcd: EtcdServer
) -> None:
    """Only a leaving node's writes are best-effort: a member that cannot say its
    workers stopped must know it."""
    a, _ = node
    fresh_etcd.stop(signal.SIGKILL)
    wait_until(lambda: not a.mirror.connected, 10, "the watch to notice")
    with pytest.raises(Exception, match="etcd unreachable"):
        a.session.mark_done(2)
