"""The agent's Prometheus endpoint: its own metrics, its workers', its GPUs', and the
training progress the workers report (prometheus-client's multiprocess mode, through
files in the node's shared-memory directory).

Names start with ``elastic_run_``, use base units, and end in ``_total`` only for
counters; labels are bounded: job (the run id), node, rank, local_rank, gpu, uuid, and a
few fixed enumerations (cause, state).
"""

from __future__ import annotations

import json
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.multiprocess import mark_process_dead

from elastic.agent.collectors import (
    GpuCollector,
    NvmlSource,
    WorkerCollector,
    WorkerFiles,
    WorkerProc,
)
from elastic.agent.core import AgentState, LostCause, RestartCause
from rendezvous.records import RoundRecord

log = logging.getLogger("elastic.metrics")

CHANGE_CAUSES = ("joined", "left", "lost")

# a counter's or histogram's creation time, as a series of its own: no panel or rule uses
# them, and they were a quarter of every scrape
disable_created_metrics()


class MetricsError(RuntimeError):
    """The metrics endpoint could not be served (the port is taken)."""


class AgentMetrics:
    """Everything one agent exports, in its own registry."""

    def __init__(
        self,
        job: str,
        node: str,
        max_restarts: int,
        version: str,
        workers: Callable[[], Iterable[WorkerProc]],
        multiproc_dir: Path | None = None,
        gpus: NvmlSource | None = None,
        min_nodes: int = 1,
        max_nodes: int = 1,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, base = self.registry, ["job", "node"]
        self._labels = {"job": job, "node": node}
        self.max_restarts = max_restarts

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, base, registry=r).labels(job, node)

        gauge("elastic_run_min_nodes", "Fewest nodes the job runs with").set(min_nodes)
        gauge("elastic_run_max_nodes", "Most nodes the job takes").set(max_nodes)
        self.world_size = gauge("elastic_run_world_size", "Workers in the current round")
        self.nodes = gauge("elastic_run_nodes", "Nodes in the current round")
        self.group_rank = gauge(
            "elastic_run_group_rank", "This node's rank among the round's nodes (-1: not a member)"
        )
        self.round = gauge("elastic_run_rendezvous_round", "Number of the current round")
        self.job_restarts = gauge(
            "elastic_run_job_restarts", "Restarts the job has charged for worker failures"
        )
        self.budget = gauge(
            "elastic_run_restart_budget_remaining",
            "Worker-failure restarts left before the job fails",
        )
        self.workers_running = gauge("elastic_run_workers", "Local worker processes running")
        self.rdzv_seconds = Histogram(
            "elastic_run_rendezvous_duration_seconds",
            "From asking for a round to being in one",
            base,
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, float("inf")),
        ).labels(job, node)
        self.changes = Counter(
            "elastic_run_membership_changes",
            "Nodes that joined, left or were lost, by cause",
            [*base, "cause"],
            registry=r,
        )
        self.restarts = Counter(
            "elastic_run_restarts",
            "Times this node's workers were stopped and started again",
            [*base, "cause"],
            registry=r,
        )
        self.reformations = Counter(
            "elastic_run_live_reformations",
            "Times this node's workers formed a new process group in place (no restart)",
            [*base, "cause"],
            registry=r,
        )
        self.lost_seconds = Counter(
            "elastic_run_lost_seconds",
            "Seconds without running workers after a failure or during a resize",
            [*base, "cause"],
            registry=r,
        )
        self.steps_redone = Counter(
            "elastic_run_steps_redone",
            "Committed steps trained again: a round resumed from an older state",
            base,
            registry=r,
        ).labels(job, node)
        self.training_seconds = Counter(
            "elastic_run_training_seconds",
            "Seconds with this node's workers running",
            base,
            registry=r,
        ).labels(job, node)
        self.state = Gauge(
            "elastic_run_agent_state",
            "1 for the agent's current state",
            [*base, "state"],
            registry=r,
        )
        for cause in CHANGE_CAUSES:
            self.changes.labels(job, node, cause)
        for restart in RestartCause:
            self.restarts.labels(job, node, restart.value)
            self.reformations.labels(job, node, restart.value)
        for lost in LostCause:
            self.lost_seconds.labels(job, node, lost.value)
        self.set_state(AgentState.JOINING)
        self.budget.set(max_restarts)
        self.group_rank.set(-1)
        info = Info(
            "elastic_run_build", "Versions of elastic-run and its environment", base, registry=r
        )
        info.labels(job, node).info(
            {"version": version, "python": platform.python_version(), "torch": _torch_version()}
        )
        r.register(WorkerCollector(workers, job, node))
        r.register(GpuCollector(gpus or NvmlSource(), workers, job, node))
        if multiproc_dir is not None:
            multiproc_dir.mkdir(parents=True, exist_ok=True)
            WorkerFiles(r, path=str(multiproc_dir))
        self._multiproc = multiproc_dir
        self._running_since: float | None = None

    # -- what the agent tells it ----------------------------------------------------------
    def set_state(self, state: AgentState) -> None:
        for s in AgentState:
            self.state.labels(self._labels["job"], self._labels["node"], s.value).set(
                1.0 if s is state else 0.0
            )

    def round_started(
        self, r: RoundRecord, group_rank: int, joined: int, waited: float, workers: int
    ) -> None:
        """This node's workers started in round ``r``; ``joined`` counts the newcomers this
        node saw arrive (none on its first round), ``waited`` the seconds it asked for it."""
        self.round.set(r.number)
        self.world_size.set(r.world_size)
        self.nodes.set(r.size)
        self.group_rank.set(group_rank)
        self.job_restarts.set(r.restarts)
        self.budget.set(max(self.max_restarts - r.restarts, 0))
        self.rdzv_seconds.observe(waited)
        self.workers_running.set(workers)
        job, node = self._labels["job"], self._labels["node"]
        for cause, n in (("joined", joined), ("left", r.counts[1]), ("lost", r.counts[2])):
            if n:
                self.changes.labels(job, node, cause).inc(n)
        self._running_since = time.monotonic()
        self.set_state(AgentState.RUNNING)

    def tick(self) -> None:
        """Count the time the workers have been running since the last tick."""
        if self._running_since is not None:
            now = time.monotonic()
            self.training_seconds.inc(now - self._running_since)
            self._running_since = now

    def workers_stopped(self, restart_cause: RestartCause | None) -> None:
        """The round's workers are gone; ``restart_cause`` when new ones will follow."""
        self.tick()
        self._running_since = None
        self.workers_running.set(0)
        if restart_cause is not None:
            job, node = self._labels["job"], self._labels["node"]
            self.restarts.labels(job, node, restart_cause.value).inc()

    def workers_held(self, restart_cause: RestartCause | None) -> None:
        """The round's workers wait to re-form in place (a live re-formation)."""
        self.tick()
        self._running_since = None
        if restart_cause is not None:
            job, node = self._labels["job"], self._labels["node"]
            self.reformations.labels(job, node, restart_cause.value).inc()

    def lost(self, cause: LostCause, seconds: float) -> None:
        job, node = self._labels["job"], self._labels["node"]
        self.lost_seconds.labels(job, node, cause.value).inc(seconds)

    def worker_exited(self, pid: int) -> None:
        """Drop a dead worker's live gauges (its counters stay, as counters should)."""
        if self._multiproc is not None:
            mark_process_dead(pid, str(self._multiproc))


