"""``elastic-run``: the command users type. Bad input ends in one line, never a traceback."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from elastic.args import UsageError, parse_args
from elastic.etcd_server import EtcdServerError
from rendezvous.config import ConfigError
from rendezvous.errors import RendezvousError

SUBCOMMANDS = {"status": "elastic.status", "tune-workers": "elastic.tuner"}


def setup_logging(node: str = "") -> None:
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    fmt = f"%(asctime)s %(levelname).1s elastic-run{f'[{node}]' if node else ''}: %(message)s"
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")


def fail(message: str, code: int = 1) -> int:
    print(f"elastic-run: error: {message}", file=sys.stderr, flush=True)
    return code


def run(argv: Sequence[str]) -> int:
    from elastic.launch import launch
    from elastic.metrics import MetricsError
    from elastic.spec import build_config

    try:
        cfg = build_config(parse_args(argv))
    except UsageError as e:
        return fail(str(e), 2)
    setup_logging(cfg.node_id)
    try:
        return launch(cfg)
    except (RendezvousError, ConfigError, EtcdServerError, MetricsError) as e:
        return fail(str(e))


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    # before prometheus-client loads: the agent's own metrics live in memory; only its
    # workers write multiprocess files, to a directory the agent gives them
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    setup_logging()
    if args and args[0] in SUBCOMMANDS:
        import importlib

        sys.exit(importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:]))
    sys.exit(run(args))
