"""What to run, checked: a ``RunConfig`` built from the parsed command line.

Every bad value becomes a ``UsageError`` naming the flag, so the CLI can print one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from elastic.agent.args import UsageError, closest
from elastic.agent.devices import DeviceError, choose_devices, count_devices
from elastic.contract import POLICY_ENV, RESTART_MODE_ENV, RestartMode, SnapshotPolicy
from rendezvous.config import ConfigError, RdzvConf, build_options

log = logging.getLogger(__name__)

BACKENDS = ("etcd-v3", "etcd", "c10d", "static")  # torchrun's mean the same here
# --run-path: the script runs where the launcher's sys.path[0] is first, as torchrun's
# workers (multiprocessing children of the launcher) inherit it
_RUN_PATH = (
    "import runpy, sys; sys.path[0] = sys.argv[1]; sys.argv = sys.argv[2:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def parse_nnodes(text: str) -> tuple[int, int]:
    lo, sep, hi = str(text).partition(":")
    try:
        mn, mx = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: expected N or MIN:MAX, like 2 or 1:4") from None
    if mn < 1:
        raise UsageError(f"--nnodes {text!r}: the minimum must be at least 1")
    if mx < mn:
        raise UsageError(f"--nnodes {text!r}: the maximum {mx} is below the minimum {mn}")
    return mn, mx


def parse_std(flag: str, text: str, nproc: int) -> dict[int, int]:
    """torchrun's -r/-t syntax: 0-3 for every rank, or ``local_rank:mode,...``."""
    text = str(text).strip()
    try:
        if ":" not in text:
            result = dict.fromkeys(range(nproc), int(text))
        else:
            result = {i: 0 for i in range(nproc)}
            for item in text.split(","):
                rank, _, mode = item.partition(":")
                result[int(rank)] = int(mode)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected 0-3 or local_rank:mode,...") from None
    if any(m not in (0, 1, 2, 3) for m in result.values()):
        raise UsageError(f"{flag} {text!r}: modes are 0 (none), 1 (stdout), 2 (stderr), 3 (both)")
    return result


def parse_signals(text: str) -> tuple[int, ...]:
    sigs = []
    for name in filter(None, (s.strip() for s in str(text).split(","))):
        try:
            sigs.append(int(signal.Signals[name]))
        except KeyError:
            raise UsageError(f"--signals-to-handle: unknown signal {name!r}") from None
    return tuple(sigs)


def _positive(flag: str, value: float, allow_zero: bool = False) -> float:
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{flag} {value}: must be {'>= 0' if allow_zero else 'positive'}")
    return value


@dataclass(frozen=True)
class RunConfig:
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_endpoint: str  # empty: start an embedded etcd
    rdzv_id: str
    rdzv_conf: RdzvConf
    max_restarts: int
    monitor_interval: float
    role: str
    command: tuple[str, ...]  # the worker command line, without per-rank parts
    script: str
    log_dir: str | None
    redirects: dict[int, int]
    tee: dict[int, int]
    local_ranks_filter: frozenset[int] | None
    local_addr: str | None
    signals: tuple[int, ...]
    shutdown_timeout: float
    virtual_local_rank: bool
    node_id: str
    worker_hang_timeout: float = 0.0
    handover_timeout: float = 30.0
    metrics_addr: str = "127.0.0.1"
    metrics_port: int | None = None  # None: 9400, or a free one if 9400 is taken
    stdout_filters: tuple[str, ...] = ()
    stderr_filters: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # added to every worker's environment
    script_args: tuple[str, ...] = ()
    static: bool = False  # torchrun's static form: node 0 serves the etcd (etcd_plan.py)
    is_host: bool | None = None  # --rdzv-conf is_host: serve the endpoint's etcd or never
    join_timeout: float = 600.0
    node_rank: int = 0  # static form: the group rank this node asks for
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # the workers' MASTER_PORT every round; None: fresh
    module: bool = False  # run the script as python -m
    forkserver: bool = False  # --start-method forkserver/fork: fork workers, torch imported
    restart_mode: RestartMode = RestartMode.LIVE  # State.run workers re-form in place


def _worker_command(ns: argparse.Namespace) -> tuple[str, ...]:
    script, args = ns.training_script, list(ns.training_script_args)
    if ns.run_path:
        return (sys.executable, "-u", "-c", _RUN_PATH, sys.path[0], script, *args)
    if ns.no_python:
        if ns.module:
            raise UsageError("--no-python and --module cannot be used together")
        return (script, *args)
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    return (python, "-u", *(["-m"] if ns.module else []), script, *args)


