"""The job's etcd, as etcd_plan decided: probe, then serve, wait for, or connect to it.

The I/O edge of ``etcd_plan``: it probes the endpoint, starts the embedded etcd when this
agent is the one to serve it, waits for another agent's, and says in the log which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import time
from collections.abc import Iterator

from elastic.agent.config import RunConfig
from elastic.agent.etcd_plan import EtcdPlan, EtcdSource, plan_etcd, static_etcd_port
from elastic.agent.etcd_server import EtcdServer, EtcdServerError
from rendezvous.client import EtcdClient
from rendezvous.config import DEFAULT_PORT, build_options, parse_endpoints
from rendezvous.errors import RendezvousError
from rendezvous.mirror import read_view
from rendezvous.net import Reach, answers, is_local_address, reach, resolve

log = logging.getLogger("elastic.launch")

SERVED_KEY = ".served-by-an-agent"  # under the prefix: this etcd belongs to one job


def _plan(cfg: RunConfig) -> EtcdPlan:
    """Probe what etcd_plan needs to know (the I/O), then decide."""
    master = (cfg.master_addr, static_etcd_port(cfg.master_port))
    if not cfg.rdzv_endpoint:
        return plan_etcd(None, static=cfg.static, node_rank=cfg.node_rank, master=master)
    endpoints, _ = parse_endpoints(cfg.rdzv_endpoint)
    host, _, port = endpoints[0].rpartition(":")
    if len(endpoints) > 1:
        return plan_etcd((host, int(port)), several=True)
    return plan_etcd(
        (host, int(port)),
        is_host=cfg.is_host,
        names_this_host=is_local_address(host),
        answers=answers(host, int(port)),
    )


def _wait_for(plan: EtcdPlan, timeout: float) -> None:
    """Wait until something answers at the plan's endpoint (another agent serving it)."""
    log.info("waiting for the job's etcd at %s (%s)", plan.endpoint, plan.reason)
    deadline = time.monotonic() + timeout
    next_word = time.monotonic() + 10
    while (met := reach(plan.host, plan.port, timeout=0.5)) is not Reach.ANSWERS:
        now = time.monotonic()
        if now > deadline:
            raise EtcdServerError(
                f"nothing answered at {plan.endpoint} within join_timeout ({timeout:.0f}s; "
                f"it {met.value}): is the node that serves the job's etcd (node rank 0, or "
                "the agent on that host) running?"
            )
        if now > next_word:
            log.info(
                "still waiting for the job's etcd at %s: it %s (join_timeout in %.0fs)",
                plan.endpoint,
                met.value,
                deadline - now,
            )
            next_word = now + 30
        time.sleep(0.2)


@contextlib.contextmanager
def job_etcd(cfg: RunConfig) -> Iterator[tuple[str, bool]]:
    """(endpoint, private) of the job's etcd: the given one, one this agent serves, or one
    another agent serves (see etcd_plan.py); the log says which. ``private``: the etcd is
    this job's alone, so the default job id "none" is safe (asked only for that id)."""
    plan = _plan(cfg)
    if plan.source is EtcdSource.CONNECT:
        etcd, _ = build_options(cfg.rdzv_endpoint, cfg.rdzv_id, 1, 1, cfg.rdzv_conf)
        log.info(
            "connecting to the etcd at %s (%s; giving up after %.0fs)",
            etcd.describe(),
            plan.reason,
            etcd.connect_timeout,
        )
        yield cfg.rdzv_endpoint, cfg.rdzv_id == "none" and _served(cfg, cfg.rdzv_endpoint)
        return
    if plan.source is EtcdSource.WAIT:
        _wait_for(plan, cfg.join_timeout)
        yield plan.endpoint, True
        return
    if plan.source is EtcdSource.EMBEDDED:
        server = EtcdServer(name="embedded")
    else:
        addr = resolve(plan.host)
        listen = addr if ipaddress.ip_address(addr).is_loopback else "0.0.0.0"
        server = EtcdServer(name="embedded", host=plan.host, client_port=plan.port, listen=listen)
    try:
        server.start()
    except EtcdServerError as e:
        server.close()
        if cfg.static and answers(plan.host, plan.port):
            # node 0 of the static form owns this port: someone else has it. Joining it
            # would merge two jobs; most often it is this job's node 0, started already
            raise EtcdServerError(_taken(cfg, plan.endpoint)) from e
        if plan.source is not EtcdSource.SERVE or not answers(plan.host, plan.port):
            raise
        log.info("another agent serves the job's etcd at %s: using it", plan.endpoint)
        yield plan.endpoint, True
        return
    with contextlib.closing(server):
        if plan.source is EtcdSource.EMBEDDED:
            log.info("no --rdzv-endpoint: started an embedded etcd at %s", server.endpoint)
            yield server.endpoint, True
            return
        if plan.guessed:
            log.warning("%s", _guessed(plan))
        else:
            log.info("serving the job's etcd at %s (%s)", server.endpoint, plan.reason)
        _mark_served(cfg, server.endpoint)
        yield server.endpoint, True
        _wait_for_others(cfg, server.endpoint)


