"""The shared streams of one etcd client against a real etcd: every watch on one Watch
stream, every lease kept alive on one LeaseKeepAlive stream; and the probe of many ports
at once."""

from __future__ import annotations

import queue
import signal
import socket
import threading
import time
from collections.abc import Callable

from harness import wait_until

from elastic.agent.etcd_server import EtcdServer
from rendezvous.client import EtcdClient
from rendezvous.config import build_options
from rendezvous.errors import EtcdUnavailableError
from rendezvous.lease import LeaseKeeper
from rendezvous.probe import ProbeListener, gone_among
from rendezvous.watches import Subscription, WatchSpec, watch


def until(what: Callable[[], object], timeout: float = 10.0) -> None:
    wait_until(what, timeout, "the condition")


def drain(sub: Subscription) -> queue.Queue:
    """Iterate ``sub`` in a thread: each batch's keys, then the error or None that ended it."""
    out: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            for events in sub:
                out.put([e.key for e in events])
            out.put(None)
        except Exception as e:
            out.put(e)

    threading.Thread(target=run, daemon=True).start()
    return out


def keys(out: queue.Queue, count: int) -> set[str]:
    """The keys of the next ``count`` events from ``drain``."""
    got: list[str] = []
    while len(got) < count:
        got += out.get(timeout=5)
    return set(got)


def watch_threads() -> int:
    return sum(t.name == "etcd-watch" for t in threading.enumerate())


def test_watches_share_one_stream_and_each_gets_its_own_events(
    client: EtcdClient, run_id: str
) -> None:
    p = f"/{run_id}/"
    before = watch_threads()  # other tests' clients may still be winding down
    start = client.put(p + "start", b"") + 1
    a = watch(client, [WatchSpec(p + "a"), WatchSpec(p + "both/", prefix=True)], start)
    b = watch(client, [WatchSpec(p + "b"), WatchSpec(p + "both/", prefix=True)], start)
    got_a, got_b = drain(a), drain(b)
    assert watch_threads() == before + 1
    client.put(p + "a", b"1")
    client.put(p + "b", b"1")
    client.put(p + "both/x", b"1")
    # each watch's events come in order; two watches' may interleave either way
    assert keys(got_a, 2) == {p + "a", p + "both/x"}
    assert keys(got_b, 2) == {p + "b", p + "both/x"}
    a.cancel()
    assert got_a.get(timeout=5) is None  # a cancel ends quietly
    client.put(p + "a", b"2")
    client.put(p + "b", b"2")
    assert got_b.get(timeout=5) == [p + "b"]  # the other goes on; a saw nothing more
    assert got_a.empty()
    b.cancel()
    assert got_b.get(timeout=5) is None
    until(lambda: watch_threads() <= before)  # the last one gone, the stream and thread go


def own_client(etcd: EtcdServer, run_id: str) -> EtcdClient:
    return EtcdClient(build_options(etcd.endpoint, run_id, 1, 1)[0])


def test_a_broken_stream_ends_every_subscription_with_the_error(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    etcd, client = fresh_etcd, own_client(fresh_etcd, run_id)
    p = f"/{run_id}/"
    try:
        start = client.put(p + "start", b"") + 1
        outs = [drain(watch(client, [WatchSpec(p + k)], start)) for k in "ab"]
        etcd.stop(signal.SIGKILL)
        try:
            for out in outs:
                assert isinstance(out.get(timeout=10), EtcdUnavailableError)
        finally:
            etcd.start()
        again = watch(client, [WatchSpec(p + "a")], start)  # on a new stream
        got = drain(again)
        client.put(p + "a", b"back")
        assert got.get(timeout=10) == [p + "a"]
        again.cancel()
    finally:
        client.close()


def test_many_leases_kept_alive_on_one_stream(client: EtcdClient) -> None:
    """Twenty leases of 5 s live on past their TTL, kept by one thread; one revoked
    behind their back is reported lost (and its waiter told), the others stay alive.
    (With 2 s, etcd stalled beside the rest of the suite on a 2-core CI host let them
    lapse: an etcd outage longer than the TTL is another test's.)"""
    changed = threading.Event()
    keepers = [LeaseKeeper(client, ttl=5, interval=5 / 3) for _ in range(20)]
    keepers[0].on_change = changed.set
    try:
        for k in keepers:
            k.grant(timeout=5)
        assert sum(t.name == "etcd-lease" for t in threading.enumerate()) == 1
        time.sleep(6)  # past the TTL: only keep-alives hold them
        raw = client.raw()
        assert all(raw.get_lease_info(k.lease_id).TTL > 0 for k in keepers)
        client.revoke(keepers[0].lease_id)
        assert changed.wait(5) and keepers[0].lost
        assert not any(k.lost for k in keepers[1:])
        assert all(raw.get_lease_info(k.lease_id).TTL > 0 for k in keepers[1:])
    finally:
        for k in keepers:
            k.revoke()
            k.stop()
    until(lambda: not any(t.name == "etcd-lease" for t in threading.enumerate()))


def test_a_lease_outlives_an_etcd_restart_within_its_ttl(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    client = own_client(fresh_etcd, run_id)
    keeper = LeaseKeeper(client, ttl=5, interval=5 / 3)
    try:
        keeper.grant(timeout=5)
        fresh_etcd.stop(signal.SIGKILL)
        time.sleep(1)
        fresh_etcd.start()
        sent = keeper.last_ok
        until(lambda: keeper.last_ok > sent)  # a new stream after the broken one
        assert not keeper.lost and client.raw().get_lease_info(keeper.lease_id).TTL > 0
    finally:
        keeper.revoke()
        keeper.stop()
        client.close()


def test_probing_many_ports_at_once_names_only_the_refusing_ones() -> None:
    listeners = [ProbeListener() for _ in range(3)]
    closed = []
    for _ in range(300):  # more than one batch
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        closed.append(s.getsockname()[1])
        s.close()
    try:
        targets = {f"live{i}": ("127.0.0.1", lst.port) for i, lst in enumerate(listeners)}
        targets |= {f"dead{i}": ("127.0.0.1", port) for i, port in enumerate(closed)}
        targets["unknown"] = ("127.0.0.1", 0)  # no probe port: proves nothing
        gone = gone_among(targets)
        assert sorted(gone) == sorted(f"dead{i}" for i in range(len(closed)))
    finally:
        for lst in listeners:
            lst.close()
