"""A node's directory in shared memory: snapshots and control blocks of its workers.

It outlives a worker crash (that is the point) but not the agent: the agent removes it
when it exits, and an agent starting later removes those of agents that died (SIGKILL)
without the chance to, but those of its own job: an agent that starts again as the same
node of the same job (a restarted pod, whose /dev/shm is the pod's) finds its
predecessor's folder and keeps its snapshot, if the job in etcd is still the one it was
taken in (``keeps``): every node that held the newest state may be gone, but not that
copy. A dead agent's folder of the job goes when a node ends the job; another job's
agent starting on the host leaves it for ``GRACE`` from the moment one first found it
dead (its node may start again: a restarted pod, a host rebooted into the job), then
removes it (it holds shared memory the host may need).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil

from elastic.stored import SnapshotSlots

log = logging.getLogger("elastic.nodedir")


def _base() -> Path:
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / f"elastic-run-{os.getuid()}"


OWNER = "owner.json"  # who made the directory: judged before removing it
GONE = "gone-since"  # when an agent first found the owner dead (seconds since the epoch)
GRACE = 600.0  # seconds another job's agent leaves a dead agent's folder for its node
PREDECESSOR = "predecessor"  # a dead agent's folder of the same job and node, until judged
JOB = "job-run"  # the run of the job its snapshots were taken in (``remember_job``)
SNAPSHOT_FILES = ("slots.hdr", "slot0.bin", "slot1.bin", "rng-rank*-step*.rng")


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


def _stale(me: dict[str, object]) -> list[tuple[Path, dict[str, object]]]:
    """The directories of agents that ended without removing their own (SIGKILL), with
    what their owner file says."""
    base = _base()
    found = []
    for d in base.iterdir() if base.is_dir() else ():
        try:
            owner = json.loads((d / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours to judge (being made, or not an agent's)
        if isinstance(owner, dict) and gone(owner, me):
            found.append((d, owner))
    return found


def remove_stale(
    run_id: str = "", node_id: str = "", mine: Path | None = None, grace: float = GRACE
) -> None:
    """Remove the directories of agents that ended without removing their own, but those
    of job ``run_id``: the newest of node ``node_id`` becomes ``mine``'s ``PREDECESSOR``,
    and the other nodes' may be this one's to inherit once they start again here (they
    go when the job ends: ``remove_job``). Another job's go once dead for ``grace``."""
    me = _owner(os.getpid())
    if me is None:
        return
    removed, waiting, same = 0, 0, []
    for d, owner in _stale(me):
        if run_id and owner.get("job") == run_id:
            if owner.get("node") == node_id and mine is not None:
                same.append((_number(owner.get("start")), d))
            continue
        if _gone_for(d) < grace:
            waiting += 1
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    for i, (_, d) in enumerate(sorted(same, reverse=True)):
        if i == 0 and mine is not None:
            with contextlib.suppress(OSError):
                d.rename(mine / PREDECESSOR)
                continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    if removed:
        log.info(
            "cleaned up %d snapshot folder(s) in %s of agents that ended without removing them",
            removed,
            _base(),
        )
    if waiting:
        log.info(
            "left %d snapshot folder(s) in %s of other jobs' agents that ended without removing "
            "them: their nodes may start again (they go %.0f min after first found)",
            waiting,
            _base(),
            grace / 60,
        )


def _gone_for(d: Path) -> float:
    """Seconds since an agent first found ``d``'s owner dead (0: just now, stamped)."""
    stamp = d / GONE
    try:
        return max(0.0, time.time() - float(stamp.read_text()))
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            stamp.write_text(f"{time.time():.3f}")
        return 0.0


def remove_job(run_id: str) -> None:
    """The job is over: no node of it will inherit a dead agent's folder any more."""
    me = _owner(os.getpid())
    for d, owner in _stale(me) if me is not None else []:
        if owner.get("job") == run_id:
            shutil.rmtree(d, ignore_errors=True)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def create(run_id: str, node_id: str) -> Path:
    path = _base() / f"{run_id}_{node_id}.{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    owner = _owner(os.getpid())
    if owner is not None:
        (path / OWNER).write_text(json.dumps({**owner, "job": run_id, "node": node_id}))
    remove_stale(run_id, node_id, path)
    return path


def predecessor_step(path: Path) -> int | None:
    """The step of the snapshot a dead agent of this job and node left (None: none)."""
    found = path / PREDECESSOR
    if not SnapshotSlots.present(found):
        return None
    try:
        newest = SnapshotSlots(found, create=False).newest()
    except OSError:
        return None
    return newest[1] if newest is not None else None


def remember_job(path: Path, job: str) -> None:
    """Note in the node's folder which run of the job its snapshots are taken in (the
    token of the job's progress record), for the agent that may find it after this one
    died."""
    with contextlib.suppress(OSError):
        tmp = path / f"{JOB}.tmp"
        tmp.write_text(job)
        tmp.rename(path / JOB)


def predecessor_job(path: Path) -> str:
    """The run of the job the dead predecessor's snapshot was taken in ("": unknown)."""
    try:
        return (path / PREDECESSOR / JOB).read_text().strip()
    except OSError:
        return ""


def keeps(recorded: int | None, closed: bool, job: str, theirs: str) -> tuple[bool, str]:
    """Whether a node keeps the snapshot its dead predecessor left, the job in etcd
    having recorded progress ``recorded`` (None: none) in its run ``job`` (the token of
    its progress record), being ``closed`` or not, and the predecessor having noted the
    run ``theirs`` ("": none); and why. A job that recorded nothing is a new one under
    the same id (an embedded etcd starts empty), and one whose run differs is too (it
    recorded progress before this node came): the snapshot is another job's."""
    if closed:
        return False, "the job is over"
    if recorded is None:
        return False, "the job in etcd has recorded no progress: it is not the one it was taken in"
    if not theirs:
        return False, "its agent did not note which run of the job it was taken in"
    if theirs != job:
        return False, (
            f"it was taken in another run of a job with this id ({theirs}; the job in etcd "
            f"is run {job or 'unknown'})"
        )
    return True, f"the job goes on (it recorded step {recorded})"


def inherit(path: Path, keep: bool) -> None:
    """Move the predecessor's snapshot into ``path`` (``keep``), then remove the rest of
    its folder: its control blocks and metrics were its workers'. The note of the run it
    was taken in comes first: this agent, killed before it notes the run itself, leaves
    the next one a snapshot it can keep (it left one without, which was removed: chaos
    seed 16, a node killed twice in 2 s)."""
    found = path / PREDECESSOR
    if keep:
        with contextlib.suppress(OSError):
            (found / JOB).rename(path / JOB)
        for pattern in SNAPSHOT_FILES:
            for f in found.glob(pattern):
                with contextlib.suppress(OSError):
                    f.rename(path / f.name)
    shutil.rmtree(found, ignore_errors=True)


def remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(path)
