"""``elastic-run``: the command users type. One module per subcommand, each with a
``main(argv) -> exit code``; with no subcommand, the arguments are a torchrun command
line and the agent runs (``elastic.agent.main``)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence

from elastic.contract import MULTIPROC_ENV

SUBCOMMANDS = {"status": "elastic.tools.status", "tune-workers": "elastic.tools.tune_workers"}
DEFAULT = "elastic.agent.main"


def setup_logging(node: str = "") -> None:
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    when = "%(asctime)s.%(msecs)03d" if level == "DEBUG" else "%(asctime)s"  # debug: to the ms
    fmt = f"{when} %(levelname).1s elastic-run{f'[{node}]' if node else ''}: %(message)s"
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    # before prometheus-client loads: the agent's own metrics live in memory; only its
    # workers write multiprocess files, to a directory the agent gives them
    os.environ.pop(MULTIPROC_ENV, None)
    setup_logging()
    if args and args[0] in SUBCOMMANDS:
        sys.exit(importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:]))
    sys.exit(importlib.import_module(DEFAULT).main(args))
