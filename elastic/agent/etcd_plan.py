"""Where this node's etcd is: one pure decision over what the command line and the network say.

torchrun's users bring three kinds of command line, and each keeps working:

- no endpoint, one node (or ``--standalone``): an embedded etcd on a free loopback port;
- torchrun's static form, ``--nnodes N --node-rank R --master-addr A --master-port P``
  with no endpoint: node 0 serves an embedded etcd at ``A:P+1`` (P is the workers'
  MASTER_PORT, as under torchrun) and the others wait for it there;
- ``--rdzv-endpoint host:port``: a real etcd there is used; if it names this host and
  nothing answers, this agent serves the embedded etcd on it, as c10d's agent serves its
  store (``--rdzv-conf is_host=true|false`` forces either way).

The probes (does the endpoint name this host? does anything answer?) are done by the
caller and passed in, so every rule is tested on plain values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

STATIC_DEFAULT_PORT = 29500  # torchrun's --master-port when it is not given


class EtcdSource(enum.Enum):
    """How this agent reaches the job's etcd."""

    EMBEDDED = "embedded"  # its own, on a free loopback port
    SERVE = "serve"  # its own, on the job's endpoint: the others connect to it
    CONNECT = "connect"  # an etcd (or another agent's) that answers there
    WAIT = "wait"  # another agent serves it there: wait for it up to join_timeout


@dataclass(frozen=True)
class EtcdPlan:
    source: EtcdSource
    host: str = ""
    port: int = 0
    reason: str = ""
    guessed: bool = False  # served because nothing answered: the user may mean another etcd

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}" if self.host else ""


def static_etcd_port(master_port: int | None) -> int:
    """The static form's etcd port: one above the workers' MASTER_PORT."""
    return (master_port or STATIC_DEFAULT_PORT) + 1


def plan_etcd(
    endpoint: tuple[str, int] | None,
    *,
    several: bool = False,
    static: bool = False,
    node_rank: int = 0,
    master: tuple[str, int] = ("127.0.0.1", STATIC_DEFAULT_PORT + 1),
    is_host: bool | None = None,
    names_this_host: bool = False,
    answers: bool = False,
) -> EtcdPlan:
    """Decide where the etcd is. ``endpoint`` is the one ``--rdzv-endpoint`` gave (None:
    none), ``several`` that it listed more than one; ``static`` is torchrun's static form
    (no endpoint, more than one node) with ``master`` its etcd address."""
    if endpoint is None:
        if not static:
            return EtcdPlan(EtcdSource.EMBEDDED, reason="no --rdzv-endpoint")
        host, port = master
        if node_rank == 0:
            return EtcdPlan(
                EtcdSource.SERVE, host, port, f"static form: node 0 serves the job's etcd at {host}"
            )
        return EtcdPlan(
            EtcdSource.WAIT, host, port, f"static form: node 0 serves the job's etcd at {host}"
        )
    host, port = endpoint
    if several:
        return EtcdPlan(EtcdSource.CONNECT, host, port, "an etcd cluster")
    if answers:
        return EtcdPlan(EtcdSource.CONNECT, host, port, "something answers there")
    if is_host is False:
        return EtcdPlan(EtcdSource.WAIT, host, port, "is_host=false: another agent serves it")
    if is_host or names_this_host:
        why = "is_host=true" if is_host else "it names this host and nothing answers there"
        return EtcdPlan(EtcdSource.SERVE, host, port, why, guessed=not is_host)
    return EtcdPlan(EtcdSource.WAIT, host, port, "nothing answers there yet")
