"""TLS-only etcd, user/password auth, and a three-member cluster with a member down."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from certs import make_tls
from etcd_servers import EtcdCluster, SlowLoginEtcdServer, TlsEtcdServer
from harness import Proc, etcdctl
from test_rendezvous import TTL, join, join_in_order, start_round

from elastic.agent.etcd_server import EtcdServer
from rendezvous.client import EtcdClient
from rendezvous.config import RdzvConf, build_options
from rendezvous.errors import EtcdUnavailableError
from rendezvous.tlsprobe import diagnose


def test_tls_only_etcd_with_client_certificates(
    tmp_path: Path, run_id: str, procs: list[Proc]
) -> None:
    tls = make_tls(tmp_path / "pki")
    with TlsEtcdServer(tls=tls) as server:
        conf = f"cacert={tls.ca},cert={tls.client_cert},key={tls.client_key}"
        a = join(procs, f"https://{server.endpoint}", run_id, "a", nnodes="2", conf=conf)
        a.expect("ready")
        b = join(procs, server.endpoint, run_id, "b", nnodes="2", conf=conf)  # cacert => TLS
        rounds = start_round([a, b])
        assert rounds[0]["members"] == ["a", "b"]
        # plain HTTP to a TLS-only etcd: a clear error naming the endpoint, in bounded time
        plain = join(procs, server.endpoint, run_id, "plain", conf="connect_timeout=2")
        err = plain.expect("error", timeout=10)
        assert err["kind"] == "EtcdUnavailableError" and server.endpoint in err["message"]
        # a client certificate from another CA is refused too
        other = make_tls(tmp_path / "other", ca_cn="someone else")
        bad = join(
            procs,
            server.endpoint,
            run_id,
            "bad",
            conf=(
                f"cacert={tls.ca},cert={other.client_cert},key={other.client_key},connect_timeout=2"
            ),
        )
        err = bad.expect("error", timeout=10)
        assert err["kind"] == "EtcdUnavailableError"
        assert "etcd refused this client's certificate" in err["message"], err
        assert f"cert={other.client_cert}" in err["message"]


def test_tls_mistakes_are_named_with_the_key_that_sets_them(tmp_path: Path) -> None:
    """gRPC reports every failed handshake as an unreachable etcd; the diagnosis says
    which side refused which certificate."""
    tls = make_tls(tmp_path / "pki")
    other = make_tls(tmp_path / "other", ca_cn="someone else")
    with TlsEtcdServer(tls=tls) as server:
        host, port = server.endpoint.rsplit(":", 1)

        def why(ca: str, cert: str | None, key: str | None) -> str | None:
            return diagnose(host, int(port), ca, cert, key)

        assert why(tls.ca, tls.client_cert, tls.client_key) is None  # all good
        assert "etcd requires a client certificate; give --rdzv-conf cert=" in str(
            why(tls.ca, None, None)
        )
        assert "etcd refused this client's certificate" in str(
            why(tls.ca, other.client_cert, other.client_key)
        )
        wrong_ca = str(why(other.ca, tls.client_cert, tls.client_key))
        assert "this client refused etcd's certificate" in wrong_ca
        assert f"cacert={other.ca}" in wrong_ca


def test_user_password_auth_survives_etcd_restart(
    tmp_path: Path, run_id: str, procs: list[Proc]
) -> None:
    with EtcdServer() as server:
        etcdctl(server, "user", "add", "root", "--new-user-password=s3cret")
        etcdctl(server, "auth", "enable")
        secret = tmp_path / "password"
        secret.write_text("s3cret\n")
        conf = f"user=root,password_file={secret}"
        a, b = join_in_order(procs, server.endpoint, run_id, "ab", nnodes="1:2", conf=conf)
        start_round([a, b])
        # etcd forgets its auth tokens when it restarts; clients must log in again
        server.stop()
        server.start()
        time.sleep(TTL)
        b.send("leave")
        # an etcd slow to come back (a loaded disk) may drop every lease: then a resumes
        # on a new one, which needs a new login as much as a keep-alive does
        ends = {"LEFT", "LAPSED"}
        a.expect("change", where=lambda ev: ev["end"] in ends, timeout=10)
        a.send("next")
        assert a.expect("round", timeout=15)["members"] == ["a"]
        wrong = join(procs, server.endpoint, run_id, "w", conf="user=root,password=nope")
        err = wrong.expect("error", timeout=15)
        assert "rejected user 'root'" in err["message"]


def test_a_login_slower_than_every_callers_deadline_still_completes() -> None:
    """etcd's login is a bcrypt check and a raft write: on a loaded etcd (here: a costly
    hash, about a second) it outlasts a caller's short deadline. The one login, shared by
    all callers, goes on past their deadlines: calls that give up early are followed by
    ones that succeed. (Each retry used to start a login of its own, cut short in turn,
    for ever: after an etcd restart the nodes' keep-alives never got through.)"""
    with SlowLoginEtcdServer(cost=14) as server:
        etcdctl(server, "user", "add", "root", "--new-user-password=s3cret")
        etcdctl(server, "auth", "enable")
        conf = RdzvConf.parse("user=root,password=s3cret")
        client = EtcdClient(build_options(server.endpoint, "slow-login", 1, 1, conf)[0])
        started = time.monotonic()
        try:
            took = timed_out = 0
            while took == 0 and time.monotonic() - started < 30:
                try:
                    client.put("k", b"v", timeout=0.3)
                    took = time.monotonic() - started
                except EtcdUnavailableError:
                    timed_out += 1
            assert took and timed_out, (took, timed_out)
            for _ in range(3):  # logged in: no new login for each call, however short
                assert client.get("k", timeout=1.0) is not None
        finally:
            client.close()


def test_cluster_with_one_member_stopped(run_id: str, procs: list[Proc]) -> None:
    with EtcdCluster(3) as cluster:
        a, b, c = join_in_order(procs, cluster.endpoints, run_id, "abc", nnodes="1:3")
        start_round([a, b, c])
        for member in cluster.members[:1]:
            member.stop(signal.SIGKILL)
        time.sleep(TTL + 2)  # longer than a lease: keep-alives must have failed over
        for n in (a, b, c):
            assert all(ev["event"] != "change" for ev in list(n.events.queue)), n.transcript()
        c.signal(signal.SIGKILL)
        a.expect("change", end="LOST", nodes=["c"], timeout=TTL + 3)
        start_round([a, b])
        # and a node that only knows the stopped member plus a live one still joins
        d = join(
            procs,
            f"{cluster.members[0].endpoint},{cluster.members[2].endpoint}",
            run_id,
            "d",
            nnodes="1:3",
        )
        d.expect("ready", timeout=15)
