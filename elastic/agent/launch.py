"""Wire one node together: embedded etcd if needed, rendezvous, workers, agent, signals."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import logging
import os
import socket
import time
from pathlib import Path

from elastic.agent import lobby, nodedir, signals
from elastic.agent.breakdown import save_at_breakdown
from elastic.agent.config import RunConfig
from elastic.agent.core import AgentState
from elastic.agent.filetimer import FileTimerServer
from elastic.agent.forkserver import ForkServer
from elastic.agent.job_etcd import job_etcd
from elastic.agent.logs import LogRouter
from elastic.agent.loop import Agent
from elastic.agent.metrics import AgentMetrics, MetricsError, MetricsServer
from elastic.agent.storehost import StoreHost
from elastic.agent.tripwire import Tripwire
from elastic.agent.workers import ForkTarget, WorkerGroup
from elastic.contract import MULTIPROC_ENV, NODE_ID_ENV, POLICY_ENV, RestartMode, SnapshotPolicy
from rendezvous import version
from rendezvous.client import EtcdClient
from rendezvous.config import ConfigError, build_options
from rendezvous.errors import RendezvousError
from rendezvous.net import default_local_addr, resolve
from rendezvous.protocol import NodeSpec, Rendezvous

log = logging.getLogger("elastic.launch")

DEFAULT_METRICS_PORT = 9400


def _reach(cfg: RunConfig) -> str:
    if ipaddress.ip_address(resolve(cfg.metrics_addr)).is_loopback:
        return " (this host only: --metrics-addr 0.0.0.0 for a Prometheus elsewhere)"
    return ""


def serve_metrics(cfg: RunConfig, server: MetricsServer) -> int:
    """Start /metrics; returns the port. The default port, if another agent on this
    machine has it, falls back to a free one (logged); an explicit one must be free."""
    taken = ""
    if cfg.metrics_port is None:
        try:
            port = server.start(cfg.metrics_addr, DEFAULT_METRICS_PORT)
        except MetricsError:
            port = server.start(cfg.metrics_addr, 0)
            taken = f" (port {DEFAULT_METRICS_PORT} is taken)"
    else:
        port = server.start(cfg.metrics_addr, cfg.metrics_port)
    log.info("metrics on http://%s:%d/metrics%s%s", cfg.metrics_addr, port, taken, _reach(cfg))
    return port


def launch(cfg: RunConfig) -> int:
    """Run this node's agent to the end; returns the exit code."""
    with contextlib.ExitStack() as stack:
        policy = SnapshotPolicy.decode(cfg.env[POLICY_ENV])
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
        endpoint, private = stack.enter_context(job_etcd(cfg))
        if cfg.rdzv_id == "none" and not private:
            raise ConfigError(
                f"--rdzv-id is needed with a shared etcd ({endpoint}): every job without one "
                "would be job 'none', and once one finished the next would exit at once; "
                "give each job its own id, e.g. --rdzv-id $(date +%s)"
            )
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
        tripwire = Tripwire(me.addr)  # the store of workers started ahead (lobby)
        stack.callback(tripwire.close)

        def join() -> Rendezvous:  # the first, and another for each time it steps out
            return Rendezvous(client, rdzv_opts, me, max_restarts=cfg.max_restarts)

        rdzv = join()
        _inherit(node_dir, rdzv)
        # the agent's rendezvous at the end: a node that stepped out joined with another
        stack.callback(lambda: (agent.rdzv if agent is not None else rdzv).shutdown(leave=True))
        in_place = cfg.restart_mode is RestartMode.LIVE
        agent = Agent(
            rdzv,
            workers,
            monitor_interval=cfg.monitor_interval,
            shutdown_timeout=cfg.shutdown_timeout,
            close_timeout=rdzv_opts.close_timeout,
            host=me.host,
            hang_timeout=cfg.worker_hang_timeout,
            handover_timeout=cfg.handover_timeout,
            on_job=functools.partial(nodedir.remember_job, node_dir),
            metrics=metrics,
            store=store,
            checkpoint_dir=policy.checkpoint_dir,
            restart_mode=cfg.restart_mode,
            prepare=functools.partial(
                lobby.ahead,
                nproc=cfg.nproc_per_node,
                max_nodes=cfg.max_nodes,
                static=cfg.static,
                in_place=in_place,
                store=(tripwire.addr, tripwire.port),
            ),
            tripwire=tripwire,
            step_out=functools.partial(
                lobby.step_out, in_place=in_place, min_nodes=cfg.min_nodes, static=cfg.static
            ),
            rejoin=join,
            back=functools.partial(lobby.back_now, min_nodes=cfg.min_nodes),
            max_restarts=cfg.max_restarts,
        )
        job = "" if cfg.rdzv_id == "none" else f" job {cfg.rdzv_id}"  # the default id
        mn, mx = cfg.min_nodes, cfg.max_nodes
        nodes = str(mn) if mn == mx else f"{mn}:{mx}"
        per = "1 worker" if cfg.nproc_per_node == 1 else f"{cfg.nproc_per_node} workers"
        log.info("node %s joining%s (%s node(s), %s per node)", cfg.node_id, job, nodes, per)
        stack.callback(workers.stop, 0)  # before leaving the job: no worker outlives the agent
        with signals.relayed(cfg.signals, agent.on_signal):
            if fork is not None:
                # joining a running job pauses it (live workers wait for the newcomer):
                # be ready to start workers at once before anyone sees this node
                started = time.monotonic()
                if fork.server.wait_ready(120.0):
                    log.info("fork server ready in %.1fs", time.monotonic() - started)
            try:
                code = agent.run()
            except BaseException:  # the agent itself breaks down (etcd gone, a bug)
                workers.stop(0)  # first: no worker may overwrite the slot being saved
                _save_at_breakdown(node_dir, policy)
                raise
        if agent.state is AgentState.FAILED:  # the job ends
            _save_at_breakdown(node_dir, policy)
        elif agent.state is AgentState.LEFT:  # this node ends, the job may go on
            _save_at_breakdown(node_dir, policy, agent.shared())
        if agent.state in (AgentState.FAILED, AgentState.SUCCEEDED):  # nothing to inherit
            nodedir.remove_job(cfg.rdzv_id)
        if agent.state is AgentState.FAILED and http is not None and http.watched:
            log.info("letting Prometheus see that the job failed (one more scrape)")
            http.wait_scraped()
        return code
    raise AssertionError("unreachable")  # mypy: ExitStack may swallow exceptions


def _inherit(node_dir: Path, rdzv: Rendezvous) -> None:
    """Keep or remove the snapshot a dead agent of this job and node left (``nodedir``):
    before any worker starts, so that they offer it when the round restores."""
    step = nodedir.predecessor_step(node_dir)
    if step is None:
        nodedir.inherit(node_dir, keep=False)  # nothing in it worth a read of etcd
        return
    try:
        seen = rdzv.glance()
    except RendezvousError as e:
        keep, why = False, f"etcd does not say whether the job goes on ({e})"
    else:
        recorded = seen.progress.step if seen.progress is not None else None
        job = seen.progress.job if seen.progress is not None else ""
        keep, why = nodedir.keeps(recorded, seen.closed, job, nodedir.predecessor_job(node_dir))
    nodedir.inherit(node_dir, keep)
    what = "kept" if keep else "removed"
    log.info("%s the snapshot of step %d this node's previous agent left: %s", what, step, why)


def _save_at_breakdown(node_dir: Path, policy: SnapshotPolicy, shared: str | None = None) -> None:
    said = save_at_breakdown(node_dir, policy.checkpoint_dir, policy.keep, shared)
    if said:
        log.info("%s", said)
