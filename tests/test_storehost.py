"""The round's TCPStore in its helper process: ready once torch is imported, a store per
round that workers reach, a clear error for a port it cannot take."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
from harness import wait_until
from torch.distributed import TCPStore

from elastic.agent.storehost import StoreError, StoreHost
from rendezvous.net import free_port


@pytest.fixture
def host() -> Iterator[StoreHost]:
    h = StoreHost(start_timeout=60)
    try:
        yield h
    finally:
        h.close()


def reach(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_hosting_before_ready_waits_for_the_helper(host: StoreHost) -> None:
    assert not host.ready  # no helper until one is needed
    port = free_port()
    host.host_round("127.0.0.1", port)  # starts the helper and waits for its import
    assert host.ready
    store = reach(port)
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_each_round_gets_a_fresh_store_and_a_taken_port_is_an_error(host: StoreHost) -> None:
    host.warm()
    wait_until(lambda: host.ready, 60, "the helper imported torch", interval=0.05)
    first, second = free_port(), free_port()
    host.host_round("127.0.0.1", first)
    reach(first).set("round", "1")
    host.host_round("127.0.0.1", second)  # the first round's store goes
    assert reach(second).check(["round"]) is False
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", first)) != 0, "the old round's store is gone"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StoreError, match=f"port {port}"):
            host.host_round("127.0.0.1", port)
