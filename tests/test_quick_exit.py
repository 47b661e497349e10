"""A worker's interpreter exit neither walks nor frees torch's objects one by one
(``elastic.worker.quick_exit``; its cost side by side: ``benchmarks/exit_cost.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import ROOT

from elastic.agent.forkserver import ForkServer

EXITING = """
import atexit, gc, sys
# registered before State's: it runs after it, as the handlers torch and logging register
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count()))
import torch, elastic
state = elastic.State(model=torch.nn.Linear(2, 1), epoch=0)
class Cycle:
    def __del__(self):
        with open(sys.argv[1], "w") as f:
            f.write("finalized")
garbage = Cycle()
garbage.me = garbage  # garbage only a collection finds
del garbage
atexit.register(lambda: print("the script's own handler ran first"))
"""


def test_a_state_user_exits_with_its_heap_frozen_and_its_garbage_finalized(
    tmp_path: Path,
) -> None:
    """After the script's own handlers: one collection (garbage in a reference cycle is
    finalized, as Python's exit would do: frozen unseen, it never would), then the heap
    is frozen, so the collections of the interpreter's exit walk none of torch's
    objects."""
    log = tmp_path / "log"
    done = subprocess.run([sys.executable, "-c", EXITING, str(log)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert said[0] == "the script's own handler ran first", said
    assert said[1].startswith("frozen at exit: ") and int(said[1].split()[-1]) > 50_000, said
    assert log.read_text() == "finalized"


def test_the_fork_servers_children_start_with_its_imports_frozen(tmp_path: Path) -> None:
    """What the fork server imported (torch) is frozen before it forks: a child's
    collections and exit never walk it, and its pages stay shared."""
    script = tmp_path / "count.py"
    script.write_text("import gc, sys\nprint(gc.get_freeze_count())\nsys.exit(3)\n")
    server = ForkServer(os.environ)
    out = tmp_path / "out"
    try:
        assert server.wait_ready(90), "the fork server's imports"
        with open(os.devnull, "rb") as stdin, out.open("w") as stdout:
            child = server.spawn(str(script), [], False, os.environ,
                                 (stdin.fileno(), stdout.fileno(), 2))  # fmt: skip
        assert child.wait(30) == 3
    finally:
        server.close()
    assert int(out.read_text()) > 50_000
