"""The snapshot cadence on synthetic step times: it adapts to what snapshots cost."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch

from elastic import State
from elastic.contract import NODE_DIR_ENV
from elastic.worker.cadence import (
    BLOCK,
    BLOCKS,
    LIMIT,
    PROBE,
    REFRESH,
    WARMUP,
    Cadence,
    StepTimes,
    choose,
    interval_moved,
)


def run(
    c: Cadence, steps: int, step_s: float, cost_s: float, start: int = 1, apart: bool = False
) -> list[int]:
    """Train ``steps`` steps of ``step_s``; a snapshot makes the next step ``cost_s``
    longer (``apart``: it went to memory, the disk is written apart). Returns the steps
    snapshotted. One rank: its proposal is the agreed one."""
    taken: list[int] = []
    disturbed = False
    for step in range(start, start + steps):
        if step > start:
            c.observe(step_s + (cost_s if disturbed else 0.0), disturbed)
        due = c.due(step)
        c.agree(c.proposal)
        if due:
            c.taken(step, apart)
            taken.append(step)
        disturbed = due
    return taken


def test_choose_is_the_smallest_interval_within_the_aim() -> None:
    assert choose(0.100, 0.010, 0.02, aim=1.0).interval == 5  # 10 ms / (5 * 100 ms) = 2%
    assert choose(0.100, 0.011, 0.02, aim=1.0).interval == 6
    assert choose(0.100, 0.010, 0.02).interval == 7  # aim 80% of the budget: 1.6%
    assert choose(0.100, 0.001, 0.02).interval == 1
    assert choose(0.100, 0.0, 0.02).interval == 1
    assert choose(0.001, 10.0, 0.02).interval == LIMIT
    assert "capped" in choose(0.001, 10.0, 0.02).reason
    why = choose(0.200, 0.045, 0.02).reason
    assert "45 ms" in why and "200 ms" in why and "budget 2.0%" in why


def test_first_snapshot_after_the_probe_then_the_budget_decides() -> None:
    c = Cadence(0.02)
    taken = run(c, 200, step_s=0.1, cost_s=0.05)  # 50 ms: every 32 steps is 1.6%
    first = 1 + WARMUP + PROBE  # step 1 is not timed: the first time taken is step 2's
    assert taken[0] == first
    assert c.interval == 32
    gaps = {b - a for a, b in itertools.pairwise(taken[1:])}
    assert gaps == {32}
    assert c.cost_s == pytest.approx(0.05)
    assert c.step_s == pytest.approx(0.1)


def test_the_disk_beside_memory_keeps_the_interval_its_own_cost_allows() -> None:
    """Sharded state kept live snapshots to memory and writes the disk at an interval of
    its own, each within half of the budget, so the two together stay within it (4 ms
    in memory and 50 ms on disk beside 100 ms steps, budget 2%: memory every 5 steps,
    where alone it would be 3; the disk every 63); before anything is measured, before
    its first write, or at a fixed interval, every snapshot writes it."""
    c = Cadence(0.02)
    assert c.disk_due(10, last=-1, cost_s=0.05)  # nothing measured yet
    run(c, 300, step_s=0.1, cost_s=0.004)
    assert c.interval == 3  # memory alone: all of the budget
    run(c, 300, step_s=0.1, cost_s=0.004, start=301, apart=True)
    assert c.interval == 5 and c.choice is not None and "the disk's writes" in c.choice.reason
    assert c.disk_due(50, last=-1, cost_s=0.05)  # never written
    assert c.disk_due(50, last=40, cost_s=0.0)  # its cost not known
    assert not c.disk_due(50, last=40, cost_s=0.05)
    disk_every = next(s for s in range(41, 2000) if c.disk_due(s, last=40, cost_s=0.05)) - 40
    assert disk_every == 63
    assert 0.004 / (c.interval * 0.1) + 0.05 / (disk_every * 0.1) <= c.budget  # both: within
    assert Cadence(0.02, fixed=4).disk_due(8, last=4, cost_s=0.05)


def test_a_slow_copy_stretches_the_interval_and_a_fast_one_shrinks_it() -> None:
    c = Cadence(0.02)
    run(c, 300, step_s=0.1, cost_s=0.02)
    assert c.interval == 13
    run(c, 1000, step_s=0.1, cost_s=0.08, start=301)  # the state grew: 4x the cost
    assert c.interval == 50
    run(c, 1000, step_s=0.1, cost_s=0.004, start=1301)  # a faster copy
    assert c.interval == 3
    assert c.choice is not None and c.choice.interval == 3


def test_longer_steps_shorten_the_interval_before_the_next_snapshot() -> None:
    c = Cadence(0.02)
    run(c, 300, step_s=0.01, cost_s=0.08)
    assert c.interval == 500
    last = c.last
    taken = run(c, 30, step_s=1.0, cost_s=0.08, start=301)
    assert c.interval == 5 and taken and taken[0] - last < 500


def test_noise_within_the_band_does_not_move_the_interval() -> None:
    c = Cadence(0.02)
    run(c, 300, step_s=0.1, cost_s=0.02)
    assert c.interval == 13  # 1.54%
    run(c, 300, step_s=0.1, cost_s=0.025, start=301)  # 1.9%: kept
    run(c, 300, step_s=0.1, cost_s=0.011, start=601)  # 0.85%: kept
    assert c.interval == 13
    run(c, 300, step_s=0.1, cost_s=0.03, start=901)  # 2.3%: over the budget, never kept
    assert c.interval == 19


def test_a_pause_between_commits_is_not_a_step_nor_a_snapshot_cost() -> None:
    c = Cadence(0.02)
    run(c, 100, step_s=0.1, cost_s=0.02)
    assert c.interval == 13
    c.taken(101)
    c.observe(60.0, disturbed=True)  # an evaluation right after a snapshot
    c.observe(60.0, disturbed=False)  # and another, between two steps
    assert c.interval == 13 and c.cost_s == pytest.approx(0.02)
    assert c.step_s == pytest.approx(0.1)
    run(c, 300, step_s=2.0, cost_s=0.02, start=102)  # steps really are 20x longer now
    assert c.step_s == pytest.approx(2.0) and c.interval == 1


def test_cheap_snapshots_go_every_step_but_one_in_refresh() -> None:
    c = Cadence(0.02)
    taken = run(c, 200, step_s=0.1, cost_s=0.0)
    assert c.interval == 1
    late = [s for s in range(100, 201)]
    missed = [s for s in late if s not in taken]
    assert missed == [s for s in late if s % REFRESH == 0]
    assert c.at_risk == 2
    assert Cadence(0.02, fixed=1).at_risk == 1 and Cadence(0.02, fixed=7).at_risk == 7


def test_step_time_is_measured_only_on_clean_steps() -> None:
    c = Cadence(0.02)
    run(c, 400, step_s=0.2, cost_s=0.5)  # a disturbed step is 3.5x a clean one
    assert c.step_s == pytest.approx(0.2)
    assert c.interval == 157


def test_a_steps_time_is_the_median_of_block_medians() -> None:
    t = StepTimes()
    assert t.value is None
    assert t.add(0.3) and t.value == 0.3  # the first block: what there is
    assert t.add(0.1) and t.value == pytest.approx(0.2)
    for _ in range(BLOCK - 2):
        t.add(0.1)
    assert t.value == 0.1 and t.count == BLOCK  # the first block full: its median
    moved = [t.add(5.0) for _ in range(BLOCK)]  # a whole block of a slow spell
    assert moved == [False] * (BLOCK - 1) + [True]  # changes once a block is full
    assert t.value == pytest.approx(2.55)  # the median of two blocks: (0.1 + 5.0) / 2
    for _ in range(BLOCK * 2):
        t.add(0.1)
    assert t.value == 0.1  # one slow block among three: outvoted
    for _ in range(BLOCK * BLOCKS):
        t.add(0.4)  # steps really are 4x longer now: the window holds only those
    assert t.value == 0.4
    t.clear()
    assert t.value is None and t.count == 0


def test_slow_spells_of_a_few_steps_move_no_interval() -> None:
    """A 1 ms step with a spell of 9 steps at 4 ms every 50 steps, as a busy 2-core VM
    gives a tiny model: the interval seldom moves, so the ranks seldom agree on a new one
    (a median of the last 9 steps followed each spell: 200 moves, each an agreement; a
    snapshot whose next step falls in a spell still moves it once)."""
    c = Cadence(0.02)
    intervals = []
    disturbed = False
    for step in range(1, 6001):
        if step > 1:
            slow = step % 50 < 9
            c.observe((0.004 if slow else 0.001) + (0.002 if disturbed else 0.0), disturbed)
        due = c.due(step)
        c.agree(c.proposal)
        if due:
            c.taken(step)
        disturbed = due
        intervals.append(c.interval)
    moves = [b for a, b in itertools.pairwise(intervals[1000:]) if a != b]
    assert len(moves) <= 2, moves


def test_the_ranks_take_the_largest_proposal() -> None:
    c = Cadence(0.02)
    run(c, 100, step_s=0.1, cost_s=0.02)
    assert c.agree(30)
    assert c.interval == 30 and c.proposal == 13
    assert not c.agree(30)


def test_a_fixed_interval_is_not_measured() -> None:
    c = Cadence(0.02, fixed=3)
    assert run(c, 10, step_s=0.1, cost_s=1.0) == [3, 6, 9]
    assert not c.agree(50) and c.interval == 3
    assert run(Cadence(0.02, fixed=0), 10, step_s=0.1, cost_s=0.0) == []


def test_a_budget_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        Cadence(1.5)


def test_state_by_default_snapshots_as_often_as_the_budget_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real State taking real snapshots, timed by an injected clock: a step takes
    10 ms, and the step after a snapshot 80 ms more (each real copy is waited for, so a
    slow machine cannot stretch one over the steps that follow). Snapshots are spread
    out and the choice logged; then steps take 1 s and snapshots come far more often."""
    monkeypatch.setenv(NODE_DIR_ENV, str(tmp_path))
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = State(model=model, optimizer=opt)
    assert state.policy.every == "auto" and state.policy.budget == 0.02
    now = [0.0]
    state._core.cadence.clock = lambda: now[0]
    x = torch.randn(2, 64)

    def train(steps: int, step_s: float, cost_s: float) -> list[int]:
        taken = []
        for _ in range(steps):
            if state._core.cadence.last == state.step and taken:
                now[0] += cost_s  # the snapshot at the last commit slows this step
            now[0] += step_s
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            state.commit()
            if state._core.cadence.last == state.step:
                taken.append(state.step)
                state.flush()  # the copy ends within the (simulated) step, as timed
        state.flush()
        return taken

    caplog.set_level(logging.INFO, logger="elastic.state")
    short = train(300, 0.01, 0.08)
    assert state._core.cadence.interval == 500  # 80 ms / (500 * 10 ms) = 1.6%
    assert len(short) == 1, short  # the probe; the next is due at step 506
    assert "snapshot every 500 step(s), at most 500 step(s) lost to a crash" in caplog.text
    long = train(30, 1.0, 0.08)
    assert state._core.cadence.interval == 5, caplog.text
    assert long and long[0] - short[0] < 500
    assert max(b - a for a, b in itertools.pairwise(long)) == 5
    assert "snapshot every 5 step(s), at most 5 step(s) lost" in caplog.text
    state.close()