def _guessed(plan: EtcdPlan) -> str:
    """What a user who mistyped the port of an existing etcd must not miss."""
    near = ""
    if plan.port != DEFAULT_PORT and answers(plan.host, DEFAULT_PORT, timeout=0.3):
        near = f" (something answers on {plan.host}:{DEFAULT_PORT}, etcd's usual port)"
    return (
        f"serving the job's etcd at {plan.endpoint} myself: nothing answered there, and it "
        "names this host (as torchrun's c10d agent serves its store). Every other node must "
        f"use this endpoint too. If you meant an etcd that runs already, check the address"
        f"{near}; --rdzv-conf is_host=false waits for one instead of serving it, "
        "is_host=true serves it without this warning"
    )


def _taken(cfg: RunConfig, endpoint: str) -> str:
    """Why node rank 0 cannot serve the job's etcd: what holds its port, and what to do."""
    others = f"--node-rank 1 to {cfg.max_nodes - 1}" if cfg.max_nodes > 2 else "--node-rank 1"
    join = f"start this node with {others} to join it"
    node0 = _node0(cfg, endpoint)
    if node0:
        return (
            f"node rank 0 of job {cfg.rdzv_id!r} already runs ({node0}) and serves its etcd "
            f"on {endpoint}: {join}; a separate job needs its own --master-port"
        )
    return (
        f"something already listens on {endpoint}, where node rank 0 serves the job's etcd "
        f"(--master-port + 1): if it is this job's node 0, {join}; if it is another job, "
        "give this one its own --master-port"
    )


def _node0(cfg: RunConfig, endpoint: str) -> str:
    """Which agent has node rank 0 in this job at ``endpoint`` ("" if none answers)."""
    try:
        etcd, rdzv = build_options(endpoint, cfg.rdzv_id, 1, 1, cfg.rdzv_conf)
        client = EtcdClient(dataclasses.replace(etcd, connect_timeout=1.0, request_timeout=1.0))
        try:
            view = read_view(client, rdzv.job_prefix)
        finally:
            client.close()
    except RendezvousError:
        return ""
    for n in view.nodes.values():
        if n.record.rank == 0:
            return f"{n.record.id}, pid {n.record.pid} on {n.record.host}"
    return ""


def _wait_for_others(cfg: RunConfig, endpoint: str, timeout: float = 10.0) -> None:
    """The others leave the job through the etcd this agent serves: give them a moment
    (as c10d's host agent keeps its store up), so none is left unable to say goodbye."""
    etcd, rdzv = build_options(endpoint, cfg.rdzv_id, 1, 1, cfg.rdzv_conf)
    nodes = rdzv.job_prefix + "nodes/"
    client = EtcdClient(dataclasses.replace(etcd, connect_timeout=1.0, request_timeout=1.0))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and client.get_prefix(nodes)[1]:
            time.sleep(0.1)
    except RendezvousError:
        pass
    finally:
        client.close()


def _one_shot(cfg: RunConfig, endpoint: str) -> tuple[EtcdClient, str]:
    etcd, rdzv = build_options(endpoint, cfg.rdzv_id, 1, 1, cfg.rdzv_conf)
    return EtcdClient(etcd), rdzv.prefix + "/" + SERVED_KEY


def _mark_served(cfg: RunConfig, endpoint: str) -> None:
    client, key = _one_shot(cfg, endpoint)
    try:
        client.put(key, b"1")
    finally:
        client.close()


def _served(cfg: RunConfig, endpoint: str) -> bool:
    """Whether the etcd there is one an agent serves for its job (then it is the job's
    alone). Unreachable: say yes, and let the rendezvous report what is wrong."""
    client, key = _one_shot(cfg, endpoint)
    try:
        return client.get(key) is not None
    except RendezvousError:
        return True
    finally:
        client.close()
