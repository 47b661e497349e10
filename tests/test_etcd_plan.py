"""Where the job's etcd is: every rule of etcd_plan.plan_etcd on plain values."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from elastic.agent.etcd_plan import EtcdSource, plan_etcd, static_etcd_port
from rendezvous.net import server_port

EP = ("etcd.example", 2379)


@pytest.mark.parametrize(
    "kwargs,source",
    [
        (dict(), EtcdSource.EMBEDDED),  # one node, no endpoint
        (dict(static=True, node_rank=0), EtcdSource.SERVE),  # static form: node 0 serves
        (dict(static=True, node_rank=1), EtcdSource.WAIT),  # the others wait for it
    ],
)
def test_no_endpoint(kwargs: dict, source: EtcdSource) -> None:
    plan = plan_etcd(None, master=("10.0.0.1", 29501), **kwargs)
    assert plan.source is source
    if source is not EtcdSource.EMBEDDED:
        assert plan.endpoint == "10.0.0.1:29501" and "static form" in plan.reason


@pytest.mark.parametrize(
    "kwargs,source",
    [
        (dict(answers=True), EtcdSource.CONNECT),  # a real etcd (or a serving agent)
        (dict(answers=True, names_this_host=True), EtcdSource.CONNECT),
        (dict(answers=True, is_host=True), EtcdSource.CONNECT),  # something is there: use it
        (dict(names_this_host=True), EtcdSource.SERVE),  # c10d: this host serves
        (dict(is_host=True), EtcdSource.SERVE),
        (dict(names_this_host=True, is_host=False), EtcdSource.WAIT),
        (dict(), EtcdSource.WAIT),  # another host, not up yet
        (dict(several=True), EtcdSource.CONNECT),  # a cluster: never served by an agent
        (dict(several=True, names_this_host=True, is_host=True), EtcdSource.CONNECT),
    ],
)
def test_with_endpoint(kwargs: dict, source: EtcdSource) -> None:
    plan = plan_etcd(EP, **kwargs)
    assert plan.source is source, plan.reason
    assert plan.endpoint == "etcd.example:2379" and plan.reason


def test_only_a_guess_is_said_to_be_one() -> None:
    """Serving because nothing answered may hide a mistyped port: that plan says so."""
    assert plan_etcd(EP, names_this_host=True).guessed
    assert not plan_etcd(EP, is_host=True).guessed  # the user said so
    assert not plan_etcd(None, static=True).guessed


def test_static_port_is_one_above_the_master_port() -> None:
    assert static_etcd_port(None) == 29501  # torchrun's default master port, plus one
    assert static_etcd_port(40000) == 40001


def test_an_etcd_that_cannot_bind_is_not_fooled_by_another_on_its_port() -> None:
    """The health check of a member that failed to bind would reach the etcd already
    listening there; two jobs' node 0 on one port must not merge into one job."""
    from elastic.agent.etcd_server import EtcdServer, EtcdServerError
    from rendezvous.net import free_port

    port = free_port()
    with EtcdServer(name="first", client_port=port):
        second = EtcdServer(name="second", client_port=port)
        try:
            with pytest.raises(EtcdServerError, match="address already in use"):
                second.start(timeout=10)
        finally:
            second.close()


def test_an_etcds_ports_are_below_the_range_outgoing_connections_take() -> None:
    """A port from the ephemeral range may be taken by any outgoing connection on the
    machine while a restarted etcd is down (a client of its own, reconnecting); below
    that range only a server takes one."""
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    taken = {server_port() for _ in range(20)}
    assert all(1024 <= p < floor for p in taken)
    port = server_port(avoid=taken)
    assert port not in taken
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free, as it said


def test_a_health_check_answered_with_its_own_request_is_not_healthy() -> None:
    """A connect to a port no one listens on yet, in the range outgoing connections take,
    may connect to itself and read its own request back (CI: "BadStatusLine: GET
    /health" crashed a static node 0 whose etcd was starting): not healthy, no crash."""
    import threading

    from elastic.agent.etcd_server import EtcdServer

    with socket.create_server(("127.0.0.1", 0)) as echo:

        def serve() -> None:
            conn, _ = echo.accept()
            with conn:
                conn.sendall(conn.recv(4096))  # what a self-connected socket reads back

        threading.Thread(target=serve, daemon=True).start()
        server = EtcdServer(name="echo", client_port=echo.getsockname()[1])
        try:
            assert server.healthy() is False
        finally:
            server.close()