def _torch_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("torch")
    except md.PackageNotFoundError:
        return "none"


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not news."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class MetricsServer:
    """``/metrics`` and ``/healthz`` over HTTP, in a thread."""

    def __init__(self, registry: CollectorRegistry, health: Callable[[], dict]) -> None:
        """``health()`` says ``alive`` (the agent loop is not wedged) and ``state``."""
        self._metrics = make_wsgi_app(registry)
        self._health = health
        self._httpd: WSGIServer | None = None
        self._scraped = threading.Condition()
        self.scrapes: list[float] = []  # monotonic times of the last /metrics requests
        self.port = 0

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO")
        if path in ("/healthz", "/readyz"):
            health = self._health()
            # /healthz: liveness (is the agent loop turning?); /readyz: training now
            ok = health.get("alive", True) if path == "/healthz" else health["state"] == "running"
            body = json.dumps(health).encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return [body]
        try:
            return self._metrics(environ, start_response)
        finally:
            with self._scraped:
                self.scrapes = [*self.scrapes[-2:], time.monotonic()]
                self._scraped.notify_all()

    @property
    def watched(self) -> bool:
        """Something scrapes /metrics regularly (at least twice so far)."""
        with self._scraped:
            return len(self.scrapes) >= 2

    def wait_scraped(self, cap: float = 60.0) -> bool:
        """If something scrapes /metrics, wait for its next scrape (about one interval, at
        most ``cap`` seconds), so that what the agent says last (the job failed) is seen
        before it exits. Returns at once when nothing has scraped this agent twice."""
        with self._scraped:
            if len(self.scrapes) < 2:
                return False
            interval = self.scrapes[-1] - self.scrapes[-2]
            seen = len(self.scrapes), self.scrapes[-1]
            return self._scraped.wait_for(
                lambda: (len(self.scrapes), self.scrapes[-1]) != seen,
                timeout=min(interval * 1.5 + 1.0, cap),
            )

    def start(self, addr: str, port: int) -> int:
        try:
            self._httpd = make_server(addr, port, self._app, _Server, handler_class=_Quiet)
        except OSError as e:
            raise MetricsError(
                f"--metrics-port {port}: cannot listen on {addr or '*'}:{port}: {e.strerror}"
            ) from None
        self.port = self._httpd.server_port
        threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True).start()
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
