"""Rendezvous options: ``--rdzv-endpoint`` and ``--rdzv-conf`` parsed and checked.

Every bad value is a ``ConfigError`` whose message names the key and what was wrong,
so the CLI can print it as one line.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/elastic-run"
PASSWORD_ENV = "ELASTIC_RUN_ETCD_PASSWORD"


class ConfigError(ValueError):
    """A rendezvous option has a bad value; the message is meant for the user as is."""


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd: endpoints (failover between them), TLS and auth, timeouts."""

    endpoints: tuple[str, ...]
    secure: bool = False
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    request_timeout: float = 5.0
    connect_timeout: float = 10.0

    def describe(self) -> str:
        scheme = "https" if self.secure else "http"
        return ", ".join(f"{scheme}://{e}" for e in self.endpoints)


# keep-alives a second that the default lease TTL keeps a job under: etcd spends a few
# hundred microseconds of CPU on each (see docs/measured.md, "Scale"), so 2,000 is under a core
RENEWALS_PER_SECOND = 2000


def default_lease_ttl(max_nodes: int) -> int:
    """5 s; longer for a job so large that three keep-alives per TTL from each of its
    nodes would pass RENEWALS_PER_SECOND (10,000 nodes: 15 s). A SIGKILLed node is
    still noticed at once through its probe port; only a frozen or cut-off one waits
    for the TTL."""
    return max(RendezvousOptions.lease_ttl, math.ceil(3 * max_nodes / RENEWALS_PER_SECOND))


@dataclass(frozen=True)
class RendezvousOptions:
    """What one job's rendezvous needs besides the etcd connection."""

    run_id: str
    min_nodes: int
    max_nodes: int
    prefix: str = DEFAULT_PREFIX
    lease_ttl: int = 5
    keep_alive_interval: float = 5 / 3
    join_timeout: float = 600.0
    last_call_timeout: float = 2.0
    close_timeout: float = 30.0
    master_port: int | None = None  # MASTER_PORT of every round (--master-port); None: fresh

    @property
    def job_prefix(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.run_id}/"


def _seconds(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}={text!r}: expected a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"--rdzv-conf {key}={text!r}: must be a positive number of seconds")
    return value


def _ttl(key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}={text!r}: expected whole seconds") from None
    if value < 2:
        raise ConfigError(f"--rdzv-conf {key}={text!r}: etcd leases need at least 2 seconds")
    return value


def _path(key: str, text: str) -> str:
    if not os.path.isfile(text):
        raise ConfigError(f"--rdzv-conf {key}={text!r}: no such file")
    return text


def _text(key: str, text: str) -> str:
    if not text:
        raise ConfigError(f"--rdzv-conf {key}: empty value")
    return text


def _prefix(key: str, text: str) -> str:
    if not text.startswith("/") or text == "/":
        raise ConfigError(f"--rdzv-conf {key}={text!r}: expected an absolute key prefix like /jobs")
    return text.rstrip("/")


def _protocol(key: str, text: str) -> str:
    if text not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf {key}={text!r}: expected http or https")
    return text


def _ignored(key: str, text: str) -> str:
    return text


def parse_bool(key: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "y", "on"):
        return True
    if value in ("0", "false", "no", "n", "off"):
        return False
    raise ConfigError(f"--rdzv-conf {key}={text!r}: expected true or false")


# c10d's, etcd-v2's and static's keys with no meaning for an etcd v3 rendezvous
IGNORED = ("keep_alive_max_attempt", "store_type", "use_libuv", "rank")


