"""The command line: every torchrun 2.13 flag (both spellings, ``PET_*`` variables) plus ours.

Parsing only; ``spec.build_config`` turns the namespace into a checked ``RunConfig``.
Errors are raised as ``UsageError`` with one line naming the problem, never printed
here, so the CLI decides how to report them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any, NoReturn


class UsageError(ValueError):
    """Bad command-line input; the message names the flag and the problem."""


class Parser(argparse.ArgumentParser):
    """argparse, with errors raised as UsageError instead of printed."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _flag_names(name: str) -> list[str]:
    """torchrun accepts both --nproc-per-node and --nproc_per_node."""
    dashed = "--" + name.replace("_", "-")
    underscored = "--" + name
    return [dashed] if dashed == underscored else [dashed, underscored]


class EnvDefault(argparse.Action):
    """A value flag whose default comes from ``PET_<DEST>`` (torchrun's ``env`` action)."""

    def __init__(self, dest: str, default: object = None, **kwargs: Any) -> None:
        default = os.environ.get(f"PET_{dest.upper()}", default)
        super().__init__(dest=dest, default=default, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class EnvFlag(argparse.Action):
    """A switch that ``PET_<DEST>=1`` also turns on (torchrun's ``check_env`` action)."""

    def __init__(self, dest: str, default: bool = False, **kwargs: Any) -> None:
        raw = os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")
        try:
            value = bool(int(raw))
        except ValueError:
            raise UsageError(f"PET_{dest.upper()}={raw!r}: expected 0 or 1") from None
        super().__init__(dest=dest, const=True, default=value, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)


def _value(
    p: argparse.ArgumentParser,
    name: str,
    default: object,
    help: str,
    short: str | None = None,
    **kw: Any,
) -> None:
    names = ([short] if short else []) + _flag_names(name)
    p.add_argument(*names, action=EnvDefault, dest=name, default=default, help=help, **kw)


def _switch(p: argparse.ArgumentParser, name: str, help: str, short: str | None = None) -> None:
    names = ([short] if short else []) + _flag_names(name)
    p.add_argument(*names, action=EnvFlag, dest=name, help=help)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="elastic-run",
        description="Elastic, fault-tolerant PyTorch launcher: torchrun's flags, etcd v3 "
        "rendezvous. Subcommands: 'elastic-run status' (a job's state), "
        "'elastic-run tune-workers' (DataLoader num_workers).",
        allow_abbrev=False,
    )
    # -- torchrun 2.13 ------------------------------------------------------------------
    _value(p, "nnodes", "1:1", "number of nodes, N or MIN:MAX")
    _value(
        p,
        "nproc_per_node",
        None,
        "workers per node: N, auto, cpu, gpu or xpu (1; with --devices, one per device)",
    )
    _value(p, "rdzv_backend", "etcd-v3", "rendezvous backend: etcd-v3 (etcd is the same)")
    _value(p, "rdzv_endpoint", "", "etcd host[:port][,host[:port]...]; empty: embedded etcd")
    _value(p, "rdzv_id", "none", "job id shared by all nodes")
    _value(p, "rdzv_conf", "", "key=value,... (see README: rdzv-conf keys)")
    _switch(p, "standalone", "single node with an embedded etcd and a random job id")
    _value(p, "max_restarts", 0, "worker-failure restarts per job before it fails", type=int)
    _value(p, "monitor_interval", 0.1, "seconds between worker polls", type=float)
    _value(
        p,
        "start_method",
        "spawn",
        "spawn: each worker a fresh python; forkserver (or "
        "fork): forked from a process that imported torch once, for fast restarts",
        choices=["spawn", "fork", "forkserver"],
    )
    _value(p, "event_log_handler", "null", "accepted for torchrun compatibility")
    _value(p, "role", "default", "worker role name (ROLE_NAME)")
    _switch(p, "module", "run the script as 'python -m'", short="-m")
    _switch(p, "no_python", "run the script as a program, not with python")
    _switch(p, "run_path", "run the script with runpy.run_path in the worker interpreter")
    _value(p, "log_dir", None, "base directory for per-attempt, per-rank logs")
    _value(
        p, "redirects", "0", "redirect stdout/stderr to files: 0-3 or per rank 0:1,1:2", short="-r"
    )
    _value(p, "tee", "0", "tee stdout/stderr to console and files, same syntax", short="-t")
    _value(p, "local_ranks_filter", "", "only these local ranks print to the console")
    _value(p, "duplicate_stdout_filters", "", "copy stdout lines containing these to a file")
    _value(p, "duplicate_stderr_filters", "", "copy stderr lines containing these to a file")
    _value(p, "node_rank", 0, "static rendezvous only; ignored", type=int)
    _value(p, "master_addr", "127.0.0.1", "static rendezvous only; ignored")
    _value(p, "master_port", None, "static rendezvous only; ignored", type=int)
    _value(p, "local_addr", None, "address other nodes reach this one at (default: FQDN)")
    _value(p, "logs_specs", None, "accepted for torchrun compatibility")
    _value(
        p,
        "numa_binding",
        None,
        "accepted for torchrun compatibility; ignored",
        choices=["node", "socket", "exclusive", "core-complex"],
    )
    _value(
        p,
        "signals_to_handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "signals forwarded to workers before leaving",
    )
    _value(
        p, "shutdown_timeout", None, "seconds from SIGTERM to SIGKILL of workers (30)", type=float
    )
    _switch(p, "virtual_local_rank", "each worker sees only its GPU, as device 0")
    # -- elastic-run ----------------------------------------------------------------------
    _value(p, "node_id", None, "this node's id in the job (default: HOSTNAME-PID)")
    _value(
        p,
        "devices",
        None,
        "GPUs this job may use (indices or UUIDs, like 0,2): workers "
        "see only these, local rank i on the i-th; two jobs share a machine this way",
    )
    _value(p, "metrics_addr", "0.0.0.0", "address of the /metrics and /healthz endpoint")
    _value(
        p,
        "metrics_port",
        None,
        "port of /metrics and /healthz: N, 0 for any free one, "
        "-1 for none (default 9400, or any free one if another agent has it)",
        type=int,
    )
    _value(
        p,
        "checkpoint_dir",
        None,
        "where elastic.State writes durable checkpoints "
        "(shared or per node); none: shared-memory snapshots only",
    )
    _value(
        p,
        "snapshot_every",
        1,
        "elastic.State snapshots every N steps (0: only to resize)",
        type=int,
    )
    _value(
        p, "checkpoint_every", 100, "every N-th snapshot also goes to --checkpoint-dir", type=int
    )
    _value(p, "checkpoint_keep", 3, "checkpoints kept in --checkpoint-dir", type=int)
    _value(
        p,
        "worker_hang_timeout",
        0.0,
        "a worker that reported progress (State.commit, "
        "elastic.heartbeat) and then none for this many seconds has failed (0: off)",
        type=float,
    )
    p.add_argument("training_script", help="the training script (or module, or program)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))