def _check_script(ns: argparse.Namespace) -> None:
    script = ns.training_script
    if ns.module:
        return  # resolved by the worker's interpreter
    if ns.no_python:
        if shutil.which(script) is None and not os.access(script, os.X_OK):
            raise UsageError(f"training program {script!r}: not found or not executable")
        return
    if not Path(script).is_file():
        from elastic.cli import SUBCOMMANDS

        command = closest(script, list(SUBCOMMANDS)) if "/" not in script else None
        hint = f" (did you mean the command 'elastic-run {command}'?)" if command else ""
        raise UsageError(f"training script {script!r}: no such file{hint}")


def _check_logs_specs(name: str) -> None:
    """torchrun loads ``--logs-specs`` from the ``torchrun.logs_specs`` entry points and
    refuses a name none has; so does this launcher (which then ignores it)."""
    from importlib import metadata

    names = sorted(metadata.entry_points().select(group="torchrun.logs_specs").names)
    if name not in names:
        raise UsageError(
            f"--logs-specs {name!r}: no entry point of that name in group "
            f"torchrun.logs_specs (there: {', '.join(names) or 'none'})"
        )


def _port(flag: str, value: object) -> int | None:
    if value is None:
        return None
    try:
        port = int(str(value))
    except ValueError:
        raise UsageError(f"{flag} {value!r}: expected a port number") from None
    if not 0 < port < 65535:
        raise UsageError(f"{flag} {port}: expected 1-65534")
    return port


def _metrics_port(value: object) -> int | None:
    if value is None:
        return None
    try:
        port = int(str(value))
    except ValueError:
        raise UsageError(f"--metrics-port {value!r}: expected a port number") from None
    if not -1 <= port < 65536:
        raise UsageError(f"--metrics-port {port}: expected 0-65535, or -1 for none")
    return port


