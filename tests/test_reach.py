"""What a connection to etcd meets, told apart for the user: a server that is not running
(refused) from a network that carries nothing (no route, no answer)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from faults import isolated_node

from rendezvous.net import Reach, reach, server_port, unreached

R = Reach


def test_a_listener_answers_a_closed_port_refuses_and_a_bad_name_does_not_resolve() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert reach("127.0.0.1", server.getsockname()[1]) is R.ANSWERS
    assert reach("127.0.0.1", server_port()) is R.REFUSED  # free: nothing listens
    assert reach("no-such-host.invalid", 2379) is R.UNKNOWN_HOST


def test_a_pulled_cable_is_no_route_on_the_node_and_silence_from_outside() -> None:
    """A node whose link is down has no route to anything; the others' packets to it are
    dropped unanswered (until ARP gives up, seconds later)."""
    with isolated_node() as net:
        net.cut()
        try:
            assert reach(net.node_ip, 2379, timeout=0.5) is R.SILENT
            inside = subprocess.run(
                net.command([sys.executable, "-c", _REACH.format(host=net.host_ip)]),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert inside.stdout.strip() == "Reach.NO_ROUTE", inside.stderr
        finally:
            net.restore()


_REACH = "from rendezvous.net import reach; print(reach({host!r}, 2379, timeout=0.5))"


@pytest.mark.parametrize(
    ("reaches", "before", "said"),
    [
        ({"a:1": R.REFUSED, "b:2": R.REFUSED}, False, "nothing accepts connections there: is etcd"),
        ({"a:1": R.UNKNOWN_HOST}, False, "a:1 does not resolve: is the host name right?"),
        (
            {"a:1": R.NO_ROUTE},
            True,
            "a:1 is unreachable from this host (no route): this host may be cut off from it "
            "(a link down, a partition, a firewall), as etcd answered there before",
        ),
        (
            {"a:1": R.SILENT, "b:2": R.REFUSED},
            False,
            "a:1 does not answer at all; b:2 refuses connections: this host may be cut off",
        ),
        (
            {"a:1": R.UNKNOWN_HOST, "b:2": R.REFUSED},
            False,
            "a:1 does not resolve; b:2 refuses connections: is etcd running, and are the host",
        ),
    ],
)
def test_what_the_user_is_told_to_check(reaches: dict[str, Reach], before: bool, said: str) -> None:
    assert unreached(reaches, before).startswith(said)