def test_the_time_a_snapshot_blocks_the_training_thread_is_part_of_its_cost() -> None:
    """commit() takes the snapshot between two steps' times: without ``blocked`` a
    snapshot that holds the thread 50 ms but disturbs nothing after it would look free."""
    c = Cadence(0.02)
    taken: list[int] = []
    for step in range(1, 200):
        if step > 1:
            c.observe(0.1, False)
        due = c.due(step)
        c.agree(c.proposal)
        if due:
            c.taken(step)
            c.blocked(0.05)
            taken.append(step)
    assert c.cost_s == pytest.approx(0.05)
    assert c.interval == 32  # as for 50 ms of a disturbed step


def test_a_snapshot_costs_at_least_the_time_it_blocked_whatever_the_noise_after_it() -> None:
    """100 ms steps on a busy host, where the steps a snapshot disturbed came out faster
    than the clean ones: the excess is noise, the 20 ms the snapshot held the thread are
    not. It costs those (20 ms: every 13 steps at a 2% budget), not nothing (every step)."""
    c = Cadence(0.02)
    for step in range(1, 400):
        if step > 1:
            disturbed = c.last == step - 1
            c.observe(0.08 if disturbed else 0.1, disturbed)
        due = c.due(step)
        c.agree(c.proposal)
        if due:
            c.taken(step)
            c.blocked(0.02)
    assert c.cost_s == pytest.approx(0.02)
    assert c.interval == 13, c.choice


