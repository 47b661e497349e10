"""New workers on their way into State.run, as the agent sees them: a script's ``import
elastic`` says so in its control block (``ELASTIC``), in live mode only, and not for every
script a fork server runs; a graceful change waits for such workers (``core.waits_for_live``,
``test_agent_core``; end to end, ``test_live``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, wait_until
from workergroup import started

from elastic.agent.placement import Placement
from elastic.contract import (
    CONTROL_ENV,
    ELASTIC,
    LIVE,
    REPORTS,
    RESTART_MODE_ENV,
    USES_STATE,
    ControlBlock,
)

FORKED = """
import os, elastic
os.environ.update(WORKER_ENV)  # as the fork server's child gets its worker's environment
elastic.watch_the_first_group(imported=False)
"""


@pytest.mark.parametrize(
    ("mode", "code", "said"),
    [
        ("live", "import elastic", True),
        ("respawn", "import elastic", False),  # nothing re-forms in place: nothing to wait for
        ("live", FORKED, False),  # the fork server imported it, whatever the script
        ("live", FORKED + "elastic.watch_the_first_group()\n", True),  # the same, said
        ("live", FORKED + "from elastic import SnapshotPolicy\n", True),  # its API, used
        ("respawn", FORKED + "elastic.SnapshotPolicy\n", False),
        ("live", FORKED + "import elastic.integrations\n", True),  # an adapter (its package)
    ],
    ids=[
        "live",
        "respawn",
        "forked",
        "forked-said",
        "forked-uses-it",
        "forked-respawn",
        "forked-adapter",
    ],
)
def test_a_scripts_import_of_elastic_says_it_heads_for_state_run(
    tmp_path: Path, mode: str, code: str, said: bool
) -> None:
    block = ControlBlock(tmp_path / "block", create=True)
    assert block.fresh and not block.starting
    env = {CONTROL_ENV: str(tmp_path / "block"), RESTART_MODE_ENV: mode}
    base = {k: v for k, v in os.environ.items() if k not in env}
    run_env = base if code.startswith(FORKED) else {**base, **env}  # forked: set after
    code = code.replace("WORKER_ENV", repr(env))
    done = subprocess.run(
        [sys.executable, "-c", code], env=run_env, cwd=str(ROOT), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert block.starting is said and block.fresh is not said


@pytest.mark.parametrize("flag", [LIVE, REPORTS, USES_STATE | REPORTS])
def test_a_worker_in_state_run_or_training_outside_it_is_no_longer_starting(
    tmp_path: Path, flag: int
) -> None:
    block = ControlBlock(tmp_path / "block", create=True)
    block.mark(ELASTIC)
    assert block.starting and not block.fresh
    block.mark(flag)
    assert not block.starting


def test_a_worker_that_said_nothing_yet_is_fresh(tmp_path: Path) -> None:
    block = ControlBlock(tmp_path / "block", create=True)
    assert block.fresh
    block.mark(USES_STATE)
    assert not block.fresh


STARTING = """
import sys, time
from pathlib import Path
marks = Path(sys.argv[0]).parent
while not (marks / "import").exists():  # importing torch, say
    time.sleep(0.01)
import elastic
from elastic.contract import LIVE, worker_block
(marks / "imported").touch()
while not (marks / "run").exists():  # building its model
    time.sleep(0.01)
worker_block().mark(LIVE)  # in State.run
(marks / "in-run").touch()
time.sleep(60)
"""


def test_new_workers_are_starting_once_they_imported_elastic_or_where_expected(
    tmp_path: Path,
) -> None:
    """A new worker that said nothing yet counts as on its way only where this node's
    workers went into State.run before (``expected``); once it imported elastic, either
    way; once in State.run, no longer (it re-forms in place from there)."""
    me = Placement(0, 0, 0, 1, 1, 1, "127.0.0.1", 29500, 0)
    with started(tmp_path, STARTING, [me]) as group:
        assert group.starting(expected=True) and not group.starting(expected=False)
        (tmp_path / "import").touch()
        wait_until(lambda: (tmp_path / "imported").exists(), 60, "the worker's import")
        assert group.starting(expected=False) and group.starting(expected=True)
        (tmp_path / "run").touch()
        wait_until(lambda: (tmp_path / "in-run").exists(), 10, "the worker in State.run")
        assert group.live and not group.starting(expected=True)
        group.stop(0)
        assert not group.starting(expected=True)  # not alive


ONE_BY_ONE = """
import os, sys, time
from pathlib import Path
from elastic.contract import COMING, ELASTIC, LIVE, worker_block
marks, rank = Path(sys.argv[0]).parent, os.environ["LOCAL_RANK"]
worker_block().mark(FLAG)  # on its way: it imported elastic, or formed its first group
(marks / f"going.{rank}").touch()
while not (marks / f"run.{rank}").exists():  # building its model
    time.sleep(0.01)
worker_block().mark(LIVE)  # in State.run, where it waits for the other rank
(marks / f"in-run.{rank}").touch()
time.sleep(60)
"""


@pytest.mark.parametrize("flag", ["ELASTIC", "COMING"])
def test_workers_that_get_into_state_run_one_by_one_are_on_their_way_until_the_last_is(
    tmp_path: Path, flag: str
) -> None:
    """A node's ranks get into State.run one by one: while one is there and the other
    still builds, the node's workers are on their way all the same (new in this round, or
    placed in place); a change acted on then would replace both (before, the first
    rank's arrival ended the wait)."""
    ranks = [Placement(i, i, 0, 2, 2, 1, "127.0.0.1", 29500, 0) for i in range(2)]
    on_the_way = {
        "ELASTIC": lambda g: g.starting(expected=False),
        "COMING": lambda g: g.coming,
    }[flag]
    with started(tmp_path, ONE_BY_ONE.replace("FLAG", flag), ranks) as group:
        both = lambda name: all((tmp_path / f"{name}.{r}").exists() for r in (0, 1))  # noqa: E731
        wait_until(lambda: both("going"), 60, "both ranks on their way")
        assert on_the_way(group) and not group.live
        (tmp_path / "run.0").touch()
        wait_until(lambda: (tmp_path / "in-run.0").exists(), 10, "rank 0 in State.run")
        assert on_the_way(group) and not group.live  # rank 1 builds yet
        (tmp_path / "run.1").touch()
        wait_until(lambda: both("in-run"), 10, "both ranks in State.run")
        assert group.live and not on_the_way(group)  # they re-form in place from there
        os.kill(group.workers[1].proc.pid, 9)
        wait_until(lambda: group.workers[1].proc.poll() is not None, 10, "rank 1's end")
        assert not on_the_way(group)  # one is gone: nothing to wait for
