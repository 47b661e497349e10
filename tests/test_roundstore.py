"""The round's store as a re-forming worker connects to it: an abandon ends the connect
at once, even while torch's TCPStore client sleeps between its own retries."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from elastic.worker import roundstore


@pytest.fixture
def resetting_host() -> Iterator[int]:
    """A store host that died as it was validated: it accepts each connection, then
    resets it (SO_LINGER 0). torch's client then backs off and retries inside its
    constructor, for longer than the timeout it was given."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join()
    server.close()


def test_an_abandon_ends_a_connect_to_a_host_that_resets_it_at_once(resetting_host: int) -> None:
    abandoned = threading.Event()
    threading.Timer(0.2, abandoned.set).start()

    def check() -> None:
        if abandoned.is_set():
            raise roundstore.Abandoned("given up")

    began = time.monotonic()
    with pytest.raises(roundstore.Abandoned):
        roundstore.connect(
            "127.0.0.1", resetting_host, 1, 2, True, check, datetime.timedelta(seconds=30)
        )
    # the abandon came 0.2 s in; torch's own retry sleeps 0.5 s and more, then tries again
    assert time.monotonic() - began < 0.45


def test_a_failing_construction_is_raised_in_the_caller() -> None:
    def fail() -> None:
        raise dist.DistNetworkError("refused")

    with pytest.raises(dist.DistNetworkError, match="refused"):
        roundstore._abortable(fail, lambda: None)


def test_the_store_connects_and_serves_once_its_host_answers() -> None:
    host = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    store = roundstore.connect(
        "127.0.0.1", host.port, 1, 2, True, lambda: None, datetime.timedelta(seconds=30)
    )
    host.set("k", "v")
    assert store.get("k") == b"v"
