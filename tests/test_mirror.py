"""The job mirror against a real etcd: switching between the lean and the full share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from elastic.agent.etcd_server import EtcdServer
from rendezvous import records
from rendezvous.client import EtcdClient
from rendezvous.config import build_options
from rendezvous.mirror import JobMirror
from rendezvous.records import NodeRecord


@pytest.fixture
def client(etcd: EtcdServer, run_id: str) -> Iterator[EtcdClient]:
    e, _ = build_options(etcd.endpoint, run_id, 1, 1, {})
    c = EtcdClient(e)
    yield c
    c.close()


def until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_going_full_again_sees_keys_dropped_while_lean(client: EtcdClient, run_id: str) -> None:
    """A lean read drops the keys outside its share; reading them again later, unchanged
    (older than that lean read), must bring them back: a leader that took the lead twice
    once planned rounds without them."""
    prefix = f"/elastic-run/{run_id}/"
    for node in "abx":
        client.put(prefix + records.NODES + node, NodeRecord(node, "127.0.0.1", 1).encode())
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
        client.put(prefix + records.NODES + "c", NodeRecord("c", "127.0.0.1", 1).encode())
        until(lambda: "c" in mirror.view().nodes)  # and the full watch goes on from there
        client.delete_prefix(prefix + records.NODES + "a")
        until(lambda: "a" not in mirror.view().nodes)
    finally:
        mirror.stop()


def test_full_view_is_not_complete_until_read(client: EtcdClient, run_id: str) -> None:
    """Going full without waiting leaves the read to the watch thread; ``complete`` says
    when the view holds the whole job (deciding on it before would miss nodes)."""
    prefix = f"/elastic-run/{run_id}/"
    for node in "ax":
        client.put(prefix + records.NODES + node, NodeRecord(node, "127.0.0.1", 1).encode())
    mirror = JobMirror(client, prefix, own="x")
    mirror.start(timeout=5)
    try:
        mirror.set_full(True, wait=False)
        assert mirror.full
        until(lambda: mirror.complete)
        assert set(mirror.view().nodes) == {"a", "x"}
    finally:
        mirror.stop()
