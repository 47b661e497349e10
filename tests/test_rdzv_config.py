"""--rdzv-endpoint and --rdzv-conf parsing: every bad value is one clear sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from rendezvous.config import (
    PASSWORD_ENV,
    RENEWALS_PER_SECOND,
    ConfigError,
    RdzvConf,
    build_options,
    parse_conf,
    parse_endpoints,
)


def test_endpoints() -> None:
    assert parse_endpoints("etcd") == (("etcd:2379",), None)
    assert parse_endpoints("a:1, b:2 ,c") == (("a:1", "b:2", "c:2379"), None)
    assert parse_endpoints("https://a:1,https://b") == (("a:1", "b:2379"), "https")
    assert parse_endpoints("[::1]:2379") == (("[::1]:2379",), None)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "empty"),
        ("a:b", r"expected host\[:port\]"),
        ("a:70000", "port out of range"),
        ("http://a,https://b", "mixes"),
    ],
)
def test_bad_endpoints(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_endpoints(text)


def test_conf_syntax() -> None:
    assert parse_conf("a=1, b = x=y ,") == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_conf("novalue")


def test_defaults_and_aliases() -> None:
    etcd, rdzv = build_options("h", "job", 1, 4)
    assert etcd.endpoints == ("h:2379",) and not etcd.secure
    assert (rdzv.lease_ttl, rdzv.last_call_timeout, rdzv.join_timeout) == (5, 2.0, 600.0)
    assert rdzv.keep_alive_interval == pytest.approx(5 / 3)
    assert rdzv.job_prefix == "/elastic-run/job/"
    _, rdzv = build_options(
        "h",
        "job",
        1,
        4,
        RdzvConf.parse(
            {"heartbeat_timeout": "9", "timeout": 900, "etcd_prefix": "/x/", "is_host": "1"}
        ),
    )
    assert (rdzv.lease_ttl, rdzv.join_timeout, rdzv.job_prefix) == (9, 900.0, "/x/job/")


@pytest.mark.parametrize(
    "conf,needle",
    [
        ({"lease_ttl": "1"}, "at least 2 seconds"),
        ({"lease_ttl": "2.5"}, "whole seconds"),
        ({"join_timeout": "-3"}, "positive"),
        ({"last_call_timeout": "soon"}, "number of seconds"),
        ({"keep_alive_interval": "6"}, "shorter than lease_ttl"),
        ({"prefix": "relative"}, "absolute key prefix"),
        ({"protocol": "https"}, "cacert"),
        ({"protocol": "ftp"}, "http or https"),
        ({"cacert": "/nonexistent/ca.pem"}, "no such file"),
        ({"user": "root"}, "user and password"),
    ],
)
def test_bad_conf_names_the_key(conf: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        build_options("h", "job", 1, 4, RdzvConf.parse(conf))
    assert "\n" not in str(e.value)


def test_bad_nodes_and_run_id() -> None:
    with pytest.raises(ConfigError, match="maximum is below minimum"):
        build_options("h", "job", 4, 1)
    with pytest.raises(ConfigError, match="at least 1"):
        build_options("h", "job", 0, 1)
    with pytest.raises(ConfigError, match="--rdzv-id"):
        build_options("h", "a/b", 1, 1)


def test_tls_and_password_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    etcd, _ = build_options("h", "job", 1, 1, RdzvConf.parse({"cacert": str(ca)}))
    assert etcd.secure and etcd.ca_cert == str(ca)
    with pytest.raises(ConfigError, match="cert and key"):
        build_options("h", "job", 1, 1, RdzvConf.parse({"cacert": str(ca), "cert": str(ca)}))
    with pytest.raises(ConfigError, match="says http but"):
        build_options(
            "http://h", "job", 1, 1, RdzvConf.parse({"protocol": "https", "cacert": str(ca)})
        )
    secret = tmp_path / "pw"
    secret.write_text("from-file\nignored\n")
    etcd, _ = build_options(
        "h", "job", 1, 1, RdzvConf.parse({"user": "u", "password_file": str(secret)})
    )
    assert (etcd.user, etcd.password) == ("u", "from-file")
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    etcd, _ = build_options("h", "job", 1, 1, RdzvConf.parse({"user": "u"}))
    assert etcd.password == "from-env"


def test_the_default_lease_ttl_keeps_keep_alives_under_a_budget() -> None:
    """Three keep-alives per TTL per node: past 3,333 nodes the default TTL grows so that
    a job sends etcd at most RENEWALS_PER_SECOND; a TTL given is kept as given."""
    for max_nodes, ttl in [(4, 5), (3_333, 5), (10_000, 15), (100_000, 150)]:
        _, rdzv = build_options("127.0.0.1:2379", "job", 1, max_nodes)
        assert rdzv.lease_ttl == ttl and rdzv.keep_alive_interval == ttl / 3
        assert 3 * max_nodes / rdzv.lease_ttl <= max(RENEWALS_PER_SECOND, 3 * max_nodes / 5)
    _, rdzv = build_options("127.0.0.1:2379", "job", 1, 10_000, RdzvConf.parse({"lease_ttl": "5"}))
    assert rdzv.lease_ttl == 5


def test_rdzv_conf_is_parsed_once_into_typed_values() -> None:
    conf = RdzvConf.parse("lease_ttl=7,store_type=tcp,is_host=no,read_timeout=2.5")
    assert (conf.lease_ttl, conf.is_host, conf.request_timeout) == (7, False, 2.5)
    assert conf.ignored == ("store_type",) and conf.ca_cert is None and conf.prefix is None
    assert RdzvConf.parse({"timeout": 30}) == RdzvConf(join_timeout=30.0)
    assert RdzvConf.parse("") == RdzvConf()
