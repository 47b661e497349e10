"""The node's shared-memory folders: an agent removes only the folders of agents that
provably ended, never those of a live agent in another pid namespace sharing /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.agent import nodedir
from elastic.stored import SnapshotSlots


def test_who_is_gone() -> None:
    me = nodedir._owner(os.getpid())
    assert me is not None
    assert not nodedir.gone(me, me)  # this very agent
    assert nodedir.gone({**me, "boot": "another boot"}, me)
    assert not nodedir.gone({**me, "pidns": "pid:[1]", "pid": 999_999_999}, me)  # not ours
    assert nodedir.gone({**me, "start": me["start"] - 100}, me)  # the pid was reused
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert nodedir.gone({**me, "pid": int(dead.stdout)}, me)


def test_remove_stale_keeps_live_and_foreign_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nodedir, "_base", lambda: tmp_path)
    mine = nodedir.create("job", "a")
    me = json.loads((mine / nodedir.OWNER).read_text())
    foreign = tmp_path / "job_b.1"  # an agent with pid 1 in another pid namespace
    foreign.mkdir()
    (foreign / nodedir.OWNER).write_text(json.dumps({**me, "pid": 1, "pidns": "pid:[7]"}))
    ended = tmp_path / "job_c.2"
    ended.mkdir()
    (ended / nodedir.OWNER).write_text(json.dumps({**me, "start": 1.0}))  # pid reused since
    unmarked = tmp_path / "something-else"
    unmarked.mkdir()
    nodedir.remove_stale(grace=0)
    assert mine.is_dir() and foreign.is_dir() and unmarked.is_dir()
    assert not ended.exists()
    nodedir.remove(mine)


def _dead_agents_folder(base: Path, name: str, owner: dict, step: int | None) -> Path:
    d = base / name
    d.mkdir()
    (d / nodedir.OWNER).write_text(json.dumps(owner))
    (d / "control-0").write_bytes(b"its worker's")
    (d / "prometheus").mkdir()
    if step is not None:
        slots = SnapshotSlots(d)
        slots.buffer(0, 8)[:8] = b"snapshot"
        slots.commit(0, step, 8)
        (d / f"rng-rank0-step{step}.rng").write_bytes(b"rng")
    return d


def test_a_restarted_node_inherits_its_dead_predecessors_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agent a of job J starts again on this host: the newest folder a dead a of J left
    becomes its predecessor (an older one goes), a dead b's of J stays for b to inherit,
    another job's stays for the grace its node has to start again, then goes. Kept, the
    snapshot moves in and the dead workers' files go."""
    monkeypatch.setattr(nodedir, "_base", lambda: tmp_path)
    me = nodedir._owner(os.getpid())
    assert me is not None
    dead = {**me, "start": 1.0}  # this pid, reused since: that agent is gone
    older = _dead_agents_folder(tmp_path, "J_a.1", {**dead, "job": "J", "node": "a"}, 3)
    newer = _dead_agents_folder(
        tmp_path, "J_a.2", {**dead, "start": 2.0, "job": "J", "node": "a"}, 40
    )
    other_node = _dead_agents_folder(tmp_path, "J_b.3", {**dead, "job": "J", "node": "b"}, 40)
    other_job = _dead_agents_folder(tmp_path, "K_a.4", {**dead, "job": "K", "node": "a"}, 9)
    mine = nodedir.create("J", "a")
    assert not older.exists() and not newer.exists()
    assert other_node.is_dir() and other_job.is_dir()  # K's node a may start again
    first_found = float((other_job / nodedir.GONE).read_text())
    nodedir.remove_stale("J", "a", mine)  # a while later: still within the grace
    assert float((other_job / nodedir.GONE).read_text()) == first_found
    (other_job / nodedir.GONE).write_text(str(first_found - nodedir.GRACE))
    nodedir.remove_stale("J", "a", mine)  # the grace is over
    assert not other_job.exists() and other_node.is_dir()
    assert nodedir.predecessor_step(mine) == 40
    nodedir.inherit(mine, keep=True)
    assert SnapshotSlots(mine, create=False).newest() == (0, 40)
    assert (mine / "rng-rank0-step40.rng").exists()
    assert not (mine / nodedir.PREDECESSOR).exists() and not (mine / "control-0").exists()
    nodedir.remove_job("J")  # the job ended: nobody inherits b's any more
    assert not other_node.exists() and mine.is_dir()
    nodedir.remove(mine)


def _dead_predecessor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder a dead agent of node a of job J left, with its snapshot of step 7 (its
    owner: this process, started at another time)."""
    monkeypatch.setattr(nodedir, "_base", lambda: tmp_path)
    me = nodedir._owner(os.getpid())
    assert me is not None
    return _dead_agents_folder(tmp_path, "J_a.1", {**me, "start": 1.0, "job": "J", "node": "a"}, 7)


def test_a_predecessors_snapshot_not_kept_goes_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dead_predecessor(tmp_path, monkeypatch)
    mine = nodedir.create("J", "a")
    nodedir.inherit(mine, keep=False)
    assert sorted(p.name for p in mine.iterdir()) == [nodedir.OWNER]
    assert nodedir.predecessor_step(mine) is None
    nodedir.remove(mine)


def test_a_kept_snapshot_carries_its_run_to_an_agent_after_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node a's agent starts again, keeps its dead predecessor's snapshot and is killed
    before it notes the job's run itself: the next agent of a finds the snapshot with its
    run, and keeps it (it found none, and removed the snapshot: chaos seed 16)."""
    dead = _dead_predecessor(tmp_path, monkeypatch)
    nodedir.remember_job(dead, "r1")
    second = nodedir.create("J", "a")
    assert nodedir.predecessor_job(second) == "r1"
    nodedir.inherit(second, keep=True)
    owner = json.loads((second / nodedir.OWNER).read_text())
    (second / nodedir.OWNER).write_text(json.dumps({**owner, "start": 2.0}))  # killed
    second = second.rename(tmp_path / "J_a.2")  # its pid was another than the next one's
    third = nodedir.create("J", "a")
    assert not second.exists()
    assert nodedir.predecessor_step(third) == 7
    assert nodedir.keeps(35, False, "r1", nodedir.predecessor_job(third))[0]
    nodedir.remove(third)


@pytest.mark.parametrize(
    ("recorded", "closed", "theirs", "kept", "why"),
    [
        (35, False, "r1", True, "the job goes on (it recorded step 35)"),
        (None, False, "r1", False, "recorded no progress"),  # an embedded etcd, new
        (35, True, "r1", False, "the job is over"),
        # a job started again under the same id: it recorded progress before this node came
        (
            35,
            False,
            "r0",
            False,
            "another run of a job with this id (r0; the job in etcd is run r1)",
        ),
        (35, False, "", False, "did not note which run"),  # it died before it learned
    ],
)
def test_whether_a_predecessors_snapshot_is_kept(
    recorded: int | None, closed: bool, theirs: str, kept: bool, why: str
) -> None:
    keep, reason = nodedir.keeps(recorded, closed, "r1", theirs)
    assert keep is kept and why in reason


def test_the_run_a_snapshot_was_taken_in_goes_with_it_to_the_next_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodedir.remember_job(_dead_predecessor(tmp_path, monkeypatch), "r1")
    mine = nodedir.create("J", "a")
    assert nodedir.predecessor_job(mine) == "r1"
    nodedir.remove(mine)
