"""Wire one node together: embedded etcd if needed, rendezvous, workers, agent, signals."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator

from elastic.agent import nodedir
from elastic.agent.config import RunConfig
from elastic.agent.core import AgentState
from elastic.agent.etcd_plan import EtcdPlan, EtcdSource, plan_etcd, static_etcd_port
from elastic.agent.etcd_server import EtcdServer, EtcdServerError
from elastic.agent.filetimer import FileTimerServer
from elastic.agent.forkserver import ForkServer
from elastic.agent.logs import LogRouter
from elastic.agent.loop import Agent
from elastic.agent.metrics import AgentMetrics, MetricsError, MetricsServer
from elastic.agent.storehost import StoreHost
from elastic.agent.workers import ForkTarget, WorkerGroup
from elastic.contract import MULTIPROC_ENV, NODE_ID_ENV
from rendezvous import version
from rendezvous.client import EtcdClient
from rendezvous.config import build_options, parse_endpoints
from rendezvous.errors import RendezvousError
from rendezvous.net import answers, default_local_addr, is_local_address, resolve
from rendezvous.protocol import NodeSpec, Rendezvous

log = logging.getLogger("elastic.launch")

DEFAULT_METRICS_PORT = 9400


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
    while not answers(plan.host, plan.port, timeout=0.5):
        now = time.monotonic()
        if now > deadline:
            raise EtcdServerError(
                f"nothing answered at {plan.endpoint} within join_timeout ({timeout:.0f}s): "
                "is the node that serves the job's etcd (node rank 0, or the agent on that "
                "host) running?"
            )
        if now > next_word:
            log.info(
                "still waiting for the job's etcd at %s (join_timeout in %.0fs)",
                plan.endpoint,
                deadline - now,
            )
            next_word = now + 30
        time.sleep(0.2)


@contextlib.contextmanager
def job_etcd(cfg: RunConfig) -> Iterator[str]:
    """The endpoint of the job's etcd: the given one, one this agent serves, or one
    another agent serves (see etcd_plan.py); the log says which."""
    plan = _plan(cfg)
    if plan.source is EtcdSource.CONNECT:
        log.info("using the etcd at %s (%s)", cfg.rdzv_endpoint, plan.reason)
        yield cfg.rdzv_endpoint
        return
    if plan.source is EtcdSource.WAIT:
        _wait_for(plan, cfg.join_timeout)
        yield plan.endpoint
        return
    if plan.source is EtcdSource.EMBEDDED:
        server = EtcdServer(name="embedded")
    else:
        addr = resolve(plan.host)
        listen = addr if ipaddress.ip_address(addr).is_loopback else "0.0.0.0"
        server = EtcdServer(name="embedded", host=plan.host, client_port=plan.port, listen=listen)
    try:
        server.start()
    except EtcdServerError:
        server.close()
        if plan.source is not EtcdSource.SERVE or not answers(plan.host, plan.port):
            raise
        log.info("another agent serves the job's etcd at %s: using it", plan.endpoint)
        yield plan.endpoint
        return
    with contextlib.closing(server):
        if plan.source is EtcdSource.EMBEDDED:
            log.info("no --rdzv-endpoint: started an embedded etcd at %s", server.endpoint)
            yield server.endpoint
            return
        log.info("serving the job's etcd at %s (%s)", server.endpoint, plan.reason)
        yield server.endpoint
        _wait_for_others(cfg, server.endpoint)


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


@contextlib.contextmanager
def handled_signals(signals: tuple[int, ...], handler: Callable[[int], None]) -> Iterator[None]:
    previous = {s: signal.signal(s, lambda n, _f: handler(n)) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def serve_metrics(cfg: RunConfig, server: MetricsServer) -> int:
    """Start /metrics; returns the port. The default port, if another agent on this
    machine has it, falls back to a free one (logged); an explicit one must be free."""
    if cfg.metrics_port is None:
        try:
            port = server.start(cfg.metrics_addr, DEFAULT_METRICS_PORT)
        except MetricsError:
            port = server.start(cfg.metrics_addr, 0)
            log.info("port %d is taken: /metrics on port %d instead", DEFAULT_METRICS_PORT, port)
            return port
    else:
        port = server.start(cfg.metrics_addr, cfg.metrics_port)
    log.info("metrics on http://%s:%d/metrics", cfg.metrics_addr, port)
    return port


def launch(cfg: RunConfig) -> int:
    """Run this node's agent to the end; returns the exit code."""
    with contextlib.ExitStack() as stack:
        node_dir = nodedir.create(cfg.rdzv_id, cfg.node_id)
        stack.callback(nodedir.remove, node_dir)
        env = dict(cfg.env)
        env[NODE_ID_ENV] = cfg.node_id
        if cfg.metrics_port != -1:
            env[MULTIPROC_ENV] = str(node_dir / "prometheus")
        # the helpers start first: they import torch while the job forms
        fork = None
        if cfg.forkserver:
            server = ForkServer({**os.environ, **env})
            stack.callback(server.close)
            fork = ForkTarget(server, cfg.script, cfg.script_args, cfg.module)
        store = StoreHost()
        stack.callback(store.close)
        watchdog = FileTimerServer.from_env(dict(os.environ))
        if watchdog is not None:
            stack.callback(watchdog.close)
        router = LogRouter(
            cfg.log_dir,
            cfg.rdzv_id,
            cfg.node_id,
            cfg.redirects,
            cfg.tee,
            cfg.local_ranks_filter,
            cfg.role,
            cfg.stdout_filters,
            cfg.stderr_filters,
        )
        stack.callback(router.close, log.info)
        workers = WorkerGroup(
            cfg.command,
            router,
            node_dir,
            role=cfg.role,
            run_id=cfg.rdzv_id,
            max_restarts=cfg.max_restarts,
            virtual_local_rank=cfg.virtual_local_rank,
            extra_env=env,
            forkserver=fork,
            watchdog=watchdog,
        )
        stack.callback(workers.stop, 0)
        agent: Agent | None = None
        metrics = None
        http = None
        port = 0
        if cfg.metrics_port != -1:
            metrics = AgentMetrics(
                cfg.rdzv_id,
                cfg.node_id,
                cfg.max_restarts,
                version(),
                workers=workers.processes,
                multiproc_dir=node_dir / "prometheus",
                min_nodes=cfg.min_nodes,
                max_nodes=cfg.max_nodes,
            )
            http = MetricsServer(
                metrics.registry,
                lambda: agent.health() if agent else {"node": cfg.node_id, "state": "starting"},
            )
            port = serve_metrics(cfg, http)
            stack.callback(http.stop)
        endpoint = stack.enter_context(job_etcd(cfg))
        etcd_opts, rdzv_opts = build_options(
            endpoint, cfg.rdzv_id, cfg.min_nodes, cfg.max_nodes, cfg.rdzv_conf
        )
        rdzv_opts = dataclasses.replace(rdzv_opts, master_port=cfg.master_port)
        client = EtcdClient(etcd_opts)
        stack.callback(client.close)
        me = NodeSpec(
            id=cfg.node_id,
            addr=cfg.local_addr or default_local_addr(),
            nproc=cfg.nproc_per_node,
            host=socket.gethostname(),
            pid=os.getpid(),
            version=version(),
            metrics_port=port,
            rank=cfg.node_rank if cfg.static else -1,
        )
        rdzv = Rendezvous(client, rdzv_opts, me, max_restarts=cfg.max_restarts)
        stack.callback(rdzv.shutdown, leave=True)
        agent = Agent(
            rdzv,
            workers,
            monitor_interval=cfg.monitor_interval,
            shutdown_timeout=cfg.shutdown_timeout,
            close_timeout=rdzv_opts.close_timeout,
            host=me.host,
            hang_timeout=cfg.worker_hang_timeout,
            metrics=metrics,
            store=store,
        )
        log.info(
            "node %s joining job %s (nnodes %d:%d, %d worker(s) per node)",
            cfg.node_id,
            cfg.rdzv_id,
            cfg.min_nodes,
            cfg.max_nodes,
            cfg.nproc_per_node,
        )
        stack.callback(workers.stop, 0)  # before leaving the job: no worker outlives the agent
        with handled_signals(cfg.signals, agent.on_signal):
            code = agent.run()
        if agent.state is AgentState.FAILED and http is not None:
            log.info("letting Prometheus see that the job failed (one more scrape)")
            http.wait_scraped()
        return code
    raise AssertionError("unreachable")  # mypy: ExitStack may swallow exceptions
