"""A newcomer's workers started ahead of joining (``elastic.agent.lobby``): when they
start, where, and when the round that admits the node still fits them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from harness import ROOT

from elastic.agent.lobby import ahead, back_now, fits, site_path, step_out, warm_up
from elastic.contract import LOBBY_ENV
from rendezvous.records import Member, NodeRecord, RoundRecord
from rendezvous.view import Glance


def round_of(number: int, *nodes: tuple[str, int]) -> RoundRecord:
    members = tuple(Member(n, i + 1, "10.0.0.1", nproc) for i, (n, nproc) in enumerate(nodes))
    return RoundRecord(number, members, "10.0.0.7", 29500, 0)


LEADER = NodeRecord("a", "10.0.0.7", 2, in_place=True)
RUNNING = Glance(round_of(3, ("a", 2), ("b", 3)), leader=LEADER)
FULL = Glance(round_of(3, ("a", 2), ("b", 2), ("c", 2), ("d", 2)), leader=LEADER)
WIRE = ("10.0.0.3", 41999)


def test_the_workers_start_after_the_members_as_the_next_round_will_place_them() -> None:
    choice = ahead(RUNNING, 0, False, nproc=2, max_nodes=4, static=False, in_place=True, store=WIRE)
    assert [(p.local_rank, p.rank, p.group_rank, p.world_size) for p in choice.placements] == [
        (0, 5, 2, 7),
        (1, 6, 2, 7),
    ]
    first = choice.placements[0]
    assert (first.local_world_size, first.group_world_size, first.restart_count) == (2, 3, 0)
    assert (first.master_addr, first.master_port) == WIRE  # no round's store: the tripwire
    assert "round 3 trains with room" in choice.reason and "round 4" in choice.reason


def test_a_standby_starts_its_workers_for_the_place_of_a_member_lost() -> None:
    """A full round admits a standby only for a member lost: its workers wait for the
    last place (group rank 3 of 4, ranks 6-7 of 8 where each node has 2 workers), so a
    loss costs the survivors the forming of the group, not the standby's start-up."""
    choice = ahead(FULL, 0, False, nproc=2, max_nodes=4, static=False, in_place=True, store=WIRE)
    assert [
        (p.rank, p.group_rank, p.world_size, p.group_world_size) for p in choice.placements
    ] == [
        (6, 3, 8, 4),
        (7, 3, 8, 4),
    ]
    assert "round 3 is full: this node waits as a standby" in choice.reason
    assert "the place of a member lost" in choice.reason


@pytest.mark.parametrize(
    ("glance", "static", "in_place", "why"),
    [
        (RUNNING, False, False, "--restart-mode respawn"),
        (RUNNING, True, True, "--node-rank"),
        (replace(RUNNING, closed=True), False, True, "the job is over"),
        (Glance(None, leader=LEADER), False, True, "no round runs yet"),
        (replace(RUNNING, leader=None), False, True, "do not re-form in place"),
        (replace(RUNNING, leader=replace(LEADER, in_place=False)), False, True, "do not re-form"),
        (replace(FULL, leader=None), False, True, "is full, and the job's workers do not re-form"),
        (FULL, False, False, "--restart-mode respawn"),
    ],
)
def test_no_workers_start_ahead_where_the_next_round_is_unknown_or_restarts_anyway(
    glance: Glance, static: bool, in_place: bool, why: str
) -> None:
    choice = ahead(
        glance, 0, False, nproc=2, max_nodes=4, static=static, in_place=in_place, store=WIRE
    )
    assert choice.placements == () and why in choice.reason


def test_a_round_fits_workers_started_ahead_as_they_were_placed_or_unread() -> None:
    choice = ahead(RUNNING, 0, False, nproc=2, max_nodes=4, static=False, in_place=True, store=WIRE)
    started = choice.placements
    store = [replace(p, master_addr="10.0.0.9", master_port=41000) for p in started]
    other = [
        [replace(p, rank=p.rank - 3, world_size=4) for p in started],
        [replace(p, group_rank=3) for p in started],  # another joined first
        [replace(p, restart_count=1) for p in started],
    ]
    assert fits(started, store, unplaced=False)  # the store's address is taken as they form
    for placed in other:
        assert not fits(started, placed, unplaced=False)  # the script may have read them
        assert fits(started, placed, unplaced=True)  # it read none: they take these in place
    assert not fits(started, store[:1], unplaced=True)  # the same local ranks, always


