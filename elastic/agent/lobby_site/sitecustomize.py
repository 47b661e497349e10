"""Run at the start of a worker started ahead of its node's joining: the agent puts this
folder first on its ``PYTHONPATH`` (``elastic.worker.placed`` says why). It loads
``placed`` under its own name without importing ``elastic`` (the script's import of it is
what the lobby waits for), then runs the ``sitecustomize`` this one shadows, if any."""

import importlib.util
import os
import sys
from importlib.machinery import PathFinder


def _load(name: str, path: str) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _start() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("ELASTIC_RUN_LOBBY"):
        placed = os.path.join(os.path.dirname(here), "..", "worker", "placed.py")
        _load("_elastic_run_placed", os.path.normpath(placed))
        sys.modules["_elastic_run_placed"].watch()
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    shadowed = PathFinder.find_spec("sitecustomize", rest)
    if shadowed is not None and shadowed.origin and os.path.isfile(shadowed.origin):
        _load("sitecustomize", shadowed.origin)


_start()
