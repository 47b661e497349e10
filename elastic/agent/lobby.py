"""A newcomer's workers start before it joins, so the others train on meanwhile.

A node that joins a running job is admitted as soon as it registers, and the members
pause (in place) until its workers have started: with ``spawn``, a new interpreter,
``import torch`` and the script's own start, 3-4 s of everyone's time. So when the
job's workers re-form in place (its leader says so in its record), a newcomer reads the
job before it registers and starts its workers with the placement the next round will
most likely give them: after the current members, as ``rules.plan`` orders a round.
They run the script up to ``init_process_group``, where ``import elastic`` holds them
(``elastic.worker.group``) until their placement comes. The newcomer registers once they
all wait there (a worker that reached torch's own ``init_process_group`` instead, its
script having imported elastic later, is seen at once: ``tripwire``), or after
``LOBBY_MAX``; the members then pause once, for the forming of the group alone.

A standby (the round is full: ``--nnodes`` MAX) starts its workers the same way, for the
place of a member lost: the last group rank, the members' world size (a member of its
own number of workers lost). A loss then costs the survivors the forming of the group,
not the standby's start-up; while nothing is lost its workers wait, as a hot spare's do.

A standby that registered without workers (it came before the job's workers re-formed
in place) steps back once they do, and joins again with its workers started
(``warm_up``).

A round that places the newcomer otherwise (another node joined or was lost meanwhile)
gets new workers: the ones started ahead may have read their ranks already.

A member whose own worker fails or hangs comes back the same way (``step_out``): it
reports the failure (the job's restart budget pays it), leaves, and once the others
have re-formed without it, in place, joins again with new workers started ahead; the
others train on through their start-up instead of waiting for them, paused. The rules
are here; the agent carries them out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from elastic.agent.placement import Placement
from rendezvous.view import Glance

LOBBY_MAX = 120.0  # seconds a newcomer waits for its workers before it joins without them


@dataclass(frozen=True)
class Ahead:
    """The workers to start before joining (none: join first), and why; ``standby``: for
    the place of a member lost (the round is full)."""

    placements: tuple[Placement, ...]
    reason: str
    standby: bool = False


def ahead(
    glance: Glance,
    restart_count: int,
    live: bool,
    nproc: int,
    max_nodes: int,
    *,
    static: bool,
    in_place: bool,
    store: tuple[str, int],
) -> Ahead:
    """Whether a node of ``nproc`` workers starts them before joining the job ``glance``
    shows, and where it expects them. ``restart_count``: its workers' next
    TORCHELASTIC_RESTART_COUNT (0 but for a node that stepped out); ``live``: it knows the
    job's workers re-form in place (it stepped out of a round whose workers did; a new
    leader may not have said so yet), else the leader's record says; ``static``: it asks
    for its rank (``--node-rank``); ``in_place``: its own workers would re-form in place
    (``--restart-mode live``); ``store``: the address they get as the store's until they
    are placed (no round's: see ``tripwire``)."""
    r = glance.round
    if not in_place:
        return Ahead((), "--restart-mode respawn: the members restart with it anyway")
    if static:
        return Ahead((), "this node asks for its rank (--node-rank)")
    if glance.closed:
        return Ahead((), "the job is over")
    if r is None:
        return Ahead((), "no round runs yet: the first forms with this node")
    leader = glance.leader
    if not live and (leader is None or not leader.in_place):
        why = "the job's workers do not re-form in place: the members restart"
        return Ahead((), f"round {r.number} is full, and {why}" if r.size >= max_nodes else why)
    if r.size >= max_nodes:  # a standby: in the place of a member lost, of its own nproc
        before = r.world_size - nproc  # the ranks of the members who stay (the header only)
        group_rank, how = r.size - 1, f"round {r.number} is full: this node waits as a standby"
        what = "a member lost"
    else:
        before, group_rank, how = r.world_size, r.size, f"round {r.number} trains with room"
        what = f"this node in round {r.number + 1}"
    placements = tuple(
        Placement(
            local_rank=lr,
            rank=before + lr,
            group_rank=group_rank,
            local_world_size=nproc,
            world_size=before + nproc,
            group_world_size=group_rank + 1,
            master_addr=store[0],
            master_port=store[1],
            restart_count=restart_count,
        )
        for lr in range(nproc)
    )
    return Ahead(
        placements,
        f"{how}: its workers start now and wait for the place of {what} (group rank "
        f"{group_rank}, world size {before + nproc})",
        standby=r.size >= max_nodes,
    )


def can_warm(*, workers: bool, lobby_failed: bool) -> bool:
    """Whether a node could warm up at all, whatever the job shows (``warm_up``): it has
    no workers, and none it started ahead failed before."""
    return not workers and not lobby_failed


def warm_up(choice: Ahead, *, workers: bool, leads: bool, lobby_failed: bool) -> str | None:
    """Why a node registered without workers, and in no round yet, steps back to start
    them ahead (``choice``: ``ahead`` for it now); None: it waits as it is. A standby
    registers without them when it came before the job's workers re-formed in place (the
    job's first seconds: nodes started together, past ``--nnodes`` MAX), and a loss would
    then cost the others its whole start-up. Not a newcomer with room (the next round
    takes it at once), nor the leader (stepping back would move the lead), nor a node
    whose workers started ahead failed before (a script that would fail them again)."""
    if not can_warm(workers=workers, lobby_failed=lobby_failed) or not choice.standby or leads:
        return None
    return f"registered without workers; now {choice.reason}"


@dataclass(frozen=True)
class StepOut:
    """Whether a node whose own workers failed leaves the job for now, and why."""

    out: bool
    reason: str


def step_out(
    were_live: bool,
    size: int,
    alone: bool,
    spent: bool,
    *,
    in_place: bool,
    min_nodes: int,
    static: bool,
) -> StepOut:
    """For a member of a round of ``size`` nodes whose own worker failed or hung.
    ``were_live``: its workers re-formed in place this round (``State.run``; the script
    is the same on every node: the others' do too); ``alone``: no other member holds
    what it trained (``handover.holds_alone``: its snapshot may be the job's newest
    state); ``spent``: the failure spends the job's restart budget (``rules.spends_budget``:
    no round follows, so there is nothing to step out for); ``in_place``:
    ``--restart-mode live``; ``static``: it asks for its rank (``--node-rank``)."""
    if spent:
        return StepOut(False, "the failure spends the job's restart budget: the job fails")
    if not in_place:
        return StepOut(False, "--restart-mode respawn: every node restarts anyway")
    if not were_live:
        return StepOut(False, "the workers do not re-form in place: every node restarts anyway")
    if static:
        return StepOut(False, "this node asks for its rank (--node-rank)")
    if alone:
        return StepOut(
            False,
            "no other node of the round holds what this node trained (its snapshot may be "
            "the job's newest state): it restarts in the round",
        )
    if size - 1 < min_nodes:
        return StepOut(
            False, f"without it {size - 1} node(s), below the minimum of {min_nodes}: no round"
        )
    return StepOut(
        True,
        f"the other {size - 1} node(s) re-form in place without this node and train on "
        "while its new workers start; then it joins again with them",
    )


def back_now(present: int, awaited: bool, *, min_nodes: int) -> str | None:
    """Why a node out of the job (``step_out``) joins again before the others re-formed
    without it: the leader's record says the next round waits for it (``awaited``: no
    member left holds what the round trained, say the only two stepped out at once, each
    for the other to go on), or the ``present`` others (-1: not known) are below
    ``min_nodes`` (one of them was lost meanwhile), so no round forms until it is back.
    None: it waits."""
    if awaited:
        return (
            "the leader waits for this node: no other member holds what the round "
            "trained (what this node holds may be the job's newest state)"
        )
    if 0 <= present < min_nodes:
        return (
            f"the others are {present} node(s), below the minimum of {min_nodes}: "
            "they cannot re-form without this node"
        )
    return None


SITE = Path(__file__).resolve().parent / "lobby_site"  # its sitecustomize: placed.py


def site_path(pythonpath: str | None) -> str:
    """A worker started ahead's ``PYTHONPATH``: ``SITE`` first, so that what the script
    reads before it is placed is known (``elastic.worker.placed``)."""
    return os.pathsep.join([str(SITE), *([pythonpath] if pythonpath else [])])


def fits(started: Sequence[Placement], placed: Sequence[Placement], unplaced: bool) -> bool:
    """The workers started ahead can take the round's placements: it placed them as they
    were started (every variable a script may read before ``init_process_group`` but the
    store's address, which they take as they form), or none of them read a placement
    variable before it was placed (``unplaced``: ``elastic.worker.placed``), so any with
    the same local ranks will do."""

    def key(p: Placement) -> Placement:
        return replace(p, master_addr="", master_port=0)

    if unplaced:
        return sorted(p.local_rank for p in started) == sorted(p.local_rank for p in placed)

    mine = {p.local_rank: key(p) for p in started}
    return mine == {p.local_rank: key(p) for p in placed}