@pytest.mark.parametrize(
    ("script", "read"),
    [
        ('rank = int(os.environ["RANK"])', "RANK"),
        ('world = os.getenv("WORLD_SIZE")', "WORLD_SIZE"),
        ('local = os.environ["LOCAL_RANK"]', None),  # the same in any placement
        ("names = [k for k, v in os.environ.items() if k.startswith('TQDM_')]", None),
        ("import torch, torch.distributed", None),
    ],
)
def test_what_a_worker_started_ahead_reads_before_its_placement(
    script: str, read: str | None, tmp_path: Path
) -> None:
    """A real interpreter started as the agent starts a worker ahead (``lobby.site_path``
    first on its PYTHONPATH): its sitecustomize watches the script's reads of placement
    variables, and then runs the sitecustomize it shadows."""
    shadowed = tmp_path / "sitecustomize.py"
    shadowed.write_text("import os\nos.environ['SHADOWED'] = 'ran'\n")
    code = (
        f"import os\n{script}\n"
        "from elastic.worker import placed\n"
        "print(placed.watched(), placed.stop(), os.environ.get('SHADOWED'))\n"
    )
    env = {**os.environ, LOBBY_ENV: "1", "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
    env["PYTHONPATH"] = site_path(os.pathsep.join([str(shadowed.parent), str(ROOT)]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", str(read), "ran"], out.stderr


def test_the_tripwire_is_tripped_by_a_worker_that_connects_to_it() -> None:
    """A worker whose script reached torch's own init_process_group (elastic imported
    later) connects to the store address it was started with; a held one never does."""
    import socket

    from elastic.agent.tripwire import Tripwire

    wire = Tripwire("127.0.0.1")
    try:
        assert not wire.tripped()
        worker = socket.create_connection((wire.addr, wire.port))
        try:
            for _ in range(100):
                if wire.tripped():
                    break
                time.sleep(0.01)
            assert wire.tripped()
            worker.settimeout(0.1)
            with pytest.raises(TimeoutError):
                worker.recv(1)  # kept open, unanswered: it waits quietly until stopped
        finally:
            worker.close()
    finally:
        wire.close()


@pytest.mark.parametrize(
    ("were_live", "size", "in_place", "min_nodes", "static", "alone", "out", "why", "spent"),
    [
        (True, 3, True, 1, False, False, True, "the other 2 node(s) re-form in place", False),
        (True, 3, True, 2, False, False, True, "the other 2", False),
        (True, 2, True, 2, False, False, False, "below the minimum of 2", False),
        (False, 3, True, 1, False, False, False, "do not re-form in place", False),
        (True, 3, False, 1, False, False, False, "--restart-mode respawn", False),
        (True, 3, True, 1, True, False, False, "--node-rank", False),
        # the others joined its round and trained no step with it: they would start over
        (True, 3, True, 1, False, True, False, "no other node of the round holds", False),
        # no round follows: nothing to step out for, whatever else holds
        (True, 3, True, 1, False, False, False, "spends the job's restart budget", True),
        (False, 3, False, 1, True, True, False, "spends the job's restart budget", True),
    ],
)
def test_a_node_whose_own_worker_failed_steps_out_only_where_the_others_go_on_in_place(
    were_live: bool,
    size: int,
    in_place: bool,
    min_nodes: int,
    static: bool,
    alone: bool,
    out: bool,
    why: str,
    spent: bool,
) -> None:
    choice = step_out(
        were_live, size, alone, spent, in_place=in_place, min_nodes=min_nodes, static=static
    )
    assert choice.out is out and why in choice.reason


def test_a_node_that_stepped_out_starts_its_workers_with_its_restart_count() -> None:
    """It knows the job's workers re-form in place: a new leader need not have said so."""
    no_leader_yet = Glance(round_of(3, ("a", 2), ("b", 3)))
    choice = ahead(
        no_leader_yet, 2, True, nproc=1, max_nodes=4, static=False, in_place=True, store=WIRE
    )
    assert [p.restart_count for p in choice.placements] == [2]
    assert (
        ahead(
            no_leader_yet, 2, False, nproc=1, max_nodes=4, static=False, in_place=True, store=WIRE
        ).placements
        == ()
    )


@pytest.mark.parametrize(
    ("present", "back"), [(1, True), (0, True), (2, False), (3, False), (-1, False)]
)
def test_a_node_out_of_the_job_is_back_at_once_when_the_others_are_too_few(
    present: int, back: bool
) -> None:
    """Its own worker hung and it stepped out for the others (min 2) to go on; one of
    them was lost meanwhile: waiting for them to re-form would wait for a round that
    cannot form (it waited OUT_MAX, 10 s, in ci28)."""
    why = back_now(present, False, min_nodes=2)
    assert (why is not None) is back
    if why:
        assert why == (
            f"the others are {present} node(s), below the minimum of 2: "
            "they cannot re-form without this node"
        )


@pytest.mark.parametrize("present", [-1, 0, 1, 5])
def test_a_node_out_of_the_job_is_back_at_once_when_the_leader_waits_for_it(
    present: int,
) -> None:
    """The only two members stepped out at once, each for the other to go on: the leader
    holds the next round for them (their snapshots may be the job's newest state), and
    they would wait for a round that waits for them (its hold's end, then from older
    state: chaos seed 24)."""
    why = back_now(present, True, min_nodes=2)
    assert why is not None and why.startswith("the leader waits for this node")


def test_a_standby_registered_without_workers_warms_up_once_it_can() -> None:
    """It steps back to start them ahead only as a standby (a newcomer with room is
    taken by the next round at once), never as the leader, nor with workers, nor after
    workers started ahead failed; and only once the job's workers re-form in place."""
    kw = {"nproc": 2, "static": False, "in_place": True, "store": WIRE}
    standby = ahead(FULL, 0, False, max_nodes=4, **kw)  # type: ignore[arg-type]
    assert standby.standby and standby.placements
    why = warm_up(standby, workers=False, leads=False, lobby_failed=False)
    assert why is not None and why.startswith("registered without workers; now round 3 is full")
    assert warm_up(standby, workers=True, leads=False, lobby_failed=False) is None
    assert warm_up(standby, workers=False, leads=True, lobby_failed=False) is None
    assert warm_up(standby, workers=False, leads=False, lobby_failed=True) is None
    room = ahead(RUNNING, 0, False, max_nodes=4, **kw)  # type: ignore[arg-type]
    assert room.placements and not room.standby
    assert warm_up(room, workers=False, leads=False, lobby_failed=False) is None
    early = Glance(FULL.round, leader=replace(LEADER, in_place=False))
    cold = ahead(early, 0, False, max_nodes=4, **kw)  # type: ignore[arg-type]
    assert not cold.placements
    assert warm_up(cold, workers=False, leads=False, lobby_failed=False) is None