def _snapshot_policy(ns: argparse.Namespace) -> SnapshotPolicy:
    """elastic.State's settings, handed to workers through their environment."""
    try:
        ckpt_every, keep = int(ns.checkpoint_every), int(ns.checkpoint_keep)
    except ValueError as e:
        raise UsageError(f"bad number: {e}") from None
    every: int | str = str(ns.snapshot_every).strip().lower()
    if every != "auto":
        try:
            every = int(every)
        except ValueError:
            raise UsageError(
                f"--snapshot-every {ns.snapshot_every!r}: a number of steps, or auto"
            ) from None
        if every < 0:
            raise UsageError(f"--snapshot-every {every}: must be >= 0")
    try:
        budget = float(ns.snapshot_budget)
    except ValueError:
        raise UsageError(
            f"--snapshot-budget {ns.snapshot_budget!r}: a share of step time, e.g. 0.02"
        ) from None
    if not 0 < budget < 1:
        raise UsageError(
            f"--snapshot-budget {budget}: a share of step time between 0 and 1 (0.02 is 2%)"
        )
    if ckpt_every < 1:
        raise UsageError(f"--checkpoint-every {ckpt_every}: must be at least 1")
    if keep < 1:
        raise UsageError(f"--checkpoint-keep {keep}: must be at least 1")
    directory = None
    if ns.checkpoint_dir:
        path = Path(ns.checkpoint_dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--checkpoint-dir {ns.checkpoint_dir}: {e.strerror}") from None
        directory = str(path.resolve())
    return SnapshotPolicy(
        every=every,
        budget=budget,
        checkpoint_every=ckpt_every,
        keep=keep,
        checkpoint_dir=directory,
    )


def build_config(ns: argparse.Namespace) -> RunConfig:
    backend = str(ns.rdzv_backend)
    if backend not in BACKENDS:
        raise UsageError(
            f"--rdzv-backend {backend!r}: elastic-run's agents meet in etcd v3 "
            f"({', '.join(BACKENDS)} are accepted); leave it out and give --rdzv-endpoint of "
            "an etcd, or nothing for an embedded one"
        )
    mn, mx = parse_nnodes(ns.nnodes)
    devices = None
    if ns.devices:
        try:
            devices = choose_devices(str(ns.devices))
        except DeviceError as e:
            raise UsageError(f"--devices {ns.devices}: {e}") from None
    spec = (
        ns.nproc_per_node
        if ns.nproc_per_node is not None
        else str(len(devices))
        if devices
        else "1"
    )
    try:
        nproc = count_devices(str(spec), visible=len(devices) if devices else None)
    except DeviceError as e:
        raise UsageError(f"--nproc-per-node {spec}: {e}") from None
    if devices and len(devices) % nproc:
        raise UsageError(
            f"--devices {ns.devices}: {len(devices)} device(s) cannot be shared "
            f"evenly by {nproc} workers"
        )
    try:
        max_restarts = int(ns.max_restarts)
        monitor_interval = float(ns.monitor_interval)
        shutdown_timeout = 30.0 if ns.shutdown_timeout is None else float(ns.shutdown_timeout)
        handover_timeout = float(ns.handover_timeout)
    except ValueError as e:
        raise UsageError(f"bad number: {e}") from None
    if max_restarts < 0:
        raise UsageError(f"--max-restarts {max_restarts}: must be >= 0")
    _positive("--monitor-interval", monitor_interval)
    _positive("--shutdown-timeout", shutdown_timeout, allow_zero=True)
    _positive("--handover-timeout", handover_timeout, allow_zero=True)
    endpoint, run_id = str(ns.rdzv_endpoint or ""), str(ns.rdzv_id)
    if ns.standalone:
        if endpoint:
            log.warning(
                "--standalone: ignoring --rdzv-endpoint %s; using an embedded etcd", endpoint
            )
        if (mn, mx) != (1, 1):
            log.warning("--standalone runs one node: ignoring --nnodes %s", ns.nnodes)
        endpoint, run_id = "", os.urandom(6).hex()
        mn = mx = 1
    master_port = _port("--master-port", ns.master_port)
    node_rank = int(ns.node_rank)
    static = not endpoint and not ns.standalone and mx > 1
    if static and not 0 <= node_rank < mx:
        raise UsageError(
            f"--node-rank {node_rank}: expected 0 to {mx - 1} for --nnodes {ns.nnodes}"
        )
    if not static and node_rank:
        log.warning("--node-rank is for torchrun's static form (no --rdzv-endpoint): ignored")
    # torchrun's static form: node 0 is the master, at --master-addr; one node with a
    # --master-port is the static form too (without one, torchrun picks a free port)
    one_static = not endpoint and not ns.standalone and mx == 1 and master_port is not None
    master_is_here = (static and node_rank == 0) or one_static
    if ns.logs_specs:
        _check_logs_specs(str(ns.logs_specs))
    for flag, value in (("--numa-binding", ns.numa_binding), ("--logs-specs", ns.logs_specs)):
        if value:
            log.warning("%s is accepted for compatibility and ignored", flag)
    filt = None
    if str(ns.local_ranks_filter).strip():
        try:
            filt = frozenset(int(r) for r in str(ns.local_ranks_filter).split(","))
        except ValueError:
            raise UsageError(
                f"--local-ranks-filter {ns.local_ranks_filter!r}: expected "
                "comma-separated local ranks like 0,1"
            ) from None
    try:
        conf = RdzvConf.parse(str(ns.rdzv_conf))
        _, rdzv = build_options(endpoint or "127.0.0.1", run_id, mn, mx, conf)  # check it all
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for line in conf.warnings():
        log.warning("%s", line)
    _check_script(ns)
    # torchrun sets this in its own environment, which its workers inherit
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": str(ns.signals_to_handle)}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    env[POLICY_ENV] = _snapshot_policy(ns).encode()
    restart_mode = RestartMode(ns.restart_mode)
    env[RESTART_MODE_ENV] = restart_mode.value
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        log.warning(
            "setting OMP_NUM_THREADS=1 for each worker to avoid overloading the "
            "machine; tune it for your workload"
        )
        env["OMP_NUM_THREADS"] = "1"
    return RunConfig(
        min_nodes=mn,
        max_nodes=mx,
        nproc_per_node=nproc,
        rdzv_endpoint=endpoint,
        rdzv_id=run_id,
        rdzv_conf=conf,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        role=str(ns.role),
        command=_worker_command(ns),
        script=str(ns.training_script),
        script_args=tuple(ns.training_script_args),
        module=bool(ns.module),
        forkserver=ns.start_method in ("fork", "forkserver") and not ns.no_python,
        log_dir=ns.log_dir,
        redirects=parse_std("--redirects", ns.redirects, nproc),
        tee=parse_std("--tee", ns.tee, nproc),
        local_ranks_filter=filt,
        local_addr=ns.local_addr or (str(ns.master_addr) if master_is_here else None),
        static=static,
        is_host=conf.is_host,
        join_timeout=rdzv.join_timeout,
        node_rank=node_rank,
        master_addr=str(ns.master_addr),
        master_port=master_port,
        signals=parse_signals(ns.signals_to_handle),
        shutdown_timeout=shutdown_timeout,
        handover_timeout=handover_timeout,
        restart_mode=restart_mode,
        virtual_local_rank=bool(ns.virtual_local_rank),
        worker_hang_timeout=_positive(
            "--worker-hang-timeout", float(ns.worker_hang_timeout), allow_zero=True
        ),
        metrics_addr=str(ns.metrics_addr),
        metrics_port=_metrics_port(ns.metrics_port),
        node_id=ns.node_id or f"{socket.gethostname()}-{os.getpid()}",
        stdout_filters=tuple(filter(None, str(ns.duplicate_stdout_filters).split(","))),
        stderr_filters=tuple(filter(None, str(ns.duplicate_stderr_filters).split(","))),
        env=env,
    )
