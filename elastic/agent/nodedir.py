"""A node's directory in shared memory: snapshots and control blocks of its workers.

It outlives a worker crash (that is the point) but not the agent: the agent removes it
when it exits, and an agent starting later removes those of agents that died (SIGKILL)
without the chance to.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import psutil

log = logging.getLogger("elastic.nodedir")


def _base() -> Path:
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / f"elastic-run-{os.getuid()}"


OWNER = "owner.json"  # who made the directory: judged before removing it


def _owner(pid: int) -> dict[str, object] | None:
    """What names a process beyond its pid: its pid namespace, its start time and the
    boot it started in (a pid is reused; a pid of another namespace is another process)."""
    try:
        return {
            "pid": pid,
            "pidns": os.readlink(f"/proc/{pid}/ns/pid"),
            "start": psutil.Process(pid).create_time(),
            "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        }
    except (OSError, psutil.Error):
        return None


def gone(owner: dict[str, object], me: dict[str, object]) -> bool:
    """Whether the agent ``owner`` describes has ended, as ``me`` (this agent) can tell:
    another boot, or the same pid namespace with that pid not running since then. An
    agent of another pid namespace sharing this memory is never judged gone."""
    if owner.get("boot") != me["boot"]:
        return True
    if owner.get("pidns") != me["pidns"]:
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    now = _owner(pid)
    return now is None or now["pidns"] != owner["pidns"] or now["start"] != owner.get("start")


def remove_stale() -> None:
    """Remove the directories of agents that ended without removing their own (SIGKILL)."""
    base = _base()
    me = _owner(os.getpid())
    if not base.is_dir() or me is None:
        return
    removed = 0
    for d in base.iterdir():
        try:
            owner = json.loads((d / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours to judge (being made, or not an agent's)
        if isinstance(owner, dict) and gone(owner, me):
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    if removed:
        log.info(
            "cleaned up %d snapshot folder(s) in %s of agents that ended without removing them",
            removed,
            base,
        )


def create(run_id: str, node_id: str) -> Path:
    remove_stale()
    path = _base() / f"{run_id}_{node_id}.{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    owner = _owner(os.getpid())
    if owner is not None:
        (path / OWNER).write_text(json.dumps(owner))
    return path


def remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(path)
