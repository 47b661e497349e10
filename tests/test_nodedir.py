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
    nodedir.remove_stale()
    assert mine.is_dir() and foreign.is_dir() and unmarked.is_dir()
    assert not ended.exists()
    nodedir.remove(mine)
