"""A node's directory in shared memory: snapshots and control blocks of its workers.

It outlives a worker crash (that is the point) but not the agent: the agent removes it
when it exits, and an agent starting later removes those of agents that died (SIGKILL)
without the chance to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("elastic.nodedir")


def _base() -> Path:
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / f"elastic-run-{os.getuid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Remove directories of agents that are gone (named ``<anything>.<pid>``)."""
    base = _base()
    if not base.is_dir():
        return
    for d in base.iterdir():
        pid = d.name.rsplit(".", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s, left by an agent that is gone", d)
            shutil.rmtree(d, ignore_errors=True)


def create(run_id: str, node_id: str) -> Path:
    remove_stale()
    path = _base() / f"{run_id}_{node_id}.{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(path)