# key -> (canonical name, parser, help). Canonical names are what docs/reference.md documents.
_Parser = Callable[[str, str], object]
KEYS: dict[str, tuple[str, _Parser, str]] = {
    "join_timeout": (
        "join_timeout",
        _seconds,
        "seconds to wait for MIN nodes before giving up (600)",
    ),
    "timeout": ("join_timeout", _seconds, "alias of join_timeout (torch's etcd backend)"),
    "last_call_timeout": (
        "last_call_timeout",
        _seconds,
        "once MIN nodes are in, seconds to wait after the latest arrival "
        "for more before forming a round below MAX (2)",
    ),
    "lease_ttl": (
        "lease_ttl",
        _ttl,
        "whole seconds a silent agent keeps its place: its etcd lease TTL (5; over 3,333 "
        "nodes, 3 x max nodes / 2,000, which keeps keep-alives under 2,000 a second)",
    ),
    "heartbeat_timeout": ("lease_ttl", _ttl, "alias of lease_ttl (torch's c10d backend)"),
    "keep_alive_interval": (
        "keep_alive_interval",
        _seconds,
        "seconds between lease keep-alives (lease_ttl / 3)",
    ),
    "read_timeout": ("request_timeout", _seconds, "seconds per etcd request (5)"),
    "connect_timeout": (
        "connect_timeout",
        _seconds,
        "seconds to keep trying an etcd that has not answered yet before failing (10); "
        "one that answered and went away is waited for up to `join_timeout` while "
        "joining, and forever while training",
    ),
    "close_timeout": (
        "close_timeout",
        _seconds,
        "after this node's workers succeed, seconds to wait for the others (30)",
    ),
    "prefix": ("prefix", _prefix, "etcd key prefix of all jobs (/elastic-run)"),
    "etcd_prefix": ("prefix", _prefix, "alias of prefix (torch's etcd backend)"),
    "protocol": ("protocol", _protocol, "http or https; https:// in the endpoint does the same"),
    "cacert": ("ca_cert", _path, "CA bundle that signed etcd's certificate; turns TLS on"),
    "ca_cert": ("ca_cert", _path, "alias of cacert"),
    "cert": ("cert", _path, "client certificate for mutual TLS"),
    "ssl_cert": ("cert", _path, "alias of cert (torch's etcd-v2 backend)"),
    "key": ("key", _path, "client private key for mutual TLS"),
    "ssl_cert_key": ("key", _path, "alias of key (torch's etcd-v2 backend)"),
    "user": ("user", _text, "etcd user name (auth)"),
    "password": (
        "password",
        _text,
        f"etcd password; prefer password_file or ${PASSWORD_ENV}, which ps cannot show",
    ),
    "password_file": ("password_file", _path, "file whose first line is the etcd password"),
    "is_host": (
        "is_host",
        parse_bool,
        "with an endpoint on this host: true serves the embedded etcd there, false never "
        "does (default: serve if nothing answers)",
    ),
    # keys of torchrun's backends that mean nothing here: accepted with a warning
    **{k: (k, _ignored, "accepted for torchrun compatibility; no effect") for k in IGNORED},
}


def unquoted(text: str) -> str:
    """``text`` without the quotes around it that a shell would have removed: a command
    line given as a list (PyTorch's own launcher tests pass
    ``--rdzv-conf='join_timeout=5,...'``) keeps them."""
    text = (text or "").strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def parse_conf(text: str) -> dict[str, str]:
    """``key=value,key2=value2`` (torchrun's --rdzv-conf syntax) into a dict."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in unquoted(text).split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf {item!r}: expected key=value")
        conf[key] = value.strip()
    return conf


_ENDPOINT = re.compile(
    r"^(?:(?P<scheme>https?)://)?(?P<host>\[[^\]]+\]|[^:/\[\]]+)(?::(?P<port>\d+))?/?$"
)


def parse_endpoints(text: str) -> tuple[tuple[str, ...], str | None]:
    """``host[:port][,host[:port]...]`` with optional http(s):// into (endpoints, scheme)."""
    endpoints: list[str] = []
    schemes: set[str] = set()
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        m = _ENDPOINT.match(item)
        if not m:
            raise ConfigError(f"--rdzv-endpoint {item!r}: expected host[:port]")
        port = int(m["port"] or DEFAULT_PORT)
        if not 0 < port < 65536:
            raise ConfigError(f"--rdzv-endpoint {item!r}: port out of range")
        if m["scheme"]:
            schemes.add(m["scheme"])
        endpoints.append(f"{m['host']}:{port}")
    if not endpoints:
        raise ConfigError("--rdzv-endpoint is empty: give host[:port] of etcd")
    if len(schemes) > 1:
        raise ConfigError(f"--rdzv-endpoint {text!r}: mixes http:// and https://")
    return tuple(endpoints), (schemes.pop() if schemes else None)