def test_a_proposal_is_urgent_when_new_and_none_agreed_or_twice_as_frequent() -> None:
    c = Cadence(0.02)
    assert not c.urgent  # nothing proposed yet
    c.proposal = 40
    assert c.urgent  # none agreed yet
    c.agree(40)
    assert not c.urgent  # agreed
    c.proposal = 30
    assert not c.urgent  # a little more often: agreed at the next snapshot
    c.proposal = 20
    assert c.urgent  # twice as often
    c.agree(80)  # another rank's longer proposal won
    assert not c.urgent  # told once: not asked again at every step
    c.proposal = 90
    assert not c.urgent  # less often: at the next snapshot
    assert not Cadence(0.02, fixed=5).urgent


def test_a_new_proposal_that_is_not_urgent_is_asked_with_the_next_snapshot() -> None:
    """Under DDP's bell a snapshot-only ring agrees on nothing: a proposal that waits for
    the next snapshot must ask for the agreement there, or it is never agreed."""
    c = Cadence(0.02)
    c.proposal = 40
    c.agree(40)
    assert not c.asks(snapshot=True)  # nothing new
    c.proposal = 60  # less often: not urgent
    assert not c.asks(snapshot=False) and c.asks(snapshot=True)
    c.agree(60)
    assert not c.asks(snapshot=True)
    c.proposal = 20  # three times as often: at once
    assert c.asks(snapshot=False)


def test_the_cadence_is_logged_at_its_first_choice_and_at_moves_of_2x() -> None:
    """The snapshot interval's moves of 2x, not the agreements' gap's: a tiny model's gap
    moved 2x within seconds (20, 10, 40, ...), and every move logged a line, 22-24 in a
    run of 11 s; with ``--snapshot-every 0`` every new gap did (0 is near no ratio)."""
    logs = [(None, 0), (None, 346), (346, 173), (100, 200), (0, 100), (100, 0)]
    quiet = [(0, 0), (346, 183), (183, 357)]
    assert all(interval_moved(a, b) for a, b in logs)
    assert not any(interval_moved(a, b) for a, b in quiet)