@dataclass(frozen=True)
class RdzvConf:
    """``--rdzv-conf``, parsed and checked once (``parse``): each key under its canonical
    name, None where not given. ``build_options`` turns it into the etcd connection's and
    the rendezvous's options."""

    join_timeout: float | None = None
    last_call_timeout: float | None = None
    lease_ttl: int | None = None
    keep_alive_interval: float | None = None
    request_timeout: float | None = None
    connect_timeout: float | None = None
    close_timeout: float | None = None
    prefix: str | None = None
    protocol: str | None = None
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    password_file: str | None = None
    is_host: bool | None = None
    ignored: tuple[str, ...] = ()  # keys of torchrun's backends with no effect here
    unknown: tuple[str, ...] = ()  # keys no backend reads: ignored, as torchrun does
    quoted: bool = False  # the whole text came with quotes around it (stripped)

    @classmethod
    def parse(cls, conf: str | Mapping[str, object]) -> RdzvConf:
        """From ``key=value,...`` or a mapping (torch's ``RendezvousParameters.config``);
        a bad key or value is a ``ConfigError`` naming it."""
        items = parse_conf(conf) if isinstance(conf, str) else conf
        quoted = isinstance(conf, str) and unquoted(conf) != conf.strip()
        values: dict[str, Any] = {}
        ignored, unknown = [], []
        for key, raw in items.items():
            if key not in KEYS:
                unknown.append(key)
                continue
            name, parser, _ = KEYS[key]
            if key in IGNORED:
                ignored.append(key)
                continue
            values[name] = parser(key, str(raw))
        base = cls(ignored=tuple(sorted(ignored)), unknown=tuple(unknown), quoted=quoted)
        return replace(base, **values)

    def warnings(self) -> list[str]:
        """What the user should hear about keys that have no effect (one line each)."""
        out = []
        if self.quoted:
            out.append("--rdzv-conf: the quotes around its value were removed")
        for key in self.unknown:
            near = difflib.get_close_matches(key.strip("'\" "), list(KEYS), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]}?)" if near else ""
            out.append(f"--rdzv-conf {key}: no rendezvous reads this key; ignored{hint}")
        for key in self.ignored:
            out.append(f"--rdzv-conf {key}: a key of torchrun's backends, no effect here")
        return out


def _password(conf: RdzvConf) -> str | None:
    if conf.password_file:
        with open(conf.password_file) as f:
            return f.readline().rstrip("\r\n")
    return conf.password or os.environ.get(PASSWORD_ENV) or None


def build_options(
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    conf: RdzvConf = RdzvConf(),
) -> tuple[EtcdOptions, RendezvousOptions]:
    """Check everything a rendezvous needs and say clearly what is wrong if anything is."""
    if not run_id or "/" in run_id:
        raise ConfigError(f"--rdzv-id {run_id!r}: must be non-empty and contain no '/'")
    if min_nodes < 1:
        raise ConfigError(f"--nnodes: minimum {min_nodes} must be at least 1")
    if max_nodes < min_nodes:
        raise ConfigError(f"--nnodes {min_nodes}:{max_nodes}: maximum is below minimum")
    endpoints, scheme = parse_endpoints(endpoint)
    if scheme and conf.protocol and scheme != conf.protocol:
        raise ConfigError(f"--rdzv-endpoint says {scheme} but --rdzv-conf protocol={conf.protocol}")
    secure = (scheme or conf.protocol) == "https" or conf.ca_cert is not None
    if secure and conf.ca_cert is None:
        raise ConfigError("--rdzv-conf: https needs cacert=<CA bundle file>")
    if (conf.cert is None) != (conf.key is None):
        raise ConfigError("--rdzv-conf: cert and key must be given together")
    password = _password(conf)
    if (conf.user is None) != (password is None):
        raise ConfigError("--rdzv-conf: user and password must be given together")
    etcd = EtcdOptions(
        endpoints=endpoints,
        secure=secure,
        ca_cert=conf.ca_cert,
        cert=conf.cert,
        key=conf.key,
        user=conf.user,
        password=password,
        request_timeout=conf.request_timeout or EtcdOptions.request_timeout,
        connect_timeout=conf.connect_timeout or EtcdOptions.connect_timeout,
    )
    ttl = conf.lease_ttl or default_lease_ttl(max_nodes)
    interval = conf.keep_alive_interval or ttl / 3
    if interval >= ttl:
        raise ConfigError(
            f"--rdzv-conf keep_alive_interval={interval}: must be shorter than lease_ttl={ttl}"
        )
    d = RendezvousOptions
    rdzv = RendezvousOptions(
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        prefix=conf.prefix or d.prefix,
        lease_ttl=ttl,
        keep_alive_interval=interval,
        join_timeout=conf.join_timeout or d.join_timeout,
        last_call_timeout=conf.last_call_timeout or d.last_call_timeout,
        close_timeout=conf.close_timeout or d.close_timeout,
    )
    return etcd, rdzv
